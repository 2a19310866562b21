"""``hybridkv serve``: an OpenAI-compatible HTTP server on the reference engine.

``cli`` imports nothing heavy at module level; ``app`` and ``async_engine`` need fastapi and torch.
"""

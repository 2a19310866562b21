"""Hypothesis profiles: ``default`` for CI, ``long`` for soak runs.

Pick one with the ``HYPOTHESIS_PROFILE`` environment variable (``default`` when unset)::

    HYPOTHESIS_PROFILE=long .venv/bin/pytest tests/test_state_machine.py
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "default",
    max_examples=100,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=1000,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

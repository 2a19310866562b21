"""RedisTier against a real redis-server started on a free loopback port by the test."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridkv import Sequence
from hybridkv.connectors import HostTier, KVTier, RedisTier
from hybridkv.errors import InvalidInputError
from test_connectors import TOKENS, Store, admit, assert_loaded_exact, connector, hybrid, produce

pytest.importorskip("redis", reason="the redis client is not installed (pip install 'hybridkv[tiers]')")
REDIS_SERVER = shutil.which("redis-server")
pytestmark = pytest.mark.skipif(REDIS_SERVER is None,
                                reason="redis-server binary not found (apt-get install redis-server)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = _free_port()
    proc = subprocess.Popen(
        [str(REDIS_SERVER), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("redis-server did not start")
    yield f"redis://127.0.0.1:{port}/0", proc
    proc.kill()
    proc.wait()


def test_two_connectors_share_a_redis_tier(redis_url: tuple[str, subprocess.Popen[bytes]]) -> None:
    url, _ = redis_url
    produce(connector([RedisTier(url)]), TOKENS)
    conn = connector([RedisTier(url)])  # another instance: its own manager and client
    store: Store = {}
    seq = Sequence("consumer", TOKENS)
    assert admit(conn, seq, store) == (0, 96)
    assert_loaded_exact(conn.manager, seq, store, 96)


def test_salts_isolate_in_redis(redis_url: tuple[str, subprocess.Popen[bytes]]) -> None:
    url, _ = redis_url
    produce(connector([RedisTier(url)]), TOKENS, salt="tenant-a")
    conn = connector([RedisTier(url)])
    assert conn.num_external_tokens(Sequence("b", TOKENS, cache_salt="tenant-b"), 0) == 0
    assert conn.num_external_tokens(Sequence("a", TOKENS, cache_salt="tenant-a"), 0) == 96


def test_a_killed_server_means_counted_misses(redis_url: tuple[str, subprocess.Popen[bytes]]) -> None:
    url, proc = redis_url
    host = HostTier(1 << 20)
    tiers: list[KVTier] = [host, RedisTier(url, timeout_s=0.2)]
    produce(connector(tiers), TOKENS)
    proc.kill()
    proc.wait()
    conn = connector([RedisTier(url, timeout_s=0.2)])
    seq = Sequence("consumer", TOKENS)
    assert conn.num_external_tokens(seq, 0) == 0
    assert conn.fetch(seq, 0, 96).num_tokens == 0
    produce(conn, TOKENS, seq_id="after")  # stores fail quietly too
    assert conn.stats.faults["error"] + conn.stats.faults["timeout"] >= 3
    # The host tier above the dead server still serves everything.
    stacked = connector(tiers)
    store: Store = {}
    assert admit(stacked, Sequence("stacked", TOKENS), store) == (0, 96)


def test_redis_refuses_a_non_cryptographic_hash(redis_url: tuple[str, subprocess.Popen[bytes]]) -> None:
    with pytest.raises(InvalidInputError, match="not cryptographic"):
        connector([RedisTier(redis_url[0])], hybrid(hash_algorithm="xxh3_128"))

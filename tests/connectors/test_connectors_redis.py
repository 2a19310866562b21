"""RedisTier against a real redis-server started on a free loopback port by the test.

The suite's ``HYBRIDKV_TIER_KEY`` (tests/conftest.py) signs the frames, as every shared tier needs.
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridkv import Sequence
from hybridkv.connectors import HostTier, KVTier, RedisTier, encode_frame
from hybridkv.errors import InvalidInputError

from helpers import manager
from test_connectors import PAGE, TOKENS, Store, admit, assert_loaded_exact, connector, full, hybrid, produce

pytest.importorskip("redis", reason="the redis client is not installed (pip install 'hybridkv[tiers]')")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def redis_url(tmp_path: Path, redis_server: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = _free_port()
    proc = subprocess.Popen(
        [redis_server, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
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


def test_redis_without_a_tier_key_refuses_to_start(redis_url: tuple[str, subprocess.Popen[bytes]],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDKV_TIER_KEY")
    with pytest.raises(InvalidInputError, match="redis is shared between instances but no tier key is set"):
        connector([RedisTier(redis_url[0])])


def test_a_forged_unsigned_frame_in_redis_is_rejected(redis_url: tuple[str, subprocess.Popen[bytes]]) -> None:
    import redis

    url, _ = redis_url
    conn = connector([RedisTier(url)])
    seq = Sequence("victim", TOKENS)
    raw = redis.Redis.from_url(url)
    for g in conn.manager.caching_groups:  # a writer without the key fills every block the victim would load
        for key in conn.keys(seq, g):
            raw.set(key, encode_frame(key, b"\x00" * PAGE))
    assert conn.num_external_tokens(seq, 0) == 96
    assert conn.fetch(seq, 0, 96).num_tokens == 0
    assert conn.stats.faults["corrupt"] >= 1
    raw.close()


@pytest.mark.parametrize("size", [1, PAGE // 2, PAGE * 2])
def test_a_forged_frame_of_the_wrong_size_in_redis_is_a_counted_miss(
        redis_url: tuple[str, subprocess.Popen[bytes]], monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    import redis

    monkeypatch.delenv("HYBRIDKV_TIER_KEY")  # unsigned frames: only the size check stands in the way
    url, _ = redis_url
    produce(connector([RedisTier(url)], manager(400, full()), allow_unauthenticated=True), TOKENS)
    conn = connector([RedisTier(url)], manager(400, full()), allow_unauthenticated=True)
    seq = Sequence("consumer", TOKENS)
    bad = conn.keys(seq, 0)[3]
    raw = redis.Redis.from_url(url)
    raw.set(bad, encode_frame(bad, b"\x00" * size))  # well-formed, correct digest, wrong size
    store: Store = {}
    assert admit(conn, seq, store) == (0, 48)
    assert_loaded_exact(conn.manager, seq, store, 48)
    assert conn.stats.faults["wrong_size"] == 1
    assert raw.exists(bad) == 0  # dropped, so the next store writes the real block
    raw.close()

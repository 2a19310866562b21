"""The disk tier against its environment: restarts, budgets, a read-only filesystem, a full one,
other processes on the same directory, files that vanish or appear behind its back."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hybridkv import Sequence
from hybridkv.connectors import DiskTier, TierError
from hybridkv.connectors.disk import STALE_TEMP_S

from test_connectors import TOKENS, Store, admit, assert_loaded_exact, connector, produce

HEADER = 16


def on_disk(path: Path) -> int:
    """Bytes of the entries in ``path`` (temporary files excluded)."""
    return sum(f.stat().st_size for f in path.iterdir() if f.name.endswith(".kv"))


def temp_name(entry: str, pid: int, host: str | None = None) -> str:
    host = host or socket.gethostname()
    return f"{entry}.{host}.{pid}.0123456789abcdef.tmp"


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@contextlib.contextmanager
def mounted(*args: str) -> Iterator[None]:
    """``mount ARGS``; skips the test where this machine does not allow mounting."""
    if os.geteuid() != 0:
        pytest.skip("mounting a filesystem needs root")
    got = subprocess.run(["mount", *args], capture_output=True, text=True)
    if got.returncode:
        pytest.skip(f"mount refused: {got.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", args[-1]], check=True)


# ---------------------------------------------------------------------- basics
def test_disk_tier_survives_reopening(tmp_path: Path) -> None:
    DiskTier(tmp_path, 1 << 20).put_many([(b"k1", b"v1"), (b"k2", b"v2")])
    again = DiskTier(tmp_path, 1 << 20)
    assert again.get_many([b"k1", b"k2", b"k3"]) == [b"v1", b"v2", None]


def test_disk_tier_evicts_least_recently_used_within_its_budget(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 3 * (HEADER + 100))  # three entries with their 16-byte headers
    disk.put_many([(b"a", b"x" * 100), (b"b", b"y" * 100), (b"c", b"z" * 100)])
    disk.get_many([b"a"])
    disk.put_many([(b"d", b"w" * 100)])
    assert disk.exists_many([b"a", b"b", b"c", b"d"]) == [True, False, True, True]
    assert len(os.listdir(tmp_path)) == 3


def test_disk_tier_rejects_a_flipped_byte(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    disk.put_many([(b"k", b"value" * 20)])
    file = tmp_path / next(iter(os.listdir(tmp_path)))
    data = bytearray(file.read_bytes())
    data[40] ^= 1
    file.write_bytes(bytes(data))
    assert disk.get_many([b"k"]) == [None]
    assert disk.stats.corrupt == 1 and not file.exists()


def test_disk_tier_serves_a_connector_after_restart(tmp_path: Path) -> None:
    produce(connector([DiskTier(tmp_path, 1 << 22)]), TOKENS)
    conn = connector([DiskTier(tmp_path, 1 << 22)])
    store: Store = {}
    seq = Sequence("consumer", TOKENS)
    assert admit(conn, seq, store) == (0, 96)
    assert_loaded_exact(conn.manager, seq, store, 96)


# ---------------------------------------------------------------------- temporary files
def test_a_temporary_file_whose_writer_exited_is_removed_on_open(tmp_path: Path) -> None:
    DiskTier(tmp_path, 1 << 20).put_many([(b"k", b"v")])
    (entry,) = os.listdir(tmp_path)
    (tmp_path / temp_name(entry, dead_pid())).write_bytes(b"half a wri")
    again = DiskTier(tmp_path, 1 << 20)
    assert again.get_many([b"k"]) == [b"v"] and len(again) == 1
    assert os.listdir(tmp_path) == [entry]


@pytest.mark.parametrize("shared", [False, True])
def test_a_running_writers_temporary_file_is_left_alone(tmp_path: Path, shared: bool) -> None:
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        in_flight = tmp_path / temp_name("a" * 64 + ".kv", writer.pid)
        in_flight.write_bytes(b"being written")
        elsewhere = tmp_path / temp_name("b" * 64 + ".kv", 1, host="another-host")
        elsewhere.write_bytes(b"being written on another host")
        DiskTier(tmp_path, 1 << 20, shared=shared)
        assert in_flight.exists() and elsewhere.exists()
    finally:
        writer.kill()
        writer.wait()


def test_a_temporary_file_older_than_an_hour_is_removed_whoever_wrote_it(tmp_path: Path) -> None:
    old = tmp_path / temp_name("c" * 64 + ".kv", 1, host="another-host")
    old.write_bytes(b"abandoned")
    past = time.time() - STALE_TEMP_S - 60
    os.utime(old, (past, past))
    DiskTier(tmp_path, 1 << 20, shared=True)
    assert not old.exists()


# ---------------------------------------------------------------------- accounting
def test_used_bytes_follows_files_removed_and_added_behind_the_tiers_back(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, resync_interval_s=0)
    disk.put_many([(b"a", b"x" * 100), (b"b", b"y" * 100), (b"c", b"z" * 100)])
    assert disk.used_bytes == 3 * (HEADER + 100) == on_disk(tmp_path)
    victim = sorted(tmp_path.iterdir())[0]
    victim.unlink()
    DiskTier(tmp_path, 1 << 20).put_many([(b"other", b"o" * 1000)])  # another instance writes
    disk.put_many([(b"d", b"w" * 100)])  # a write re-reads the directory first
    assert disk.used_bytes == 3 * (HEADER + 100) + HEADER + 1000 == on_disk(tmp_path)
    assert len(disk) == 4


def test_a_read_of_a_vanished_file_is_a_miss_and_forgets_its_bytes(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    disk.put_many([(b"a", b"x" * 100), (b"b", b"y" * 100)])
    for f in tmp_path.iterdir():
        f.unlink()
    assert disk.get_many([b"a", b"b"]) == [None, None]
    assert disk.used_bytes == 0 and len(disk) == 0 and disk.stats.misses == 2


def test_a_shared_budget_counts_every_processes_entries(tmp_path: Path) -> None:
    a = DiskTier(tmp_path, 4 * (HEADER + 100), shared=True, resync_interval_s=0)
    b = DiskTier(tmp_path, 4 * (HEADER + 100), shared=True, resync_interval_s=0)
    a.put_many([(b"a1", b"x" * 100), (b"a2", b"x" * 100)])
    b.put_many([(b"b1", b"y" * 100), (b"b2", b"y" * 100), (b"b3", b"y" * 100)])
    assert on_disk(tmp_path) <= 4 * (HEADER + 100)  # b evicted a's oldest entry
    assert b.exists_many([b"a1", b"a2", b"b3"]) == [False, True, True]


# ---------------------------------------------------------------------- a read-only filesystem
def test_a_read_only_filesystem_still_serves(tmp_path: Path) -> None:
    src, view = tmp_path / "src", tmp_path / "ro"
    src.mkdir()
    view.mkdir()
    produce(connector([DiskTier(src, 1 << 22)]), TOKENS)
    with mounted("--bind", "-o", "ro", str(src), str(view)):
        with pytest.raises(OSError):
            (view / "probe").write_bytes(b"")  # the mount really is read-only
        disk = DiskTier(view, 1 << 22)
        conn = connector([disk])
        store: Store = {}
        seq = Sequence("consumer", TOKENS)
        assert admit(conn, seq, store) == (0, 96)
        assert_loaded_exact(conn.manager, seq, store, 96)
        assert conn.stats.faults["error"] == 0
        with pytest.raises(TierError, match="Read-only file system"):
            disk.put_many([(b"new", b"v")])
        produce(conn, TOKENS + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], seq_id="writer")
        assert conn.stats.faults["error"] > 0  # stores fail as counted faults, nothing raised


# ---------------------------------------------------------------------- a full filesystem
def test_a_full_filesystem_evicts_and_retries(tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    with mounted("-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)):
        disk = DiskTier(small, 64 << 20)  # a budget far above what the filesystem holds
        values = {f"k{i}".encode(): bytes([i]) * (16 << 10) for i in range(64)}  # 1 MiB in all
        for key, value in values.items():
            disk.put_many([(key, value)])
        assert disk.stats.puts == 64 and disk.stats.evictions > 40
        assert disk.get_many([b"k63", b"k62"]) == [values[b"k63"], values[b"k62"]]
        assert disk.get_many([b"k0"]) == [None]
        assert disk.used_bytes == on_disk(small) <= 256 << 10
        assert not [f for f in os.listdir(small) if f.endswith(".tmp")]


def test_an_entry_larger_than_the_whole_filesystem_is_a_tier_error(tmp_path: Path) -> None:
    small = tmp_path / "small"
    small.mkdir()
    with mounted("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)):
        disk = DiskTier(small, 64 << 20)
        disk.put_many([(b"fits", b"x" * 1000)])
        with pytest.raises(TierError, match="nothing left to evict"):
            disk.put_many([(b"huge", b"x" * (128 << 10))])
        assert not [f for f in os.listdir(small) if f.endswith(".tmp")]


# ---------------------------------------------------------------------- many processes
def value_of(key: bytes) -> bytes:
    return (key * 512)[:512]


def _worker(path: str, seed: int, rounds: int, errors: multiprocessing.Queue) -> None:  # type: ignore[type-arg]
    """Open, write, read and reopen a directory (shared, and now and then privately); report any
    exception or wrong value."""
    budget = 40 * (HEADER + 512)
    try:
        disk = DiskTier(path, budget, shared=True, resync_interval_s=0.01)
        for r in range(rounds):
            keys = [f"k{(seed * 7 + r * 3 + j) % 60}".encode() for j in range(4)]
            disk.put_many([(k, value_of(k)) for k in keys])
            for k, v in zip(keys, disk.get_many(keys)):
                if v is not None and v != value_of(k):
                    errors.put(f"wrong value for {k!r}")
            if r % 5 == 0:
                disk = DiskTier(path, budget, shared=True, resync_interval_s=0.01)
            if r % 7 == 0:
                DiskTier(path, budget)  # a private open must not take others' in-flight writes
    except BaseException as exc:  # any failure at all is what this test looks for
        errors.put(f"{type(exc).__name__}: {exc}")


def test_many_processes_share_one_directory_without_failing(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(str(tmp_path), seed, 150, errors)) for seed in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    found = []
    while not errors.empty():
        found.append(errors.get())
    assert found == []
    assert [p.exitcode for p in procs] == [0] * 6
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]
    assert on_disk(tmp_path) <= 40 * (HEADER + 512) + 6 * (HEADER + 512) * 4  # the budget, give or take a batch
    survivor = DiskTier(tmp_path, 40 * (HEADER + 512), shared=True)
    assert survivor.used_bytes == on_disk(tmp_path)

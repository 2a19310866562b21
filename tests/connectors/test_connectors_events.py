"""The external tiers' KV events: which keys enter and leave a host or disk tier, and the connector's
``BlockStored`` / ``BlockRemoved`` events of them (medium ``CPU`` or ``STORAGE``), which an index
reads next to the device pool's own."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from hybridkv import Sequence
from hybridkv.cluster import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    BlockRemovedEvent,
    BlockStoredEvent,
    ClusterIndex,
    HybridkvHashes,
    from_core_events,
    group_metadata,
    make_batch,
)
from hybridkv.cluster.events import WireEvent
from hybridkv.connectors import DiskTier, FaultyTier, HostTier, KVConnector
from hybridkv.core import KVCacheManager

from helpers import manager
from test_connectors import Store, admit, connector, full, hybrid, produce, swa

HEADER = 16
"""Bytes of a disk entry's header."""


def wire(conn: KVConnector, mgr: KVCacheManager | None = None) -> list[WireEvent]:
    """What a publisher sends for one step: the device pool's events, then the tiers' (``mgr``: the
    device's events too; else the tiers' alone)."""
    meta = group_metadata(conn.manager.layout)
    events = from_core_events(mgr.take_events(), meta) if mgr is not None else []
    for medium, tier_events in conn.take_events():
        events += from_core_events(tier_events, meta, medium=medium)
    return events


# ---------------------------------------------------------------------- the tiers' change logs
def test_a_tier_keeps_no_change_log_until_asked() -> None:
    host = HostTier(300)
    host.put_many([(b"k%d" % i, b"v" * 100) for i in range(50)])  # 47 evictions
    host.delete(b"k49")
    assert host.stats.evictions == 47 and host.take_changes() == []
    assert host._changes is None  # nothing retained: no log grows without a reader
    host.record_changes()
    host.put_many([(b"new", b"v" * 100)])  # room for it: nothing evicted
    assert host.take_changes() == [(True, b"new")]


def test_a_connector_without_events_has_its_tiers_log_nothing(tmp_path: Path) -> None:
    host, disk = HostTier(2000), DiskTier(tmp_path, 2000)
    conn = connector([host, disk], manager(400, full()))
    produce(conn, list(range(200)))  # twelve blocks into tiers of six or seven: both evict
    assert host.stats.evictions > 0 and disk.stats.evictions > 0
    assert conn.take_events() == [] and host._changes is None and disk._changes is None


def test_host_eviction_logs_the_evicted_key_as_left_low_priority_first() -> None:
    host = HostTier(300)
    host.record_changes()
    host.put_many([(b"a", b"x" * 100), (b"b", b"y" * 100)])
    host.put_many([(b"spill", b"s" * 100)], low=True)
    assert host.take_changes() == [(True, b"a"), (True, b"b"), (True, b"spill")]
    host.put_many([(b"c", b"z" * 100)])  # the low entry goes first
    host.put_many([(b"d", b"w" * 100)])  # then the least recently used normal one
    assert host.take_changes() == [(False, b"spill"), (True, b"c"), (False, b"a"), (True, b"d")]
    host.put_many([(b"late", b"l" * 100)], low=True)  # a low put never evicts a normal entry: skipped
    assert host.take_changes() == []


def test_a_key_stored_again_or_deleted_twice_is_reported_once() -> None:
    host = HostTier(1000)
    host.record_changes()
    host.put_many([(b"a", b"x" * 100)])
    host.put_many([(b"a", b"y" * 100)])
    host.delete(b"a")
    host.delete(b"a")
    host.delete(b"never")
    assert host.take_changes() == [(True, b"a"), (False, b"a")]


def test_disk_eviction_and_removal_behind_its_back_are_logged_with_the_key(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 3 * (HEADER + 100), resync_interval_s=0)
    disk.record_changes()
    disk.put_many([(b"a", b"x" * 100), (b"b", b"y" * 100), (b"c", b"z" * 100)])
    disk.put_many([(b"d", b"w" * 100)])
    assert disk.take_changes() == [(True, b"a"), (True, b"b"), (True, b"c"), (False, b"a"), (True, b"d")]
    (tmp_path / (hashlib.sha256(b"b").hexdigest() + ".kv")).unlink()  # another process removes it
    disk.resync()
    assert disk.take_changes() == [(False, b"b")]


def test_disk_entries_from_before_recording_are_never_reported(tmp_path: Path) -> None:
    DiskTier(tmp_path, 1 << 20).put_many([(b"old1", b"x" * 100), (b"old2", b"y" * 100)])  # an earlier run
    disk = DiskTier(tmp_path, 2 * (HEADER + 100))
    disk.record_changes()
    disk.put_many([(b"new", b"z" * 100)])  # evicts old1, whose key this process never saw
    assert disk.take_changes() == [(True, b"new")]
    assert disk.exists_many([b"old1", b"old2", b"new"]) == [False, True, True]


# ---------------------------------------------------------------------- the connector's events
def test_stored_blocks_carry_group_kind_window_tokens_parent_and_the_device_hash() -> None:
    mgr = manager(400, full(), swa(48), enable_events=True)
    conn = connector([HostTier(1 << 20)], mgr)
    conn.enable_events()
    tokens = list(range(1000, 1100))  # six full blocks
    produce(conn, tokens, chunk=100)
    events = wire(conn, mgr)
    device = {e.group_idx: e for e in events if isinstance(e, BlockStoredEvent) and e.medium == MEDIUM_GPU}
    host = [e for e in events if isinstance(e, BlockStoredEvent) and e.medium == MEDIUM_CPU]
    hashes = Sequence("again", tokens).block_hashes(mgr.hasher, 16)
    assert device[0].block_hashes == device[1].block_hashes == tuple(hashes)
    # Every block of both groups, keyed by the hash the device's events carry: the window group in
    # two runs (the blocks a hit at the prompt's end needs, then the rest at low priority).
    assert [(e.group_idx, e.kind, e.sliding_window) for e in host] == [
        (0, "full_attention", None), (1, "sliding_window", 48), (1, "sliding_window", 48)]
    for group in (0, 1):
        assert sorted(h for e in host if e.group_idx == group for h in e.block_hashes) == sorted(hashes)
    for e in host:
        i = hashes.index(e.block_hashes[0])
        n = len(e.block_hashes)
        assert e.block_hashes == tuple(hashes[i : i + n]) and e.block_size == 16
        assert e.parent_block_hash == (hashes[i - 1] if i else None)
        assert e.token_ids == tuple(tokens[16 * i : 16 * (i + n)])


def test_a_run_that_starts_mid_sequence_names_its_parent() -> None:
    mgr = manager(400, full(), enable_events=True)
    conn = connector([HostTier(1 << 20)], mgr)
    conn.enable_events()
    tokens = list(range(2000, 2100))
    produce(conn, tokens[:50], chunk=50, seq_id="first")  # three blocks
    wire(conn, mgr)
    produce(conn, tokens, chunk=100, seq_id="second")  # blocks 3-5 are new to the tier
    (stored,) = [e for e in wire(conn) if isinstance(e, BlockStoredEvent)]
    hashes = Sequence("again", tokens).block_hashes(mgr.hasher, 16)
    assert stored.block_hashes == tuple(hashes[3:6]) and stored.parent_block_hash == hashes[2]
    assert stored.token_ids == tuple(tokens[48:96])


def test_a_host_eviction_is_a_cpu_removal_and_a_disk_one_a_storage_removal(tmp_path: Path) -> None:
    mgr = manager(400, full(), enable_events=True)
    entry = entry_bytes()
    host, disk = HostTier(4 * entry), DiskTier(tmp_path, 4 * (entry + HEADER))
    conn = connector([host, disk], mgr)
    conn.enable_events()
    produce(conn, list(range(100, 180)), chunk=80, seq_id="a")  # five blocks: one evicted from each tier
    events = wire(conn)
    removed = [(e.medium, e.block_hashes) for e in events if isinstance(e, BlockRemovedEvent)]
    first = Sequence("a", list(range(100, 180))).block_hashes(mgr.hasher, 16)[0]
    assert removed == [(MEDIUM_CPU, (first,)), (MEDIUM_STORAGE, (first,))]
    assert host.stats.evictions == disk.stats.evictions == 1


def test_a_shared_tier_publishes_nothing(tmp_path: Path) -> None:
    mgr = manager(400, full(), enable_events=True)
    shared = DiskTier(tmp_path, 1 << 20, shared=True)
    conn = connector([shared], mgr, allow_unauthenticated=True)
    conn.enable_events()
    produce(conn, list(range(100)))
    assert conn.take_events() == [] and len(shared) == 6 and shared.take_changes() == []


def test_a_block_promoted_from_disk_to_host_is_a_cpu_store_with_its_tokens(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20)
    tokens = list(range(3000, 3100))
    produce(connector([disk], manager(400, full())), tokens)  # an earlier run filled the disk
    mgr = manager(400, full(), enable_events=True)
    conn = connector([HostTier(1 << 20), disk], mgr)
    conn.enable_events()
    store: Store = {}
    assert admit(conn, Sequence("reader", tokens), store) == (0, 96)
    (stored,) = [e for e in wire(conn) if isinstance(e, BlockStoredEvent)]
    hashes = Sequence("again", tokens).block_hashes(mgr.hasher, 16)
    assert (stored.medium, stored.block_hashes, stored.token_ids) == (MEDIUM_CPU, tuple(hashes), tuple(tokens[:96]))


def test_a_faulty_wrapper_reports_its_inner_tiers_changes() -> None:
    mgr = manager(400, full(), enable_events=True)
    conn = connector([FaultyTier(HostTier(1 << 20))], mgr)
    conn.enable_events()
    produce(conn, list(range(100)))
    assert [(m, len(e)) for m, e in conn.take_events()] == [(MEDIUM_CPU, 1)]


# ---------------------------------------------------------------------- an index fed by them
def entry_bytes() -> int:
    """Bytes one framed block of ``full()`` takes in a host tier."""
    probe = HostTier(1 << 20)
    produce(connector([probe], manager(400, full())), list(range(48)))
    return probe.used_bytes // len(probe)


@pytest.mark.parametrize(("layout", "host_blocks", "fillers", "expected", "host_evictions"), [
    # Full attention, 19 usable blocks: a 176-token filler evicts the prefix's last two blocks from
    # the device, and its eleventh block evicts the oldest of them from the 20-block host tier.
    ("full", 20, [176], ((MEDIUM_GPU, 128), (MEDIUM_CPU, 16)), 1),
    # Full + 48-token window + Mamba: the window blocks leave the device first, so it serves nothing.
    ("hybrid", 10_000, [300, 300, 300], ((MEDIUM_CPU, 160),), 0),
])
def test_the_index_predicts_the_device_and_host_hits_the_connector_then_loads(
        layout: str, host_blocks: int, fillers: list[int], expected: tuple[tuple[str, int], ...],
        host_evictions: int) -> None:
    mgr = manager(20, full(), retention="none", enable_events=True) if layout == "full" else hybrid(
        num_blocks=60, enable_events=True)
    host = HostTier(host_blocks * entry_bytes())
    conn = connector([host], mgr)
    conn.enable_events()
    index = ClusterIndex()
    index.add_replica("r", scheme=HybridkvHashes(), layout=mgr.layout)
    shared = list(range(5000, 5160))  # ten blocks
    produce(conn, shared + [1, 2, 3], seq_id="first")
    for i, n in enumerate(fillers):
        produce(conn, list(range(10_000 * (i + 2), 10_000 * (i + 2) + n)), seq_id=f"filler{i}")
    index.apply_events("r", make_batch(wire(conn, mgr)))
    seq = Sequence("next", shared + [7, 8, 9])
    predicted = index.lookup(seq.token_ids)["r"]
    hit, external = admit(conn, seq, {})
    assert predicted.by_medium == expected
    assert (predicted.medium_tokens(MEDIUM_GPU), predicted.medium_tokens(MEDIUM_CPU)) == (hit, external)
    assert host.stats.evictions == host_evictions

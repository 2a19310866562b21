"""External KV tiers: the connector's window rules, loading, faults, salts, frames and tiers."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from hybridkv import FullAttentionSpec, KVCacheManager, MambaSpec, Sequence, SlidingWindowSpec
from hybridkv.connectors import (
    DiskTier,
    FaultyTier,
    HostTier,
    KVConnector,
    KVTier,
    decode_frame,
    encode_frame,
    tier_key,
)
from hybridkv.connectors.codec import FrameCodec, PlaceholderCodec
from hybridkv.connectors.frame import FrameError
from hybridkv.connectors.storage import StoreAll
from hybridkv.errors import InvalidInputError

from helpers import manager

BS = 16
PAGE = 128
"""Bytes of one block of one layer in these tests' specs: the size of ``fake_kv``."""
Store = dict[tuple[int, int], bytes]


def full() -> FullAttentionSpec:
    return FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=2, dtype_bytes=2)  # 2*16*1*2*2 = 128 bytes


def swa(window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=2, dtype_bytes=2, sliding_window=window)


def mamba(**kw: int) -> MambaSpec:
    return MambaSpec(block_size=BS, state_bytes=PAGE, mode="align", **kw)  # type: ignore[arg-type]


def fake_kv(tokens: list[int], group: int, index: int, bs: int = BS) -> bytes:
    """The KV a block 'computes': a function of the group and the prefix up to the block's end."""
    prefix = ",".join(map(str, tokens[: (index + 1) * bs]))
    return hashlib.sha256(f"{group}|{prefix}".encode()).digest() * (PAGE // 32)


def compute(mgr: KVCacheManager, seq: Sequence, store: Store, start: int, end: int) -> None:
    """Fill the blocks whose last token lies in ``[start, end)`` as a forward pass would."""
    for group, table in enumerate(mgr.block_table(seq.seq_id)):
        for i, b in enumerate(table):
            if b and start < (i + 1) * BS <= end:
                store[(group, b)] = fake_kv(seq.token_ids, group, i)


def produce(conn: KVConnector, tokens: list[int], *, salt: str | None = None, chunk: int = BS,
            seq_id: str = "producer") -> None:
    """Prefill ``tokens`` in chunks on ``conn.manager``, storing after every chunk, then free."""
    mgr = conn.manager
    store: Store = {}
    seq = Sequence(seq_id, tokens, cache_salt=salt)
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        assert mgr.allocate(seq, n) is not None
        compute(mgr, seq, store, seq.num_computed_tokens, seq.num_computed_tokens + n)
        seq.num_computed_tokens += n
        conn.store(seq, seq.num_computed_tokens, lambda g, b: store[(g, b)])
        mgr.check_invariants()
    mgr.free(seq)


def hybrid(num_blocks: int = 400, **kw: object) -> KVCacheManager:
    return manager(num_blocks, full(), swa(48), mamba(), retention="none", **kw)


def connector(tiers: list[KVTier], mgr: KVCacheManager | None = None, **kw: object) -> KVConnector:
    return KVConnector(tiers, mgr or hybrid(), namespace="test-model/bf16", **kw)  # type: ignore[arg-type]


def admit(conn: KVConnector, seq: Sequence, store: Store, max_tokens: int | None = None) -> tuple[int, int]:
    """The two-phase flow: local hit, external tokens, allocate, write. Returns (hit, external)."""
    mgr = conn.manager
    hit = mgr.lookup(seq)
    k = conn.num_external_tokens(seq, hit.num_tokens, max_tokens)
    got = conn.fetch(seq, hit.num_tokens, k)
    assert mgr.allocate(seq, seq.num_tokens - hit.num_tokens - got.num_tokens, hit=hit,
                        num_external_tokens=got.num_tokens) is not None
    mgr.check_invariants()
    conn.write(got, mgr.block_table(seq.seq_id), lambda g, b, data: store.__setitem__((g, b), data))
    return hit.num_tokens, got.num_tokens


def assert_loaded_exact(mgr: KVCacheManager, seq: Sequence, store: Store, upto: int) -> None:
    """Every non-null block of the first ``upto`` tokens holds what a computing sequence wrote."""
    checked = 0
    for group, table in enumerate(mgr.block_table(seq.seq_id)):
        for i, b in enumerate(table[: upto // BS]):
            if b:
                assert store[(group, b)] == fake_kv(seq.token_ids, group, i), (group, i)
                checked += 1
    assert checked


TOKENS = list(range(1000, 1100))  # 100 tokens: six full blocks, the last token in block 6


# ---------------------------------------------------------------------- window rules
def test_round_trip_loads_every_group_byte_exact() -> None:
    tiers: list[KVTier] = [HostTier(1 << 20)]
    produce(connector(tiers), TOKENS)
    conn = connector(tiers)
    store: Store = {}
    seq = Sequence("consumer", TOKENS)
    assert admit(conn, seq, store) == (0, 96)
    assert_loaded_exact(conn.manager, seq, store, 96)
    # Full attention gets all six blocks, the 48-token window three, Mamba its last state.
    assert [sum(1 for b in t[:6] if b) for t in conn.manager.block_table("consumer")] == [6, 3, 1]
    assert conn.stats.loaded_blocks == 10 and conn.stats.loaded_tokens == 96


def test_external_tokens_never_cover_the_last_token_and_are_block_aligned() -> None:
    tiers: list[KVTier] = [HostTier(1 << 20)]
    produce(connector(tiers), list(range(64)))
    conn = connector(tiers)
    assert conn.num_external_tokens(Sequence("a", list(range(64))), 0) == 48  # 64 would cover token 63
    assert conn.num_external_tokens(Sequence("b", list(range(64)) + [7]), 0) == 64
    assert conn.num_external_tokens(Sequence("c", list(range(64)) + [7]), 0, max_tokens=40) == 32
    with pytest.raises(InvalidInputError):
        conn.num_external_tokens(Sequence("d", list(range(64))), 8)


def test_missing_block_outside_the_window_does_not_shorten_the_hit() -> None:
    host = HostTier(1 << 20)
    produce(connector([host], storage=StoreAll()), TOKENS)  # every block of every group
    conn = connector([host])
    seq = Sequence("consumer", TOKENS)
    swa_keys = conn.keys(seq, 1)
    host.delete(swa_keys[1])  # the window at 96 is blocks 3..5
    assert conn.num_external_tokens(seq, 0) == 96


def test_missing_block_inside_the_window_shortens_the_hit() -> None:
    host = HostTier(1 << 20)
    produce(connector([host], storage=StoreAll()), TOKENS)  # every block of every group
    conn = connector([host])
    seq = Sequence("consumer", TOKENS)
    host.delete(conn.keys(seq, 1)[4])
    # 80 and 96 need block 4; at 64 the window is blocks 1..3, all stored.
    assert conn.num_external_tokens(seq, 0) == 64


def test_missing_mamba_state_shortens_the_hit_to_the_previous_state() -> None:
    host = HostTier(1 << 20)
    produce(connector([host], storage=StoreAll()), TOKENS)  # every block of every group
    conn = connector([host])
    seq = Sequence("consumer", TOKENS)
    host.delete(conn.keys(seq, 2)[5])
    assert conn.num_external_tokens(seq, 0) == 80


def test_missing_full_attention_block_bounds_the_hit() -> None:
    host = HostTier(1 << 20)
    produce(connector([host], storage=StoreAll()), TOKENS)  # every block of every group
    conn = connector([host])
    seq = Sequence("consumer", TOKENS)
    host.delete(conn.keys(seq, 0)[3])
    assert conn.num_external_tokens(seq, 0) == 48


def test_a_one_step_prefill_stores_the_mamba_state_at_the_prompts_last_boundary() -> None:
    host = HostTier(1 << 20)
    conn = connector([host])
    produce(conn, TOKENS, chunk=96 + 4)  # one step: the prompt-end checkpoint (96) is its only state
    assert connector([host]).num_external_tokens(Sequence("c", TOKENS), 0) == 96
    # A shorter prompt sharing the first 64 tokens cannot resume: no state at 64 was kept.
    assert connector([host]).num_external_tokens(Sequence("d", TOKENS[:64] + [7] * 30), 0) == 0


def test_without_checkpoint_blocks_a_one_step_prefill_stores_no_mamba_state() -> None:
    host = HostTier(1 << 20)
    conn = connector([host], manager(400, full(), swa(48), mamba(checkpoint_blocks=0), retention="none"))
    produce(conn, TOKENS, chunk=96 + 4)  # one step ending at 100: not on a block boundary
    assert connector([host]).num_external_tokens(Sequence("c", TOKENS), 0) == 0


def test_external_tokens_extend_a_local_hit() -> None:
    host = HostTier(1 << 20)
    produce(connector([host]), TOKENS)
    conn = connector([host])
    local: Store = {}
    warm = Sequence("warm", TOKENS[:40])
    for n in (32, 8):  # a step ending on a block boundary leaves a Mamba checkpoint
        assert conn.manager.allocate(warm, n) is not None
        compute(conn.manager, warm, local, warm.num_computed_tokens, warm.num_computed_tokens + n)
        warm.num_computed_tokens += n
    conn.manager.free(warm)
    seq = Sequence("consumer", TOKENS)
    assert admit(conn, seq, local) == (32, 64)
    assert_loaded_exact(conn.manager, seq, local, 96)


# ---------------------------------------------------------------------- faults
@pytest.mark.parametrize("fault,kind", [("error", "error"), ("timeout", "timeout"), ("short", "short"),
                                        ("corrupt", "corrupt"), ("lose", "missing")])
def test_a_fault_ends_the_loaded_prefix_and_is_counted(fault: str, kind: str) -> None:
    mgr_kw = {"retention": "none"}
    host = HostTier(1 << 20)
    produce(KVConnector([host], manager(400, full(), **mgr_kw), namespace="m"), TOKENS)  # type: ignore[arg-type]
    mgr = manager(400, full(), **mgr_kw)  # type: ignore[arg-type]
    probe = KVConnector([host], mgr, namespace="m")
    seq = Sequence("consumer", TOKENS)
    bad = probe.keys(seq, 0)[4]
    conn = KVConnector([FaultyTier(host, {bad: fault})], mgr, namespace="m", batch_blocks=2)  # type: ignore[dict-item]
    assert conn.num_external_tokens(seq, 0) == 96
    store: Store = {}
    loaded = conn.fetch(seq, 0, 96)
    assert mgr.allocate(seq, 100 - loaded.num_tokens, num_external_tokens=loaded.num_tokens) is not None
    mgr.check_invariants()
    conn.write(loaded, mgr.block_table("consumer"), lambda g, b, d: store.__setitem__((g, b), d))
    assert loaded.num_tokens == 64  # blocks 0..3; batch [4, 5] failed or block 4 was rejected
    assert_loaded_exact(mgr, seq, store, 64)
    assert conn.stats.faults[kind] == 1
    assert sum(conn.stats.faults.values()) == 1


def test_load_after_allocate_returns_the_prefix_and_never_raises() -> None:
    host = HostTier(1 << 20)
    produce(connector([host]), TOKENS)
    conn = connector([FaultyTier(host, rate=1.0, kinds=("error",))])
    seq = Sequence("consumer", TOKENS)
    store: Store = {}
    assert conn.manager.allocate(seq, 4, num_external_tokens=96) is not None
    assert conn.load(seq, 0, 96, conn.manager.block_table("consumer"), lambda g, b, d: None) == 0
    assert not store and conn.stats.faults["error"] >= 1


def test_a_fault_in_a_window_group_falls_back_to_the_local_hit() -> None:
    host = HostTier(1 << 20)
    produce(connector([host]), TOKENS)
    probe = connector([host])
    seq = Sequence("consumer", TOKENS)
    bad = probe.keys(seq, 1)[5]
    conn = connector([FaultyTier(host, {bad: "corrupt"})])
    assert conn.fetch(seq, 0, 96).num_tokens == 0  # no window was fetched for a shorter point
    assert conn.stats.faults["corrupt"] == 1


def test_faults_on_store_are_counted_not_raised() -> None:
    class Broken(HostTier):
        def put_many(self, items: object) -> None:  # type: ignore[override]
            raise OSError("disk full")

    conn = connector([Broken(1 << 20)])
    produce(conn, TOKENS)
    assert conn.stats.stored_blocks == 0 and conn.stats.faults["error"] > 0


# ---------------------------------------------------------------------- salts and frames
def test_salts_never_share_entries() -> None:
    host = HostTier(1 << 20)
    produce(connector([host]), TOKENS, salt="tenant-a")
    conn = connector([host])
    assert conn.num_external_tokens(Sequence("b", TOKENS, cache_salt="tenant-b"), 0) == 0
    assert conn.num_external_tokens(Sequence("n", TOKENS), 0) == 0
    assert conn.num_external_tokens(Sequence("a", TOKENS, cache_salt="tenant-a"), 0) == 96


def test_an_entry_copied_under_another_salts_key_is_rejected() -> None:
    host = HostTier(1 << 20)
    produce(connector([host]), TOKENS, salt="tenant-a")
    conn = connector([host])
    victim, attacker = Sequence("a", TOKENS, cache_salt="tenant-a"), Sequence("b", TOKENS, cache_salt="tenant-b")
    for g in conn.manager.caching_groups:
        src = host.get_many(conn.keys(victim, g))
        host.put_many([(k, v) for k, v in zip(conn.keys(attacker, g), src) if v is not None])
    assert conn.num_external_tokens(attacker, 0) == 96  # the copies exist under the attacker's keys
    assert conn.fetch(attacker, 0, 96).num_tokens == 0
    assert conn.stats.faults["wrong_key"] == 10  # every copied block, each deleted from the tier
    assert conn.num_external_tokens(attacker, 0) == 0


def test_frame_checks_reject_tampering() -> None:
    key, other = b"hkv1/ns/0/aa", b"hkv1/ns/0/bb"
    frame = encode_frame(key, b"payload" * 10)
    assert decode_frame(key, frame) == b"payload" * 10
    cases = {
        "wrong_key": (other, frame),
        "short": (key, frame[:-3]),
        "corrupt": (key, frame[:-1] + b"X"),
    }
    longer = bytearray(frame)
    longer[8:16] = (10).to_bytes(8, "little")  # declared payload length 10, actual 70
    cases["corrupt_length"] = (key, bytes(longer))
    for name, (k, data) in cases.items():
        with pytest.raises(FrameError) as err:
            decode_frame(k, data)
        assert err.value.kind == name.split("_length")[0], name


def test_a_forged_entry_without_the_shared_secret_is_rejected() -> None:
    key = b"hkv1/ns/0/aa"
    assert decode_frame(key, encode_frame(key, b"kv", b"secret"), b"secret") == b"kv"
    with pytest.raises(FrameError):
        decode_frame(key, encode_frame(key, b"evil"), b"secret")
    with pytest.raises(FrameError):
        decode_frame(key, encode_frame(key, b"evil", b"guess"), b"secret")


def test_different_layouts_and_namespaces_use_different_keys() -> None:
    a = connector([HostTier(1)], hybrid())
    b = connector([HostTier(1)], manager(400, full(), swa(64), mamba()))
    c = KVConnector([HostTier(1)], hybrid(), namespace="other-model/bf16")
    assert len({a.namespace_id, b.namespace_id, c.namespace_id}) == 3
    assert tier_key(a.namespace_id, 1, b"\x01\x02") == f"hkv1/{a.namespace_id}/1/0102".encode()


def test_a_shared_tier_refuses_a_non_cryptographic_hash(tmp_path: Path) -> None:
    mgr = hybrid(hash_algorithm="xxh3_128")
    with pytest.raises(InvalidInputError, match="not cryptographic"):
        connector([HostTier(1 << 20), DiskTier(tmp_path, 1 << 20, shared=True)], mgr)
    connector([HostTier(1 << 20), DiskTier(tmp_path, 1 << 20)], mgr)  # private tiers: allowed


# ---------------------------------------------------------------------- tiers
def test_host_tier_evicts_least_recently_used_within_its_budget() -> None:
    host = HostTier(300)
    host.put_many([(b"a", b"x" * 100), (b"b", b"x" * 100), (b"c", b"x" * 100)])
    host.get_many([b"a"])
    host.put_many([(b"d", b"x" * 100)])
    assert host.exists_many([b"a", b"b", b"c", b"d"]) == [True, False, True, True]
    assert host.used_bytes == 300 and host.stats.evictions == 1
    host.put_many([(b"huge", b"x" * 301)])
    assert host.exists_many([b"huge"]) == [False]


def test_disk_tier_serves_a_connector_after_restart(tmp_path: Path) -> None:
    produce(connector([DiskTier(tmp_path, 1 << 22)]), TOKENS)
    conn = connector([DiskTier(tmp_path, 1 << 22)])
    store: Store = {}
    seq = Sequence("consumer", TOKENS)
    assert admit(conn, seq, store) == (0, 96)
    assert_loaded_exact(conn.manager, seq, store, 96)


def test_stacked_tiers_promote_lower_hits_upwards(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 22)
    produce(connector([disk]), TOKENS)
    host = HostTier(1 << 20)
    conn = connector([host, disk])
    assert len(host) == 0
    store: Store = {}
    seq = Sequence("consumer", TOKENS)
    assert admit(conn, seq, store) == (0, 96)
    assert len(host) == 10 and conn.stats.promoted_blocks == 10
    disk_reads = disk.stats.hits
    conn2 = connector([host, disk])
    assert admit(conn2, Sequence("again", TOKENS), {}) == (0, 96)
    assert disk.stats.hits == disk_reads  # served by the host tier


def test_store_skips_blocks_a_tier_already_holds() -> None:
    host = HostTier(1 << 20)
    conn = connector([host])
    produce(conn, TOKENS)
    stored = conn.stats.stored_blocks
    produce(conn, TOKENS, seq_id="again")
    assert conn.stats.stored_blocks == stored


def test_the_codec_builds_each_value_once_for_every_tier_and_only_for_blocks_a_tier_lacks(tmp_path: Path) -> None:
    class Counting(FrameCodec):
        encoded = 0

        def encode(self, key: bytes, payload: bytes) -> bytes:
            self.encoded += 1
            return super().encode(key, payload)

    host, disk = HostTier(1 << 20), DiskTier(tmp_path, 1 << 20)
    conn = connector([host, disk], batch_blocks=2)
    codec = conn.codec = Counting(conn.auth_key, conn.payload_bytes)
    produce(conn, TOKENS)
    assert codec.encoded == conn.stats.stored_blocks == len(host) == len(disk) > 0  # both tiers, one frame each
    assert conn.stats.bytes_stored == 2 * host.used_bytes  # the same frames in both tiers
    produce(conn, TOKENS, seq_id="again")
    assert codec.encoded == conn.stats.stored_blocks  # nothing lacking, nothing encoded
    consumer = connector([host, disk])
    assert admit(consumer, Sequence("c", TOKENS), {}) == (0, 96)


def test_placeholder_values_go_through_the_same_store_and_read() -> None:
    host = HostTier(1 << 20)
    conn = connector([host], codec=PlaceholderCodec())
    produce(conn, TOKENS)
    assert conn.stats.stored_blocks == len(host) > 0 and conn.stats.bytes_stored == 0
    reader = connector([host], codec=PlaceholderCodec())
    seq = Sequence("c", TOKENS)
    got = reader.fetch(seq, 0, reader.num_external_tokens(seq, 0))
    assert got.num_tokens == 96 and set(got.payloads.values()) == {b""}  # served unchecked
    assert reader.stats.faults == dict.fromkeys(reader.stats.faults, 0)


# ---------------------------------------------------------------------- end to end
def test_local_hits_at_the_eviction_head_plus_external_tokens() -> None:
    """Two-phase adoption: local hit blocks sit first in the free queue; external allocation must not take them."""
    tiers: list[KVTier] = [HostTier(1 << 22)]
    produce(connector(tiers), TOKENS)
    mgr = hybrid(num_blocks=16)  # warm's 8 blocks + the filler's 10 (its prompt-end checkpoint included) - 2
    conn = connector(tiers, mgr)
    device: Store = {}
    # 1. A sequence computes the first 40 tokens and finishes: its blocks are cached and free.
    warm = Sequence("warm", TOKENS[:40])
    for n in (32, 8):  # a step ending on a block boundary leaves a Mamba checkpoint
        assert mgr.allocate(warm, n) is not None
        compute(mgr, warm, device, warm.num_computed_tokens, warm.num_computed_tokens + n)
        warm.num_computed_tokens += n
    mgr.free(warm)
    mgr.check_invariants()
    # 2. Another sequence takes every fresh block, then finishes: the LRU is warm's blocks, then its own.
    filler = Sequence("filler", list(range(5000, 5000 + 16 * 4)))
    assert mgr.allocate(filler, filler.num_tokens) is not None
    filler.num_computed_tokens = filler.num_tokens
    mgr.free(filler)
    mgr.check_invariants()
    # 3. The consumer: local hit of 32 tokens in every group, external tokens up to 96.
    seq = Sequence("consumer", TOKENS)
    hit = mgr.lookup(seq)
    assert hit.num_tokens == 32 and all(any(ids) for ids in hit.block_ids)
    k = conn.num_external_tokens(seq, hit.num_tokens)
    assert k == 64
    got = conn.fetch(seq, hit.num_tokens, k)
    assert mgr.allocate(seq, seq.num_tokens - 96, hit=hit, num_external_tokens=got.num_tokens) is not None
    mgr.check_invariants()
    conn.write(got, mgr.block_table("consumer"), lambda g, b, d: device.__setitem__((g, b), d))
    assert_loaded_exact(mgr, seq, device, 96)
    compute(mgr, seq, device, 96, 100)
    seq.num_computed_tokens = 100
    seq.append_token_ids([7])
    assert mgr.allocate(seq, 1) is not None  # decoding on from the loaded prefix
    mgr.check_invariants()
    assert mgr.stats.external_tokens == 64 and mgr.stats.hit_tokens == 32

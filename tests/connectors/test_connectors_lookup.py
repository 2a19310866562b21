"""Tier lookups: the device cache's hit rule over what the tiers hold, in a logarithmic number of probes."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import KVCacheManager, Sequence
from hybridkv.connectors import HostTier, KVConnector, KVTier
from hybridkv.connectors.lookup import probe_hit
from hybridkv.connectors.storage import StoreAll, StoreHitSpans

from helpers import chunked, full, mamba, manager, swa, tokens

LAYOUTS = {"swa": (full(), swa(64)), "two-windows": (full(), swa(64), swa(128)), "chunked": (full(), chunked(64)),
           "mamba": (full(), mamba())}


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(sorted(LAYOUTS)), length=st.integers(2, 700), chain=st.integers(0, 50),
       start_blocks=st.integers(0, 10), held=st.sets(st.integers(0, 45), max_size=30))
def test_probed_hit_equals_the_rule_over_everything_held(kind: str, length: int, chain: int, start_blocks: int,
                                                          held: set[int]) -> None:
    mgr = manager(100, *LAYOUTS[kind], retention="none")
    seq = Sequence("s", tokens(0, length))
    cap = (length - 1) // 16 * 16
    start = min(start_blocks * 16, cap)
    hashes = {g: mgr.block_hashes(seq, g) for g in mgr.caching_groups}
    # The growing group holds a prefix of its chain; the others any blocks.
    present = {0: set(range(min(chain, len(hashes[0]))))}
    for g in mgr.caching_groups[1:]:
        present[g] = {i for i in held if i < len(hashes[g])}
    calls: list[int] = []

    def probe(items: list[tuple[int, int]]) -> list[bool]:
        calls.append(len(items))
        return [i in present[g] for g, i in items]

    hit, reach = probe_hit(mgr.rules, seq, start, cap, probe)
    truth = mgr.rules.longest_hit(seq, {g: {hashes[g][i]: 1 for i in present[g]} for g in present}, start=start,
                                  limit=cap)
    assert hit == truth
    assert reach >= hit


class CountingTier(HostTier):
    def __init__(self) -> None:
        super().__init__(1 << 30)
        self.exists_calls = 0
        self.asked = 0

    def exists_many(self, keys: Seq[bytes]) -> list[bool]:
        self.exists_calls += 1
        self.asked += len(keys)
        return super().exists_many(keys)


def produce(conn: KVConnector, prompt: list[int], chunk: int = 4096) -> None:
    mgr = conn.manager
    seq = Sequence("p", prompt)
    while seq.num_computed_tokens < seq.num_tokens:
        c = seq.num_computed_tokens
        n = min(chunk, seq.num_tokens - c)
        assert mgr.allocate(seq, n) is not None
        seq.num_computed_tokens = c + n
        conn.store(seq, c + n, lambda g, b: b"k" * 8, c)
    mgr.free(seq)


def gemma_like() -> KVCacheManager:
    return manager(12000, full(), *[swa(1024)] * 5, max_model_len=32768, retention="none")


def conn_of(mgr: KVCacheManager, tier: KVTier, **kw: object) -> KVConnector:
    return KVConnector([tier], mgr, namespace="m", payload_bytes=dict.fromkeys(range(len(mgr.layout.groups)), 8),
                       **kw)  # type: ignore[arg-type]


def test_a_28k_token_lookup_takes_a_handful_of_probes_not_a_scan() -> None:
    tier = CountingTier()
    prompt = tokens(0, 28000)
    produce(conn_of(gemma_like(), tier), prompt)
    conn = conn_of(gemma_like(), tier)
    tier.exists_calls = tier.asked = 0
    assert conn.num_external_tokens(Sequence("c", prompt + [1]), 0) == 28000
    # 1,750 blocks in 6 groups: a scan asks about 10,500 blocks; the search 3 probes for the chain,
    # then the five window groups together their 64 blocks in doubling runs (8, 16, 32, 64).
    assert tier.exists_calls <= 3 + 4 and tier.asked < 1000
    assert conn.stats.probes == tier.exists_calls


def test_a_window_far_below_the_chains_end_costs_logarithmically_many_probes() -> None:
    tier = CountingTier()
    prompt = tokens(0, 27900)
    produce(conn_of(gemma_like(), tier, storage=StoreHitSpans(end_align=14000)), prompt)
    conn = conn_of(gemma_like(), tier)
    tier.exists_calls = tier.asked = 0
    # The chain runs to 27,888; the only window is at 14,000, 868 blocks below.
    assert conn.num_external_tokens(Sequence("c", prompt + [1]), 0) == 14000
    # log2(868) = 10 doubling runs at most, each one probe for all five window groups together.
    assert tier.exists_calls <= 3 + 10


def test_a_hole_in_a_chain_ends_the_load_before_the_hole() -> None:
    tier = CountingTier()
    prompt = tokens(0, 1600)
    mgr = manager(400, full(), swa(64), retention="none")
    produce(conn_of(mgr, tier, storage=StoreAll()), prompt)
    conn = conn_of(manager(400, full(), swa(64), retention="none"), tier)
    seq = Sequence("c", prompt + [1])
    tier.delete(conn.keys(seq, 0)[50])  # the search assumes a prefix: it may not see the hole
    got = conn.start_load(seq, 0).result()
    # The load reads the windows the lookup's hit needs (at 1,584) and stops at the hole: no hit
    # past it, and none before it either (the window at 800 was not read): a miss, counted.
    assert got.num_tokens == 0 and got.payloads == {}
    assert conn.stats.faults["missing"] == 1

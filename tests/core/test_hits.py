"""The agreed hit: what every group can serve, checked against the sequence before adoption.

* A request that repeats a cached prompt but diverges inside its last aligned block (a chat
  client re-sending an edited last turn) hits up to the last aligned boundary whose window is
  fully present, with different block sizes per group.
* A hit is verified, not trusted: one from another manager, a hand-built one or a stale one is
  accepted only if its blocks hold the sequence's prefix; anything else is an ``InvalidInputError``
  before any state changes.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv import CacheHit, HitRules, InvalidInputError, KVCacheManager, Sequence, UnknownSequenceError

from helpers import full, mamba, manager, run_prefill, swa, tokens


@given(sizes=st.sampled_from([(16, 32), (32, 16), (8, 16), (16, 16), (16, 48)]), window=st.integers(2, 100),
       n=st.integers(40, 300), back=st.integers(1, 70), chunk=st.sampled_from([16, 48, 512]))
def test_an_edit_inside_the_last_block_hits_up_to_the_last_boundary_with_a_whole_window(
        sizes: tuple[int, int], window: int, n: int, back: int, chunk: int) -> None:
    full_bs, swa_bs = sizes
    mgr = manager(2000, full(full_bs), swa(window, swa_bs), max_model_len=512, batch=512, retention="none")
    a = Sequence("a", tokens(0, n))
    run_prefill(mgr, a, chunk)
    mgr.free(a)
    d = max(1, n - back)  # b keeps a's first d tokens, then differs
    b = Sequence("b", tokens(0, d) + tokens(5000, back))
    align = math.lcm(full_bs, swa_bs)
    expected = min(d, b.num_tokens - 1, n) // align * align  # nothing evicted: every window is present
    hit = mgr.lookup(b)
    assert hit.num_tokens == expected
    assert mgr.allocate(b, b.num_tokens - hit.num_tokens, hit=hit) is not None
    mgr.check_invariants()


def test_the_hit_stops_where_a_window_block_is_missing() -> None:
    # full 16 + SWA(33, 32-token blocks): a hit at L needs the SWA block ending at L only when
    # 33 - 1 <= 32; evicting that block pulls the hit back to the previous aligned boundary.
    mgr = manager(2000, full(16), swa(33, 32), max_model_len=512, batch=64, retention="none")
    a = Sequence("a", tokens(0, 200))
    run_prefill(mgr, a, 64)
    mgr.free(a)
    b = Sequence("b", tokens(0, 180) + tokens(9000, 20))
    assert mgr.lookup(b).num_tokens == 160
    swa_hashes = mgr.block_hashes(b, 1)
    mgr.pool.uncache([mgr.pool.get_cached_block(1, swa_hashes[4])])  # the SWA block of tokens 128..160
    assert mgr.lookup(b).num_tokens == 128


# ---------------------------------------------------------------------- verified hits
def _cached(mgr: KVCacheManager, prompt: list[int]) -> None:
    seq = Sequence("producer", prompt)
    run_prefill(mgr, seq, 512)
    mgr.free(seq)


def test_a_hit_found_by_another_manager_is_verified_against_this_one() -> None:
    one, other = (manager(400, full(), swa(64), max_model_len=1024, batch=512) for _ in range(2))
    _cached(one, tokens(0, 300))
    seq = Sequence("s", tokens(0, 300))
    foreign = one.lookup(seq)
    assert foreign.num_tokens == 288
    free_before = other.num_free_blocks
    with pytest.raises(InvalidInputError, match="do not hold this sequence's prefix"):
        other.allocate(seq, 12, hit=foreign)
    assert other.num_free_blocks == free_before and other.num_sequences == 0
    other.check_invariants()
    # The same prompt cached in ``other`` too: the foreign hit's block ids differ, still refused.
    _cached(other, tokens(0, 300))
    if foreign.block_ids != other.lookup(seq).block_ids:
        with pytest.raises(InvalidInputError):
            other.allocate(seq, 12, hit=foreign)
    other.check_invariants()


def test_a_hand_built_hit_is_refused_before_anything_changes() -> None:
    mgr = manager(400, full(), swa(64), max_model_len=1024, batch=512)
    _cached(mgr, tokens(0, 300))
    seq = Sequence("q", tokens(0, 300))
    for bogus in (CacheHit("q", 32, ((), ())),  # tokens without blocks
                  CacheHit("q", 32, ((1, 2), (0, 0))),  # the window's blocks are missing
                  CacheHit("q", 30, ((1, 2), (1, 2))),  # not a multiple of the block size
                  CacheHit("q", 32, ((1, 99999), (0, 0))),  # a block id out of range
                  CacheHit("q", 32, ((1, 2.0), (0, 0))),  # type: ignore[arg-type]
                  CacheHit("q", 300, ((1,), (2,)))):  # covers the last token
        with pytest.raises(InvalidInputError):
            mgr.allocate(seq, 10, hit=bogus)
        assert mgr.num_sequences == 0
        mgr.check_invariants()


def test_a_hand_built_hit_that_holds_the_prefix_is_accepted() -> None:
    mgr = manager(400, full(), swa(64), max_model_len=1024, batch=512)
    _cached(mgr, tokens(0, 300))
    seq = Sequence("q", tokens(0, 300))
    real = mgr.lookup(seq)
    copy = CacheHit("q", real.num_tokens, real.block_ids)  # no owner, no epoch: verified block by block
    assert mgr.allocate(seq, 12, hit=copy) is not None
    assert mgr.block_table("q")[0][:18] == real.block_ids[0]
    mgr.check_invariants()


def test_a_stale_hit_for_a_new_sequence_reusing_the_id_is_refused() -> None:
    mgr = manager(400, full(), swa(64), max_model_len=1024, batch=512)
    _cached(mgr, tokens(0, 300))
    old = Sequence("r", tokens(0, 300))
    hit = mgr.lookup(old)
    reused = Sequence("r", tokens(1000, 300))  # same id, other tokens: nobody computed their KV
    with pytest.raises(InvalidInputError, match="do not hold this sequence's prefix"):
        mgr.allocate(reused, 12, hit=hit)
    assert mgr.lookup(Sequence("probe", tokens(1000, 300))).num_tokens == 0  # nothing was registered
    mgr.check_invariants()


def test_a_hit_evicted_since_the_lookup_is_refused() -> None:
    mgr = manager(40, full(), max_model_len=1024, batch=512, retention="none")
    _cached(mgr, tokens(0, 300))
    seq = Sequence("s", tokens(0, 300))
    hit = mgr.lookup(seq)
    _cached(mgr, tokens(5000, 600))  # evicts the prefix
    with pytest.raises(InvalidInputError, match="look the sequence up again"):
        mgr.allocate(seq, 12, hit=hit)
    mgr.check_invariants()


def test_wrong_arguments_are_clear_errors_that_change_nothing() -> None:
    mgr = manager(400, full(), mamba(), max_model_len=1024, batch=512)
    seq = Sequence("s", tokens(0, 100))
    with pytest.raises(InvalidInputError, match="sequence id"):
        mgr.free(123)  # type: ignore[arg-type]
    seq.num_computed_tokens = 1.5  # type: ignore[assignment]
    with pytest.raises(InvalidInputError, match="num_computed_tokens"):
        mgr.allocate(seq, 10)
    seq.num_computed_tokens = 0
    for bad in (-1, 1.0, True, None):
        with pytest.raises(InvalidInputError):
            mgr.allocate(seq, bad)  # type: ignore[arg-type]
    with pytest.raises(UnknownSequenceError):
        mgr.block_table("nobody")
    assert mgr.num_sequences == 0 and mgr.num_free_blocks == 399
    mgr.check_invariants()


@given(window=st.integers(2, 80), n=st.integers(20, 300), cut=st.integers(1, 300), chunk=st.sampled_from([16, 64]),
       kinds=st.sampled_from(["swa", "mamba", "both"]))
def test_hit_rules_without_a_pool_agree_with_the_managers_lookup(window: int, n: int, cut: int, chunk: int,
                                                                  kinds: str) -> None:
    specs = [full(16)] + ([swa(window, 16)] if kinds != "mamba" else []) + ([mamba(16)] if kinds != "swa" else [])
    mgr = manager(120, *specs, max_model_len=512, batch=512, retention="none")
    for i, prompt in enumerate((tokens(0, n), tokens(0, min(cut, n)) + tokens(777, 40))):
        seq = Sequence(f"p{i}", prompt)
        run_prefill(mgr, seq, chunk)
        mgr.free(seq)
    rules = HitRules(mgr.layout, 512, 512)
    cached = {g: dict(mgr.pool.index[g]) for g in rules.caching_groups}  # what the pool holds, by group
    for probe in (tokens(0, n), tokens(0, min(cut, n)) + tokens(999, 9), tokens(0, 5)):
        seq = Sequence("q", probe)
        assert rules.longest_hit(seq, cached) == mgr.lookup(seq).num_tokens

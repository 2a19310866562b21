"""The prefix cache holds only computed content, and keeps all of it, whatever callers do.

Each test builds one situation by hand and fails, every run, if the behaviour it names breaks:

* freeing a sequence between its allocation and its step (an abort, a preemption, a client gone)
  removes from the cache exactly the blocks that step was to compute, never a hit it adopted;
* a caller that rewinds ``num_computed_tokens`` or claims tokens without slots gets a
  ``HybridKVError`` and the manager is unchanged;
* the hit rules at their edges: a hit ending on a junction pays for the kept windows it adopts, a
  hit is checked group by group, a chunked-local hit starts at its chunk, a re-sent prompt whose
  length is a multiple of the alignment hits its recurrent state, salts and adapters never collide.
"""

from __future__ import annotations

import pytest

from hybridkv import CacheHit, InvalidInputError, KVCacheManager, Sequence

from helpers import chunked, full, manager, run_prefill, swa, tokens


def _cached_prefix(mgr: KVCacheManager, toks: list[int]) -> int:
    """Tokens of ``toks`` a new sequence would hit now."""
    return mgr.lookup(Sequence("probe", toks + [99_999])).num_tokens


def _computed_and_freed(mgr: KVCacheManager, sid: str, toks: list[int]) -> None:
    seq = Sequence(sid, toks)
    run_prefill(mgr, seq, 1024)
    mgr.free(seq)


# ---------------------------------------------------------------------- computed content survives
@pytest.mark.parametrize("retention", ["none", "window"])
def test_a_hit_freed_before_its_step_leaves_the_shared_prefix_cached(retention: str) -> None:
    mgr = manager(64, full(), swa(32), max_model_len=512, batch=256, retention=retention)
    prefix = tokens(0, 64)
    _computed_and_freed(mgr, "a", prefix)
    assert _cached_prefix(mgr, prefix) == 64

    b = Sequence("b", prefix + tokens(500, 20))
    hit = mgr.lookup(b)
    assert hit.num_tokens == 64
    assert mgr.allocate(b, 20, hit=hit) is not None
    mgr.free(b)  # aborted before its step ran: its own 20 tokens were never computed
    mgr.check_invariants()
    assert _cached_prefix(mgr, prefix) == 64, "a's computed prefix left the cache"


def test_two_sequences_sharing_a_hit_keep_it_when_one_is_aborted() -> None:
    mgr = manager(64, full(), swa(32), max_model_len=512, batch=256)
    prefix = tokens(0, 64)
    _computed_and_freed(mgr, "a", prefix)
    d = Sequence("d", prefix + tokens(700, 10))
    run_prefill(mgr, d, 256)  # running, holds the prefix through its own hit
    b = Sequence("b", prefix + tokens(500, 20))
    assert mgr.allocate(b, 20, hit=mgr.lookup(b)) is not None
    shared = mgr.block_table("d")[0][:4]
    assert mgr.block_table("b")[0][:4] == shared
    mgr.free(b)
    mgr.check_invariants()
    assert all(mgr.pool.block_hash[blk] is not None for blk in shared), "blocks d holds left the cache"
    assert _cached_prefix(mgr, prefix) == 64


def test_a_sequence_freed_mid_block_after_a_step_that_never_ran_leaves_nothing_of_that_step() -> None:
    """40 tokens computed (2.5 blocks); a step for 30 more is allocated, then the sequence is freed:
    block 2 (tokens 32..48, only 32..40 written) and block 3 (never written) must not serve a hit."""
    mgr = manager(64, full(), swa(32), max_model_len=512, batch=256)
    toks = tokens(0, 70)
    seq = Sequence("a", toks)
    assert mgr.allocate(seq, 40, hit=mgr.lookup(seq)) is not None
    seq.num_computed_tokens = 40
    assert _cached_prefix(mgr, toks) == 32
    assert mgr.allocate(seq, 30) is not None
    assert _cached_prefix(mgr, toks) == 64  # in flight: registered by the step being allocated
    written = mgr.block_table("a")[0]
    mgr.free(seq)  # the step never ran: num_computed_tokens is still 40
    mgr.check_invariants()
    assert _cached_prefix(mgr, toks) == 32, "a later request would read KV that was never written"
    assert mgr.pool.block_hash[written[2]] is None and mgr.pool.block_hash[written[3]] is None
    assert mgr.pool.block_hash[written[1]] is not None


def test_external_blocks_of_an_admission_that_never_ran_leave_the_cache() -> None:
    mgr = manager(64, full(), max_model_len=512, batch=256)
    seq = Sequence("a", tokens(0, 80))
    assert mgr.allocate(seq, 16, num_external_tokens=48) is not None
    assert _cached_prefix(mgr, tokens(0, 80)) == 64
    mgr.free(seq)  # the load and the step never happened
    assert _cached_prefix(mgr, tokens(0, 80)) == 0
    mgr.check_invariants()


# ---------------------------------------------------------------------- misuse raises, changes nothing
def _state(mgr: KVCacheManager) -> tuple[object, ...]:
    pool = mgr.pool
    return (list(pool.ref_cnt), list(pool.block_hash), mgr.pool.num_free_blocks,
            {sid: mgr.block_table(sid) for sid in mgr._seqs})


def test_a_rewind_of_num_computed_tokens_without_free_raises_and_changes_nothing() -> None:
    mgr = manager(40, swa(20, 8), full(8), max_model_len=96, batch=16)
    seq = Sequence("s1", tokens(0, 64))
    run_prefill(mgr, seq, 16)
    before = _state(mgr)
    for rewound in (0, 8, 47):
        seq.num_computed_tokens = rewound
        with pytest.raises(InvalidInputError, match="rewind"):
            mgr.allocate(seq, 16)
        assert _state(mgr) == before
        mgr.check_invariants()
    seq.num_computed_tokens = 64
    seq.append_token_ids([1])
    assert mgr.allocate(seq, 1) is not None
    mgr.check_invariants()


def test_a_count_past_the_allocated_slots_raises() -> None:
    mgr = manager(40, full(8), max_model_len=96, batch=16)
    seq = Sequence("s1", tokens(0, 64))
    assert mgr.allocate(seq, 16) is not None
    seq.num_computed_tokens = 40  # only 16 tokens had slots
    before = _state(mgr)
    with pytest.raises(InvalidInputError, match="16"):
        mgr.allocate(seq, 8)
    assert _state(mgr) == before


def test_free_trusts_only_a_possible_count() -> None:
    """A caller that set a count the last allocation could not have produced frees as if the step
    never ran: the blocks that step registered leave the cache."""
    for junk in (-3, 1000, "x", None, 3.5):
        mgr = manager(40, full(8), max_model_len=96, batch=64)
        seq = Sequence("s1", tokens(0, 64))
        assert mgr.allocate(seq, 48) is not None
        seq.num_computed_tokens = junk  # type: ignore[assignment]
        mgr.free(seq)
        mgr.check_invariants()
        assert _cached_prefix(mgr, tokens(0, 64)) == 0
        assert mgr.num_free_blocks == 39


# ---------------------------------------------------------------------- hit rules at their edges
def test_a_hit_is_checked_group_by_group_with_blocks_of_its_own_group() -> None:
    mgr = manager(64, full(), swa(32), max_model_len=512, batch=256)
    _computed_and_freed(mgr, "a", tokens(0, 64))
    b = Sequence("b", tokens(0, 80))
    hit = mgr.lookup(b)
    assert hit.num_tokens == 64
    swapped = CacheHit("b", 64, (hit.block_ids[1], hit.block_ids[0]))
    before = _state(mgr)
    with pytest.raises(InvalidInputError):
        mgr.allocate(b, 16, hit=swapped)
    # the full group's blocks hold the right hashes but belong to group 0: group 1 must refuse them
    full_ids, window_ids = hit.block_ids
    crossed = CacheHit("b", 64, (full_ids, tuple(0 if i < 2 else full_ids[i] for i in range(4))))
    with pytest.raises(InvalidInputError, match="group 1"):
        mgr.allocate(b, 16, hit=crossed)
    assert window_ids != crossed.block_ids[1]
    assert _state(mgr) == before
    assert mgr.allocate(b, 16, hit=hit) is not None
    mgr.check_invariants()

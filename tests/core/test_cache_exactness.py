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

from collections.abc import Callable

import pytest

from hybridkv import CacheHit, InvalidInputError, KVCacheManager, Sequence

from helpers import chunked, full, mamba, manager, run_prefill, swa, tokens


def _cached_prefix(mgr: KVCacheManager, toks: list[int]) -> int:
    """Tokens of ``toks`` a new sequence would hit now."""
    return mgr.lookup(Sequence("probe", toks + [99_999])).num_tokens


def _computed_and_freed(mgr: KVCacheManager, sid: str, toks: list[int]) -> None:
    seq = Sequence(sid, toks)
    run_prefill(mgr, seq, mgr.max_num_batched_tokens)
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


def _junction_setup(num_blocks: int, ballast: int) -> tuple[KVCacheManager, Sequence]:
    """Two prompts sharing a 64-token prefix, computed and freed with window retention (the second
    teaches the junction at 64, so its window blocks there are kept); a running sequence of
    ``ballast`` unrelated tokens holds part of the pool; ``c`` shares the prefix."""
    mgr = manager(num_blocks, full(), swa(32), max_model_len=512, batch=64, retention="window")
    prefix = tokens(0, 64)
    for i in range(2):
        _computed_and_freed(mgr, f"w{i}", prefix + tokens(1000 * (i + 1), 32))
    if ballast:
        run_prefill(mgr, Sequence("ballast", tokens(50_000, ballast)), 64)
    return mgr, Sequence("c", prefix + tokens(3000, 40))


def test_a_hit_ending_on_a_junction_pays_for_the_kept_windows_it_adopts() -> None:
    """The hit at the junction adopts 4 free full-attention blocks and the 2 kept window blocks
    tied to them: 6 admissible blocks, on top of the blocks the step allocates. Admission must
    refuse exactly when those do not fit, never run the pool dry mid-allocation."""
    mgr, c = _junction_setup(40, 0)
    hit = mgr.lookup(c)
    assert hit.num_tokens == 64
    assert sorted(mgr.pool.queue_of(b) for ids in hit.block_ids for b in ids if b) == ["kept"] * 2 + ["lru"] * 4
    assert mgr.allocate(c, 40, hit=hit) is not None
    _sweep_admission(lambda ballast: _junction_setup(40, ballast), range(16, 400, 16),
                     step_blocks=mgr.num_held_blocks("c") - 6, hit_cost=6)


def _sweep_admission(setup: Callable[[int], tuple[KVCacheManager, Sequence]], ballasts: range, *,
                     step_blocks: int, hit_cost: int) -> None:
    """Admit ``c`` (40 new tokens on its 64-token hit) beside running ballasts of growing size: it must
    be admitted exactly when the admissible blocks cover the step's and the hit's cost, and the sweep
    must cross that boundary."""
    outcomes = {}
    for ballast in ballasts:
        mgr, c = setup(ballast)
        hit = mgr.lookup(c)
        if hit.num_tokens != 64:
            continue  # the ballast evicted the prefix
        admissible = mgr.num_admissible_blocks
        result = mgr.allocate(c, 40, hit=hit)
        mgr.check_invariants()
        assert (result is not None) == (admissible >= step_blocks + hit_cost), (
            f"{admissible} admissible blocks, {step_blocks} for the step + {hit_cost} for the hit: allocate gave "
            f"{result}")
        outcomes[result is not None] = ballast
    assert set(outcomes) == {True, False}, f"the sweep never crossed the boundary: {outcomes}"


def _reserved_windows_setup(num_blocks: int, ballast: int) -> tuple[KVCacheManager, Sequence]:
    """As ``_junction_setup``, but a running sequence ``d`` holds the prefix past the junction, so
    the two windows kept at 64 are *reserved* (their anchor is held): no new sequence could take
    them anyway, so ``c``'s hit adopting them consumes no admissible block."""
    mgr = manager(num_blocks, full(), swa(32), max_model_len=512, batch=64, retention="window")
    prefix = tokens(0, 64)
    for i in range(2):
        _computed_and_freed(mgr, f"w{i}", prefix + tokens(1000 * (i + 1), 32))
    d = Sequence("d", prefix + tokens(1000, 32) + tokens(4000, 8))
    hit = mgr.lookup(d)
    assert hit.num_tokens == 96 and mgr.allocate(d, 8, hit=hit) is not None
    d.num_computed_tokens = 104
    if ballast:
        run_prefill(mgr, Sequence("ballast", tokens(50_000, ballast)), 64)
    return mgr, Sequence("c", prefix + tokens(3000, 40))


def test_a_hit_on_reserved_windows_costs_no_admissible_block() -> None:
    """``c``'s hit at the junction adopts 4 held full-attention blocks and the 2 reserved kept
    windows: admission needs only the step's own blocks, and must admit exactly when they fit."""
    mgr, c = _reserved_windows_setup(36, 0)
    hit = mgr.lookup(c)
    free = [b for ids in hit.block_ids for b in ids if b and not mgr.pool.ref_cnt[b]]
    assert hit.num_tokens == 64 and len(free) == 2 and {mgr.pool.queue_of(b) for b in free} == {"kept"}
    assert mgr.retainer.admission_cost(free) == 0
    assert mgr.allocate(c, 40, hit=hit) is not None
    _sweep_admission(lambda ballast: _reserved_windows_setup(36, ballast), range(16, 304, 16),
                     step_blocks=mgr.num_held_blocks("c") - 6, hit_cost=0)


def test_a_chunked_local_hit_bounded_at_a_chunk_boundary_holds_no_block_of_that_group() -> None:
    """Chunks of 32 tokens: a hit ending at 64 starts a new chunk, so the chunked group reads
    nothing of the prefix (all null); a hit ending at 48 reads its chunk's block 2 (tokens 32..48)."""
    mgr = manager(64, full(), chunked(32), max_model_len=512, batch=256)
    _computed_and_freed(mgr, "a", tokens(0, 100))
    at_64 = mgr.lookup(Sequence("b", tokens(0, 64) + tokens(900, 20)))
    assert at_64.num_tokens == 64 and at_64.full_hit_tokens == 64
    assert at_64.block_ids[1] == (0, 0, 0, 0)
    at_48 = mgr.lookup(Sequence("c", tokens(0, 48) + tokens(900, 20)))
    assert at_48.num_tokens == 48
    assert at_48.block_ids[1][:2] == (0, 0) and at_48.block_ids[1][2] == mgr.pool.get_cached_block(
        1, mgr.block_hashes(Sequence("c", tokens(0, 48) + tokens(900, 20)), 1)[2])
    b = Sequence("b", tokens(0, 64) + tokens(900, 20))
    assert mgr.allocate(b, 20, hit=at_64) is not None
    assert mgr.block_table("b")[1][:4] == (0, 0, 0, 0)
    mgr.check_invariants()


@pytest.mark.parametrize("length", [64, 80, 128])
def test_a_resent_prompt_whose_length_is_a_multiple_of_the_alignment_hits_its_recurrent_state(length: int) -> None:
    """The last token is never a hit, so a re-sent prompt of 64 tokens can hit at most 48: the
    state checkpointed at the prompt's end must be the one at 48, not at 64."""
    mgr = manager(64, full(), mamba(), max_model_len=512, batch=256)
    _computed_and_freed(mgr, "a", tokens(0, length))
    hit = mgr.lookup(Sequence("again", tokens(0, length)))
    assert hit.max_hit_tokens == length - 16
    assert hit.num_tokens == length - 16


def test_different_salt_and_adapter_pairs_never_hash_alike() -> None:
    pairs: list[tuple[object, object]] = [
        (None, None), ("a", None), (None, "a"), ("ab", None), ("a", "b"), ("b", "a"), (None, "ab"),
        ("xa", None), ("x", ""), ("", "x"), ("", None), (None, ""), (b"\x00", None), ("s", 1), (None, 1),
        (None, 12), ("1", 2), ("12", None), ("a" * 300, None), ("a" * 299, "a"),
    ]
    seen: dict[bytes, tuple[object, object]] = {}
    for salt, adapter in pairs:
        seq = Sequence("s", tokens(0, 40), cache_salt=salt, adapter_id=adapter)  # type: ignore[arg-type]
        first = manager(8, full()).block_hashes(seq, 0)[0]
        assert first not in seen, f"salt/adapter {(salt, adapter)} hashes like {seen[first]}"
        seen[first] = (salt, adapter)
    salted = manager(64, full())
    _computed_and_freed(salted, "t1", tokens(0, 64))
    for salt, adapter in pairs[1:]:
        probe = Sequence("p", tokens(0, 64), cache_salt=salt, adapter_id=adapter)  # type: ignore[arg-type]
        assert salted.lookup(probe).num_tokens == 0, f"{(salt, adapter)} hit an unsalted prefix"


def test_freeing_a_sequence_before_its_step_breaks_the_same_step_hits_on_what_it_was_to_compute() -> None:
    """a registers blocks for tokens its step will compute; b and c, admitted in the same step,
    adopt them as hits. If a is freed before the step runs, that KV is never written: the blocks
    leave the cache, and b and c cannot go on (their next allocate says so) until freed."""
    mgr = manager(64, full(), max_model_len=512, batch=256)
    a = Sequence("a", tokens(0, 64))
    assert mgr.allocate(a, 64) is not None
    b, c = Sequence("b", tokens(0, 48) + [1, 2]), Sequence("c", tokens(0, 48) + [3])
    for s in (b, c):
        hit = mgr.lookup(s)
        assert hit.num_tokens == 48  # a's blocks, in flight
        assert mgr.allocate(s, s.num_tokens - 48, hit=hit) is not None
        s.num_computed_tokens = s.num_tokens
    mgr.free(a)
    mgr.check_invariants()
    assert _cached_prefix(mgr, tokens(0, 64)) == 0
    for s in (b, c):
        s.append_token_ids([5])
        with pytest.raises(InvalidInputError, match="freed before that step ran"):
            mgr.allocate(s, 1)
    mgr.free(b)
    mgr.free(c)
    mgr.check_invariants()
    assert mgr.num_free_blocks == 63

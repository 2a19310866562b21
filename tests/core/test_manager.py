"""Manager scenarios: hits per kind, window drops, admission (the admission bound), two-phase adoption."""

from __future__ import annotations

import pytest

from hybridkv import (
    BlockHasher,
    BlockStored,
    CacheHit,
    CrossAttentionSpec,
    InvalidInputError,
    KVCacheManager,
    Sequence,
    SequenceTooLongError,
    UnknownSequenceError,
)

from helpers import chunked, full, mamba, manager, run_prefill, swa, tokens

# ---------------------------------------------------------------------- the admission bound


def test_swa_admission_uses_the_per_request_bound_and_never_fails_mid_run() -> None:
    # 1,000-token prompt, full + SWA (W=64), 16-token blocks, 128-token chunks, max_model_len 1024:
    # full needs 63 blocks, SWA at most cdiv(63 + 128, 16) + 1 = 13: 76 <= 77 usable of 78.
    mgr = manager(78, full(), swa(64), max_model_len=1024, batch=128)
    seq = Sequence("long", tokens(0, 1000))
    run_prefill(mgr, seq, 128, whole=True)  # asserts every chunk fits
    table = mgr.block_table("long")
    assert sum(b != 0 for b in table[0]) == 63
    assert sum(b != 0 for b in table[1]) <= 13


def test_full_attention_still_refuses_a_request_that_cannot_fit() -> None:
    mgr = manager(5, full(), max_model_len=1024, batch=128)
    seq = Sequence("big", tokens(0, 256))
    assert mgr.allocate(seq, 128, whole_sequence_must_fit=True) is None
    assert not mgr.can_ever_fit(256)
    assert mgr.num_free_blocks == 4 and mgr.num_sequences == 0


def test_whole_sequence_check_counts_blocks_past_the_first_chunk() -> None:
    mgr = manager(40, full(), max_model_len=1024, batch=128)
    seq = Sequence("s", tokens(0, 700))  # 44 blocks in all, 8 for the first chunk
    assert mgr.allocate(seq, 128) is not None  # without the check the first chunk fits
    mgr.free(seq)
    assert mgr.allocate(seq, 128, whole_sequence_must_fit=True) is None


# ---------------------------------------------------------------------- hits per kind


def test_full_attention_hit_stops_at_the_first_miss_and_never_covers_the_last_token() -> None:
    mgr = manager(100, full(16))
    run_prefill(mgr, Sequence("a", tokens(0, 64)), 64)
    mgr.free("a")
    # Same 64 tokens: the hit stops at 48 so the last token is computed.
    assert mgr.lookup(Sequence("b", tokens(0, 64))).num_tokens == 48
    assert mgr.lookup(Sequence("c", tokens(0, 65))).num_tokens == 64
    diverge = tokens(0, 40) + tokens(1000, 40)
    assert mgr.lookup(Sequence("d", diverge)).num_tokens == 32


def test_sliding_window_hit_needs_only_the_blocks_inside_the_window() -> None:
    mgr = manager(200, full(16), swa(48, 16))  # cdiv(47, 16) = 3 contiguous blocks
    a = Sequence("a", tokens(0, 160))
    run_prefill(mgr, a, 32)  # chunks drop the early SWA blocks as the window moves
    hit = mgr.lookup(Sequence("b", tokens(0, 160) + [7]))
    assert hit.num_tokens == 160
    full_ids, swa_ids = hit.block_ids
    assert len(full_ids) == 10 and 0 not in full_ids
    assert swa_ids[:7] == (0,) * 7 and 0 not in swa_ids[7:]  # earlier positions are null


def test_sliding_window_hit_falls_back_to_the_last_complete_window() -> None:
    mgr = manager(200, full(16), swa(48, 16), retention="none")
    a = Sequence("a", tokens(0, 160))
    run_prefill(mgr, a, 160)
    mgr.free(a)
    # Evict SWA block 9 (the last window block of the 160-token prefix) by hand.
    b9 = mgr.lookup(Sequence("x", tokens(0, 161))).block_ids[1][9]
    mgr.pool.touch([b9])
    mgr.pool._evict(b9)
    mgr.pool.free([b9])
    hit = mgr.lookup(Sequence("b", tokens(0, 161)))
    assert hit.num_tokens == 144  # SWA needs 3 contiguous blocks ending at 144: 6, 7, 8
    mgr.check_invariants()


def test_sliding_window_run_starting_at_block_zero_counts_even_if_short() -> None:
    mgr = manager(50, full(16), swa(1024, 16))  # the window would need 64 blocks
    run_prefill(mgr, Sequence("a", tokens(0, 40)), 40)
    mgr.free("a")
    assert mgr.lookup(Sequence("b", tokens(0, 40) + [9])).num_tokens == 32


def test_chunked_local_counts_blocks_before_the_current_chunk_as_null_hits() -> None:
    mgr = manager(100, full(16), chunked(64, 16))
    run_prefill(mgr, Sequence("a", tokens(0, 100)), 100)
    mgr.free("a")
    hit = mgr.lookup(Sequence("b", tokens(0, 100)))
    assert hit.num_tokens == 96
    assert hit.block_ids[1][:4] == (0, 0, 0, 0) and 0 not in hit.block_ids[1][4:]


def test_mamba_align_hit_is_the_latest_cached_state() -> None:
    mgr = manager(100, full(16), mamba(16))
    a = Sequence("a", tokens(0, 100))
    run_prefill(mgr, a, 32)  # steps end at 32, 64, 96, 100: states cached at 32, 64 and 96
    table = mgr.block_table("a")[1]
    # Only the state the last step read (at 96) and the one it wrote (at 100) are kept.
    assert [i for i, b in enumerate(table) if b] == [5, 6]
    mgr.free(a)
    hit = mgr.lookup(Sequence("b", tokens(0, 90)))
    assert hit.num_tokens == 64
    assert hit.block_ids[1] == (0, 0, 0, hit.block_ids[1][3]) and hit.block_ids[1][3] != 0


def test_mamba_none_mode_never_hits_and_holds_one_block() -> None:
    mgr = manager(100, full(16), mamba(16, mode="none"))
    run_prefill(mgr, Sequence("a", tokens(0, 100)), 32)
    assert sum(b != 0 for b in mgr.block_table("a")[1]) == 1
    mgr.free("a")
    assert mgr.lookup(Sequence("b", tokens(0, 100))).num_tokens == 0


def test_cross_attention_allocates_once_from_the_encoder_length() -> None:
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, max_encoder_len=1500)
    mgr = manager(200, full(16), cross)
    seq = Sequence("w", tokens(0, 10), num_encoder_tokens=1500)
    new = mgr.allocate(seq, 10)
    assert new is not None and len(new[1]) == 94
    seq.num_computed_tokens = 10
    seq.append_token_ids([1])
    assert mgr.allocate(seq, 1) == ([], [])
    mgr.check_invariants()


def test_hits_align_to_a_boundary_every_group_divides() -> None:
    mgr = manager(200, full(16), swa(64, 32))
    run_prefill(mgr, Sequence("a", tokens(0, 200)), 200)
    mgr.free("a")
    hit = mgr.lookup(Sequence("b", tokens(0, 200) + [5]))
    assert hit.num_tokens % 32 == 0 and hit.num_tokens == 192


# ---------------------------------------------------------------------- window drops


@pytest.mark.parametrize(
    ("spec", "computed", "skipped_blocks"),
    [(swa(64, 16), 200, (200 - 64 + 1) // 16), (chunked(64, 16), 200, 192 // 16), (mamba(16), 200, 199 // 16)],
)
def test_windows_drop_wholly_skipped_blocks(spec: object, computed: int, skipped_blocks: int) -> None:
    mgr = manager(100, full(16), spec)
    seq = Sequence("s", tokens(0, computed + 1))
    run_prefill(mgr, seq, computed + 1)
    seq.num_computed_tokens = computed  # as if the last token were still to come
    mgr.free(seq)
    seq2 = Sequence("t", tokens(0, computed + 1))
    assert mgr.allocate(seq2, computed) is not None
    seq2.num_computed_tokens = computed
    assert mgr.allocate(seq2, 1) is not None  # the next step drops what the window left behind
    table = mgr.block_table("t")[1]
    assert all(b == 0 for b in table[:skipped_blocks])
    assert table[skipped_blocks] != 0
    mgr.check_invariants()


def test_dropped_window_blocks_are_reused_by_other_sequences() -> None:
    mgr = manager(40, full(16), swa(32, 16), max_model_len=1024, batch=64)
    a = Sequence("a", tokens(0, 400))
    run_prefill(mgr, a, 64)  # 25 full blocks + a bounded window: fits only because of drops
    assert mgr.num_free_blocks == 39 - 25 - sum(b != 0 for b in mgr.block_table("a")[1])


# ---------------------------------------------------------------------- two-phase adoption


def _hits_at_the_eviction_head(num_swa_groups: int) -> tuple[KVCacheManager, Sequence]:
    """A computed 28 tokens in 4-token steps and finished; its SWA blocks 0 and 1 were dropped
    first, so they lead the LRU. B shares A's first 8 tokens."""
    specs = [full(4)] + [swa(16, 4) for _ in range(num_swa_groups)]
    mgr = manager(1 + 7 * len(specs), *specs, max_model_len=64, batch=4, retention="none")
    a = Sequence("a", tokens(0, 28))
    run_prefill(mgr, a, 4)
    mgr.free(a)
    assert mgr.pool._next_fresh == mgr.pool.num_blocks and not mgr.pool._uncached  # nothing else to take
    return mgr, Sequence("b", tokens(0, 8) + tokens(500, 12))


@pytest.mark.parametrize("num_swa_groups", [1, 2])
def test_local_hits_of_all_groups_are_referenced_before_external_blocks_are_allocated(num_swa_groups: int) -> None:
    mgr, b = _hits_at_the_eviction_head(num_swa_groups)
    hit = mgr.lookup(b)
    assert hit.num_tokens == 8
    swa_hits = {b for ids in hit.block_ids[1:] for b in ids[:2]}
    # The SWA hits are the next blocks an allocation would pop.
    assert set(list(mgr.pool._lru)[: 2 * num_swa_groups]) == swa_hits
    new = mgr.allocate(b, 4, hit=hit, num_external_tokens=8)
    assert new is not None
    mgr.check_invariants()
    tables = mgr.block_table("b")
    for ids, table in zip(hit.block_ids, tables):
        assert table[:2] == ids[:2]
    live = [x for t in tables for x in t if x]
    assert len(live) == len(set(live))  # no physical block in two places


@pytest.mark.parametrize("num_swa_groups", [1, 2])
def test_two_phase_adoption_holds_after_preemption_and_reallocation(num_swa_groups: int) -> None:
    mgr, b = _hits_at_the_eviction_head(num_swa_groups)
    assert mgr.allocate(b, 4, hit=mgr.lookup(b), num_external_tokens=8) is not None
    b.num_computed_tokens = 20
    mgr.free(b)  # preempted
    b.num_computed_tokens = 0
    hit = mgr.lookup(b)
    assert hit.num_tokens == 16
    assert mgr.allocate(b, 1, hit=hit, num_external_tokens=3) is not None
    mgr.check_invariants()


def test_one_phase_adoption_would_double_allocate_a_block() -> None:
    """Negative control: interleaving touch and allocation per group breaks the invariants."""
    mgr, b = _hits_at_the_eviction_head(1)
    hit = mgr.lookup(b)
    mgr._seqs[b.seq_id] = b
    for g, ids in zip(mgr.groups, hit.block_ids):  # group by group: what two-phase adoption prevents
        mgr.pool.touch(list(ids))
        g.adopt(b.seq_id, list(ids))
        indices = g.plan_indices(b.seq_id, [], 16, 0, 16)  # blocks for 8 external tokens
        g.grow(b.seq_id, indices, allow_reserved=False)  # pops the SWA group's untouched hits
    with pytest.raises(AssertionError, match="tables without being cached"):
        mgr.check_invariants()


# ---------------------------------------------------------------------- failures, errors, resets


def test_a_failed_allocate_changes_nothing() -> None:
    mgr = manager(10, full(16))
    a = Sequence("a", tokens(0, 64))
    assert mgr.allocate(a, 64) is not None
    before = (mgr.num_free_blocks, mgr.block_table("a"))
    assert mgr.allocate(Sequence("b", tokens(100, 200)), 200) is None
    assert (mgr.num_free_blocks, mgr.block_table("a")) == before
    with pytest.raises(UnknownSequenceError):
        mgr.block_table("b")
    assert mgr.stats.allocation_failures == 1
    mgr.check_invariants()


def test_cache_salt_isolates_tenants_and_same_salt_hits() -> None:
    mgr = manager(100, full(16), swa(32, 16))
    run_prefill(mgr, Sequence("a", tokens(0, 100), cache_salt="tenant-1"), 100)
    mgr.free("a")
    assert mgr.lookup(Sequence("b", tokens(0, 100), cache_salt="tenant-2")).num_tokens == 0
    assert mgr.lookup(Sequence("c", tokens(0, 100))).num_tokens == 0
    assert mgr.lookup(Sequence("d", tokens(0, 100), cache_salt="tenant-1")).num_tokens == 96


def test_stats_report_queried_and_hit_tokens() -> None:
    mgr = manager(100, full(16))
    run_prefill(mgr, Sequence("a", tokens(0, 100)), 100)
    run_prefill(mgr, Sequence("b", tokens(0, 100)), 100)
    assert (mgr.stats.queried_tokens, mgr.stats.hit_tokens, mgr.stats.admissions) == (200, 96, 2)
    assert mgr.stats.hit_rate == pytest.approx(0.48)


def test_reset_prefix_cache_is_refused_while_a_sequence_holds_blocks() -> None:
    mgr = manager(100, full(16))
    a = Sequence("a", tokens(0, 50))
    run_prefill(mgr, a, 50)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    mgr.free(a)  # idempotent
    assert mgr.reset_prefix_cache() is True
    assert mgr.lookup(Sequence("b", tokens(0, 50))).num_tokens == 0


def test_bad_input_gets_specific_errors_and_loses_nothing() -> None:
    mgr = manager(100, full(16), max_model_len=128)
    with pytest.raises(SequenceTooLongError, match="200 tokens; max_model_len is 128"):
        mgr.allocate(Sequence("long", tokens(0, 200)), 10)
    a = Sequence("a", tokens(0, 50))
    with pytest.raises(InvalidInputError, match="exceed its 50 tokens"):
        mgr.allocate(a, 51)
    with pytest.raises(InvalidInputError, match="num_new_tokens"):
        mgr.allocate(a, -1)
    assert mgr.allocate(a, 50) is not None
    a.num_computed_tokens = 50
    with pytest.raises(InvalidInputError, match="first allocation"):
        mgr.allocate(a, 0, hit=CacheHit("a", 16, ((1,),)))
    with pytest.raises(InvalidInputError, match="not 'b'"):
        mgr.allocate(Sequence("b", tokens(0, 20)), 4, hit=mgr.lookup(Sequence("x", tokens(0, 20))))
    with pytest.raises(UnknownSequenceError, match="'nope'"):
        mgr.block_table("nope")
    with pytest.raises(InvalidInputError, match="retention"):
        manager(10, full(16), retention="sometimes")
    mgr.check_invariants()
    assert mgr.num_free_blocks == 99 - 4


def test_a_stale_hit_is_rejected_instead_of_adopting_reused_blocks() -> None:
    mgr = manager(6, full(16))
    run_prefill(mgr, Sequence("a", tokens(0, 64)), 64)
    mgr.free("a")
    stale = mgr.lookup(Sequence("b", tokens(0, 65)))
    run_prefill(mgr, Sequence("c", tokens(900, 80)), 80, use_hit=False)  # evicts a's blocks
    mgr.free("c")
    with pytest.raises(InvalidInputError, match="look the sequence up again"):
        mgr.allocate(Sequence("b", tokens(0, 65)), 1, hit=stale)
    mgr.check_invariants()


# ---------------------------------------------------------------------- the per-step path


def _decode(mgr: KVCacheManager, seq: Sequence, steps: int) -> list[tuple[list[int], ...]]:
    """Append one token and allocate its slot ``steps`` times; the allocations' results."""
    out = []
    for i in range(steps):
        seq.append_token_ids([9000 + i])
        new = mgr.allocate(seq, 1)
        assert new is not None
        out.append(new)
        seq.num_computed_tokens += 1
        mgr.check_invariants()
    return out


def test_decodes_inside_a_block_allocate_nothing_and_return_one_fresh_list_per_group() -> None:
    mgr = manager(100, full(16), swa(64))
    seq = Sequence("s", tokens(0, 40))
    run_prefill(mgr, seq, 40)
    steps = _decode(mgr, seq, 7)  # tokens 41..47: the third block has room for them
    assert all(new == ([], []) for new in steps)
    steps[0][0].append(1)  # callers may keep and change the lists: the next step's are fresh
    assert _decode(mgr, seq, 1) == [([], [])]


def test_a_decode_that_fills_a_block_registers_it_and_the_next_one_allocates() -> None:
    mgr = manager(100, full(16))
    seq = Sequence("s", tokens(0, 40))
    run_prefill(mgr, seq, 40)
    _decode(mgr, seq, 8)  # 48 tokens: the third block is full now
    probe = Sequence("p", seq.token_ids + [1])
    assert mgr.lookup(probe).num_tokens == 48
    (new,) = _decode(mgr, seq, 1)  # token 49 needs a fourth block
    assert len(new[0]) == 1 and mgr.block_table("s")[0][-1] == new[0][0]


def test_sliding_window_blocks_are_dropped_on_the_step_the_window_leaves_them() -> None:
    mgr = manager(100, full(16), swa(32))
    seq = Sequence("s", tokens(0, 40))
    run_prefill(mgr, seq, 40)
    free_before = mgr.num_free_blocks
    _decode(mgr, seq, 8)  # 47 computed: the window (32) no longer reads tokens 0..15
    assert mgr.block_table("s")[1][0] == 0
    assert mgr.num_free_blocks == free_before + 1


def test_stored_events_describe_the_blocks_with_parent_and_tokens() -> None:
    mgr = manager(100, full(16), swa(32, 16), max_model_len=512, batch=64, enable_events=True)
    seq = Sequence("a", tokens(0, 100))
    run_prefill(mgr, seq, 64)
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    full_events = [e for e in stored if e.group == 0]
    assert [len(e.block_hashes) for e in full_events] == [4, 2]  # 64 tokens, then 36 more
    hashes = mgr.block_hashes(seq, 0)
    assert full_events[0].parent_block_hash is None and full_events[1].parent_block_hash == hashes[3]
    assert full_events[1].token_ids == tuple(tokens(64, 32)) and full_events[1].block_size == 16
    assert list(full_events[0].block_hashes + full_events[1].block_hashes) == hashes[:6]


# ---------------------------------------------------------------------- the sequence protocol


class HashOnlySequence:
    """A ``KVSequence`` by composition, known only by its block hashes (as a simulator's requests are):
    it wraps a real sequence's hashes and has no token ids."""

    token_ids = None
    num_encoder_tokens = 0

    def __init__(self, seq_id: str, inner: Sequence) -> None:
        self.seq_id = seq_id
        self.inner = inner
        self.num_tokens = self.num_prompt_tokens = inner.num_tokens
        self.num_computed_tokens = 0

    def block_hashes(self, hasher: BlockHasher, block_size: int) -> list[bytes]:
        return self.inner.block_hashes(hasher, block_size)


def test_a_sequence_known_only_by_its_hashes_is_served_like_one_with_token_ids() -> None:
    mgr = manager(100, full(16), swa(32, 16), max_model_len=512, batch=128, enable_events=True)
    real = Sequence("real", tokens(0, 96))
    run_prefill(mgr, real, 128)
    mgr.free(real)
    mgr.take_events()
    shadow = HashOnlySequence("shadow", Sequence("x", tokens(0, 96)))
    hit = mgr.lookup(shadow)
    assert hit.num_tokens == mgr.lookup(Sequence("probe", tokens(0, 96))).num_tokens > 0
    assert mgr.allocate(shadow, 96 - hit.num_tokens, hit=hit) is not None
    shadow.num_computed_tokens = 96
    other = HashOnlySequence("other", Sequence("y", tokens(500, 64)))
    assert mgr.allocate(other, 64) is not None
    other.num_computed_tokens = 64
    assert mgr.allocate(other, 0) is not None  # registers its computed blocks
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    assert stored and all(e.token_ids == () for e in stored)  # no token ids to report
    mgr.free(shadow)
    mgr.free("other")
    mgr.check_invariants()
    assert mgr.num_sequences == 0


@pytest.mark.parametrize("bad", [object(), "a-string", 7, tokens(0, 16)])
def test_an_object_that_is_not_a_sequence_is_refused_with_its_type(bad: object) -> None:
    mgr = manager(20, full(16), max_model_len=256, batch=64)
    with pytest.raises(InvalidInputError, match="expected a sequence"):
        mgr.lookup(bad)
    with pytest.raises(InvalidInputError, match="expected a sequence"):
        mgr.allocate(bad, 16)
    mgr.check_invariants()
    assert mgr.num_free_blocks == 19


def test_a_chunk_that_does_not_start_on_a_block_boundary_is_refused_naming_the_group() -> None:
    with pytest.raises(InvalidInputError, match="group 1: attention_chunk_size=40 is not a multiple of block_size=16"):
        manager(64, full(), chunked(40))
    assert manager(64, full(), chunked(48)).num_free_blocks == 63

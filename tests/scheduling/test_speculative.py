"""Speculative decoding in the scheduler and manager: draft tokens get slots for one step, are never
registered in the prefix cache until verified, and the blocks of rejected ones are freed."""

from __future__ import annotations

import pytest

from hybridkv import BlockRemoved, BlockStored, CrossAttentionSpec, InvalidInputError, Sequence
from hybridkv.core.block_pool import NULL_BLOCK
from hybridkv.scheduling.scheduler import Scheduler, SchedulerConfig

from helpers import chunked, full, mamba, manager, swa, tokens


def decoding(mgr_blocks: int = 64, k: int = 8, specs: tuple[object, ...] = ()) -> tuple[Scheduler, Sequence]:
    """A scheduler with one sequence of a 30-token prompt, prefilled, its first token sampled."""
    mgr = manager(mgr_blocks, *(specs or (full(16), swa(32, 16))), max_model_len=512, batch=256)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, num_speculative_tokens=k))
    seq = Sequence("a", tokens(0, 30))
    sched.add(seq, max_new_tokens=100)
    out = sched.schedule()
    sched.update(out, {"a": [900]})
    return sched, seq


def step(sched: Scheduler, drafts: list[int], sampled: list[int]) -> None:
    sched.set_draft_tokens("a", drafts)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1} and out.draft_tokens.get("a", []) == drafts
    sched.update(out, {"a": sampled})
    sched.manager.check_invariants()


def test_accepted_drafts_advance_the_sequence_and_rejected_blocks_are_freed() -> None:
    sched, seq = decoding()
    mgr = sched.manager
    free = mgr.num_free_blocks
    # 31 tokens (30 computed); drafts at positions 31..38 cross into block 2 (slots 32..47).
    step(sched, [901, 902, 903, 904, 905, 906, 907, 908], [901, 902, 5])  # two accepted, then 5
    assert seq.token_ids[-4:] == [900, 901, 902, 5] and seq.num_computed_tokens == 33 == seq.num_tokens - 1
    # Block 2 holds verified token 32: it stays (in both groups); nothing past it.
    assert [len(t) for t in mgr.block_table("a")] == [3, 3] and mgr.num_free_blocks == free - 2
    # Nothing past the verified tokens is cached: a lookup of the drafts' continuation finds only
    # what was computed, and a full block of verified tokens is registered at the next allocate.
    step(sched, [], [6])
    probe = Sequence("p", seq.token_ids[:32] + [903, 904, 905])
    assert mgr.lookup(probe).num_tokens == 32


def test_all_rejected_frees_the_draft_blocks() -> None:
    sched, seq = decoding()
    mgr = sched.manager
    step(sched, [1] * 8, [9])  # nothing accepted: the step's own token and the correction
    assert seq.num_computed_tokens == 31 and [len(t) for t in mgr.block_table("a")] == [2, 2]
    assert mgr.num_free_blocks == 63 - 4


def test_a_draft_is_never_a_prefix_hit() -> None:
    sched, seq = decoding()
    step(sched, [901] * 8, [901] * 8 + [7])  # all accepted: 31 + 9 tokens, 39 computed
    mgr = sched.manager
    assert seq.num_computed_tokens == 39
    # Block 1 (16..31), full of verified tokens, is registered once they are verified; block 2
    # (slots 32..47) holds verified tokens up to 39 only and the rest were drafts' slots: not cached.
    probe = Sequence("p", seq.token_ids + [1] * 20)
    assert mgr.lookup(probe).num_tokens == 32
    step(sched, [], [8])
    assert mgr.lookup(probe).num_tokens == 32


def test_drafts_stop_at_the_stop_token_and_max_tokens() -> None:
    sched, seq = decoding()
    sched.requests["a"].stop_token_ids = frozenset({42})
    step(sched, [901, 42, 903], [901, 42, 903, 904])  # the stop token ends it; what follows is dropped
    assert sched.requests.get("a") is None and seq.token_ids[-3:] == [900, 901, 42]
    assert sched.manager.num_free_blocks == 63


def test_drafts_are_capped_by_what_the_request_may_still_generate() -> None:
    mgr = manager(64, full(16), max_model_len=512, batch=256)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, num_speculative_tokens=8))
    seq = Sequence("a", tokens(0, 30))
    sched.add(seq, max_new_tokens=4)
    sched.update(sched.schedule(), {"a": [900]})
    sched.set_draft_tokens("a", [1] * 8)
    out = sched.schedule()
    assert out.draft_tokens["a"] == [1, 1]  # 1 generated, 4 allowed: one token plus two drafts
    sched.update(out, {"a": [1, 1, 3]})
    assert sched.requests.get("a") is None and len(seq.token_ids) == 34


def test_sampled_tokens_must_follow_the_drafts() -> None:
    sched, _ = decoding()
    sched.set_draft_tokens("a", [1, 2, 3])
    out = sched.schedule()
    for bad in ([2, 5], [1, 2, 3, 4, 5], []):
        with pytest.raises(InvalidInputError):
            sched.update(out, {"a": bad})
    sched.update(out, {"a": [1, 2, 3, 4]})  # a refused update changed nothing
    sched.manager.check_invariants()


def test_bad_drafts_and_settings_are_refused() -> None:
    sched, _ = decoding(k=2)
    with pytest.raises(InvalidInputError, match="num_speculative_tokens"):
        sched.set_draft_tokens("a", [1, 2, 3])
    with pytest.raises(InvalidInputError, match="not running"):
        sched.set_draft_tokens("nobody", [1])
    with pytest.raises(InvalidInputError):
        sched.set_draft_tokens("a", [1, -2])
    with pytest.raises(InvalidInputError, match="num_speculative_tokens"):
        SchedulerConfig(num_speculative_tokens=17)
    mgr = manager(64, full(16), mamba(16), max_model_len=512, batch=256)
    Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, num_speculative_tokens=15))
    with pytest.raises(InvalidInputError, match="recurrent"):  # a step with drafts stays in one state block
        Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, num_speculative_tokens=16))


def test_drafts_yield_before_anyone_is_preempted() -> None:
    # Two sequences fill the pool (4 usable blocks; 24 tokens and 8 draft slots each fit 2 blocks):
    # a's drafts reach a fifth block, so its step runs without them and nobody is preempted.
    mgr = manager(5, full(16), max_model_len=512, batch=256)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, num_speculative_tokens=8))
    for sid, start in (("a", 0), ("b", 5000)):
        sched.add(Sequence(sid, tokens(start, 24)), max_new_tokens=2)
    sched.update(sched.schedule(), {"a": [900], "b": [901]})
    assert mgr.num_free_blocks == 0
    sched.set_draft_tokens("a", [1] * 8)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 1} and not out.draft_tokens and not out.preempted


# ---------------------------------------------------------------------- the manager's draft semantics
def _decode_with_drafts(mgr: object, seq: Sequence, drafts: int) -> tuple[list[int], ...]:
    """Append the step's token and allocate it with ``drafts`` lookahead slots (the step's blocks)."""
    seq.append_token_ids([7])
    new = mgr.allocate(seq, 1, num_lookahead_tokens=drafts)  # type: ignore[attr-defined]
    assert new is not None
    mgr.check_invariants()  # type: ignore[attr-defined]
    return new


def test_lookahead_slots_are_never_registered_even_over_known_tokens() -> None:
    # A 40-token prompt: a 20-token chunk with 12 lookahead slots over tokens 20..31 of the prompt.
    mgr = manager(64, full(16), swa(32, 16), max_model_len=512, batch=256, enable_events=True)
    seq = Sequence("a", tokens(0, 40))
    assert mgr.allocate(seq, 20, num_lookahead_tokens=12) is not None
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    # Block 0 (tokens 0..15) only, in both groups: block 1 holds 4 new tokens and 12 lookahead slots.
    assert [(e.group, len(e.block_ids), e.token_ids) for e in stored] == [(0, 1, tuple(range(16))),
                                                                          (1, 1, tuple(range(16)))]
    assert [i for i, _, _ in mgr.registered_blocks(seq, 0, 0, 32)] == [0]  # what a tier's store may take
    assert mgr.lookup(Sequence("p", tokens(0, 40))).num_tokens == 16
    seq.num_computed_tokens = 20  # the step ran; its lookahead slots were not verified
    assert mgr.release_lookahead(seq) == 0  # block 1 holds tokens 16..19: it stays, uncached
    mgr.check_invariants()
    assert not mgr.take_events() and mgr.lookup(Sequence("p", tokens(0, 40))).num_tokens == 16


def test_verified_drafts_are_stored_with_their_tokens_and_rejected_ones_never() -> None:
    mgr = manager(64, full(16), max_model_len=512, batch=256, enable_events=True)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, num_speculative_tokens=8))
    seq = Sequence("a", tokens(0, 30))
    sched.add(seq, max_new_tokens=100)
    sched.update(sched.schedule(), {"a": [900]})
    assert [e.token_ids for e in mgr.take_events()] == [tuple(range(16))]
    # 31 tokens: drafts at 31..38; 901 and 902 accepted (positions 31, 32), then 5 sampled.
    sched.set_draft_tokens("a", [901, 902, 77, 78, 79, 80, 81, 82])
    out = sched.schedule()
    assert not mgr.take_events()  # block 1 (16..31) ends at draft position 31: not yet verified
    sched.update(out, {"a": [901, 902, 5]})
    events = mgr.take_events()  # verified: block 1 holds 900 and 901; block 2 (32..47) only 902
    assert not any(isinstance(e, BlockRemoved) for e in events)  # draft blocks were never stored
    assert [e.token_ids for e in events if isinstance(e, BlockStored)] == [tuple(range(16, 30)) + (900, 901)]
    sched.set_draft_tokens("a", [77] * 8)
    sched.update(sched.schedule(), {"a": [6]})  # all rejected: block 2 holds 902, 5 and rejected drafts
    assert not mgr.take_events()


def test_release_frees_exactly_the_blocks_wholly_past_the_verified_tokens() -> None:
    mgr = manager(64, full(16), swa(32, 16), max_model_len=512, batch=256)
    seq = Sequence("a", tokens(0, 30))
    assert mgr.allocate(seq, 30) is not None
    seq.num_computed_tokens = 30
    _decode_with_drafts(mgr, seq, 16)  # slots 30..46: blocks 0, 1, 2 in each group
    before = mgr.block_table("a")
    assert [len(t) for t in before] == [3, 3]
    seq.num_computed_tokens = 31 + 1  # the step's token and one draft verified: tokens 0..31
    seq.append_token_ids([8])
    free = mgr.num_free_blocks
    assert mgr.release_lookahead(seq) == 2  # block 2 of each group held drafts only
    assert mgr.block_table("a") == tuple(t[:2] for t in before) and mgr.num_free_blocks == free + 2
    mgr.check_invariants()
    seq.num_computed_tokens = 32
    _decode_with_drafts(mgr, seq, 0)  # the next step needs block 2 again
    assert [len(t) for t in mgr.block_table("a")] == [3, 3]


def test_a_partly_verified_block_is_kept_and_cached_only_once_verified_tokens_fill_it() -> None:
    mgr = manager(64, full(16), max_model_len=512, batch=256)
    seq = Sequence("a", tokens(0, 30))
    assert mgr.allocate(seq, 30) is not None
    seq.num_computed_tokens = 30
    _decode_with_drafts(mgr, seq, 8)  # slots 30..38: block 2 holds 32..38 (drafts)
    block2 = mgr.block_table("a")[0][2]
    seq.append_token_ids([1, 2])  # two drafts accepted: tokens 31, 32 verified
    seq.num_computed_tokens = 33
    assert mgr.release_lookahead(seq) == 0 and mgr.block_table("a")[0][2] == block2
    assert mgr.pool.block_hash[block2] is None
    while seq.num_computed_tokens < 48:
        seq.num_computed_tokens = seq.num_tokens
        _decode_with_drafts(mgr, seq, 0)
    assert mgr.pool.block_hash[block2] == mgr.block_hashes(seq, 0)[2]  # verified tokens only


def test_a_sliding_window_keeps_what_the_earliest_position_of_the_step_reads() -> None:
    # Window 32, block 16: with 60 tokens computed, position 60 reads 29..60 (blocks 1..3); the
    # drafts at 61..68 read less. Block 1 must stay for the whole step.
    mgr = manager(64, full(16), swa(32, 16), max_model_len=512, batch=256)
    seq = Sequence("a", tokens(0, 60))
    assert mgr.allocate(seq, 60) is not None
    seq.num_computed_tokens = 60
    _decode_with_drafts(mgr, seq, 8)
    window = mgr.block_table("a")[1]
    assert window[0] == NULL_BLOCK and NULL_BLOCK not in window[1:] and len(window) == 5
    seq.append_token_ids([1] * 8)  # all accepted: 69 verified, position 69 reads 38..69
    seq.num_computed_tokens = 69
    mgr.release_lookahead(seq)
    seq.num_computed_tokens = 69
    _decode_with_drafts(mgr, seq, 0)
    assert mgr.block_table("a")[1][:2] == (NULL_BLOCK, NULL_BLOCK)  # the next step drops block 1


def test_a_chunked_local_group_keeps_the_chunk_of_the_earliest_position_of_the_step() -> None:
    # Chunks of 32: position 62 reads chunk 1 (32..63, blocks 2 and 3); drafts at 63..70 reach chunk 2.
    mgr = manager(64, full(16), chunked(32, 16), max_model_len=512, batch=256)
    seq = Sequence("a", tokens(0, 62))
    assert mgr.allocate(seq, 62) is not None
    seq.num_computed_tokens = 62
    _decode_with_drafts(mgr, seq, 8)
    local = mgr.block_table("a")[1]
    assert local[:2] == (NULL_BLOCK, NULL_BLOCK) and NULL_BLOCK not in local[2:] and len(local) == 5
    seq.append_token_ids([1] * 3)  # 66 verified: chunk 2 from now on
    seq.num_computed_tokens = 66
    assert mgr.release_lookahead(seq) == 0  # block 4 (64..79) holds verified tokens 64, 65
    _decode_with_drafts(mgr, seq, 0)
    assert mgr.block_table("a")[1][:4] == (NULL_BLOCK,) * 4  # chunk 1 dropped at the next step


def test_release_keeps_the_cross_attention_blocks() -> None:
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=8, head_size=128, dtype_bytes=2, max_encoder_len=64)
    mgr = manager(64, full(16), cross, max_model_len=512, batch=256)
    seq = Sequence("a", tokens(0, 20), num_encoder_tokens=64)
    assert mgr.allocate(seq, 20) is not None
    seq.num_computed_tokens = 20
    _decode_with_drafts(mgr, seq, 4)
    encoder = mgr.block_table("a")[1]
    assert len(encoder) == 4
    seq.num_computed_tokens = 21
    seq.append_token_ids([5])
    assert mgr.release_lookahead(seq) == 0 and mgr.block_table("a")[1] == encoder
    mgr.check_invariants()


def test_a_sequence_admitted_while_drafts_are_in_flight_adopts_only_verified_blocks() -> None:
    # a decodes with 8 drafts over block 2; b's prompt is a's tokens and those drafts. b is admitted
    # in the same step (before a's verification): its hit is a's verified blocks only.
    mgr = manager(64, full(16), swa(32, 16), max_model_len=512, batch=256)
    a = Sequence("a", tokens(0, 40))
    assert mgr.allocate(a, 40) is not None
    a.num_computed_tokens = 40
    a.append_token_ids([41])
    assert mgr.allocate(a, 1, num_lookahead_tokens=8) is not None  # slots 40..48: block 3 holds 48
    b = Sequence("b", tokens(0, 40) + [41] + [1] * 8 + [2] * 10)
    hit = mgr.lookup(b)
    assert hit.num_tokens == 32
    assert mgr.allocate(b, b.num_tokens - 32, hit=hit) is not None
    a_tables = mgr.block_table("a")
    assert set(a_tables[0][2:]).isdisjoint(mgr.block_table("b")[0])  # a's block 2 (32..47) was not full
    b_before = mgr.block_table("b")
    a.num_computed_tokens = 41  # every draft rejected
    a.append_token_ids([3])
    assert mgr.release_lookahead(a) == 2  # block 3 of each group
    assert mgr.block_table("b") == b_before
    mgr.check_invariants()


def _run_turn(k: int, accept: int) -> tuple[int, dict[str, int], int]:
    """A 70-token prompt, 40 generated tokens (drafts of ``k``, ``accept`` of them accepted each step),
    window retention; then a second turn (the conversation so far and 20 new tokens): its hit, the
    retention counters and the free blocks after it finished."""
    mgr = manager(40, full(16), swa(32, 16), max_model_len=512, batch=256, retention="window")
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, num_speculative_tokens=k))
    answer = list(range(1000, 1040))
    seq = Sequence("t1", tokens(0, 70))
    sched.add(seq, max_new_tokens=40)
    sched.update(sched.schedule(), {"t1": [answer[0]]})
    while "t1" in sched.requests:
        done = seq.num_output_tokens
        drafts = answer[done:done + k]
        sched.set_draft_tokens("t1", drafts)
        out = sched.schedule()
        drafts = out.draft_tokens.get("t1", [])
        sampled = drafts[:accept] + [answer[min(done + min(accept, len(drafts)), 39)]]
        sched.update(out, {"t1": sampled})
        mgr.check_invariants()
    assert seq.token_ids == tokens(0, 70) + answer
    turn2 = Sequence("t2", seq.token_ids + tokens(5000, 20))
    hit = mgr.lookup(turn2).num_tokens
    return hit, mgr.stats.retention, mgr.num_free_blocks


def test_window_retention_keeps_the_same_blocks_with_drafts_in_flight() -> None:
    plain = _run_turn(0, 0)
    assert plain[0] == 96  # the end of the first turn, rounded down to a block (window retention kept it)
    assert _run_turn(4, 4) == plain  # every draft accepted
    assert _run_turn(4, 1)[0] == plain[0]  # most rejected


def test_the_admission_bound_counts_the_draft_slots() -> None:
    # 5 usable blocks of 16 tokens: a 70-token request fits (5 blocks), with 16 draft slots it does not.
    mgr = manager(6, full(16), max_model_len=512, batch=256)
    seq = Sequence("a", tokens(0, 70))
    assert mgr.allocate(seq, 16, whole_sequence_must_fit=True, reserve_lookahead_tokens=16) is None
    assert mgr.num_sequences == 0 and mgr.stats.allocation_failures == 1
    assert mgr.allocate(seq, 16, whole_sequence_must_fit=True, reserve_lookahead_tokens=10) is not None
    mgr.check_invariants()


def test_the_scheduler_admits_with_the_draft_slots_reserved() -> None:
    for k, max_new, admitted in ((0, 20, ["a", "b"]), (8, 20, ["a"]), (8, 1, ["a", "b"])):
        # 6 usable blocks: two 41-token prompts fit (3 blocks each), not with 8 draft slots (4 each),
        # unless the requests may generate no draft (one new token: nothing left to verify).
        mgr = manager(7, full(16), max_model_len=512, batch=256)
        sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, num_speculative_tokens=k))
        sched.add(Sequence("a", tokens(0, 41)), max_new_tokens=max_new)
        sched.add(Sequence("b", tokens(500, 41)), max_new_tokens=max_new)
        assert sched.schedule().admitted == admitted


def test_a_recurrent_layout_verifies_drafts() -> None:
    # Mamba + full attention: admission reserves draft slots, drafts are verified and the state's
    # rejected entry is freed (tests/core/test_recurrent_drafts.py has the state's contents).
    sched, seq = decoding(specs=(full(16), mamba(16)))
    mgr = sched.manager
    step(sched, [901, 902, 903, 904], [901, 5])  # 31 tokens: drafts at 31..34 cross into block 2
    assert seq.num_computed_tokens == 32 and [len(t) for t in mgr.block_table("a")] == [2, 2]
    step(sched, [1, 2, 3], [1, 2, 7])  # 33 tokens: the accepted drafts end at 34, in the state's block 2
    assert seq.num_computed_tokens == 35 and [len(t) for t in mgr.block_table("a")] == [3, 3]
    assert mgr.block_table("a")[1][:1] == (NULL_BLOCK,)  # superseded states are dropped


def test_a_preempted_sequence_takes_its_drafts_out_of_the_step() -> None:
    # Priority policy: lo (priority 5) decodes first with 8 drafts and takes the last free block;
    # hi then needs a block and lo is preempted: its drafts leave the step with it.
    mgr = manager(6, full(16), max_model_len=512, batch=256)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, num_speculative_tokens=8, policy="priority"))
    sched.add(Sequence("lo", tokens(0, 24)), max_new_tokens=20, priority=5)
    sched.update(sched.schedule(), {"lo": [900]})
    sched.add(Sequence("hi", tokens(500, 32)), max_new_tokens=20, priority=0)
    sched.update(sched.schedule(), {"lo": [902], "hi": [901]})
    assert mgr.num_free_blocks == 1
    sched.set_draft_tokens("lo", [1] * 8)
    out = sched.schedule()
    assert out.preempted == ["lo"] and out.num_scheduled_tokens == {"hi": 1}
    assert out.draft_tokens == {} and out.total_tokens == 1
    sched.update(out, {"hi": [7]})
    mgr.check_invariants()


def test_release_after_a_step_planned_again_keeps_its_registered_blocks() -> None:
    # A 40-token step registers blocks 0 and 1, never runs, and is planned again as 5 tokens with 3
    # draft slots: release keeps blocks 0 and 1 (registered, to be computed), so freeing the sequence
    # uncaches them instead of leaving never-computed KV in the prefix cache.
    mgr = manager(64, full(16), max_model_len=512, batch=256)
    seq = Sequence("a", tokens(0, 40))
    assert mgr.allocate(seq, 40) is not None
    assert mgr.allocate(seq, 5, num_lookahead_tokens=3) is not None  # the count stayed at 0
    seq.num_computed_tokens = 5
    assert mgr.release_lookahead(seq) == 0 and len(mgr.block_table("a")[0]) == 3
    mgr.check_invariants()
    mgr.free(seq)
    assert mgr.pool.num_cached_blocks == 0
    mgr.check_invariants()


def test_blocks_accepted_drafts_fill_are_cached_when_the_request_finishes() -> None:
    # The last step accepts drafts that fill block 1; the request ends there (max_new_tokens) and
    # the next turn, its prompt and answer, hits them.
    mgr = manager(64, full(16), swa(32, 16), max_model_len=512, batch=256)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, num_speculative_tokens=8))
    seq = Sequence("a", tokens(0, 30))
    sched.add(seq, max_new_tokens=6)
    sched.update(sched.schedule(), {"a": [900]})
    sched.set_draft_tokens("a", [901, 902, 903, 904])
    finished = sched.update(sched.schedule(), {"a": [901, 902, 903, 904, 905]})
    assert [r.seq_id for r in finished] == ["a"] and seq.num_computed_tokens == 35
    assert mgr.lookup(Sequence("turn2", seq.token_ids + tokens(700, 10))).num_tokens == 32
    mgr.check_invariants()

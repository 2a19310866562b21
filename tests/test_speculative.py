"""Speculative decoding in the scheduler and manager: draft tokens get slots for one step, are never
registered in the prefix cache until verified, and the blocks of rejected ones are freed."""

from __future__ import annotations

import pytest

from hybridkv import InvalidInputError, Sequence
from hybridkv.scheduling.scheduler import Scheduler, SchedulerConfig

from helpers import full, mamba, manager, swa, tokens


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
    # Verified blocks register at the next allocate; block 2 (slots 32..47) holds verified tokens
    # up to 40 only and the rest were drafts' slots: not a full block, not cached.
    probe = Sequence("p", seq.token_ids + [1] * 20)
    assert mgr.lookup(probe).num_tokens == 16
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
    with pytest.raises(InvalidInputError, match="recurrent"):
        Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, num_speculative_tokens=4))


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

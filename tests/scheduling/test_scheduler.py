"""Scheduler: continuous batching, chunked prefill, preemption, admission; never deadlocks."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import KVCacheManager, Sequence, SequenceTooLongError
from hybridkv.scheduling.scheduler import Scheduler, SchedulerConfig, Status

from helpers import chunked, full, layout, mamba, manager, swa, tokens


def drive(sched: Scheduler, *, max_steps: int = 100_000, stop_token: int | None = None,
          rng: random.Random | None = None) -> int:
    """Run until every sequence finished or was rejected; returns the number of steps."""
    steps = 0
    while sched.has_unfinished:
        steps += 1
        assert steps <= max_steps, "the scheduler did not drain: deadlock or livelock"
        out = sched.schedule()
        assert out.total_tokens > 0 or out.preempted or out.rejected, "a step with nothing to do: deadlock"
        sampled = {}
        for sid, n in out.num_scheduled_tokens.items():
            seq = sched.requests[sid].seq
            if seq.num_computed_tokens + n == seq.num_tokens:
                tok = stop_token if (stop_token is not None and rng and rng.random() < 0.05) else 7
                sampled[sid] = [tok]
        sched.update(out, sampled)
        sched.manager.check_invariants()
    return steps


def test_fcfs_batches_prefill_chunks_and_decodes() -> None:
    mgr = manager(200, full(16), swa(64, 16), max_model_len=1024, batch=256)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8))
    for i in range(3):
        sched.add(Sequence(f"s{i}", tokens(1000 * i, 300)), max_new_tokens=4)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"s0": 256}  # the budget is spent on the first prompt
    sched.update(first)
    second = sched.schedule()
    assert second.num_scheduled_tokens["s0"] == 44  # the rest of s0, then s1 begins
    assert second.num_scheduled_tokens["s1"] == 212
    sched.update(second, {"s0": [7]})  # s0's prompt is done: its first token
    drive_rest = drive(sched)
    assert drive_rest > 0
    assert all(r.status is Status.FINISHED and r.finish_reason == "length" for r in sched.requests.values())
    assert mgr.num_free_blocks == 199


def test_long_prefill_threshold_caps_chunks() -> None:
    mgr = manager(200, full(16), max_model_len=1024, batch=512)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=512, long_prefill_token_threshold=100))
    sched.add(Sequence("a", tokens(0, 300)), 2)
    sched.add(Sequence("b", tokens(500, 300)), 2)
    assert sched.schedule().num_scheduled_tokens == {"a": 100, "b": 100}


def test_prefill_tokens_pending_counts_waiting_prompts_and_the_rest_of_running_ones() -> None:
    mgr = manager(200, full(16), max_model_len=1024, batch=512)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=512, long_prefill_token_threshold=100))
    sched.add(Sequence("a", tokens(0, 300)), 2)
    sched.add(Sequence("b", tokens(500, 250)), 2)
    assert sched.prefill_tokens_pending == 550
    out = sched.schedule()  # 100 tokens of each
    sched.update(out, {})
    assert sched.prefill_tokens_pending == 200 + 150
    for _ in range(3):
        out = sched.schedule()
        sampled = {sid: (1,) for sid, n in out.num_scheduled_tokens.items()
                   if sched.requests[sid].seq.num_computed_tokens + n == sched.requests[sid].seq.num_tokens}
        sched.update(out, sampled)
    assert sched.prefill_tokens_pending == 0  # both prompts computed; decoding adds none


def test_prompt_longer_than_max_model_len_is_refused_at_add() -> None:
    sched = Scheduler(manager(100, full(16), max_model_len=128, batch=128))
    with pytest.raises(SequenceTooLongError, match="200 tokens; max_model_len is 128"):
        sched.add(Sequence("x", tokens(0, 200)), 5)
    assert not sched.has_unfinished


def test_request_that_never_fits_is_rejected_with_a_reason_not_queued() -> None:
    sched = Scheduler(manager(10, full(16), max_model_len=1024, batch=256))
    req = sched.add(Sequence("big", tokens(0, 400)), 10)
    assert req.status is Status.REJECTED and "needs 26 blocks" in (req.finish_reason or "")
    small = sched.add(Sequence("small", tokens(1000, 40)), 5)
    out = sched.schedule()
    assert out.rejected == [("big", req.finish_reason)]
    assert list(out.num_scheduled_tokens) == ["small"]
    sched.update(out, {"small": [7]})
    drive(sched)
    assert small.status is Status.FINISHED


def test_a_long_request_is_admitted_by_the_window_bound_and_finishes() -> None:
    # 16k-token prompt, full + SWA 1024: counting every SWA block would need 2 x 1,000 blocks.
    mgr = manager(1000 + 1 + 2 * 80, full(16), swa(1024, 16), max_model_len=16384, batch=512)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=512))
    req = sched.add(Sequence("long", tokens(0, 15990)), 8)
    drive(sched)
    assert req.status is Status.FINISHED and req.num_preemptions == 0


def test_preemption_frees_the_newest_and_recomputes_with_prefix_hits() -> None:
    mgr = manager(30, full(16), max_model_len=512, batch=512, retention="none")
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=512))
    a = sched.add(Sequence("a", tokens(0, 200)), 100)  # grows to 300 tokens = 19 blocks
    b = sched.add(Sequence("b", tokens(1000, 150)), 100)  # grows to 250 tokens = 16 blocks
    drive(sched)
    assert a.status is b.status is Status.FINISHED
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    assert b.num_hit_tokens > 0  # re-admitted with its computed prefix from the cache
    assert mgr.stats.hit_tokens >= b.num_hit_tokens
    # That hit is the victim's own blocks found again: counted, and left out of the first admissions' rate.
    st = mgr.stats
    assert st.readmissions == b.num_preemptions and st.readmitted_hit_tokens == st.hit_tokens > 0
    assert st.first_admission_hit_rate == 0.0 < st.hit_rate


def test_guaranteed_no_preemption_never_preempts() -> None:
    mgr = manager(30, full(16), max_model_len=512, batch=512)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=512, admission="guaranteed_no_preemption"))
    reqs = [sched.add(Sequence(f"s{i}", tokens(1000 * i, 150)), 100) for i in range(4)]
    drive(sched)
    assert sched.stats.preemptions == 0
    assert all(r.status is Status.FINISHED for r in reqs)


def test_priority_policy_admits_and_keeps_the_most_urgent() -> None:
    mgr = manager(30, full(16), max_model_len=512, batch=512)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=512, policy="priority"))
    low = sched.add(Sequence("low", tokens(0, 200)), 100, priority=5)
    high = sched.add(Sequence("high", tokens(1000, 150)), 100, priority=0)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["high", "low"]
    sched.update(out, {"high": [1], "low": [1]})
    drive(sched)
    assert high.num_preemptions == 0 and low.num_preemptions >= 1


def test_stop_token_finishes_early() -> None:
    sched = Scheduler(manager(100, full(16), max_model_len=512, batch=512))
    req = sched.add(Sequence("a", tokens(0, 20)), 50, stop_token_ids=[99])
    out = sched.schedule()
    sched.update(out, {"a": [5]})
    out = sched.schedule()
    finished = sched.update(out, {"a": [99]})
    assert finished == [req] and req.finish_reason == "stop" and req.seq.num_output_tokens == 2
    assert sched.manager.num_free_blocks == 99


def test_generation_stops_at_max_model_len() -> None:
    sched = Scheduler(manager(100, full(16), max_model_len=64, batch=64))
    req = sched.add(Sequence("a", tokens(0, 60)), 50)
    drive(sched)
    assert req.seq.num_tokens == 64 and req.finish_reason == "length"
    full_len = sched.add(Sequence("b", tokens(100, 64)), 50)
    drive(sched)
    assert full_len.seq.num_tokens == 65  # a full-length prompt still gets one token, never computed


# ---------------------------------------------------------------------- property: never deadlock

SPECS = st.sampled_from(["swa", "chunked", "mamba", "mamba_none", "full"])


@st.composite
def workloads(draw: st.DrawFn) -> tuple[KVCacheManager, SchedulerConfig, list[tuple[list[int], int, int]]]:
    kinds = draw(st.lists(SPECS, min_size=0, max_size=3))
    specs = [full(16)] + [{"swa": swa(draw(st.sampled_from([17, 32, 64])), 16), "chunked": chunked(64, 16),
                           "mamba": mamba(16), "mamba_none": mamba(16, "none"), "full": full(16)}[k] for k in kinds]
    batch = draw(st.sampled_from([32, 64, 128]))
    num_blocks = draw(st.integers(min_value=12, max_value=120))
    retention = draw(st.sampled_from(["none", "window"]))
    mgr = KVCacheManager(layout(num_blocks, *specs), 512, batch, retention=retention)
    cfg = SchedulerConfig(max_num_batched_tokens=batch, max_num_seqs=draw(st.integers(1, 6)),
                          policy=draw(st.sampled_from(["fcfs", "priority"])),
                          admission=draw(st.sampled_from(["max_utilization", "guaranteed_no_preemption"])),
                          long_prefill_token_threshold=draw(st.sampled_from([0, 16, 48])))
    prefixes = [tokens(10_000 * p, 96) for p in range(3)]
    reqs = []
    for _ in range(draw(st.integers(1, 10))):
        prefix = prefixes[draw(st.integers(0, 2))][: draw(st.integers(0, 96))]
        suffix = [draw(st.integers(1, 50)) for _ in range(draw(st.integers(1, 200)))]
        reqs.append((prefix + suffix, draw(st.integers(1, 80)), draw(st.integers(0, 3))))
    return mgr, cfg, reqs


@settings(deadline=None)
@given(workloads(), st.randoms(use_true_random=False))
def test_every_sequence_finishes_or_is_rejected_with_a_reason(
    case: tuple[KVCacheManager, SchedulerConfig, list[tuple[list[int], int, int]]], rng: random.Random
) -> None:
    mgr, cfg, reqs = case
    sched = Scheduler(mgr, cfg)
    for i, (prompt, max_new, prio) in enumerate(reqs):
        sched.add(Sequence(f"r{i}", prompt), max_new, priority=prio, stop_token_ids=[3])
    bound = sum(len(p) + m for p, m, _ in reqs) * (cfg.max_self_preemptions + 2) + 50
    drive(sched, max_steps=bound, stop_token=3, rng=rng)
    for req in sched.requests.values():
        assert req.status in (Status.FINISHED, Status.REJECTED)
        if req.status is Status.REJECTED:
            assert req.finish_reason and req.finish_reason.startswith("rejected: ")
    if cfg.admission == "guaranteed_no_preemption":
        assert sched.stats.preemptions == 0
    assert mgr.num_free_blocks == mgr.layout.num_blocks - 1 and mgr.num_sequences == 0
    mgr.check_invariants()


def test_forced_preempt_between_steps_requeues_at_the_front_and_recomputes() -> None:
    mgr = manager(100, full(16), swa(32, 16), max_model_len=512, batch=512)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=512))
    a = sched.add(Sequence("a", tokens(0, 100)), 10)
    b = sched.add(Sequence("b", tokens(1000, 100)), 10)
    out = sched.schedule()
    sched.update(out, {"a": [7], "b": [7]})
    held = mgr.num_free_blocks
    assert sched.preempt("a") and not sched.preempt("a") and not sched.preempt("nope")
    assert mgr.num_free_blocks > held and a.seq.num_computed_tokens == 0
    assert sched.waiting[0] is a and a.status is Status.WAITING and a.num_preemptions == 1
    out = sched.schedule()
    assert out.num_scheduled_tokens["a"] == 101 - a.num_hit_tokens  # prompt + its first output token
    assert a.num_hit_tokens == 96  # the cached full blocks of its prompt (never the last token)
    st = mgr.stats
    assert (st.admissions, st.readmissions, st.readmitted_hit_tokens, st.readmitted_queried_tokens) == (3, 1, 96, 101)
    sched.update(out, {"a": [7], "b": [7]})
    drive(sched)
    assert a.status is b.status is Status.FINISHED and len(a.seq.token_ids) == 110


def test_a_victim_that_never_returns_leaves_no_readmission_mark() -> None:
    """A preempted request aborted while it waits is freed again: a later request that reuses its id
    is a first admission."""
    mgr = manager(100, full(16), max_model_len=512, batch=512)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=512))
    sched.add(Sequence("a", tokens(0, 100)), 10)
    sched.update(sched.schedule(), {"a": [7]})
    assert sched.preempt("a")
    sched.abort("a")
    sched.forget("a")
    again = sched.add(Sequence("a", tokens(0, 100)), 10)
    drive(sched)
    st = mgr.stats
    assert again.status is Status.FINISHED and again.num_hit_tokens == 96
    assert (st.admissions, st.readmissions) == (2, 0) and st.first_admission_hit_rate == st.hit_rate > 0

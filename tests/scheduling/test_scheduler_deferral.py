"""Shared prefills on recurrent layouts: a waiting sequence whose first block to compute another
sequence computes in the same step waits one step and hits it, instead of computing the prefix
twice (attention blocks are hit in the step that computes them; a recurrent state only after)."""

from __future__ import annotations

from hybridkv import Sequence
from hybridkv.scheduling.scheduler import Scheduler, SchedulerConfig

from helpers import full, mamba, manager, swa, tokens
from test_scheduler import drive

PREFIX = tokens(0, 256)


def burst(defer: bool = True, caching: bool = True, n: int = 3, *specs: object) -> Scheduler:
    """A scheduler with ``n`` prompts sharing ``PREFIX`` queued at once."""
    mgr = manager(400, *(specs or (full(16), mamba())), max_model_len=1024, batch=2048,
                  enable_prefix_caching=caching)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=2048, defer_shared_prefills=defer))
    for i in range(n):  # the shared system prompt's end is marked, as a chat server does
        sched.add(Sequence(f"s{i}", PREFIX + tokens(10_000 * (i + 1), 40), checkpoint_hints=[256]), 2)
    return sched


def test_a_burst_sharing_a_prefix_computes_it_once() -> None:
    sched = burst()
    first = sched.schedule()
    assert first.admitted == ["s0"] and sched.stats.deferrals == 2
    sched.update(first, {"s0": [7]})
    second = sched.schedule()
    assert second.admitted == ["s1", "s2"]
    assert [sched.requests[s].num_hit_tokens for s in ("s1", "s2")] == [256, 256]
    assert second.num_scheduled_tokens["s1"] == 40
    sched.update(second, {"s0": [7], "s1": [7], "s2": [7]})
    drive(sched)


def test_without_deferral_the_burst_computes_the_prefix_three_times() -> None:
    sched = burst(defer=False)
    first = sched.schedule()
    assert first.admitted == ["s0", "s1", "s2"] and sched.stats.deferrals == 0
    assert all(sched.requests[s].num_hit_tokens == 0 for s in first.admitted)


def test_nothing_waits_without_prefix_caching() -> None:
    sched = burst(caching=False)
    assert sched.schedule().admitted == ["s0", "s1", "s2"] and sched.stats.deferrals == 0


def test_requests_behind_a_deferred_one_are_admitted() -> None:
    sched = burst(n=2)
    sched.add(Sequence("other", tokens(50_000, 300)), max_new_tokens=2)
    assert sched.schedule().admitted == ["s0", "other"]


def test_attention_layouts_need_no_wait() -> None:
    """Without a recurrent group the burst hits the prefix in the step that computes it."""
    sched = burst(True, True, 3, full(16), swa(64, 16))
    first = sched.schedule()
    assert first.admitted == ["s0", "s1", "s2"] and sched.stats.deferrals == 0
    assert [sched.requests[s].num_hit_tokens for s in first.admitted] == [0, 256, 256]


def test_a_deferred_request_is_admitted_when_its_sharer_is_aborted() -> None:
    """The sharer's step never completes: the next step has nothing computing that prefix, so the
    deferred request computes it itself (it waits one step, never longer)."""
    sched = burst(n=2)
    first = sched.schedule()
    sched.abort("s0")
    sched.update(first)
    second = sched.schedule()
    assert second.admitted == ["s1"] and sched.requests["s1"].num_hit_tokens == 0
    sched.update(second, {"s1": [7]})
    drive(sched)


def test_a_chunked_shared_prefill_is_followed_chunk_by_chunk() -> None:
    """With a prompt longer than the step budget, the second request follows the first one chunk
    behind and resumes from the state at each chunk's end (a step that ends on a block boundary
    checkpoints there)."""
    mgr = manager(400, full(16), mamba(), max_model_len=2048, batch=256)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, keep_finished=True))
    prefix = tokens(0, 600)
    for i in range(2):
        sched.add(Sequence(f"s{i}", prefix + tokens(10_000 * (i + 1), 40)), max_new_tokens=2)
    computed = {"s0": 0, "s1": 0}
    while sched.has_unfinished:
        out = sched.schedule()
        sampled = {}
        for sid, n in out.num_scheduled_tokens.items():
            seq = sched.requests[sid].seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                computed[sid] += n
            if seq.num_computed_tokens + n >= seq.num_prompt_tokens:
                sampled[sid] = [7]
        sched.update(out, sampled)
        mgr.check_invariants()
    assert sched.stats.deferrals == 1 and sched.requests["s1"].num_hit_tokens == 512
    assert computed == {"s0": 640, "s1": 128}


def test_a_recurrent_prefix_hint_and_deferral_let_the_second_request_resume() -> None:
    """On a recurrent layout the second request of a burst hits the first's state at the hinted
    system prompt's end."""
    mgr = manager(400, full(16), mamba(), max_model_len=1024, batch=2048)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=2048))
    for i in range(2):
        sched.add(Sequence(f"s{i}", PREFIX + tokens(10_000 * (i + 1), 40), checkpoint_hints=[256]), 2)
    first = sched.schedule()
    assert first.admitted == ["s0"]
    sched.update(first, {"s0": [7]})
    assert sched.schedule().admitted == ["s1"] and sched.requests["s1"].num_hit_tokens == 256

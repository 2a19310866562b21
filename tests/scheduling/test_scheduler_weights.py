"""A sequence whose prompt tokens cost more than a plain prefill's (prompt scoring) takes
``prefill_weight`` budget tokens per prompt token, so no step costs more than a plain chunk."""

from __future__ import annotations

import pytest

from hybridkv import Sequence
from hybridkv.errors import InvalidInputError
from hybridkv.scheduling.scheduler import Scheduler, SchedulerConfig

from helpers import full, manager, swa, tokens


def scheduler() -> Scheduler:
    mgr = manager(400, full(16), swa(64, 16), max_model_len=2048, batch=256)
    return Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8))


def test_a_weighted_prompt_takes_its_weight_of_the_budget_and_leaves_the_rest_to_others() -> None:
    sched = scheduler()
    sched.add(Sequence("scored", tokens(0, 1000)), max_new_tokens=1, prefill_weight=2)
    sched.add(Sequence("plain", tokens(5000, 1000)), max_new_tokens=1)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"scored": 128}  # 128 x 2 = the whole 256-token budget
    sched.update(first)
    sched.abort("scored")
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"plain": 256}


def test_a_decode_of_a_weighted_sequence_costs_one_and_an_odd_remainder_waits() -> None:
    sched = scheduler()
    sched.add(Sequence("plain", tokens(5000, 255)), max_new_tokens=8)
    sched.add(Sequence("scored", tokens(0, 300)), max_new_tokens=4, prefill_weight=2)
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"plain": 255}  # 1 token left: half a scored token does not fit
    sched.update(first, {"plain": [7]})
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"plain": 1, "scored": 127}  # (256 - 1) // 2


def test_prefill_weight_must_be_a_positive_integer() -> None:
    with pytest.raises(InvalidInputError, match="prefill_weight"):
        scheduler().add(Sequence("s", tokens(0, 10)), max_new_tokens=1, prefill_weight=0)


def context_scheduler(cost: float) -> Scheduler:
    mgr = manager(400, full(16), swa(64, 16), max_model_len=2048, batch=256)
    return Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, prefill_context_cost=cost))


def chunks_of(sched: Scheduler, seq_id: str) -> list[int]:
    sizes = []
    while seq_id in sched.requests and sched.requests[seq_id].seq.num_computed_tokens < 1000:
        out = sched.schedule()
        sizes.append(out.num_scheduled_tokens[seq_id])
        sched.update(out, {seq_id: [7]} if sched.requests[seq_id].seq.num_computed_tokens + sizes[-1] >= 1000 else {})
    return sizes


def test_context_cost_gives_later_chunks_of_a_long_prompt_fewer_tokens_and_each_step_the_same_cost() -> None:
    sched = context_scheduler(1e-3)  # a token at position 1,000 costs 2
    sched.add(Sequence("long", tokens(0, 1000)), max_new_tokens=1)
    sizes = chunks_of(sched, "long")
    assert sum(sizes) == 1000 and sizes[0] == 229 and sizes == sorted(sizes, reverse=True) and sizes[-2] < 150
    start = 0
    for n in sizes[:-1]:  # every full chunk within the budget and within a token of it
        cost = n + 1e-3 * (n * start + n * (n - 1) / 2)
        assert 256 - 2 * (1 + 1e-3 * (start + n)) < cost <= 256, (start, n, cost)
        start += n
    plain = context_scheduler(0.0)
    plain.add(Sequence("long", tokens(0, 1000)), max_new_tokens=1)
    assert chunks_of(plain, "long") == [256, 256, 256, 232]  # 0: every prompt token counts one


def test_context_cost_leaves_decodes_alone_and_always_lets_a_lone_chunk_progress() -> None:
    sched = context_scheduler(0.9)  # absurd: one token at position 300 costs 271
    sched.add(Sequence("far", tokens(0, 400)), max_new_tokens=2)
    first = sched.schedule()
    assert 0 < first.num_scheduled_tokens["far"] < 30
    sched.update(first)
    while sched.requests["far"].seq.num_computed_tokens < 400:
        out = sched.schedule()
        assert out.num_scheduled_tokens["far"] >= 1  # alone in the step: never stuck
        sched.update(out, {"far": [7]} if sched.requests["far"].seq.num_computed_tokens
                      + out.num_scheduled_tokens["far"] >= 400 else {})
    sched.add(Sequence("other", tokens(3000, 10)), max_new_tokens=1)
    out = sched.schedule()
    assert out.num_scheduled_tokens["far"] == 1  # a decode costs one budget token however long its context


@pytest.mark.parametrize("bad", [-0.1, 1.0, "0.1", True, float("nan")])
def test_context_cost_must_be_a_number_in_zero_one(bad: object) -> None:
    with pytest.raises(InvalidInputError, match="prefill_context_cost"):
        SchedulerConfig(prefill_context_cost=bad)  # type: ignore[arg-type]

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

"""Speculative decoding on recurrent (Mamba) layouts in the simulator: what a verify pass through
recurrent layers costs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hybridkv.sim.cost_model import CostModel, SeqWork


# ---------------------------------------------------------------------- the cost of a verify pass
def test_a_verify_pass_moves_the_state_after_each_position_and_the_accepted_one_again() -> None:
    cost = CostModel.from_preset("nemotron-h-8b", "h100-80gb")
    state = cost.layers.recurrent_state_bytes
    assert state == pytest.approx(51.8e6, rel=1e-3)
    stateless = replace(cost, layers=replace(cost.layers, recurrent_state_bytes=0.0, recurrent_flops_per_token=0.0))
    for k in (0, 1, 3, 15):
        work = [SeqWork(1 + k, 2000, num_draft_tokens=k)] * 8
        with_states, without = cost.breakdown(work), stateless.breakdown(work)
        # Read once and written once; with k drafts also the state after each of the k + 1 positions,
        # then the accepted end's read back and written into its pages.
        assert with_states["bytes"] - without["bytes"] == pytest.approx(8 * (k + 4 if k else 2) * state)
        # The scan runs through all k + 1 positions.
        scan = 8 * (k + 1) * cost.layers.recurrent_flops_per_token
        assert with_states["flops"] - without["flops"] == pytest.approx(scan)


@pytest.mark.parametrize("gpu", ["h100-80gb", "l4-24gb"])
@pytest.mark.parametrize(("model", "tp"), [("qwen3-next-80b-a3b", 4), ("nemotron-h-8b", 1)])
def test_a_verify_step_costs_more_than_one_decode_step_and_less_than_k_plus_one(model: str, tp: int,
                                                                              gpu: str) -> None:
    # h100-80gb: the step-shaped model of its built-in profile; l4-24gb: the one roofline.
    cost = CostModel.from_preset(model, gpu, tensor_parallel_size=tp)
    for batch in (1, 8, 64, 128):
        for context in (100, 4000):
            plain = cost.step_time([SeqWork(1, context)] * batch)
            for k in (1, 3, 7, 15):
                verify = cost.step_time([SeqWork(1 + k, context, num_draft_tokens=k)] * batch)
                assert plain < verify < (k + 1) * plain, (batch, context, k)


def test_one_draft_costs_more_than_two_decode_steps_where_states_dominate() -> None:
    # 512 short sequences of Nemotron-H: 26.5 GB of states per plain step. Verifying one draft moves
    # 5 states per sequence (read, two positions, the accepted one copied), two plain steps 4.
    cost = CostModel.from_preset("nemotron-h-8b", "h100-80gb")
    plain = cost.step_time([SeqWork(1, 10)] * 512)
    assert cost.step_time([SeqWork(2, 10, num_draft_tokens=1)] * 512) > 2 * plain
    assert cost.step_time([SeqWork(3, 10, num_draft_tokens=2)] * 512) < 3 * plain

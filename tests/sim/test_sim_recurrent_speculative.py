"""Speculative decoding on recurrent (Mamba) layouts in the simulator: what a verify pass through
recurrent layers costs, the simulated engine and cluster with drafts, and the most drafts one state
block takes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import pytest

from hybridkv import InvalidInputError
from hybridkv.cli import main
from hybridkv.sim.cluster import ClusterConfig, simulate_cluster
from hybridkv.sim.cost_model import CostModel, SeqWork
from hybridkv.sim.engine import SimEngine
from hybridkv.sim.simulator import SimConfig, simulate
from hybridkv.sim.tiers import parse_tiers
from hybridkv.sim.workloads import ClosedLoop, multi_turn_chat, shared_prefix

# Nemotron-H 8B: 4 attention layers in one group, 24 Mamba-2 states of 51.8 MB per sequence in all.
NEMOTRON = SimConfig(model="nemotron-h-8b", gpu="h100-80gb", max_model_len=8192, max_num_batched_tokens=2048,
                     kv_cache_tokens=40_000)
# Qwen3-Next 80B-A3B on 4 GPUs: 3 Gated DeltaNet states of 17 pages each and one full-attention group.
QWEN = SimConfig(model="qwen3-next-80b-a3b", gpu="h100-80gb", tensor_parallel_size=4, max_model_len=4096,
                 max_num_batched_tokens=1024, kv_cache_tokens=6000)


def _spec(cfg: SimConfig, k: int, rate: float) -> SimConfig:
    return replace(cfg, speculative_tokens=k, acceptance_rate=rate)


@pytest.fixture
def checked_steps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Every simulated engine step is followed by the manager's ``check_invariants``; yields the count."""
    count: list[int] = [0]
    step = SimEngine.step

    def checked(self: SimEngine) -> list[str] | None:
        ended = step(self)
        self.mgr.check_invariants()
        count[0] += 1
        return ended

    monkeypatch.setattr(SimEngine, "step", checked)
    yield count


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


# ---------------------------------------------------------------------- the simulated engine
def test_acceptance_changes_the_steps_and_the_decode_time_on_a_recurrent_preset(checked_steps: list[int]) -> None:
    w = shared_prefix(8, 2, 600, 60, max_new_tokens=48, arrivals=ClosedLoop(4), seed=1)
    plain = simulate(w, NEMOTRON).summary
    rejected = simulate(w, _spec(NEMOTRON, 3, 0.0)).summary
    accepted = simulate(w, _spec(NEMOTRON, 3, 0.8)).summary
    assert checked_steps[0] == plain["steps"] + rejected["steps"] + accepted["steps"]
    for s in (plain, rejected, accepted):
        assert (s["finished"], s["rejected"], s["output_tokens"]) == (8, 0, 8 * 48)
    # Rejected drafts: as many steps, each verifying 3 drafts through every layer, so slower.
    assert rejected["steps"] == plain["steps"] and rejected["duration_s"] > plain["duration_s"]
    assert rejected["spec_decode"]["accepted"] == 0 and rejected["spec_decode"]["drafted"] > 0
    # Accepted drafts: fewer steps, less time.
    assert accepted["steps"] < 0.6 * plain["steps"] and accepted["duration_s"] < 0.7 * plain["duration_s"]
    assert accepted["spec_decode"]["tokens_per_step"] > 2
    assert accepted["hit_tokens"] == plain["hit_tokens"] > 0  # states hit at the shared prefixes' checkpoints


def test_drafts_crossing_state_blocks_with_preemptions_keep_the_invariants(checked_steps: list[int]) -> None:
    # A pool of 376 blocks for 8 requests of 540 tokens: running requests are preempted. K = 7 in
    # 16-token state blocks: most steps whose drafts are accepted cross a block boundary.
    w = shared_prefix(8, 2, 300, 40, max_new_tokens=200, arrivals=ClosedLoop(8), seed=1)
    plain = simulate(w, QWEN).summary
    spec = simulate(w, _spec(QWEN, 7, 0.5)).summary
    assert checked_steps[0] == plain["steps"] + spec["steps"]
    assert spec["num_blocks"] == 376 and spec["preemptions"] > 0
    assert (spec["finished"], spec["output_tokens"]) == (plain["finished"], plain["output_tokens"]) == (8, 1600)
    assert spec["steps"] < plain["steps"]


def test_the_largest_draft_count_of_a_state_block_runs(checked_steps: list[int]) -> None:
    w = shared_prefix(4, 1, 300, 40, max_new_tokens=64, arrivals=ClosedLoop(4), seed=1)
    s = simulate(w, _spec(QWEN, 15, 1.0)).summary
    # 63 tokens after the first: 3 steps of 16 and one of 15 per request.
    assert (s["finished"], s["output_tokens"], s["spec_decode"]["tokens_per_step"]) == (4, 256, 63 / 4)


def test_tiers_get_the_state_checkpoints_accepted_drafts_crossed() -> None:
    # Later turns load the earlier ones' answers (states at their block boundaries included) from
    # the host tier, as much with every draft accepted as without speculation.
    w = multi_turn_chat(6, 3, system_prompt_len=500, user_len=50, max_new_tokens=40, arrivals=ClosedLoop(3))
    cfg = replace(QWEN, kv_cache_tokens=8000, tiers=parse_tiers("host:8GiB"))
    plain = simulate(w, cfg).summary
    spec = simulate(w, _spec(cfg, 4, 1.0)).summary
    assert spec["finished"] == plain["finished"] == 18 and spec["spec_decode"]["tokens_per_step"] > 4
    assert spec["tier_hit_tokens"] == plain["tier_hit_tokens"] > 0


def test_a_cluster_of_recurrent_replicas_speculates(checked_steps: list[int]) -> None:
    w = shared_prefix(8, 2, 600, 60, max_new_tokens=32, arrivals=ClosedLoop(4), seed=1)
    cluster = ClusterConfig(instances=2, router="hybrid_exact")
    plain = simulate_cluster(w, NEMOTRON, cluster).summary
    spec = simulate_cluster(w, _spec(NEMOTRON, 3, 1.0), cluster).summary
    assert checked_steps[0] > 0
    assert (spec["finished"], spec["output_tokens"]) == (plain["finished"], plain["output_tokens"]) == (8, 8 * 32)
    assert spec["steps"] < plain["steps"] / 2 and spec["duration_s"] < plain["duration_s"]
    assert spec["spec_decode"]["acceptance_rate"] == 1.0
    one = simulate(w, _spec(NEMOTRON, 3, 0.6)).summary
    alone = simulate_cluster(w, _spec(NEMOTRON, 3, 0.6), ClusterConfig(instances=1, router="round_robin")).summary
    for key in ("steps", "output_tokens", "duration_s", "spec_decode", "finished", "hit_tokens"):
        assert alone[key] == one[key], key


# ---------------------------------------------------------------------- the draft limit
def test_more_drafts_than_a_state_block_holds_are_refused_at_start_up() -> None:
    w = shared_prefix(2, 1, 100, 10, max_new_tokens=4, arrivals=ClosedLoop(2), seed=1)
    with pytest.raises(InvalidInputError, match=r"speculative_tokens=16, .* at most 15 draft tokens"):
        simulate(w, _spec(NEMOTRON, 16, 0.5))
    with pytest.raises(InvalidInputError, match=r"speculative_tokens=16, .* at most 15 draft tokens"):
        simulate_cluster(w, _spec(NEMOTRON, 16, 0.5), ClusterConfig(instances=2))
    # Larger blocks take more: 32-token blocks, 16 drafts (the scheduler's most).
    s = simulate(w, replace(_spec(QWEN, 16, 0.5), block_size=32)).summary
    assert s["finished"] == 2 and s["spec_decode"]["drafted"] > 0


def test_cli_simulate_refuses_too_many_drafts_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--model", "nemotron-h-8b", "--max-model-len", "8192", "--kv-cache-tokens", "40000",
            "--workload", "shared-prefix", "--requests", "2", "--concurrency", "2", "--no-progress",
            "--acceptance-rate", "0.7"]
    assert main([*args, "--speculative-tokens", "16"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == ("hybridkv simulate: nemotron-h-8b: --speculative-tokens=16, but a decode step of this layout "
                       "verifies at most 15 draft tokens: a step with drafts stays within one 16-token block of a "
                       "recurrent state that checkpoints (a larger --block-size allows more)\n")
    assert main([*args, "--speculative-tokens", "15"]) == 0
    assert "tokens per decode step" in capsys.readouterr().out


def test_drafts_under_memory_pressure_preempt_but_never_reject_a_request_that_fits() -> None:
    """A tight pool: with K=7 draft steps cross state-block boundaries far more often than plain
    decoding, so sequences hold a second state more often and the newest preempts itself. Those
    self-preemptions happen beside other sequences' drafts: they do not count toward the rejection
    limit (plain decoding finishes every request in this pool)."""
    cfg = SimConfig(model="nemotron-h-8b", gpu="h100-80gb", max_model_len=4096, kv_cache_tokens=28000)
    work = shared_prefix(10, 2, 500, 100, max_new_tokens=600, arrivals=ClosedLoop(10))
    plain = simulate(work, cfg).summary
    spec = simulate(work, _spec(cfg, 7, 0.5)).summary
    assert (plain["rejected"], plain["preemptions"]) == (0, 0)
    assert spec["preemptions"] > 0 and spec["rejected"] == 0
    assert spec["finished"] == plain["finished"] == 10 and spec["output_tokens"] == plain["output_tokens"]

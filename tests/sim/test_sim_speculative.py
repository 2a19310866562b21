"""Speculative decoding in the simulator and the planner: drafts per decode step accepted at a given
rate, the step's work with its drafts, the admission bound's draft slots, and what the plan reports."""

from __future__ import annotations

import json

import pytest

from hybridkv import InvalidInputError, Sequence
from hybridkv.cli import main
from hybridkv.core.specs import FullAttentionSpec
from hybridkv.planning.planner import PlanInput, make_plan
from hybridkv.scheduling.scheduler import Scheduler, SchedulerConfig
from hybridkv.sim.cluster import ClusterConfig, simulate_cluster
from hybridkv.sim.cost_model import CostModel, SeqWork
from hybridkv.sim.engine import step_work
from hybridkv.sim.simulator import SimConfig, simulate
from hybridkv.sim.tiers import parse_tiers
from hybridkv.sim.workloads import ClosedLoop, SimRequest, Workload, multi_turn_chat, shared_prefix

from helpers import decoding_requests, manager, tokens

H100 = SimConfig(model="gemma-3-1b", gpu="h100-80gb", max_model_len=8192, max_num_batched_tokens=2048,
                 kv_cache_tokens=200_000)


def _spec(k: int, rate: float, **kw: object) -> SimConfig:
    return SimConfig(**{**H100.__dict__, "speculative_tokens": k, "acceptance_rate": rate, **kw})


def test_accepted_drafts_raise_decode_throughput_and_rejected_ones_lower_it() -> None:
    w = shared_prefix(16, 4, 1000, 100, max_new_tokens=64, arrivals=ClosedLoop(8), seed=1)
    plain = simulate(w, H100).summary
    good = simulate(w, _spec(4, 0.8)).summary
    bad = simulate(w, _spec(4, 0.0)).summary
    assert plain["output_tokens"] == good["output_tokens"] == bad["output_tokens"] == 16 * 64
    # Each step verifies 4 drafts: accepted ones save steps, rejected ones only add work.
    assert good["throughput_tokens_per_s"] > 1.5 * plain["throughput_tokens_per_s"]
    assert bad["throughput_tokens_per_s"] < plain["throughput_tokens_per_s"]
    assert good["steps"] < plain["steps"] == bad["steps"]
    assert plain["spec_decode"] == {"num_speculative_tokens": 0, "drafted": 0, "accepted": 0,
                                    "acceptance_rate": 0.0, "tokens_per_step": 1.0}
    assert bad["spec_decode"]["drafted"] > 0 and bad["spec_decode"]["accepted"] == 0
    assert bad["spec_decode"]["tokens_per_step"] == 1.0
    # Drafts after the first rejection are lost: 4 drafts at 0.8 accept 0.8 + 0.64 + 0.51 + 0.41 per step.
    spec = good["spec_decode"]
    assert 0.5 < spec["acceptance_rate"] < 0.7 and 2.8 < spec["tokens_per_step"] < 3.6
    assert spec["tokens_per_step"] == pytest.approx(1 + spec["accepted"] / (spec["drafted"] / 4), rel=0.1)


def test_every_draft_accepted_emits_one_plus_k_tokens_per_step() -> None:
    w = Workload([SimRequest("r", 0.0, (("p", 100),), 41)], 1, "one")
    s = simulate(w, _spec(4, 1.0)).summary["spec_decode"]
    # 40 tokens after the first: 8 steps of 5 (the last step's drafts capped by max_new_tokens).
    assert (s["drafted"], s["accepted"], s["acceptance_rate"], s["tokens_per_step"]) == (32, 32, 1.0, 5.0)


def test_acceptance_draws_are_seeded() -> None:
    w = shared_prefix(8, 2, 500, 50, max_new_tokens=32, arrivals=ClosedLoop(4), seed=1)
    a = simulate(w, _spec(4, 0.6)).summary
    assert simulate(w, _spec(4, 0.6)).summary == a
    assert simulate(w, _spec(4, 0.6, speculative_seed=1)).summary["spec_decode"] != a["spec_decode"]


def test_a_step_s_work_counts_its_drafts() -> None:
    mgr = manager(64, FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64), max_model_len=512, batch=256)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, num_speculative_tokens=4))
    sched.add(Sequence("a", tokens(0, 30)), max_new_tokens=10)
    sched.update(sched.schedule(), {"a": [1]})
    sched.set_draft_tokens("a", [2, 3, 4, 5])
    work, _ = step_work(sched, sched.schedule(), {}, {}, None)
    assert work == [SeqWork(5, 30, sampled=True, num_draft_tokens=4)]
    cost = CostModel.from_preset("gemma-3-1b", "h100-80gb")
    # The LM head scores the drafts too; the step is still a decode step (no prefill launches).
    one, drafted = cost.breakdown([SeqWork(1, 30)]), cost.breakdown(work)
    assert drafted["total_s"] > one["total_s"] and drafted["launch_s"] == pytest.approx(one["launch_s"])
    with pytest.raises(InvalidInputError, match="drafts"):
        SeqWork(2, 30, num_draft_tokens=2)


def test_the_admission_bound_reserves_the_draft_slots_in_the_simulator() -> None:
    # 678 usable blocks; a 504-token request holds 224 (7 groups of 32) and with 16 draft slots
    # reserves 231: three are admitted at once without speculation, two with it.
    cfg = SimConfig(model="gemma-3-1b", gpu="h100-80gb", max_model_len=4096, max_num_batched_tokens=2048,
                    kv_cache_tokens=10848)
    w = Workload([SimRequest(f"r{i}", 0.0, ((f"unique-{i}", 504),), 20) for i in range(3)], 3, "unique")
    plain = simulate(w, cfg).summary
    spec = simulate(w, SimConfig(**{**cfg.__dict__, "speculative_tokens": 16, "acceptance_rate": 0.5})).summary
    assert (plain["num_blocks"], plain["peak_running"], spec["peak_running"]) == (679, 3, 2)
    assert spec["finished"] == 3


def test_tiers_get_the_blocks_speculative_steps_verified() -> None:
    # Three-turn conversations over a pool too small for them: later turns load the earlier ones'
    # answers from the host tier, as much with every draft accepted as without speculation.
    w = multi_turn_chat(12, 3, system_prompt_len=500, user_len=50, max_new_tokens=40, arrivals=ClosedLoop(4))
    cfg = SimConfig(model="gemma-3-1b", gpu="h100-80gb", max_model_len=8192, max_num_batched_tokens=2048,
                    kv_cache_tokens=6000, tiers=parse_tiers("host:1GiB"))
    plain = simulate(w, cfg).summary
    spec = simulate(w, SimConfig(**{**cfg.__dict__, "speculative_tokens": 4, "acceptance_rate": 1.0})).summary
    assert spec["spec_decode"]["tokens_per_step"] > 4 and spec["finished"] == 36
    assert spec["tier_hit_tokens"] == plain["tier_hit_tokens"] > 0


def test_speculation_settings_out_of_range_are_refused() -> None:
    for bad in ({"speculative_tokens": 17}, {"speculative_tokens": -1}, {"acceptance_rate": 1.5},
                {"acceptance_rate": True}):
        with pytest.raises(InvalidInputError):
            SimConfig(**bad)  # type: ignore[arg-type]


def test_cli_simulate_reports_spec_decode(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--model", "gemma-3-1b", "--gpu", "h100-80gb", "--max-model-len", "4096",
            "--kv-cache-tokens", "60000", "--workload", "shared-prefix", "--requests", "8", "--prefixes", "2",
            "--prefix-len", "500", "--suffix-len", "50", "--output-len", "16", "--concurrency", "4", "--no-progress"]
    assert main([*args, "--speculative-tokens", "3", "--acceptance-rate", "0.7", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["spec_decode"]) == {"num_speculative_tokens", "drafted", "accepted", "acceptance_rate",
                                       "tokens_per_step"}
    assert doc["spec_decode"]["num_speculative_tokens"] == 3 and doc["spec_decode"]["tokens_per_step"] > 1
    assert main([*args, "--speculative-tokens", "3", "--acceptance-rate", "0.7"]) == 0
    assert "tokens per decode step" in capsys.readouterr().out
    assert main([*args, "--speculative-tokens", "3"]) == 2
    assert "--acceptance-rate" in capsys.readouterr().err


# ---------------------------------------------------------------------- the planner
def test_the_plan_reports_the_draft_blocks_and_the_concurrency_left() -> None:
    # gemma-3-1b: 6 sliding-window groups and 1 full-attention group of 16-token blocks.
    base = PlanInput(model="gemma-3-1b", gpu="l4-24gb", max_model_len=8192, request_lens=(1024, 8000))
    plain = make_plan(base).report
    spec = make_plan(PlanInput(**{**base.__dict__, "num_speculative_tokens": 8})).report
    assert plain["speculative"] == {"num_speculative_tokens": 0, "max_speculative_tokens": 16,
                                    "draft_blocks_per_request": 0, "draft_state_blocks_per_request": 0,
                                    "draft_state_blocks_up_to_tokens": 0, "max_concurrency": plain["max_concurrency"],
                                    "concurrency_at_request_len": plain["concurrency_at_request_len"]}
    s = spec["speculative"]
    assert s["num_speculative_tokens"] == 8 and s["draft_blocks_per_request"] == 7  # one block per group
    usable = spec["num_blocks"] - 1
    assert s["max_concurrency"] == usable // (spec["blocks_per_request"] + 7)
    # 1024 tokens end on a block boundary: 8 draft slots need one more block in every group.
    assert s["concurrency_at_request_len"]["1024"] == usable // (7 * 65) < plain["concurrency_at_request_len"]["1024"]


def test_the_real_manager_decodes_as_many_requests_with_drafts_as_planned() -> None:
    # Full attention only (the plan's bound is what a decoding request holds): 1024-token requests,
    # each decode step with 8 draft slots.
    plan = make_plan(PlanInput(model="llama-3.1-8b", gpu="l4-24gb", max_model_len=4096, request_lens=(1024,),
                               num_speculative_tokens=8))
    planned = plan.report["speculative"]["concurrency_at_request_len"]["1024"]
    assert planned < plan.report["concurrency_at_request_len"]["1024"]
    assert decoding_requests(plan.layout, 1024, 8) == planned


def test_cli_plan_num_speculative_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "gemma-3-1b", "--gpu", "l4-24gb", "--max-model-len", "8192"]
    assert main([*args, "--num-speculative-tokens", "4", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["speculative"]["num_speculative_tokens"] == 4 and doc["speculative"]["draft_blocks_per_request"] == 7
    assert main([*args, "--num-speculative-tokens", "4"]) == 0
    assert "draft slots" in capsys.readouterr().out
    with pytest.raises(InvalidInputError, match="at most 16"):
        make_plan(PlanInput(model="gemma-3-1b", num_speculative_tokens=17))


@pytest.mark.parametrize("router", ["hybrid_exact", "round_robin"])
def test_speculation_in_a_cluster_needs_fewer_steps_per_replica(router: str) -> None:
    # Every draft accepted: each replica runs fewer steps for the same requests, and the outputs are
    # the same tokens (a request's last step may emit fewer than K + 1).
    w = shared_prefix(12, 2, 500, 50, max_new_tokens=32, arrivals=ClosedLoop(4), seed=1)
    cluster = ClusterConfig(instances=2, router=router)
    plain = simulate_cluster(w, H100, cluster)
    spec = simulate_cluster(w, _spec(4, 1.0), cluster)
    assert "spec_decode" not in plain.summary
    assert spec.summary["finished"] == plain.summary["finished"] == 12
    assert spec.summary["output_tokens"] == plain.summary["output_tokens"] == 12 * 32
    assert spec.summary["steps"] < plain.summary["steps"] / 2
    assert spec.summary["spec_decode"]["acceptance_rate"] == 1.0
    assert spec.summary["spec_decode"]["tokens_per_step"] > 4
    # Route by route, a replica's requests finish sooner with speculation.
    for rid, r in spec.requests.items():
        if r["replica"] == plain.requests[rid]["replica"]:
            assert r["latency_s"] <= plain.requests[rid]["latency_s"]


def test_speculation_in_a_cluster_matches_one_engine_with_one_replica() -> None:
    w = multi_turn_chat(4, 3, system_prompt_len=300, user_len=40, max_new_tokens=24, arrivals=ClosedLoop(3))
    cfg = _spec(3, 0.7)
    one = simulate(w, cfg).summary
    cl = simulate_cluster(w, cfg, ClusterConfig(instances=1, router="round_robin")).summary
    for key in ("steps", "output_tokens", "duration_s", "spec_decode", "finished", "hit_tokens"):
        assert cl[key] == one[key], key

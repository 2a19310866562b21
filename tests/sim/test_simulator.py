"""Simulator: the loop, the founding scenarios in miniature, and the CLI."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hybridkv.cli import main
from hybridkv.sim.simulator import SimConfig, build_manager, simulate
from hybridkv.sim.synthetic import SyntheticSequence
from hybridkv.sim.tiers import parse_tiers
from hybridkv.sim.trace import write_trace
from hybridkv.sim.workloads import ClosedLoop, Poisson, SimRequest, Workload, multi_turn_chat, shared_prefix

SMALL = SimConfig(model="gemma-3-1b", gpu="l4-24gb", max_model_len=8192, max_num_batched_tokens=2048,
                  kv_cache_tokens=60_000)


def test_synthetic_sequences_share_hashes_of_shared_runs_only() -> None:
    from hybridkv import BlockHasher

    h = BlockHasher()
    a = SyntheticSequence("a", (("p", 1000), ("x", 40))).block_hashes(h, 16)
    b = SyntheticSequence("b", (("p", 1000), ("y", 40))).block_hashes(h, 16)
    assert a[:62] == b[:62] and a[62:] != b[62:] and len(a) == 65
    assert SyntheticSequence("c", (("p", 1000), ("x", 40)), cache_salt="t").block_hashes(h, 16)[0] != a[0]


def test_every_request_finishes_and_the_summary_is_consistent() -> None:
    w = shared_prefix(60, 4, 2000, 200, max_new_tokens=20, arrivals=Poisson(5.0), seed=1)
    res = simulate(w, SMALL)
    s = res.summary
    assert s["finished"] == 60 and s["rejected"] == 0
    assert s["output_tokens"] == 60 * 20
    assert 0.5 < s["prefix_hit_rate"] < 1.0  # 4 prefixes of 2,000 tokens shared by 60 requests
    assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"] and 0 < s["itl_p50_s"] <= s["itl_p99_s"]
    assert s["throughput_tokens_per_s"] == pytest.approx(s["output_tokens"] / s["duration_s"])
    assert res.timeline and all(0.0 <= u <= 1.0 for _, u, _ in res.timeline)


def test_simulation_is_deterministic() -> None:
    w = shared_prefix(30, 3, 1000, 100, max_new_tokens=10, arrivals=ClosedLoop(8), seed=2)
    assert simulate(w, SMALL).summary == simulate(w, SMALL).summary


def test_window_retention_beats_lru_when_prefixes_exceed_the_pool() -> None:
    # 12 prefixes of 6,000 tokens against a 60k-token pool: the hybrid hit-rate collapse and window retention's fix.
    w = shared_prefix(240, 12, 6000, 100, max_new_tokens=8, arrivals=ClosedLoop(4), seed=3)
    lru = simulate(w, SimConfig(**{**SMALL.__dict__, "retention": "none"})).summary
    kept = simulate(w, SimConfig(**{**SMALL.__dict__, "retention": "window"})).summary
    assert kept["prefix_hit_rate"] > lru["prefix_hit_rate"] + 0.1
    assert kept["ttft_p50_s"] < lru["ttft_p50_s"]


def test_multi_turn_turns_hit_the_previous_context() -> None:
    w = multi_turn_chat(10, 3, system_prompt_len=500, user_len=50, max_new_tokens=30, arrivals=ClosedLoop(5))
    s = simulate(w, SMALL).summary
    assert s["finished"] == 30
    # Turns 2 and 3 reuse the previous turn's prompt and output; turn 1 reuses the system prompt.
    assert s["prefix_hit_rate"] > 0.6


def test_planned_concurrency_is_what_the_simulation_reaches() -> None:
    # Requests that grow to max_model_len, admitted only when every admitted request can reach
    # its final length: the number running at once is exactly the planned max concurrency.
    cfg = SimConfig(**{**SMALL.__dict__, "max_model_len": 1024, "kv_cache_tokens": 30_000, "retention": "none",
                       "admission": "guaranteed_no_preemption"})
    w = Workload([SimRequest(f"r{i}", 0.0, ((f"unique-{i}", 256),), 768) for i in range(16)], 16, "unique")
    s = simulate(w, cfg).summary
    assert s["peak_running"] == s["max_concurrency"] > 1
    assert s["preemptions"] == 0 and s["finished"] == 16


def test_a_long_request_is_admitted_by_the_admission_bound_and_finishes_on_gemma3() -> None:
    # Gemma 3 12B (5 sliding-window groups + 1 full), 16k-token requests, a pool of 2,500 blocks:
    # counting every sliding-window block (6 x 1,000 blocks) would never admit one; the bound
    # (1,000 + 5 x 193 blocks) does.
    cfg = SimConfig(model="gemma-3-12b", gpu="h100-80gb", max_model_len=16384, max_num_batched_tokens=2048,
                    kv_cache_tokens=40_000)
    mgr, _ = build_manager(cfg)
    naive = sum(-(-16000 // g.spec.block_size) for g in mgr.layout.groups)
    assert naive > mgr.layout.num_blocks - 1
    w = shared_prefix(3, 3, 15900, 100, max_new_tokens=16, arrivals=ClosedLoop(3), seed=5)
    s = simulate(w, cfg).summary
    assert s["finished"] == 3 and s["rejected"] == 0


def test_cli_simulate_json_and_compare(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--model", "gemma-3-1b", "--gpu", "l4-24gb", "--max-model-len", "8192",
            "--kv-cache-tokens", "60000", "--workload", "shared-prefix", "--requests", "40", "--prefixes", "4",
            "--prefix-len", "2000", "--suffix-len", "100", "--output-len", "8", "--concurrency", "8", "--no-progress"]
    assert main([*args, "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    for key in ("prefix_hit_rate", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "throughput_tokens_per_s",
                "preemptions", "rejected", "kv_capacity_tokens"):
        assert key in doc
    assert main([*args, "--compare", "retention=none,window", "--json", "-"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert set(both) == {"retention=none", "retention=window"}
    assert both["retention=none"]["retention"] == "none"


def test_cli_simulate_reads_a_trace_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    trace = tmp_path / "t.jsonl"
    write_trace(trace, shared_prefix(20, 2, 1000, 50, max_new_tokens=4, arrivals=Poisson(10.0), seed=6))
    png = tmp_path / "out.png"
    assert main(["simulate", "--model", "gemma-3-1b", "--gpu", "l4-24gb", "--max-model-len", "4096",
                 "--workload", "trace", "--trace", str(trace), "--plot", str(png), "--no-progress"]) == 0
    assert "20 / 0" in capsys.readouterr().out
    assert png.stat().st_size > 10_000


def test_cli_simulate_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--workload", "trace", "--no-progress"]) == 2
    assert "--trace" in capsys.readouterr().err
    assert main(["simulate", "--workload", "chat", "--compare", "colour=red", "--requests", "2", "--no-progress"]) == 2
    assert "unknown option" in capsys.readouterr().err


def _unique_prompts_past_a_small_pool(tiers: str = "none") -> dict[str, Any]:
    """The summary of 8 unique 1,000-token prompts growing past a 6,000-token pool (the newest are
    preempted and re-admitted), with ``tiers``."""
    cfg = SimConfig(model="llama-3.1-8b", gpu="l4-24gb", max_model_len=2048, max_num_batched_tokens=2048,
                    kv_cache_tokens=6_000, retention="none", tiers=parse_tiers(tiers))
    w = Workload([SimRequest(f"r{i}", 0.0, ((f"unique-{i}", 1000),), 600) for i in range(8)], 8, "unique")
    return simulate(w, cfg).summary


def test_re_admissions_after_preemption_are_counted_apart() -> None:
    """Unique prompts that grow past a small pool: the newest is preempted and re-admitted, finding its
    own computed blocks again. Those hits count in ``prefix_hit_rate`` (documented) and are left out
    of ``first_admission_hit_rate``, which here is 0: no request shares anything with another."""
    s = _unique_prompts_past_a_small_pool()
    assert s["finished"] == 8 and s["preemptions"] > 0
    assert s["readmissions"] == s["preemptions"]  # every victim came back
    assert s["hit_tokens"] == s["readmitted_hit_tokens"] > 0 and s["prefix_hit_rate"] > 0
    assert s["first_admission_hit_rate"] == s["first_admission_total_hit_rate"] == 0.0
    assert s["queried_tokens"] - s["readmitted_queried_tokens"] == 8 * 1000


def test_re_admissions_tier_hits_are_counted_apart() -> None:
    """The same preempted, unique prompts with a host tier: a victim re-admitted loads its own blocks
    back from the tier. Those loads count in ``tier_hit_rate`` and are left out of
    ``first_admission_tier_hit_rate`` (0: nobody shares), which with the device's makes the total."""
    s = _unique_prompts_past_a_small_pool("host:8GiB")
    assert s["finished"] == 8 and s["preemptions"] > 0
    assert s["tier_hit_tokens"] == s["readmitted_tier_hit_tokens"] > 0 and s["tier_hit_rate"] > 0
    assert s["first_admission_tier_hit_rate"] == s["first_admission_total_hit_rate"] == 0.0
    assert s["first_admission_total_hit_rate"] == s["first_admission_hit_rate"] + s["first_admission_tier_hit_rate"]

"""Simulator options for modelling the CPU reference engine: cpu preset, fp32, LM head per sample,
calibration files, pool sizing by KV budget, and the matching ``hybridkv simulate`` flags."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hybridkv.cli import main
from hybridkv.core.layout import plan_layout
from hybridkv.errors import InvalidInputError
from hybridkv.planning import get_preset
from hybridkv.planning.hardware import get_hardware
from hybridkv.planning.hf_config import layer_specs, parse_config
from hybridkv.sim.cost_model import (
    DEFAULT_EFFICIENCY,
    CostModel,
    Efficiency,
    LMHead,
    SeqWork,
    calibrate,
    load_calibration,
)
from hybridkv.sim.simulator import SimConfig, build_manager, simulate
from hybridkv.sim.trace import write_trace
from hybridkv.sim.workloads import ClosedLoop, Workload, shared_prefix
from hybridkv.sizes import size_arg as parse_size

GEMMA = "gemma-3-270m"
HEAD = 262_144 * 640  # Gemma 3 270M's tied embedding / LM head
BODY = 268_098_176 - HEAD
KV_BLOCK = 16 * 3 * 2 * 256 * 4  # 16 tokens x 3 layers x K,V x 256 x fp32: 96 KiB


CPU_CONFIG = SimConfig(model=GEMMA, gpu="cpu", max_model_len=2048, max_num_batched_tokens=1024, max_num_seqs=32,
                       kv_cache_memory=64 << 20, weights_dtype="fp32", kv_dtype="fp32", lm_head="per_sample")


def cpu_model(lm_head: LMHead = "per_sample", efficiency: Efficiency = DEFAULT_EFFICIENCY) -> CostModel:
    return CostModel.from_preset(GEMMA, "cpu", weights_dtype="fp32", kv_dtype="fp32", lm_head=lm_head,
                                 efficiency=efficiency)


def cpu_config(**changes: Any) -> SimConfig:
    return replace(CPU_CONFIG, **changes)


def workload() -> Workload:
    return shared_prefix(12, 2, 640, 120, max_new_tokens=8, arrivals=ClosedLoop(4), seed=3)


def write_samples(path: Path, model: CostModel) -> None:
    """A calibration file of the step times ``model`` predicts, over prefill, decode and mixed shapes."""
    shapes = ([[SeqWork(n, c)] for n in (16, 128, 512, 1000) for c in (0, 512)]
              + [[SeqWork(1, c)] * b for b in (1, 2, 4, 8) for c in (144, 912)]
              + [[SeqWork(1, 785)] * 3 + [SeqWork(700, 0), SeqWork(321, 0, 0, False)]])
    doc = {"samples": [{"work": [[w.num_new_tokens, w.context_len, w.num_loaded_tokens, int(w.sampled)]
                                 for w in work], "seconds": model.step_time(work)} for work in shapes]}
    path.write_text(json.dumps(doc))


# ---------------------------------------------------------------------- hardware, dtypes, LM head


def test_the_cpu_preset_has_nominal_fp32_peaks() -> None:
    cpu = get_hardware("cpu")
    assert cpu.bf16_flops == 160e9 and cpu.bandwidth == 40e9
    assert "nominal" in cpu.name


def test_fp32_doubles_weight_and_kv_bytes() -> None:
    fp32 = CostModel.from_preset(GEMMA, "cpu", weights_dtype="fp32", kv_dtype="fp32")
    bf16 = CostModel.from_preset(GEMMA, "cpu")
    assert fp32.weight_bytes_per_param == 4
    assert fp32.layers.kv_bytes_per_token == 2 * bf16.layers.kv_bytes_per_token == 18 * 2 * 256 * 4
    work = [SeqWork(1, 100)]
    assert fp32.breakdown(work)["bytes"] == pytest.approx(2 * bf16.breakdown(work)["bytes"])


def test_lm_head_per_sample_charges_the_head_once_per_sampled_sequence() -> None:
    per_token = cpu_model("per_token")
    per_sample = cpu_model("per_sample")
    assert per_sample.lm_head_params == HEAD and per_sample.embedding_params == 0  # tied
    chunk = [SeqWork(512, 0, sampled=False)]
    attention = per_token.breakdown(chunk)["flops"] - 512 * 2 * 268_098_176
    assert per_sample.breakdown(chunk)["flops"] == pytest.approx(512 * 2 * BODY + attention)
    last = [SeqWork(512, 0)]
    assert per_sample.breakdown(last)["flops"] - per_sample.breakdown(chunk)["flops"] == pytest.approx(2 * HEAD)
    # The head's weights are read only by a step that samples.
    assert per_sample.breakdown(last)["bytes"] - per_sample.breakdown(chunk)["bytes"] == pytest.approx(4 * HEAD)
    # Decodes sample every token: both ways count the same FLOPs and bytes.
    decodes = [SeqWork(1, 300)] * 4
    for key in ("flops", "bytes"):
        assert per_sample.breakdown(decodes)[key] == pytest.approx(per_token.breakdown(decodes)[key])
    # A long unsampled prefill costs far less than the generic roofline says.
    assert per_sample.step_time(chunk) < 0.5 * per_token.step_time(chunk)


def test_lm_head_per_sample_needs_the_vocabulary_and_reads_tied_embeddings() -> None:
    # The presets carry their vocabulary; a config.json without one cannot charge the head per sample.
    config = {k: v for k, v in get_preset("llama-3.1-8b").config.items()
              if k not in ("vocab_size", "tie_word_embeddings")}
    with pytest.raises(InvalidInputError, match="needs a positive integer vocab_size"):
        CostModel.from_config(config, 8_030_261_248, get_hardware("h100-80gb"), lm_head="per_sample")
    untied = CostModel.from_config({**config, "vocab_size": 128_256, "tie_word_embeddings": False}, 8_030_261_248,
                                   get_hardware("h100-80gb"), lm_head="per_sample")
    assert untied.lm_head_params == untied.embedding_params == 128_256 * 4096
    flops = untied.breakdown([SeqWork(10, 0, sampled=False)])["flops"]
    assert flops > 10 * 2 * (8_030_261_248 - 2 * 128_256 * 4096)
    assert flops < 10 * 2 * (8_030_261_248 - 2 * 128_256 * 4096) * 1.01
    with pytest.raises(InvalidInputError, match="lm_head must be"):
        CostModel.from_preset(GEMMA, "cpu", lm_head="sometimes")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="lm_head_params"):
        CostModel.from_config(config, 1e9, get_hardware("cpu"), lm_head="per_sample", vocab_size=10**6)


# ---------------------------------------------------------------------- calibration


def test_the_sampled_flag_round_trips_through_a_calibration_file(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"samples": [{"work": [[512, 0, 0, 0], [1, 90, 0, 1], [1, 80]], "seconds": 1.5}]}))
    assert load_calibration(path) == [([SeqWork(512, 0, 0, False), SeqWork(1, 90), SeqWork(1, 80)], 1.5)]
    path.write_text(json.dumps({"samples": [{"work": [[512, 0, 0, 2]], "seconds": 1.5}]}))
    with pytest.raises(InvalidInputError, match=r"'work'\[0\] must be .*sampled 0/1"):
        load_calibration(path)


def test_calibrating_on_slower_steps_makes_the_model_slower(tmp_path: Path) -> None:
    base = cpu_model()
    slow = base.with_efficiency(Efficiency(compute=0.1, memory=0.2, step_overhead_s=0.05))
    path = tmp_path / "slow.json"
    write_samples(path, slow)
    fitted = calibrate(base, path)
    for work in ([SeqWork(1, 500)], [SeqWork(1, 500)] * 4, [SeqWork(800, 0)]):
        assert fitted.step_time(work) > base.step_time(work)
        assert fitted.step_time(work) == pytest.approx(slow.step_time(work), rel=0.05)
    assert calibrate(base, slow.efficiency).efficiency == slow.efficiency


def test_a_calibrated_simulation_takes_the_measured_time(tmp_path: Path) -> None:
    slow = Efficiency(compute=0.1, memory=0.2, step_overhead_s=0.05)
    path = tmp_path / "slow.json"
    write_samples(path, cpu_model(efficiency=slow))
    wl = workload()
    default = simulate(wl, cpu_config()).summary
    from_file = simulate(wl, cpu_config(calibration=str(path))).summary
    truth = simulate(wl, cpu_config(calibration=slow)).summary
    assert from_file["duration_s"] > 3 * default["duration_s"]
    assert from_file["duration_s"] == pytest.approx(truth["duration_s"], rel=0.05)
    assert from_file["efficiency"]["compute"] == pytest.approx(0.1, rel=0.1)
    # The time scale changes nothing the scheduler and manager decide.
    for key in ("hit_tokens", "queried_tokens", "steps", "preemptions", "output_tokens"):
        assert from_file[key] == default[key]


# ---------------------------------------------------------------------- pool sizing


def test_kv_cache_memory_sizes_the_pool_as_plan_layout_does() -> None:
    memory = 64 << 20
    specs = layer_specs(parse_config(get_preset(GEMMA).config), block_size=16, kv_dtype_bytes=4)
    planned = plan_layout(specs, memory, max_model_len=2048, max_num_batched_tokens=1024)
    mgr, report = build_manager(cpu_config(kv_cache_memory=memory))
    assert mgr.layout.num_blocks == planned.num_blocks == memory // KV_BLOCK == 682
    assert [g.layer_names for g in mgr.layout.groups] == [g.layer_names for g in planned.groups]
    assert report["num_blocks"] == 682 and report["kv_capacity_tokens"] > 0


def test_per_request_hits_add_up_to_the_manager_counter() -> None:
    res = simulate(workload(), cpu_config())
    s = res.summary
    assert s["preemptions"] == 0 and s["num_blocks"] == 682
    assert sum(r["hit_tokens"] for r in res.requests.values()) == s["hit_tokens"] > 0
    assert sorted(r["ttft_s"] for r in res.requests.values()) == pytest.approx(res.ttfts)


def test_bad_pool_options_are_named() -> None:
    with pytest.raises(InvalidInputError, match="kv_cache_memory or kv_cache_tokens"):
        build_manager(cpu_config(kv_cache_tokens=10_000))
    with pytest.raises(InvalidInputError, match="largest max_model_len that fits"):
        build_manager(cpu_config(kv_cache_memory=8 << 20))
    with pytest.raises(InvalidInputError, match="kv_cache_memory must be a positive"):
        build_manager(cpu_config(kv_cache_memory=0))


# ---------------------------------------------------------------------- CLI


def cli_args(trace: Path, *extra: str) -> list[str]:
    return ["simulate", "--model", GEMMA, "--gpu", "cpu", "--weights-dtype", "fp32", "--kv-dtype", "fp32",
            "--kv-cache-memory", "64MiB", "--max-model-len", "2048", "--max-num-batched-tokens", "1024",
            "--lm-head", "per_sample", "--workload", "trace", "--trace", str(trace), "--no-progress", *extra]


def test_cli_simulate_with_a_calibration_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, workload())
    calib = tmp_path / "c.json"
    slow = Efficiency(compute=0.1, memory=0.2, step_overhead_s=0.05)
    write_samples(calib, cpu_model(efficiency=slow))
    assert main([*cli_args(trace), "--json", "-"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*cli_args(trace, "--calibration", str(calib)), "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert plain["num_blocks"] == doc["num_blocks"] == 682
    assert doc["hit_tokens"] == plain["hit_tokens"]
    assert doc["duration_s"] > 3 * plain["duration_s"]
    assert doc["efficiency"]["step_overhead_s"] == pytest.approx(0.05, rel=0.1)
    library = simulate(workload(), cpu_config(calibration=str(calib))).summary
    assert doc["duration_s"] == pytest.approx(library["duration_s"])


@pytest.mark.parametrize(("content", "message"), [
    (None, "no calibration file"),
    ("{not json", "not valid JSON"),
    ('{"samples": [{"work": [[1, 0]], "seconds": 0}]}', "sample 0: 'seconds' must be a number > 0"),
])
def test_cli_simulate_names_a_bad_calibration_file(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                   content: str | None, message: str) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(trace, workload())
    calib = tmp_path / "c.json"
    if content is not None:
        calib.write_text(content)
    assert main(cli_args(trace, "--calibration", str(calib))) == 2
    assert message in capsys.readouterr().err


def test_cli_sizes_parse_units_and_reject_nonsense(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("2GB") == 2 * 10**9
    assert parse_size("4096") == 4096
    for bad in ("lots", "0", "-1MiB"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_size(bad)
    with pytest.raises(SystemExit):
        main(["simulate", "--kv-cache-memory", "lots"])
    assert "--kv-cache-memory" in capsys.readouterr().err

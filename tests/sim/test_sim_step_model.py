"""The step-shaped cost model, its fit to calibration profiles, and the built-in H100 profile."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.errors import InvalidInputError
from hybridkv.planning import PRESETS
from hybridkv.sim.calibration import error_summary, fit_profile, leave_one_out, step_errors
from hybridkv.sim.cost_model import (
    DEFAULT_EFFICIENCY,
    FIT_PARAMETERS,
    H100_EFFICIENCY,
    PROFILE_DIR,
    CostModel,
    Efficiency,
    Profile,
    ProfileStep,
    SeqWork,
    builtin_profile,
    calibrate,
    default_efficiency,
    fit_step_model,
    load_profile,
)

H100_PROFILE = PROFILE_DIR / "h100_gemma-3-27b_steps.json"


def gemma27() -> CostModel:
    return CostModel.from_preset("gemma-3-27b", "h100-80gb")


def synthetic_profile(model: CostModel) -> Profile:
    """Steps like the H100 measurement's, timed by ``model`` itself."""
    steps: list[ProfileStep] = []
    for c in (0, 8192, 32768):
        for n in (128, 512, 2048, 8192):
            work = (SeqWork(n, c),)
            steps.append(ProfileStep(work, model.step_time(work, graph=False), "prefill-eager"))
    for b, c in ((1, 1024), (1, 32768), (8, 1024), (8, 8192), (32, 4096), (64, 2048)):
        work = (SeqWork(1, c),) * b
        for mode, graph in (("decode-eager", False), ("decode-graph", True)):
            steps.append(ProfileStep(work, model.step_time(work, graph=graph), mode))
    work = (SeqWork(2048, 0),) + (SeqWork(1, 4096),) * 32
    steps.append(ProfileStep(work, model.step_time(work, graph=False), "mixed-eager"))
    return Profile(tuple(steps), model.window_kernel)


# ---------------------------------------------------------------------- the model's shape


def test_every_preset_knows_its_vocabulary_and_h100_charges_the_head_per_sampled_row() -> None:
    for preset in PRESETS.values():
        cfg = preset.config.get("text_config", preset.config)
        assert isinstance(cfg["vocab_size"], int) and isinstance(cfg["tie_word_embeddings"], bool), preset.id
    model = gemma27()
    assert model.efficiency == H100_EFFICIENCY
    assert model.lm_head_params == 262_208 * 5376 and model.embedding_params == 0  # tied
    # A prompt chunk that samples nothing runs no head; the last chunk runs one row of it.
    chunk, last = [SeqWork(2048, 0, sampled=False)], [SeqWork(2048, 0)]
    assert 0 < model.step_time(last) - model.step_time(chunk) < 0.002


def test_other_gpus_keep_the_data_sheet_defaults_and_say_so() -> None:
    model = CostModel.from_preset("gemma-3-27b", "a100-80gb")
    assert model.efficiency == DEFAULT_EFFICIENCY and model.efficiency_source == "data sheet"
    assert model.lm_head_params == 0  # the one-roofline model keeps the generic head
    assert default_efficiency("h100-80gb")[1].startswith("calibrated profile h100_gemma-3-27b_steps.json")
    assert "calibrated profile" in gemma27().efficiency_source


def test_matmul_efficiency_rises_with_the_tokens_in_a_step() -> None:
    eff = replace(H100_EFFICIENCY, gemm_m_half=256.0, memory=1.0, roofline_norm=float("inf"))
    model = gemma27().with_efficiency(eff)
    per_token = [model.breakdown([SeqWork(n, 0, sampled=False)])["compute_s"] / n for n in (256, 1024, 8192)]
    # compute per token = 2P / (peak * compute) * (M + m_half) / M
    assert per_token[0] / per_token[2] == pytest.approx((512 / 256) / (8448 / 8192))
    assert per_token[0] > per_token[1] > per_token[2]


def test_a_decode_step_under_a_graph_saves_the_launch_costs_of_every_layer() -> None:
    model = gemma27()
    work = [SeqWork(1, 4096)] * 8
    eager, graph = model.step_time(work, graph=False), model.step_time(work, graph=True)
    expected = 62 * (H100_EFFICIENCY.launch_s_per_layer - H100_EFFICIENCY.graph_launch_s_per_layer)
    assert eager - graph == pytest.approx(expected)
    assert model.step_time(work) == graph  # cuda_graphs: decode-only steps replay a graph
    assert model.step_time(work + [SeqWork(64, 0)]) > eager  # a mixed step runs eagerly


def test_a_small_model_eager_step_waits_for_the_host() -> None:
    small = CostModel.from_preset("gemma-3-1b", "h100-80gb")
    work = [SeqWork(1, 1024)]
    assert small.step_time(work, graph=False) == pytest.approx(26 * H100_EFFICIENCY.host_s_per_layer)
    assert small.step_time(work, graph=True) < 0.5 * small.step_time(work, graph=False)


def test_masked_windows_charge_the_whole_chunk_causally() -> None:
    exact = gemma27()
    masked = replace(exact, window_kernel="masked")
    short = [SeqWork(512, 0)]  # inside the window: the same
    assert masked.breakdown(short)["flops"] == exact.breakdown(short)["flops"]
    long = [SeqWork(8192, 4096)]
    per_pair = 52 * 4 * 32 * 128  # the sliding layers' FLOPs per (query, key) pair
    extra = (8192 * 1023 + 8192 * 8193 // 2) - 8192 * 1024
    assert masked.breakdown(long)["flops"] - exact.breakdown(long)["flops"] == pytest.approx(extra * per_pair)
    with pytest.raises(InvalidInputError, match="window_kernel"):
        replace(exact, window_kernel="banded")  # type: ignore[arg-type]


def test_invalid_step_parameters_are_rejected() -> None:
    with pytest.raises(InvalidInputError, match="attention_compute"):
        Efficiency(attention_compute=1.5)
    with pytest.raises(InvalidInputError, match="launch_s_per_layer"):
        Efficiency(attention_compute=0.3, launch_s_per_layer=-1e-6)
    with pytest.raises(InvalidInputError, match="roofline_norm"):
        Efficiency(attention_compute=0.3, roofline_norm=0.5)


def test_step_time_stays_fast() -> None:
    model = gemma27()
    work = [SeqWork(1, 4000 + i) for i in range(255)] + [SeqWork(2048, 1000)]
    start = time.perf_counter()
    for _ in range(200):
        model.step_time(work)
    assert (time.perf_counter() - start) / 200 < 2e-3  # one loop over the sequences, none over layers


# ---------------------------------------------------------------------- the fit


def test_the_fit_recovers_known_parameters_from_steps_the_model_timed() -> None:
    truth = replace(H100_EFFICIENCY, compute=0.52, gemm_m_half=90.0, memory=0.74, attention_compute=0.41,
                    launch_s_per_layer=40e-6, graph_launch_s_per_layer=9e-6, activation_traffic=0.7)
    model = CostModel.from_preset("gemma-3-12b", "h100-80gb")
    profile = synthetic_profile(model.with_efficiency(truth))
    fitted = fit_step_model(model, profile.steps)
    for name in FIT_PARAMETERS:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=0.03), name
    assert max(abs(e.error) for e in step_errors(model, profile, fitted)) < 1e-3


def test_the_built_in_default_is_the_fit_of_the_built_in_profile() -> None:
    profile = builtin_profile("h100-80gb")
    assert profile is not None and profile.window_kernel == "masked" and len(profile.steps) == 33
    fitted = fit_profile(gemma27(), profile)
    for name in FIT_PARAMETERS:
        assert getattr(fitted, name) == pytest.approx(getattr(H100_EFFICIENCY, name), rel=0.01, abs=1e-3), name
    assert builtin_profile("a100-80gb") is None


def test_leave_one_out_on_the_h100_profile_meets_the_targets() -> None:
    profile = builtin_profile("h100-80gb")
    assert profile is not None
    summary = error_summary(leave_one_out(gemma27(), profile))
    assert {"prefill", "decode", "mixed"} <= set(summary)
    for kind in ("prefill", "decode", "mixed"):
        _, median, worst = summary[kind]
        assert median <= 0.05 and worst <= 0.15, (kind, median, worst)


def test_calibrate_fits_a_profile_with_modes_and_keeps_the_old_fit_without(tmp_path: Path) -> None:
    model = gemma27()
    fitted = calibrate(model, H100_PROFILE)
    assert fitted.efficiency.step_shaped and fitted.window_kernel == "exact"
    assert fitted.efficiency_source == f"fitted to {H100_PROFILE}"
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"samples": [{"work": [[1, 1000]], "seconds": 0.02},
                                             {"work": [[2048, 0]], "seconds": 0.2}]}))
    assert not calibrate(model, plain).efficiency.step_shaped


# ---------------------------------------------------------------------- the file format

MALFORMED = [
    ("[]", "expected an object with a non-empty 'samples' list"),
    ('{"samples": []}', "expected an object with a non-empty 'samples' list"),
    ('{"meta": 3, "samples": [{"work": [[1, 0]], "seconds": 1}]}', "'meta' must be an object"),
    ('{"meta": {"window_kernel": "banded"}, "samples": [{"work": [[1, 0]], "seconds": 1}]}', "window_kernel"),
    ('{"samples": [{"work": [[1, 0]], "seconds": 1, "mode": 7}]}', "sample 0: 'mode' must be a non-empty string"),
    ('{"samples": [{"work": [[0, 10]], "seconds": 1}]}', "sample 0: no sequence in 'work' computes a token"),
    ('{"samples": [{"work": [[1, 0]], "seconds": 1}, {"work": [[1, -1]], "seconds": 1}]}', r"sample 1: 'work'\[0\]"),
    ('{"samples": [{"work": [[1, 0]], "seconds": 0}]}', "sample 0: 'seconds' must be a number > 0"),
    ("{", "is not valid JSON"),
]


@pytest.mark.parametrize(("document", "message"), MALFORMED)
def test_a_malformed_profile_is_one_clear_error(tmp_path: Path, document: str, message: str) -> None:
    path = tmp_path / "profile.json"
    path.write_text(document)
    with pytest.raises(InvalidInputError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value)
    code = main(["calibrate", str(path), "--model", "gemma-3-27b"])
    assert code == 2


def test_the_profile_format_reads_modes_and_meta() -> None:
    profile = load_profile(H100_PROFILE)
    assert profile.meta["model"] == "gemma-3-27b" and profile.meta["gpu"] == "h100-80gb"
    kinds = {s.mode: (s.kind, s.graph) for s in profile.steps}
    assert kinds == {"prefill-eager": ("prefill", False), "decode-eager": ("decode", False),
                     "decode-graph": ("decode", True), "mixed-eager": ("mixed", False)}
    assert ProfileStep((SeqWork(1, 5),), 1.0).graph is None
    assert ProfileStep((SeqWork(1, 5), SeqWork(8, 0)), 1.0).kind == "mixed"


# ---------------------------------------------------------------------- the command line


def test_calibrate_prints_the_parameters_and_each_steps_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "gemma-3-27b" and len(doc["steps"]) == 33
    assert doc["efficiency"]["compute"] == pytest.approx(H100_EFFICIENCY.compute, rel=0.01)
    assert doc["errors"]["all"]["worst_abs_error"] < 0.1
    assert main(["calibrate", str(H100_PROFILE), "--model", "gemma-3-27b", "--check"]) == 0
    out = capsys.readouterr().out
    assert "calibrated profile" in out and "decode-graph" in out and "median" in out


def test_calibrate_takes_a_config_json_with_its_parameter_count(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(PRESETS["gemma-3-27b"].config)))
    assert main(["calibrate", "--model", str(config), "--check"]) == 2
    assert "pass --num-params" in capsys.readouterr().err
    assert main(["calibrate", "--model", str(config), "--num-params", "27009346304", "--check", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["errors"]["all"]["worst_abs_error"] < 0.1


def test_calibrate_without_a_profile_for_the_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--gpu", "a100-80gb"]) == 2
    assert "has no built-in profile" in capsys.readouterr().err


SIM = ["simulate", "--model", "gemma-3-27b", "--max-model-len", "8192", "--workload", "chat", "--requests", "4",
       "--no-progress"]


def test_simulate_with_the_built_in_profile_as_calibration(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SIM, "--json", "-"]) == 0
    default = json.loads(capsys.readouterr().out)
    assert default["cost_model"].startswith("calibrated profile") and default["lm_head"] == "per_sample"
    assert main([*SIM, "--calibration", str(H100_PROFILE), "--json", "-"]) == 0
    fitted = json.loads(capsys.readouterr().out)
    assert fitted["cost_model"] == f"fitted to {H100_PROFILE}"
    assert fitted["duration_s"] == pytest.approx(default["duration_s"], rel=0.01)
    assert main([*SIM]) == 0
    assert "step times: calibrated profile" in capsys.readouterr().out
    assert main([*SIM, "--gpu", "a100-80gb"]) == 0
    assert "step times: data sheet" in capsys.readouterr().out


def test_data_sheet_names_the_one_roofline_model_on_a_gpu_with_a_profile() -> None:
    from hybridkv.sim.cost_model import DATA_SHEET

    calibrated = CostModel.from_preset("gemma-3-27b", "h100-80gb", lm_head="per_token")
    sheet = calibrate(calibrated, DATA_SHEET)
    assert calibrated.efficiency != DEFAULT_EFFICIENCY and sheet.efficiency == DEFAULT_EFFICIENCY
    assert sheet.efficiency_source == "data sheet"
    work = [SeqWork(num_new_tokens=2048, context_len=0)]
    reference = CostModel.from_preset("gemma-3-27b", "h100-80gb", efficiency=DEFAULT_EFFICIENCY, lm_head="per_token")
    assert sheet.step_time(work) == reference.step_time(work) != calibrated.step_time(work)

"""bench/measure_steps.py without a GPU: its arguments, the shapes it builds, the format it writes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hybridkv.errors import InvalidInputError
from hybridkv.sim.cost_model import parse_profile

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "measure_steps.py"


@pytest.fixture(scope="module")
def ms() -> ModuleType:
    spec = importlib.util.spec_from_file_location("measure_steps", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["measure_steps"] = module
    spec.loader.exec_module(module)  # importing it needs no torch
    return module


def test_the_defaults_are_the_h100_measurements_grid(ms: ModuleType) -> None:
    args = ms.parse_args(["out.json", "--model", "gemma-3-27b"])
    assert args.out == Path("out.json") and args.gpu == "h100-80gb" and args.dtype == "bf16"
    steps = ms.plan_steps(args)
    modes = [m for m, _ in steps]
    assert len(steps) == 33
    assert modes.count("prefill-eager") == 12 and modes.count("decode-graph") == 9 and modes.count("mixed-eager") == 3
    assert ("mixed-eager", [(1, 2048, 0), (32, 1, 4096)]) in steps


def test_custom_grids_parse_and_bad_ones_exit_2(ms: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    args = ms.parse_args(["o.json", "--model", "llama-3.1-8b", "--prefill-chunks", "256,1024", "--prefill-contexts",
                          "0", "--decode", "4:512,16:2048", "--mixed", "1024:0:8:512", "--no-graphs"])
    assert ms.plan_steps(args) == [("prefill-eager", [(1, 256, 0)]), ("prefill-eager", [(1, 1024, 0)]),
                                   ("decode-eager", [(4, 1, 512)]), ("decode-eager", [(16, 1, 2048)]),
                                   ("mixed-eager", [(1, 1024, 0), (8, 1, 512)])]
    for bad in (["--decode", "4x512"], ["--prefill-chunks", "a,b"], ["--mixed", "1:2:3"]):
        with pytest.raises(SystemExit) as info:
            ms.parse_args(["o.json", "--model", "gemma-3-1b", *bad])
        assert info.value.code == 2
    assert "expected" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ms.parse_args(["o.json"])  # --model is required


def test_gemma_3_27b_builds_the_measured_decoder(ms: ModuleType) -> None:
    shape = ms.model_shape("gemma-3-27b")
    assert (shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate) == (5376, 32, 16, 128,
                                                                                               21504)
    assert len(shape.kinds) == 62 and shape.window == 1024 and shape.vocab == 262_208
    assert [i for i, k in enumerate(shape.kinds) if k == "full"] == [i for i in range(62) if (i + 1) % 6 == 0]
    assert shape.keys(5, 8192, 512) == 8192 + 512  # a global layer sees everything
    assert shape.keys(0, 8192, 512) == 1023 + 512  # a sliding layer: the window's cached keys plus the chunk
    assert shape.keys(0, 100, 1) == 101


def test_other_presets_build_or_are_refused(ms: ModuleType) -> None:
    scout = ms.model_shape("llama-4-scout")
    assert scout.window == 8192 and scout.keys(0, 10_000, 100) == 10_000 % 8192 + 100
    assert ms.model_shape("gpt-oss-20b").intermediate > 0  # an MoE runs as its active width
    with pytest.raises(InvalidInputError, match="not mamba"):
        ms.model_shape("jamba-mini")
    with pytest.raises(InvalidInputError, match="mla"):
        ms.model_shape("deepseek-v3")


def test_a_sample_is_in_the_profile_format(ms: ModuleType) -> None:
    sample = ms.sample_of("mixed-eager", [(1, 512, 100), (2, 1, 50)], [0.03, 0.01, 0.02])
    assert sample["work"] == [[512, 100, 0, 1], [1, 50, 0, 1], [1, 50, 0, 1]]
    assert sample["seconds"] == 0.02 and sample["best_s"] == 0.01
    profile = parse_profile({"meta": {"model": "gemma-3-1b", "window_kernel": "masked"}, "samples": [sample]})
    assert profile.steps[0].kind == "mixed" and profile.window_kernel == "masked"


def test_a_cpu_smoke_run_writes_a_profile(ms: ModuleType, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "smoke.json"
    args = ms.parse_args([str(out), "--model", "gemma-3-1b", "--smoke", "--prefill-chunks", "8,32",
                          "--prefill-contexts", "0,40", "--decode", "2:20", "--mixed", "16:8:2:20"])
    ms.measure(args)
    doc = json.loads(out.read_text())
    assert doc["meta"]["smoke"] is True and doc["meta"]["window_kernel"] == "masked"
    assert [s["mode"] for s in doc["samples"]] == ["prefill-eager"] * 4 + ["decode-eager", "mixed-eager"]
    assert len(parse_profile(doc).steps) == 6

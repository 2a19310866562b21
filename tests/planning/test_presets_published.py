"""Model presets against the numbers published for each model.

The expected values below are literals copied from the model cards, papers and ``config.json``
files named in each preset's ``notes``; nothing here is read back from the presets except the
config being checked. The local/global split is computed from the config fields by the small
helper ``_layer_kinds`` (independent of ``hybridkv.planning.hf_config``); the recurrent state sizes
of the Mamba-2 presets are checked against literals computed by hand from the published shapes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import pytest

from hybridkv.core import FullAttentionSpec, MambaSpec
from hybridkv.planning import layer_specs, parse_config
from hybridkv.planning.presets import PRESETS, ModelPreset


class Published(NamedTuple):
    layers: int
    local: int
    """Sliding-window, chunked-local, linear-attention or Mamba layers (a parallel hybrid layer
    counts here and in ``global_``)."""
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
    # Nemotron-H (arXiv:2504.03624; NVIDIA's Megatron-Bridge docs and Nemotron-H blog): the 8B has 52
    # layers, 24 Mamba-2 + 24 MLP + 4 self-attention (8 KV heads, KV channels 128), 8K context, 8B.
    "nemotron-h-8b": Published(52, 24, 4, 7, None, 8, 128, 8192, 8e9, 1e9),
    # Granite 4.0-H-Tiny card and IBM's Granite 4.0 announcement: 4 attention + 36 Mamba-2 layers
    # (IBM: 9 Mamba-2 blocks per attention block), 12 query / 4 KV heads of 128, 128K context, 7B total
    # (1B active).
    "granite-4.0-h-tiny": Published(40, 36, 4, 5, None, 4, 128, 131_072, 7e9, 1e9),
    # Falcon-H1 (transformers FalconH1 docs table; report arXiv:2507.22448): 7B = 44 layers, each with
    # attention (2 KV heads of 128) and Mamba-2 heads in parallel, 256K context. Its size is only
    # published as "7B" (a size class: the shapes give 7.59B), so the count is checked to within 1B.
    "falcon-h1-7b": Published(44, 44, 44, 0, None, 2, 128, 262_144, 7e9, 2e9),
    # DeepSeek-V3 report (arXiv:2412.19437): 61 MLA layers caching a 512 + 64 = 576-wide latent, 671B
    # total; config max_position_embeddings 163840 (the card advertises 128K).
    "deepseek-v3": Published(61, 0, 61, 0, None, 1, 576, 163_840, 671e9, 1e9),
    # Phi-3 report (arXiv:2404.14219) and config: 32 layers, 32 heads, hidden 3072, 4K context.
    "phi-3-mini": Published(32, 32, 0, None, 2047, 32, 96, 4096, 3.8e9, 0.1e9),
}

EXPECTED_IDS = (
    "gemma-3-270m", "gemma-3-1b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b", "gemma-2-9b", "gemma-2-27b",
    "gpt-oss-20b", "gpt-oss-120b", "mistral-7b-v0.1", "llama-3.1-8b", "llama-3.1-70b", "llama-4-scout",
    "qwen3-next-80b-a3b", "jamba-mini", "nemotron-h-8b", "granite-4.0-h-tiny", "falcon-h1-7b", "deepseek-v3",
    "phi-3-mini",
)


def _text(config: Mapping[str, Any]) -> dict[str, Any]:
    """The language-model fields, a nested ``text_config`` taking precedence."""
    merged = {k: v for k, v in config.items() if k != "text_config"}
    merged.update(config.get("text_config") or {})
    return merged


def _layer_kinds(cfg: Mapping[str, Any]) -> list[str]:
    """'local', 'global', 'both' (attention and Mamba in parallel) or 'none' (no cache) per layer, as
    the config's fields imply."""
    n = cfg["num_hidden_layers"]
    if "layer_types" in cfg:  # Granite 4.0-H spells full attention "attention" and its Mamba-2 layers "mamba"
        return ["global" if t in ("full_attention", "attention") else "local" for t in cfg["layer_types"]]
    if "hybrid_override_pattern" in cfg:  # Nemotron-H: M = Mamba-2, * = attention, - = MLP only
        return [{"M": "local", "*": "global"}.get(c, "none") for c in cfg["hybrid_override_pattern"]]
    if cfg["model_type"] == "falcon_h1":  # every layer runs attention and a Mamba-2 mixer side by side
        return ["both"] * n
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
    head_dim = cfg.get("head_dim", cfg.get("attention_head_dim"))  # Nemotron-H: attention_head_dim
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
    assert sum(k in ("local", "both") for k in kinds) == pub.local
    assert sum(k in ("global", "both") for k in kinds) == pub.global_
    globals_ = [i for i, k in enumerate(kinds) if k in ("global", "both")]
    assert (globals_[0] if globals_ else None) == pub.first_global
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


class Mamba2(NamedTuple):
    """A Mamba-2 layer's published shape and its recurrent state, from the config and model card."""

    heads: int
    head_dim: int
    d_state: int
    groups: int
    d_conv: int
    state_bytes: int
    """bf16 bytes of one layer's state on one GPU: 2 x ((d_conv - 1) x (heads x head_dim + 2 x groups x
    d_state) + heads x head_dim x d_state), worked out by hand."""
    state_bytes_tp2: int
    """The same on each of two tensor-parallel ranks (heads and groups split; one group is replicated)."""


MAMBA2: dict[str, Mamba2] = {
    # 2 x (3 x (8192 + 2048) + 128 x 64 x 128) = 2 x (30,720 + 1,048,576); TP 2: 2 x (15,360 + 524,288).
    "nemotron-h-8b": Mamba2(128, 64, 128, 8, 4, 2_158_592, 1_079_296),
    # 2 x (3 x (3072 + 256) + 48 x 64 x 128) = 2 x (9,984 + 393,216); TP 2: the single group is kept on both
    # ranks, 2 x (3 x (3072 + 512) / 2 + 24 x 64 x 128) = 2 x (5,376 + 196,608).
    "granite-4.0-h-tiny": Mamba2(48, 64, 128, 1, 4, 806_400, 403_968),
    # 2 x (3 x (3072 + 512) + 24 x 128 x 256) = 2 x (10,752 + 786,432); TP 2, the group on both ranks:
    # 2 x (3 x (3072 + 1024) / 2 + 12 x 128 x 256) = 2 x (6,144 + 393,216).
    "falcon-h1-7b": Mamba2(24, 128, 256, 1, 4, 1_594_368, 798_720),
}


def _mamba2_shape(cfg: Mapping[str, Any]) -> tuple[int, int, int, int, int]:
    if "mamba_num_heads" in cfg:  # Nemotron-H spelling
        return (cfg["mamba_num_heads"], cfg["mamba_head_dim"], cfg["ssm_state_size"], cfg["n_groups"],
                cfg["conv_kernel"])
    return cfg["mamba_n_heads"], cfg["mamba_d_head"], cfg["mamba_d_state"], cfg["mamba_n_groups"], cfg["mamba_d_conv"]


@pytest.mark.parametrize("preset_id", sorted(MAMBA2))
def test_mamba2_presets_state_and_caches(preset_id: str) -> None:
    preset = PRESETS[preset_id]
    pub = MAMBA2[preset_id]
    cfg = _text(preset.config)
    assert _mamba2_shape(cfg) == (pub.heads, pub.head_dim, pub.d_state, pub.groups, pub.d_conv)
    model = parse_config(preset.config)
    assert model.mamba_state_elements * 2 == pub.state_bytes
    assert parse_config(preset.config, tensor_parallel_size=2).mamba_state_elements * 2 == pub.state_bytes_tp2
    # One cache per attention layer and one state per Mamba layer; a layer with neither (Nemotron-H's
    # MLP-only layers) keeps nothing.
    specs = layer_specs(model)
    attention = [n for n, s in specs.items() if isinstance(s, FullAttentionSpec)]
    states = [n for n, s in specs.items() if isinstance(s, MambaSpec)]
    published = PUBLISHED[preset_id]
    assert (len(attention), len(states), len(specs)) == (
        published.global_, published.local, published.global_ + published.local)
    assert all(s.state_bytes == pub.state_bytes for s in specs.values() if isinstance(s, MambaSpec))
    assert all((s.num_kv_heads, s.head_size) == (published.kv_heads, published.head_dim)
               for s in specs.values() if isinstance(s, FullAttentionSpec))


def test_nemotron_h_pattern_places_four_attention_layers() -> None:
    cfg = _text(PRESETS["nemotron-h-8b"].config)
    kinds = _layer_kinds(cfg)
    assert [i for i, k in enumerate(kinds) if k == "global"] == [7, 18, 29, 40]
    assert kinds.count("none") == 24  # MLP-only layers
    assert cfg["mamba_num_heads"] * cfg["mamba_head_dim"] == cfg["expand"] * cfg["hidden_size"] == 8192


def test_granite_h_tiny_attention_layers_and_inner_size() -> None:
    cfg = _text(PRESETS["granite-4.0-h-tiny"].config)
    assert [i for i, k in enumerate(_layer_kinds(cfg)) if k == "global"] == [5, 15, 25, 35]
    assert cfg["mamba_n_heads"] * cfg["mamba_d_head"] == cfg["mamba_expand"] * cfg["hidden_size"] == 3072


def test_falcon_h1_every_layer_keeps_a_kv_cache_and_a_state() -> None:
    cfg = _text(PRESETS["falcon-h1-7b"].config)
    assert cfg["mamba_n_heads"] * cfg["mamba_d_head"] == cfg["mamba_d_ssm"] == 3072  # not expand x hidden
    names = list(layer_specs(parse_config(PRESETS["falcon-h1-7b"].config)))
    assert names[:4] == ["model.layers.0.self_attn", "model.layers.0.mamba",
                         "model.layers.1.self_attn", "model.layers.1.mamba"]
    assert len(names) == 2 * 44


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

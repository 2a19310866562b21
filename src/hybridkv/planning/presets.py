"""Presets of real models: the ``config.json`` facts that decide their KV-cache layout.

Each preset's ``config`` is a subset of the published ``config.json`` (same keys and nesting), so
it goes through the same parser as a downloaded file; ``num_params``, ``max_model_len``, the
vocabulary and ``notes`` say where each fact comes from.
See docs/LIBRARY.md, "Models, presets and GPUs".
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybridkv.errors import InvalidInputError


@dataclass(frozen=True)
class ModelPreset:
    """One real model."""

    id: str
    """Short lower-case id, e.g. ``gemma-3-27b``."""
    hf_name: str
    """Hugging Face repository, e.g. ``google/gemma-3-27b-it``."""
    num_params: int
    """Total parameter count (all experts of an MoE, vision tower included)."""
    max_model_len: int
    """Default maximum context in tokens."""
    config: Mapping[str, Any]
    """A subset of the real ``config.json``: same key names, same nesting."""
    notes: str = ""
    """Where the numbers come from, and anything approximated."""


def _gemma3_layer_types(num_layers: int) -> list[str]:
    """Gemma 3: five sliding-window layers, then one global layer, repeated."""
    return ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(num_layers)]


_GEMMA3_DEFAULTS_NOTE = (
    "The published config.json nests a sparse text_config and leaves {fields} to the transformers "
    "Gemma3TextConfig defaults; those defaults are written out here."
)

_PRESET_LIST: tuple[ModelPreset, ...] = (
    # ---------------------------------------------------------------- Gemma 3
    ModelPreset(
        id="gemma-3-270m",
        hf_name="google/gemma-3-270m",
        num_params=268_098_176,
        max_model_len=32_768,
        config={
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "_sliding_window_pattern": 6,
            "head_dim": 256,
            "hidden_size": 640,
            "layer_types": _gemma3_layer_types(18),
            "max_position_embeddings": 32_768,
            "num_attention_heads": 4,
            "num_hidden_layers": 18,
            "num_key_value_heads": 1,
            "sliding_window": 512,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": True,
            "vocab_size": 262_144,
        },
        notes=(
            "https://huggingface.co/google/gemma-3-270m/blob/main/config.json (transformers 4.55 export: "
            "layer_types list plus the private '_sliding_window_pattern': 6). 18 layers = 15 sliding (512) + "
            "3 global, MQA with 1 KV head of 256. Model card: 32K context, 268M parameters (170M of them "
            "embeddings); 268,098,176 recomputed from the shapes."
        ),
    ),
    ModelPreset(
        id="gemma-3-1b",
        hf_name="google/gemma-3-1b-it",
        num_params=999_885_952,
        max_model_len=32_768,
        config={
            "architectures": ["Gemma3ForCausalLM"],
            "model_type": "gemma3_text",
            "head_dim": 256,
            "hidden_size": 1152,
            "max_position_embeddings": 32_768,
            "num_attention_heads": 4,
            "num_hidden_layers": 26,
            "num_key_value_heads": 1,
            "sliding_window": 512,
            "sliding_window_pattern": 6,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": True,
            "vocab_size": 262_144,
        },
        notes=(
            "https://huggingface.co/google/gemma-3-1b-it/blob/main/config.json (transformers 4.50 export: "
            "sliding_window_pattern 6, no layer_types). 26 layers = 22 sliding (512) + 4 global (layers "
            "5, 11, 17, 23). Text-only. Model card: 32K context, 1B parameters; 999,885,952 recomputed."
        ),
    ),
    ModelPreset(
        id="gemma-3-4b",
        hf_name="google/gemma-3-4b-it",
        num_params=4_300_079_472,
        max_model_len=131_072,
        config={
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": {
                "model_type": "gemma3_text",
                "head_dim": 256,
                "hidden_size": 2560,
                "max_position_embeddings": 131_072,
                "num_attention_heads": 8,
                "num_hidden_layers": 34,
                "num_key_value_heads": 4,
                "sliding_window": 1024,
                "sliding_window_pattern": 6,
                "tie_word_embeddings": True,
                "vocab_size": 262_208,
            },
            "torch_dtype": "bfloat16",
        },
        notes=(
            "https://huggingface.co/google/gemma-3-4b-it/blob/main/config.json: text_config sets hidden_size "
            "2560, num_hidden_layers 34, sliding_window 1024. "
            + _GEMMA3_DEFAULTS_NOTE.format(
                fields="num_attention_heads (8), num_key_value_heads (4), head_dim (256), "
                "max_position_embeddings (131072) and sliding_window_pattern (6)"
            )
            + " These match the Gemma 3 technical report (4B: 8 query heads, 4 KV heads, head dim 256). "
            "34 layers = 29 sliding + 5 global. Model card: 128K context, 4.3B parameters including the "
            "~417M SigLIP vision tower; 4,300,079,472 recomputed."
        ),
    ),
    ModelPreset(
        id="gemma-3-12b",
        hf_name="google/gemma-3-12b-it",
        num_params=12_187_325_040,
        max_model_len=131_072,
        config={
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": {
                "model_type": "gemma3_text",
                "head_dim": 256,
                "hidden_size": 3840,
                "max_position_embeddings": 131_072,
                "num_attention_heads": 16,
                "num_hidden_layers": 48,
                "num_key_value_heads": 8,
                "sliding_window": 1024,
                "sliding_window_pattern": 6,
                "tie_word_embeddings": True,
                "vocab_size": 262_208,
            },
            "torch_dtype": "bfloat16",
        },
        notes=(
            "https://huggingface.co/google/gemma-3-12b-it/blob/main/config.json: text_config sets hidden_size "
            "3840, num_attention_heads 16, num_key_value_heads 8, num_hidden_layers 48, sliding_window 1024. "
            + _GEMMA3_DEFAULTS_NOTE.format(
                fields="head_dim (256), max_position_embeddings (131072) and sliding_window_pattern (6)"
            )
            + " 48 layers = 40 sliding + 8 global. Model card: 128K context, 12.2B parameters with the vision "
            "tower; 12,187,325,040 recomputed."
        ),
    ),
    ModelPreset(
        id="gemma-3-27b",
        hf_name="google/gemma-3-27b-it",
        num_params=27_432_406_640,
        max_model_len=131_072,
        config={
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": {
                "model_type": "gemma3_text",
                "head_dim": 128,
                "hidden_size": 5376,
                "max_position_embeddings": 131_072,
                "num_attention_heads": 32,
                "num_hidden_layers": 62,
                "num_key_value_heads": 16,
                "sliding_window": 1024,
                "sliding_window_pattern": 6,
                "tie_word_embeddings": True,
                "vocab_size": 262_208,
            },
            "torch_dtype": "bfloat16",
        },
        notes=(
            "https://huggingface.co/google/gemma-3-27b-it/blob/main/config.json: text_config sets head_dim 128, "
            "hidden_size 5376, num_attention_heads 32, num_key_value_heads 16, num_hidden_layers 62, "
            "sliding_window 1024 (query_pre_attn_scalar 168). "
            + _GEMMA3_DEFAULTS_NOTE.format(fields="max_position_embeddings (131072) and sliding_window_pattern (6)")
            + " 62 layers = 52 sliding + 10 global (the last two layers are sliding). Model card: 128K "
            "context, 27.4B parameters with the vision tower; 27,432,406,640 recomputed."
        ),
    ),
    # ---------------------------------------------------------------- Gemma 2
    ModelPreset(
        id="gemma-2-9b",
        hf_name="google/gemma-2-9b",
        num_params=9_241_705_984,
        max_model_len=8192,
        config={
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "head_dim": 256,
            "hidden_size": 3584,
            "max_position_embeddings": 8192,
            "num_attention_heads": 16,
            "num_hidden_layers": 42,
            "num_key_value_heads": 8,
            "sliding_window": 4096,
            "sliding_window_size": 4096,
            "torch_dtype": "float32",
            "tie_word_embeddings": True,
            "vocab_size": 256_000,
        },
        notes=(
            "https://huggingface.co/google/gemma-2-9b/blob/main/config.json (transformers 4.42 export). The "
            "file has no layer_types: Gemma 2 alternates by layer index, even layers sliding (4096), odd "
            "layers global (transformers Gemma2: is_sliding = not layer_idx % 2), so 21 + 21. "
            "'sliding_window_size' is a legacy duplicate of sliding_window kept in the file. Weights are "
            "published in float32 (the -it variant's dtype may differ). 8K context; 9,241,705,984 "
            "parameters recomputed (card: 9B)."
        ),
    ),
    ModelPreset(
        id="gemma-2-27b",
        hf_name="google/gemma-2-27b",
        num_params=27_227_128_320,
        max_model_len=8192,
        config={
            "architectures": ["Gemma2ForCausalLM"],
            "model_type": "gemma2",
            "head_dim": 128,
            "hidden_size": 4608,
            "max_position_embeddings": 8192,
            "num_attention_heads": 32,
            "num_hidden_layers": 46,
            "num_key_value_heads": 16,
            "sliding_window": 4096,
            "sliding_window_size": 4096,
            "torch_dtype": "float32",
            "tie_word_embeddings": True,
            "vocab_size": 256_000,
        },
        notes=(
            "https://huggingface.co/google/gemma-2-27b/blob/main/config.json (query_pre_attn_scalar 144). "
            "No layer_types: even layers sliding (4096), odd layers global, so 23 + 23. Weights published in "
            "float32 (the -it variant's dtype may differ). 8K context; 27,227,128,320 parameters recomputed "
            "(card: 27B)."
        ),
    ),
    # ---------------------------------------------------------------- GPT-OSS
    ModelPreset(
        id="gpt-oss-20b",
        hf_name="openai/gpt-oss-20b",
        num_params=20_914_757_184,
        max_model_len=131_072,
        config={
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "head_dim": 64,
            "hidden_size": 2880,
            "initial_context_length": 4096,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
            "max_position_embeddings": 131_072,
            "num_attention_heads": 64,
            "num_hidden_layers": 24,
            "num_key_value_heads": 8,
            "num_local_experts": 32,
            "sliding_window": 128,
            "tie_word_embeddings": False,
            "vocab_size": 201_088,
        },
        notes=(
            "https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json: layer_types alternate "
            "sliding_attention (128-token window) / full_attention starting with sliding, so 12 + 12; "
            "64 query heads, 8 KV heads of 64; YaRN from 4096 to 131072. The file has no torch_dtype "
            "(MoE weights ship as MXFP4, the rest bf16). Model card: 21B total / 3.6B active; the paper's "
            "20.91B matches 20,914,757,184 recomputed (attention sinks and biases included)."
        ),
    ),
    ModelPreset(
        id="gpt-oss-120b",
        hf_name="openai/gpt-oss-120b",
        num_params=116_829_156_672,
        max_model_len=131_072,
        config={
            "architectures": ["GptOssForCausalLM"],
            "model_type": "gpt_oss",
            "head_dim": 64,
            "hidden_size": 2880,
            "initial_context_length": 4096,
            "layer_types": ["sliding_attention", "full_attention"] * 18,
            "max_position_embeddings": 131_072,
            "num_attention_heads": 64,
            "num_hidden_layers": 36,
            "num_key_value_heads": 8,
            "num_local_experts": 128,
            "sliding_window": 128,
            "tie_word_embeddings": False,
            "vocab_size": 201_088,
        },
        notes=(
            "https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json: 36 layers alternating "
            "sliding (128) / full starting with sliding, so 18 + 18; 8 KV heads of 64. No torch_dtype in "
            "the file (MXFP4 MoE weights). Model card: 117B total / 5.1B active; the paper's 116.83B "
            "matches 116,829,156,672 recomputed."
        ),
    ),
    # ---------------------------------------------------------------- Mistral
    ModelPreset(
        id="mistral-7b-v0.1",
        hf_name="mistralai/Mistral-7B-v0.1",
        num_params=7_241_732_096,
        max_model_len=32_768,
        config={
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "hidden_size": 4096,
            "max_position_embeddings": 32_768,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "sliding_window": 4096,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
            "vocab_size": 32_000,
        },
        notes=(
            "https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json: every layer uses "
            "sliding-window attention with window 4096 (no head_dim field: 4096 / 32 = 128). "
            "max_position_embeddings is 32768; the paper (arXiv:2310.06825) lists context_len 8192 for "
            "training. 7,241,732,096 parameters recomputed (paper: 7.3B, HF: 7.24B)."
        ),
    ),
    # ---------------------------------------------------------------- Llama 3.1
    ModelPreset(
        id="llama-3.1-8b",
        hf_name="meta-llama/Llama-3.1-8B-Instruct",
        num_params=8_030_261_248,
        max_model_len=131_072,
        config={
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 4096,
            "max_position_embeddings": 131_072,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
            "vocab_size": 128_256,
        },
        notes=(
            "https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct/blob/main/config.json: full attention "
            "in all 32 layers, 8 KV heads, head size 4096 / 32 = 128 (no head_dim field in the file), llama3 "
            "RoPE scaling to 128K. 8,030,261,248 parameters recomputed (card: 8B, HF: 8.03B)."
        ),
    ),
    ModelPreset(
        id="llama-3.1-70b",
        hf_name="meta-llama/Llama-3.1-70B-Instruct",
        num_params=70_553_706_496,
        max_model_len=131_072,
        config={
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 8192,
            "max_position_embeddings": 131_072,
            "num_attention_heads": 64,
            "num_hidden_layers": 80,
            "num_key_value_heads": 8,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
            "vocab_size": 128_256,
        },
        notes=(
            "https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json: full attention "
            "in all 80 layers, 8 KV heads, head size 8192 / 64 = 128. 70,553,706,496 parameters recomputed "
            "(card: 70B, HF: 70.6B)."
        ),
    ),
    # ---------------------------------------------------------------- Llama 4
    ModelPreset(
        id="llama-4-scout",
        hf_name="meta-llama/Llama-4-Scout-17B-16E-Instruct",
        num_params=108_641_793_536,
        max_model_len=10_485_760,
        config={
            "architectures": ["Llama4ForConditionalGeneration"],
            "model_type": "llama4",
            "text_config": {
                "model_type": "llama4_text",
                "attention_chunk_size": 8192,
                "head_dim": 128,
                "hidden_size": 5120,
                "interleave_moe_layer_step": 1,
                "max_position_embeddings": 10_485_760,
                "no_rope_layers": [1, 1, 1, 0] * 12,
                "num_attention_heads": 40,
                "num_hidden_layers": 48,
                "num_key_value_heads": 8,
                "num_local_experts": 16,
                "torch_dtype": "bfloat16",
                "tie_word_embeddings": False,
                "vocab_size": 202_048,
            },
            "torch_dtype": "bfloat16",
        },
        notes=(
            "https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E-Instruct/blob/main/config.json: "
            "text_config with attention_chunk_size 8192 and no_rope_layers, where 1 means the layer uses RoPE "
            "(transformers: use_rope = no_rope_layers[i]) and attends within 8192-token chunks, 0 means a NoPE "
            "layer with global attention: every 4th layer (3, 7, ..., 47), so 36 chunked + 12 global. Some "
            "copies of the config carry an empty no_rope_layers, which transformers fills with the same list "
            "from no_rope_layer_interval 4. max_position_embeddings 10485760 (the advertised 10M context; the "
            "base Llama-4-Scout-17B-16E config says 262144). Model card: 17B active / 109B total; "
            "108,641,793,536 recomputed (text 107.77B + vision encoder and projector 0.87B)."
        ),
    ),
    # ---------------------------------------------------------------- Qwen3-Next
    ModelPreset(
        id="qwen3-next-80b-a3b",
        hf_name="Qwen/Qwen3-Next-80B-A3B-Instruct",
        num_params=79_674_391_296,
        max_model_len=262_144,
        config={
            "architectures": ["Qwen3NextForCausalLM"],
            "model_type": "qwen3_next",
            "full_attention_interval": 4,
            "head_dim": 256,
            "hidden_size": 2048,
            "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_value_head_dim": 128,
            "max_position_embeddings": 262_144,
            "num_attention_heads": 16,
            "num_experts": 512,
            "num_hidden_layers": 48,
            "num_key_value_heads": 2,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
            "vocab_size": 151_936,
        },
        notes=(
            "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json: no layer_types in "
            "the file; full_attention_interval 4 makes every 4th layer gated full attention (layers 3, 7, "
            "..., 47: 12 layers, 2 KV heads of 256) and the other 36 Gated DeltaNet linear attention (16 key "
            "heads / 32 value heads of 128, conv kernel 4). Native context 262144 (card: up to 1M with YaRN). "
            "Card: 80B total / 3B active; 79,674,391,296 recomputed without the MTP module the checkpoint "
            "also ships (HF's safetensors count, ~81B, includes it)."
        ),
    ),
    # ---------------------------------------------------------------- Jamba
    ModelPreset(
        id="jamba-mini",
        hf_name="ai21labs/AI21-Jamba-1.5-Mini",
        num_params=51_570_323_328,
        max_model_len=262_144,
        config={
            "architectures": ["JambaForCausalLM"],
            "model_type": "jamba",
            "attn_layer_offset": 4,
            "attn_layer_period": 8,
            "expert_layer_offset": 1,
            "expert_layer_period": 2,
            "hidden_size": 4096,
            "mamba_d_conv": 4,
            "mamba_d_state": 16,
            "mamba_dt_rank": 256,
            "mamba_expand": 2,
            "max_position_embeddings": 262_144,
            "num_attention_heads": 32,
            "num_experts": 16,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "sliding_window": None,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
            "vocab_size": 65_536,
        },
        notes=(
            "https://huggingface.co/ai21labs/AI21-Jamba-1.5-Mini/blob/main/config.json (the repository is also "
            "listed as AI21-Jamba-Mini-1.5): attention where layer % 8 == 4 (layers 4, 12, 20, 28: 4 layers, "
            "8 KV heads, head size 4096 / 32 = 128, no head_dim field) and Mamba-1 in the other 28 (d_inner "
            "= 2 x 4096, d_state 16, d_conv 4); MoE every other layer from layer 1. 256K context. Jamba 1.5 "
            "paper: 12B active / 52B total; 51,570,323,328 recomputed (HF: 51.6B)."
        ),
    ),
    # ---------------------------------------------------------------- Nemotron-H
    ModelPreset(
        id="nemotron-h-8b",
        hf_name="nvidia/Nemotron-H-8B-Base-8K",
        num_params=8_100_852_736,
        max_model_len=8192,
        config={
            "architectures": ["NemotronHForCausalLM"],
            "model_type": "nemotron_h",
            "attention_head_dim": 128,
            "chunk_size": 128,
            "conv_kernel": 4,
            "expand": 2,
            "hidden_size": 4096,
            "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
            "intermediate_size": 21504,
            "mamba_head_dim": 64,
            "mamba_num_heads": 128,
            "max_position_embeddings": 8192,
            "n_groups": 8,
            "num_attention_heads": 32,
            "num_hidden_layers": 52,
            "num_key_value_heads": 8,
            "ssm_state_size": 128,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": 131072,
        },
        notes=(
            "https://huggingface.co/nvidia/Nemotron-H-8B-Base-8K/blob/main/config.json (not reachable from "
            "here; read from the full copy in NVIDIA-NeMo/Megatron-Bridge "
            "tests/unit_tests/models/nemotronh/test_nemotron_h_bridge.py, and checked against NVIDIA's "
            "Megatron-Bridge docs, docs.nvidia.com/nemo/megatron-bridge/latest/models/llm/nemotronh.html: 52 "
            "layers, this pattern, hidden 4096, FFN 21504, 32 query / 8 KV heads, KV channels 128, 128 Mamba "
            "heads of 64, state 128). hybrid_override_pattern: M = Mamba-2 (24 layers), * = attention (4: "
            "layers 7, 18, 29, 40; 8 KV heads of attention_head_dim 128), - = MLP only, no cache (24). "
            "Mamba-2 state per layer: conv 3 x (128 x 64 + 2 x 8 x 128) + SSM 128 x 64 x 128 elements. 8K "
            "context. Card and paper (arXiv:2504.03624): 8B; 8,100,852,736 recomputed (untied 131072-token "
            "embedding and output, squared-ReLU MLP without a gate)."
        ),
    ),
    # ---------------------------------------------------------------- Granite 4.0-H
    ModelPreset(
        id="granite-4.0-h-tiny",
        hf_name="ibm-granite/granite-4.0-h-tiny",
        num_params=6_939_037_248,
        max_model_len=131_072,
        config={
            "architectures": ["GraniteMoeHybridForCausalLM"],
            "model_type": "granitemoehybrid",
            "hidden_size": 1536,
            "intermediate_size": 512,
            "layer_types": (["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 9
                            + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 4),
            "mamba_chunk_size": 256,
            "mamba_conv_bias": True,
            "mamba_d_conv": 4,
            "mamba_d_head": 64,
            "mamba_d_state": 128,
            "mamba_expand": 2,
            "mamba_n_groups": 1,
            "mamba_n_heads": 48,
            "mamba_proj_bias": False,
            "max_position_embeddings": 131_072,
            "num_attention_heads": 12,
            "num_experts_per_tok": 6,
            "num_hidden_layers": 40,
            "num_key_value_heads": 4,
            "num_local_experts": 64,
            "shared_intermediate_size": 1024,
            "tie_word_embeddings": True,
            "torch_dtype": "bfloat16",
            "vocab_size": 100_352,
        },
        notes=(
            "https://huggingface.co/ibm-granite/granite-4.0-h-tiny/blob/main/config.json (not reachable from "
            "here; its values are taken from copies quoted in public code: a full transcription in an HF-config "
            "importer's test fixtures, and the Mamba-2 shape, 48 heads of 64 / d_state 128 / 1 group / chunk "
            "256, again in a vLLM kernel benchmark and an mlx_lm parameter test). 40 layers: 36 Mamba-2 and 4 "
            "attention (12 query / 4 KV heads, head size 1536 / 12 = 128, no head_dim field); the "
            "attention positions 5, 15, 25, 35 come from that one transcription (the 4 + 36 split is confirmed "
            "by several sources, the positions are not, and do not change the cache). Every layer has a MoE "
            "(64 experts of 512, 6 active, plus a shared expert of 1024). Mamba-2 inner size mamba_expand x "
            "hidden = 3072 = 48 x 64. Card: 7B total / 1B active, 128K context; 6,939,037,248 recomputed "
            "(tied embeddings)."
        ),
    ),
    # ---------------------------------------------------------------- Falcon-H1
    ModelPreset(
        id="falcon-h1-7b",
        hf_name="tiiuae/Falcon-H1-7B-Instruct",
        num_params=7_585_648_736,
        max_model_len=262_144,
        config={
            "architectures": ["FalconH1ForCausalLM"],
            "model_type": "falcon_h1",
            "head_dim": 128,
            "hidden_size": 3072,
            "intermediate_size": 12288,
            "mamba_conv_bias": True,
            "mamba_d_conv": 4,
            "mamba_d_head": 128,
            "mamba_d_ssm": 3072,
            "mamba_d_state": 256,
            "mamba_expand": 2,
            "mamba_n_groups": 1,
            "mamba_n_heads": 24,
            "mamba_proj_bias": False,
            "mamba_rms_norm": True,
            "max_position_embeddings": 262_144,
            "num_attention_heads": 12,
            "num_hidden_layers": 44,
            "num_key_value_heads": 2,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "vocab_size": 130_048,
        },
        notes=(
            "https://huggingface.co/tiiuae/Falcon-H1-7B-Instruct/blob/main/config.json (not reachable from "
            "here). The transformers FalconH1 docs table gives the 7B's shape: 44 layers, width 3072, 12 "
            "attention heads, 2 KV heads, 24 Mamba heads, head dims 128 / 128, d_state 256, 256K context; the "
            "other fields (head_dim 128, intermediate_size 12288, mamba_d_ssm 3072, mamba_n_groups 1, "
            "mamba_d_conv 4, mamba_rms_norm, untied embeddings, vocab_size 130048, max_position_embeddings "
            "262144) are from copies of the config quoted in public code; one derived (quantized) copy says "
            "vocab_size 130049, which would add 6144 parameters. Every one of the 44 layers runs attention "
            "and a Mamba-2 mixer in parallel (no layer pattern in the file), so each keeps a KV cache (2 KV "
            "heads of 128) and a recurrent state (conv 3 x (3072 + 2 x 256) + SSM 24 x 128 x 256 elements; "
            "the inner size is mamba_d_ssm, not mamba_expand x hidden). Technical report arXiv:2507.22448 and "
            "card: 7B; 7,585,648,736 recomputed (7.59B: SwiGLU MLP 3072 -> 12288 in every layer, gated RMS "
            "norm in the mixer)."
        ),
    ),
    # ---------------------------------------------------------------- DeepSeek-V3
    ModelPreset(
        id="deepseek-v3",
        hf_name="deepseek-ai/DeepSeek-V3",
        num_params=671_026_419_200,
        max_model_len=163_840,
        config={
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_size": 7168,
            "kv_lora_rank": 512,
            "max_position_embeddings": 163_840,
            "num_attention_heads": 128,
            "num_hidden_layers": 61,
            "num_key_value_heads": 128,
            "num_nextn_predict_layers": 1,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "torch_dtype": "bfloat16",
            "v_head_dim": 128,
            "tie_word_embeddings": False,
            "vocab_size": 129_280,
        },
        notes=(
            "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json: 61 layers of MLA; the cache "
            "holds one latent per token per layer, kv_lora_rank 512 + qk_rope_head_dim 64 = 576 wide "
            "(num_key_value_heads 128 is the decompressed head count, not what is cached). "
            "max_position_embeddings 163840 (YaRN factor 40 over 4096); the model card advertises 128K. "
            "The checkpoint's weights are FP8 (block-wise quantization_config, not copied here). Paper: 671B "
            "total / 37B active; 671,026,419,200 recomputed for the 61 main layers, without the 14B "
            "multi-token-prediction module (num_nextn_predict_layers 1) that makes HF's 685B."
        ),
    ),
    # ---------------------------------------------------------------- Phi-3
    ModelPreset(
        id="phi-3-mini",
        hf_name="microsoft/Phi-3-mini-4k-instruct",
        num_params=3_821_079_552,
        max_model_len=4096,
        config={
            "architectures": ["Phi3ForCausalLM"],
            "model_type": "phi3",
            "hidden_size": 3072,
            "max_position_embeddings": 4096,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 32,
            "original_max_position_embeddings": 4096,
            "sliding_window": 2047,
            "torch_dtype": "bfloat16",
            "tie_word_embeddings": False,
            "vocab_size": 32_064,
        },
        notes=(
            "https://huggingface.co/microsoft/Phi-3-mini-4k-instruct/blob/main/config.json: sliding_window 2047 "
            "with no per-layer pattern, so every layer is sliding-window as the config is written (transformers "
            "applies the window only under flash attention; engines may treat the model as full attention "
            "since the window is half the 4K context); 32 KV heads (no GQA), head size 3072 / 32 = 96. "
            "Card: 3.8B parameters, 4K context; 3,821,079,552 recomputed."
        ),
    ),
)

PRESETS: dict[str, ModelPreset] = {p.id: p for p in _PRESET_LIST}
"""Model presets by id."""


def get_preset(name: str) -> ModelPreset:
    """A preset by id; the error lists the known ids."""
    try:
        return PRESETS[name]
    except KeyError:
        raise InvalidInputError(f"unknown model {name!r}; known presets: {', '.join(PRESETS)}") from None

"""The engine's public data types: its configuration, what a step returns per request, and the
tokenizer it needs."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from hybridkv.engine.quant import gguf_kernels_available
from hybridkv.engine.sampling import TokenLogprob
from hybridkv.errors import InvalidInputError

MODELS = ("gemma-3-270m", "hybrid-tiny", "gemma-3-270m-random")
"""The built-in models (``EngineConfig.model``; ``hybridkv.engine.models``)."""
RANDOM_MODEL_ID = "gemma-3-270m-random"
"""Gemma 3 270M's shapes with random weights (``Gemma3Weights.generate``)."""
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
WEIGHT_FORMATS = ("dense", "gguf")


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidInputError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}") from None


def weights_format(config: Any) -> str:
    """The weights format an engine config (``dtype``, ``weights``, ``device``) runs with: ``auto`` is
    ``gguf`` for bfloat16 on the CPU (where torch has the int4 kernels) and ``dense`` otherwise, so
    ``float32`` alone selects the exact path. The random-weights model is dense only."""
    parse_dtype(config.dtype)
    if config.weights not in (*WEIGHT_FORMATS, "auto"):
        raise InvalidInputError(f"weights must be one of {[*WEIGHT_FORMATS, 'auto']}, got {config.weights!r}")
    if getattr(config, "model", None) == RANDOM_MODEL_ID:
        if config.weights == "gguf":
            raise InvalidInputError(f"{RANDOM_MODEL_ID} has dense weights only (it has no GGUF codes)")
        return "dense"
    if config.weights != "auto":
        if config.weights == "gguf" and config.device != "cpu":
            raise InvalidInputError(f"the gguf weights format runs on the CPU only, not on {config.device!r}")
        return str(config.weights)
    fast = parse_dtype(config.dtype) == torch.bfloat16 and config.device == "cpu" and gguf_kernels_available()
    return "gguf" if fast else "dense"


def resolved_device(device: str | torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` is the current CUDA device (``cuda:0`` on most machines),
    as tensors moved there report it."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return d



class Tokenizer(Protocol):
    eos_token_id: int

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str: ...

    def decode_incremental(self, ids: Seq[int], prefix_offset: int, read_offset: int,
                           skip_special_tokens: bool = True, final: bool = False) -> tuple[str, int, int]: ...


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. ``kv_cache_memory`` is the KV budget in bytes the layout is planned for."""

    dtype: str = "bfloat16"
    """KV-cache and attention dtype; ``float32`` with dense weights is the exact path."""
    weights: str = "auto"
    """``dense``, ``gguf`` (the GGUF's own codes, CPU int4 kernels) or ``auto`` (``weights_format``)."""
    device: str = "cpu"
    kv_cache_memory: int = 256 << 20
    max_model_len: int = 8192
    block_size: int = 16
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 32
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    retention: str = "window"
    policy: str = "fcfs"
    """``fcfs`` or ``priority`` (lower ``priority`` first; the server's per-request field)."""
    hash_algorithm: str = "sha256"
    ignore_sliding_window: bool = False
    """Plan every layer as full attention and attend over all tokens (a negative control: wrong outputs)."""
    kv_tiers: tuple[str, ...] = ()
    """External KV tiers, queried in order: ``host:SIZE``, ``disk:PATH:SIZE``, ``redis://HOST:PORT[/DB]``."""
    kv_events_endpoint: str | None = None
    """Publish KV-cache events (vLLM's wire format) on this ZMQ endpoint, e.g. ``tcp://127.0.0.1:5557``."""
    kv_events_replay_endpoint: str | None = None
    """Serve missed event batches on this ZMQ endpoint (needs ``kv_events_endpoint``)."""
    speculative: str | None = None
    """``ngram``: each decode step verifies up to ``num_speculative_tokens`` draft tokens proposed by
    prompt lookup (``hybridkv.engine.speculative``); None: one token per step."""
    num_speculative_tokens: int = 0
    """Draft tokens per step with ``speculative`` (1..8)."""
    enforce_eager: bool = False
    """Run every step eagerly; otherwise, on a GPU, decode-only steps replay CUDA graphs (as vLLM's flag)."""
    model: str = "gemma-3-270m"
    """The built-in model ``LLMEngine.from_package`` loads: ``gemma-3-270m``, ``hybrid-tiny`` (attention
    and Mamba-2 layers, weights from a fixed seed: ``hybridkv.engine.hybrid``) or ``gemma-3-270m-random``
    (Gemma 3 270M's shapes, dense random weights from a fixed seed, bytes as tokens: speed and GPU
    runs on machines without the model package; its text is meaningless)."""

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise InvalidInputError(f"unknown model {self.model!r}: the built-in models are {', '.join(MODELS)}")
        weights_format(self)
        if not isinstance(self.device, str) or (self.device != "cpu" and not self.device.startswith("cuda")):
            raise InvalidInputError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidInputError(f"device {self.device!r}: this torch build ({torch.__version__}) has no CUDA "
                                    f"device available; use --device cpu")
        from hybridkv.engine.speculative import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS

        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise InvalidInputError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)} (or unset), "
                                    f"got {self.speculative!r}")
        k = self.num_speculative_tokens
        if type(k) is not int or (self.speculative is None and k) or (
                self.speculative is not None and not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise InvalidInputError(
                f"num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS} with speculative decoding and 0 "
                f"without, got {k!r}" + ("" if self.speculative else " (set speculative='ngram')"))
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise InvalidInputError("kv_events_replay_endpoint needs kv_events_endpoint")
        for name in ("kv_cache_memory", "max_model_len", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidInputError(f"EngineConfig.{name} must be a positive integer, got {value!r}")


@dataclass
class RequestOutput:
    """What one step produced for one request (``text``, ``token_ids`` and ``logprobs`` are cumulative)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    """Prompt tokens served from the device prefix cache at the request's first admission."""
    num_external_tokens: int
    """Prompt tokens loaded from external KV tiers at the request's first admission."""
    ttft: float | None
    """Seconds from arrival to the first output token."""
    latency: float | None = None
    """Seconds from arrival to finishing (set when finished)."""
    logprobs: list[TokenLogprob] | None = None
    """Per output token (``SamplingParams.logprobs``): its log-probability and the top alternatives."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """Per prompt token once the prompt is computed (``SamplingParams.prompt_logprobs``); None for the first."""
    error: str | None = None
    """Why a request with ``finish_reason == "error"`` failed."""

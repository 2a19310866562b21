"""Cost of one engine step on a GPU (or, calibrated, a CPU): a step-shaped model calibrated on a
measured H100, or one roofline over FLOPs and bytes with fixed overheads.

What it models, in full: ``docs/SIMULATOR.md``, "The cost model".
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, NamedTuple

from hybridkv.errors import InvalidInputError
from hybridkv.planning import get_preset
from hybridkv.planning.hardware import Hardware, get_hardware
from hybridkv.planning.hf_config import ModelKVConfig, parse_config, text_config
from hybridkv.planning.planner import DTYPE_BYTES

ACTIVE_PARAMS: dict[str, float] = {
    # OpenAI gpt-oss model card / launch post: 21B total, 3.6B active; 117B total, 5.1B active.
    "gpt-oss-20b": 3.6e9,
    "gpt-oss-120b": 5.1e9,
    # Llama-4-Scout-17B-16E model card: 17B active, 109B total.
    "llama-4-scout": 17e9,
    # Qwen3-Next-80B-A3B model card: 80B in total, 3B activated.
    "qwen3-next-80b-a3b": 3e9,
    # Jamba-1.5 paper (arXiv:2408.12570): Jamba-1.5-Mini has 12B active of 52B parameters.
    "jamba-mini": 12e9,
    # DeepSeek-V3 technical report (arXiv:2412.19437): 671B total, 37B activated per token.
    "deepseek-v3": 37e9,
    # IBM Granite 4.0 announcement / granite-4.0-h-tiny card: 7B total, 1B active (6 of 64 experts).
    "granite-4.0-h-tiny": 1e9,
}
"""Parameters one token runs through, for the MoE presets; dense presets use ``num_params``."""

TEXT_PARAMS: dict[str, float] = {
    # Gemma 3 4B/12B/27B: the preset's num_params less the SigLIP tower (416,867,184) and the
    # projector (1152 * hidden_size): the text decoder, recomputed from the shapes (per layer q, k,
    # v, o, gated MLP and six norms, the final norm, the tied 262,208-token embedding).
    "gemma-3-4b": 3_880_263_168,
    "gemma-3-12b": 11_766_034_176,
    "gemma-3-27b": 27_009_346_304,
}
"""The text decoder's parameters of multimodal presets: what a text token's step runs and reads
(their ``num_params`` include a vision tower)."""

LMHead = Literal["per_token", "per_sample"]
WindowKernel = Literal["exact", "masked"]

STATE_DTYPE_BYTES = 2
"""Recurrent states stay in the model dtype (bf16), as in ``layer_specs``."""


@dataclass(frozen=True, slots=True)
class SeqWork:
    """One sequence's work in one step; all counts are >= 0."""

    num_new_tokens: int
    """Tokens computed this step (a prefill chunk, or 1 for decode)."""
    context_len: int
    """Tokens already in the KV cache before this step (computed tokens)."""
    num_loaded_tokens: int = 0
    """Tokens an external KV tier loads for this sequence this step; they precede the new tokens."""
    sampled: bool = True
    """Whether the step samples a token for this sequence (a decode or a last prefill chunk)."""
    num_draft_tokens: int = 0
    """Of ``num_new_tokens``, the draft tokens a speculative decode step verifies after its token: the
    LM head scores each of them, recurrent layers keep the state after each position until they are
    verified (``d + 4`` states moved instead of 2: ``docs/SIMULATOR.md``, "Verify pass through
    recurrent layers"), and a step whose sequences compute one token plus drafts is still a decode
    step (a CUDA graph replays it)."""

    def __post_init__(self) -> None:
        if (self.num_new_tokens < 0 or self.context_len < 0 or self.num_loaded_tokens < 0
                or not 0 <= self.num_draft_tokens < max(1, self.num_new_tokens)):
            raise InvalidInputError(
                f"SeqWork counts must be >= 0 (drafts fewer than the new tokens), got num_new_tokens="
                f"{self.num_new_tokens}, context_len={self.context_len}, num_loaded_tokens={self.num_loaded_tokens}, "
                f"num_draft_tokens={self.num_draft_tokens}"
            )


@dataclass(frozen=True)
class Efficiency:
    """How close a real engine gets to the hardware peaks, and its fixed costs."""

    compute: float = 0.6
    """Fraction of peak FLOP/s reached, in (0, 1]."""
    memory: float = 0.8
    """Fraction of peak memory bandwidth reached, in (0, 1]."""
    step_overhead_s: float = 0.004
    """Fixed cost of every step (scheduling, kernel launches, sampling), >= 0."""
    tp_overhead_s_per_layer: float = 0.00002
    """All-reduce cost per layer per step when tensor_parallel_size > 1, >= 0."""
    sample_overhead_s: float = 0.0
    """Fixed cost per sequence that samples in a step (its logits row, the sampler), >= 0."""
    attention_compute: float | None = None
    """Fraction of peak FLOP/s the attention kernels reach, in (0, 1]; ``None``: the one-roofline
    model (attention shares the matmuls' roof and efficiency; the fields below are then unused)."""
    gemm_m_half: float = 0.0
    """Tokens in a step at which the matmuls reach half of ``compute`` (``eff(M) = compute * M / (M
    + gemm_m_half)``), >= 0; step-shaped model only."""
    launch_s_per_layer: float = 0.0
    """GPU time per layer between and around kernels in an eager step (launch gaps), >= 0."""
    graph_launch_s_per_layer: float = 0.0
    """The same under a CUDA graph (a decode-only step when ``cuda_graphs``), >= 0."""
    host_s_per_layer: float = 0.0
    """Host (Python, dispatch) time per layer of an eager step: an eager step takes at least
    ``num_layers`` times this (the GPU waits for its launches), >= 0."""
    cuda_graphs: bool = False
    """Whether decode-only steps replay a CUDA graph (as vLLM does by default)."""
    activation_traffic: float = 0.0
    """Multiple of ``CostModel.activation_bytes_per_token`` (the activations an unfused PyTorch
    decoder moves through HBM per token: norms, residual adds, the gated MLP's elementwise ops,
    matmul inputs and outputs) that the engine moves, at the memory bandwidth, >= 0; 1 for the
    engine of the built-in H100 profile (counted from its operators, not fitted), less for fused
    kernels; step-shaped model only."""
    roofline_norm: float = 2.0
    """How a matmul's compute and memory times combine in the step-shaped model: their
    ``roofline_norm``-norm, ``(c**p + m**p) ** (1/p)`` (``math.inf``: the larger, a sharp roofline;
    2: near the ridge part of each shows), >= 1."""

    @property
    def step_shaped(self) -> bool:
        """Whether this is the step-shaped model (``attention_compute`` set) rather than one roofline."""
        return self.attention_compute is not None

    def __post_init__(self) -> None:
        for name in ("compute", "memory"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise InvalidInputError(f"Efficiency.{name} must be in (0, 1], got {value}")
        if self.attention_compute is not None and not 0 < self.attention_compute <= 1:
            raise InvalidInputError(f"Efficiency.attention_compute must be in (0, 1] or None, "
                                    f"got {self.attention_compute}")
        if not self.roofline_norm >= 1:
            raise InvalidInputError(f"Efficiency.roofline_norm must be >= 1, got {self.roofline_norm}")
        for name in ("step_overhead_s", "tp_overhead_s_per_layer", "sample_overhead_s", "gemm_m_half",
                     "launch_s_per_layer", "graph_launch_s_per_layer", "host_s_per_layer", "activation_traffic"):
            value = getattr(self, name)
            if not value >= 0:
                raise InvalidInputError(f"Efficiency.{name} must be >= 0, got {value}")


DEFAULT_EFFICIENCY = Efficiency()

DATA_SHEET = "data-sheet"
"""``calibrate``'s name for the data-sheet defaults (``--calibration data-sheet``)."""


@dataclass(frozen=True)
class LayerCosts:
    """One rank's per-token costs of all layers, summed over the layers of each reach.

    ``global`` layers (full attention, MLA) attend to the whole context, ``sliding`` layers to the
    last ``sliding_window`` tokens, ``chunked`` layers to the tokens since the start of their
    ``attention_chunk_size`` chunk; recurrent layers keep one state per sequence.
    """

    global_flops_per_pair: float = 0.0
    """Attention FLOPs of one (query, key) pair, summed over the global layers."""
    global_kv_bytes_per_token: float = 0.0
    sliding_flops_per_pair: float = 0.0
    sliding_kv_bytes_per_token: float = 0.0
    sliding_window: int = 0
    chunked_flops_per_pair: float = 0.0
    chunked_kv_bytes_per_token: float = 0.0
    attention_chunk_size: int = 0
    recurrent_flops_per_token: float = 0.0
    recurrent_state_bytes: float = 0.0
    """One sequence's states of all recurrent layers."""

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes of one token in all attention layers (what a new token writes, what a tier loads)."""
        return self.global_kv_bytes_per_token + self.sliding_kv_bytes_per_token + self.chunked_kv_bytes_per_token

    @classmethod
    def from_config(cls, config: Mapping[str, Any], model: ModelKVConfig, *, tensor_parallel_size: int,
                    kv_dtype_bytes: float) -> LayerCosts:
        """Sum the per-layer costs of ``model`` (parsed from ``config`` at ``tensor_parallel_size``)."""
        cfg = text_config(config)
        tp = tensor_parallel_size
        heads = cfg.get("num_attention_heads")
        if not isinstance(heads, int) or heads <= 0:
            raise InvalidInputError(f"config field 'num_attention_heads' must be a positive integer, got {heads!r}")
        if heads >= tp and heads % tp:
            raise InvalidInputError(f"num_attention_heads={heads} is not divisible by tensor parallel size {tp}")
        heads_per_rank = heads // tp if heads >= tp else 1
        gqa_flops = 4.0 * heads_per_rank * model.head_size
        gqa_bytes = 2.0 * model.num_kv_heads * model.head_size * kv_dtype_bytes
        qk_dim = int(cfg.get("qk_nope_head_dim") or 0) + int(cfg.get("qk_rope_head_dim") or 0) or model.head_size
        v_dim = int(cfg.get("v_head_dim") or 0) or model.head_size
        mla_flops = 2.0 * heads_per_rank * (qk_dim + v_dim)
        mla_bytes = float(model.mla_latent * kv_dtype_bytes)
        # A parallel hybrid layer (Falcon-H1) counts once as attention and once as recurrent.
        counts = {kind: model.count(kind) for kind in ("full", "mla", "sliding", "chunked", "mamba")}
        return cls(
            global_flops_per_pair=counts["full"] * gqa_flops + counts["mla"] * mla_flops,
            global_kv_bytes_per_token=counts["full"] * gqa_bytes + counts["mla"] * mla_bytes,
            sliding_flops_per_pair=counts["sliding"] * gqa_flops,
            sliding_kv_bytes_per_token=counts["sliding"] * gqa_bytes,
            sliding_window=(model.sliding_window or 0) if counts["sliding"] else 0,
            chunked_flops_per_pair=counts["chunked"] * gqa_flops,
            chunked_kv_bytes_per_token=counts["chunked"] * gqa_bytes,
            attention_chunk_size=(model.attention_chunk_size or 0) if counts["chunked"] else 0,
            recurrent_flops_per_token=counts["mamba"] * 2.0 * model.mamba_state_elements,
            recurrent_state_bytes=float(counts["mamba"] * model.mamba_state_elements * STATE_DTYPE_BYTES),
        )


def _activation_bytes_per_token(cfg: Mapping[str, Any], model: ModelKVConfig, active_params: float, vocab: Any,
                                tp: int) -> float:
    """``CostModel.activation_bytes_per_token`` of a parsed config (0 when its shapes are unknown)."""
    hidden, heads = cfg.get("hidden_size"), cfg.get("num_attention_heads")
    layers = model.num_layers
    if not isinstance(hidden, int) or not isinstance(heads, int) or hidden <= 0 or heads <= 0 or not layers:
        return 0.0
    head_dim = cfg.get("head_dim") or hidden // heads
    q_width = heads * int(head_dim)
    kv_width = model.num_kv_heads * model.head_size * tp  # num_kv_heads is per rank
    inter = cfg.get("intermediate_size")
    if not isinstance(inter, int) or inter <= 0:
        tied = bool(cfg.get("tie_word_embeddings", True))
        vocab_params = (vocab * hidden * (1 if tied else 2)) if isinstance(vocab, int) and vocab > 0 else 0
        per_layer = (active_params - vocab_params) / layers - 2 * hidden * (q_width + kv_width)
        inter = max(0.0, per_layer / (3 * hidden))
    per_layer_elements = 36 * hidden + (6 * q_width + 2 * kv_width + 8 * inter) / tp
    return 2.0 * layers * per_layer_elements


def _dtype_bytes(name: str, what: str) -> float:
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise InvalidInputError(f"unknown {what} {name!r}; choose one of {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class CostModel:
    """Step times of one model on one GPU type; build with ``from_preset`` or ``from_config``."""

    name: str
    hardware: Hardware
    tensor_parallel_size: int
    num_layers: int
    total_params: float
    active_params: float
    weight_bytes_per_param: float
    layers: LayerCosts
    efficiency: Efficiency = DEFAULT_EFFICIENCY
    tier_bandwidth: float | None = None
    """Bytes/s per GPU of the external KV tier; ``None`` without one."""
    lm_head_params: float = 0.0
    """Output-projection parameters run once per sampled sequence (0: counted per token, the generic roofline)."""
    embedding_params: float = 0.0
    """Input-embedding parameters apart from the head (a lookup: no FLOPs, not read in full)."""
    window_kernel: WindowKernel = "exact"
    """How a sliding-window layer's prefill chunk is computed: ``exact`` (each query sees its last
    ``window`` keys, as a windowed kernel does) or ``masked`` (the window's cached keys plus the
    whole chunk under a causal mask, as PyTorch SDPA with a causal mask does: what the measuring
    scripts run)."""
    efficiency_source: str = "data sheet"
    """Where ``efficiency`` comes from, for reports: ``data sheet`` (the defaults on the GPU's
    data-sheet peaks), ``calibrated profile ...`` or ``fitted to ...``."""
    activation_bytes_per_token: float = 0.0
    """HBM bytes of activations one token moves through all layers of an unfused decoder (one rank):
    per layer ``2 * (36 * hidden + 6 * q_width + 2 * kv_width + 8 * intermediate)`` in bf16, counted
    from the measured decoder's operators (two RMS norms in fp32 at 26 bytes per element each, two
    residual adds, the attention output's copy, the gated MLP's GELU and product, every matmul's
    input and output); charged times ``Efficiency.activation_traffic``. ``from_config`` derives
    ``intermediate`` from the config's ``intermediate_size`` or, failing that, from the parameters
    the layers have left after attention (``3 * hidden * intermediate`` per layer)."""

    # Per-call constants, derived in __post_init__.
    _flops_per_token: float = field(init=False, repr=False, compare=False)
    _seconds_per_flop: float = field(init=False, repr=False, compare=False)
    _seconds_per_attention_flop: float = field(init=False, repr=False, compare=False)
    _seconds_per_byte: float = field(init=False, repr=False, compare=False)
    _seconds_per_tier_byte: float = field(init=False, repr=False, compare=False)
    _forward_overhead_s: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or tp <= 0:
            raise InvalidInputError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if not 0 < self.active_params <= self.total_params:
            raise InvalidInputError(
                f"active_params={self.active_params:g} must be > 0 and at most the total {self.total_params:g}"
            )
        if self.tier_bandwidth is not None and not self.tier_bandwidth > 0:
            raise InvalidInputError(f"tier_bandwidth must be > 0 bytes/s, got {self.tier_bandwidth}")
        vocab = self.lm_head_params + self.embedding_params
        if self.lm_head_params < 0 or self.embedding_params < 0 or not vocab < self.active_params:
            raise InvalidInputError(
                f"lm_head_params={self.lm_head_params:g} and embedding_params={self.embedding_params:g} must be "
                f">= 0 and together less than active_params={self.active_params:g}"
            )
        eff, hw = self.efficiency, self.hardware
        setattr_ = object.__setattr__
        setattr_(self, "_flops_per_token", 2.0 * (self.active_params - vocab) / tp
                 + self.layers.recurrent_flops_per_token)
        if self.window_kernel not in ("exact", "masked"):
            raise InvalidInputError(f"window_kernel must be 'exact' or 'masked', got {self.window_kernel!r}")
        setattr_(self, "_seconds_per_flop", 1.0 / (hw.bf16_flops * eff.compute))
        setattr_(self, "_seconds_per_attention_flop", 1.0 / (hw.bf16_flops * (eff.attention_compute or eff.compute)))
        setattr_(self, "_seconds_per_byte", 1.0 / (hw.bandwidth * eff.memory))
        setattr_(self, "_seconds_per_tier_byte", 1.0 / self.tier_bandwidth if self.tier_bandwidth else 0.0)
        setattr_(self, "_forward_overhead_s", self.num_layers * eff.tp_overhead_s_per_layer if tp > 1 else 0.0)

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any],
        num_params: float,
        hardware: Hardware,
        *,
        tensor_parallel_size: int = 1,
        weights_dtype: str = "bf16",
        kv_dtype: str = "bf16",
        active_params: float | None = None,
        efficiency: Efficiency | None = None,
        tier_bandwidth: float | None = None,
        name: str = "custom",
        lm_head: LMHead | None = None,
        vocab_size: int | None = None,
        tie_word_embeddings: bool | None = None,
    ) -> CostModel:
        """The cost model of a Hugging Face ``config`` with ``num_params`` parameters (all experts).

        ``active_params`` (per token) defaults to ``num_params``, i.e. a dense model. ``efficiency``
        defaults to ``default_efficiency(hardware.id)``: the fit of the GPU's built-in profile
        (``h100-80gb``), else the data-sheet ``DEFAULT_EFFICIENCY``. ``lm_head`` picks how the output
        projection is charged (``docs/SIMULATOR.md``, "The cost model"); ``"per_sample"`` needs the vocabulary size
        (``vocab_size`` or the config's) and takes ``tie_word_embeddings`` from the argument, else the
        config, else True (the Hugging Face default). ``None``: ``per_sample`` for a step-shaped
        efficiency when the vocabulary is known, else ``per_token``.
        """
        if not num_params > 0:
            raise InvalidInputError(f"num_params must be > 0, got {num_params}")
        weight_bytes = _dtype_bytes(weights_dtype, "weights dtype")
        kv_bytes = _dtype_bytes(kv_dtype, "KV dtype")
        if kv_bytes < 1:
            raise InvalidInputError(f"the KV cache dtype must be fp32, bf16, fp16 or fp8, got {kv_dtype!r}")
        model = parse_config(config, tensor_parallel_size=tensor_parallel_size)
        layers = LayerCosts.from_config(config, model, tensor_parallel_size=tensor_parallel_size,
                                        kv_dtype_bytes=kv_bytes)
        source = "given"
        if efficiency is None:
            efficiency, source = default_efficiency(hardware.id)
        cfg = text_config(config)
        vocab = vocab_size if vocab_size is not None else cfg.get("vocab_size")
        if lm_head is None:
            known = isinstance(vocab, int) and not isinstance(vocab, bool) and vocab > 0
            lm_head = "per_sample" if efficiency.step_shaped and known else "per_token"
        head, embedding = _lm_head_params(lm_head, config, vocab, tie_word_embeddings, name)
        active = float(num_params if active_params is None else active_params)
        activation = _activation_bytes_per_token(cfg, model, active, vocab, tensor_parallel_size)
        return cls(name, hardware, tensor_parallel_size, model.num_layers, float(num_params), active, weight_bytes,
                   layers, efficiency, tier_bandwidth, head, embedding, efficiency_source=source,
                   activation_bytes_per_token=activation)

    @classmethod
    def from_preset(
        cls,
        model_id: str,
        gpu_id: str,
        *,
        tensor_parallel_size: int = 1,
        weights_dtype: str = "bf16",
        kv_dtype: str = "bf16",
        active_params: float | None = None,
        efficiency: Efficiency | None = None,
        tier_bandwidth: float | None = None,
        lm_head: LMHead | None = None,
    ) -> CostModel:
        """The cost model of a model preset on a hardware preset (as ``from_config``); MoE presets take
        ``ACTIVE_PARAMS``, multimodal ones count their text decoder (``TEXT_PARAMS``)."""
        preset = get_preset(model_id)
        hardware = get_hardware(gpu_id)
        num_params = TEXT_PARAMS.get(preset.id, preset.num_params)
        if active_params is None:
            active_params = ACTIVE_PARAMS.get(preset.id, num_params)
        return cls.from_config(preset.config, num_params, hardware, tensor_parallel_size=tensor_parallel_size,
                               weights_dtype=weights_dtype, kv_dtype=kv_dtype, active_params=active_params,
                               efficiency=efficiency, tier_bandwidth=tier_bandwidth, name=preset.id,
                               lm_head=lm_head)

    def with_efficiency(self, efficiency: Efficiency) -> CostModel:
        """A copy with other efficiencies."""
        return replace(self, efficiency=efficiency, efficiency_source="given")

    # ------------------------------------------------------------------ step cost

    def step_time(self, work: Sequence[SeqWork], extra_load_s: float = 0.0, *, graph: bool | None = None) -> float:
        """Seconds one engine step takes to run ``work`` (one entry per scheduled sequence), plus
        ``extra_load_s`` of external-tier loads timed by the caller (not overlapped). ``graph``:
        whether the step replays a CUDA graph (step-shaped model only); ``None``: a decode-only
        step does when ``efficiency.cuda_graphs``."""
        return self._time(self._totals(work), extra_load_s, graph)

    def breakdown(self, work: Sequence[SeqWork], extra_load_s: float = 0.0, *,
                  graph: bool | None = None) -> dict[str, float]:
        """``step_time``'s parts: ``compute_s``, ``memory_s`` (the matmuls' two roofs, with the LM
        head and, in the one-roofline model, attention; the larger counts there, their
        ``roofline_norm``-norm in the step-shaped model), and in the step-shaped model
        ``attention_s`` (attention FLOPs, KV and states), ``activation_s`` and ``launch_s`` (launch
        costs, or the host floor's excess); ``overhead_s`` (step and TP), ``sample_s`` (per sampled
        sequence), ``load_s`` (with ``extra_load_s``), ``total_s``, and the step's ``flops``,
        ``bytes`` (HBM, without activations), ``load_bytes`` (tier, at ``tier_bandwidth``) and
        ``sampled`` (sequences that sample)."""
        st = self._totals(work)
        parts = self._parts(st, extra_load_s, graph)
        flops = st.body_flops + st.head_flops + st.attn_flops
        nbytes = st.weight_bytes + st.head_bytes + st.kv_bytes
        return {**parts, "flops": flops, "bytes": nbytes, "load_bytes": st.load_bytes, "sampled": float(st.sampled)}

    def _time(self, st: StepTotals, extra_load_s: float, graph: bool | None) -> float:
        eff = self.efficiency
        t = eff.step_overhead_s + st.load_bytes * self._seconds_per_tier_byte + extra_load_s
        if not st.tokens:
            return t
        spb = self._seconds_per_byte
        t += self._forward_overhead_s + st.sampled * eff.sample_overhead_s
        if eff.attention_compute is None:  # one roofline
            compute = (st.body_flops + st.head_flops + st.attn_flops) * self._seconds_per_flop
            memory = (st.weight_bytes + st.head_bytes + st.kv_bytes) * spb
            return t + (compute if compute > memory else memory)
        return t + self._gpu_time(st, graph)

    def _gpu_time(self, st: StepTotals, graph: bool | None) -> float:
        """The step-shaped model's forward pass (tokens > 0)."""
        eff = self.efficiency
        spf, spb = self._seconds_per_flop, self._seconds_per_byte
        half = eff.gemm_m_half
        norm = eff.roofline_norm
        gpu = _roof(st.body_flops * (st.tokens + half) / st.tokens * spf, st.weight_bytes * spb, norm)
        if st.head_rows and st.head_flops:
            gpu += _roof(st.head_flops * (st.head_rows + half) / st.head_rows * spf, st.head_bytes * spb, norm)
        gpu += (st.attn_flops * self._seconds_per_attention_flop
                + (st.kv_bytes + st.tokens * self.activation_bytes_per_token * eff.activation_traffic) * spb)
        if graph is None:
            graph = eff.cuda_graphs and st.decode_only
        if graph:
            return gpu + self.num_layers * eff.graph_launch_s_per_layer
        gpu += self.num_layers * eff.launch_s_per_layer
        host = self.num_layers * eff.host_s_per_layer
        return gpu if gpu > host else host

    def _parts(self, st: StepTotals, extra_load_s: float, graph: bool | None) -> dict[str, float]:
        eff = self.efficiency
        load_s = st.load_bytes * self._seconds_per_tier_byte + extra_load_s
        overhead_s = eff.step_overhead_s + (self._forward_overhead_s if st.tokens else 0.0)
        sample_s = st.sampled * eff.sample_overhead_s
        spf, spb = self._seconds_per_flop, self._seconds_per_byte
        compute_s = memory_s = attention_s = activation_s = launch_s = 0.0
        if st.tokens and eff.attention_compute is None:
            compute_s = (st.body_flops + st.head_flops + st.attn_flops) * spf
            memory_s = (st.weight_bytes + st.head_bytes + st.kv_bytes) * spb
        elif st.tokens:
            half = eff.gemm_m_half
            compute_s = st.body_flops * (st.tokens + half) / st.tokens * spf
            memory_s = st.weight_bytes * spb
            if st.head_rows and st.head_flops:
                compute_s += st.head_flops * (st.head_rows + half) / st.head_rows * spf
                memory_s += st.head_bytes * spb
            attention_s = st.attn_flops * self._seconds_per_attention_flop + st.kv_bytes * spb
            activation_s = st.tokens * self.activation_bytes_per_token * eff.activation_traffic * spb
            launch_s = self._gpu_time(st, graph) - self._gpu_time_without_launch(st)
        total = self._time(st, extra_load_s, graph)
        return {"compute_s": compute_s, "memory_s": memory_s, "attention_s": attention_s,
                "activation_s": activation_s, "launch_s": launch_s, "overhead_s": overhead_s, "sample_s": sample_s,
                "load_s": load_s, "total_s": total}

    def _gpu_time_without_launch(self, st: StepTotals) -> float:
        saved = self.efficiency
        bare = replace(saved, launch_s_per_layer=0.0, graph_launch_s_per_layer=0.0, host_s_per_layer=0.0)
        return CostModel._gpu_time(replace(self, efficiency=bare), st, True)

    def _totals(self, work: Sequence[SeqWork]) -> StepTotals:
        """One step's FLOPs and bytes by kind, on one rank."""
        lc = self.layers
        window = lc.sliding_window
        masked = self.window_kernel == "masked"
        chunk = lc.attention_chunk_size
        tokens = loaded = loaded_seqs = sampled = head_rows = states = 0
        decode_only = True
        global_pairs2 = global_read = 0  # global_pairs2 is twice the (query, key) pairs
        sliding_pairs = sliding_read = chunked_pairs = chunked_read = 0
        for w in work:
            n = w.num_new_tokens
            c = w.context_len
            ext = w.num_loaded_tokens
            if ext:
                loaded += ext
                loaded_seqs += 1
                c += ext
            if not n:
                continue
            tokens += n
            sampled += w.sampled
            d = w.num_draft_tokens
            head_rows += w.sampled + d
            states += d + 4 if d else 2  # read, written; with drafts: d + 1 kept, the accepted one copied
            if n - d > 1:
                decode_only = False
            end = c + n
            global_pairs2 += n * (c + end + 1)
            global_read += c
            if window:
                # sum of min(p + 1, window) over p in [c, end)
                if end <= window:
                    sliding_pairs += n * (c + end + 1) // 2
                    sliding_read += c
                elif masked:
                    # the window's cached keys, then the chunk under a causal mask
                    r = c if c < window else window - 1
                    sliding_pairs += n * r + n * (n + 1) // 2
                    sliding_read += r
                elif c >= window:
                    sliding_pairs += n * window
                    sliding_read += window - 1
                else:
                    sliding_pairs += (window * (window + 1) - c * (c + 1)) // 2 + (end - window) * window
                    sliding_read += c
            if chunk:
                pairs, r = _chunked_pairs(c, n, chunk)
                chunked_pairs += pairs
                chunked_read += r
        load_bytes = loaded * lc.kv_bytes_per_token + loaded_seqs * lc.recurrent_state_bytes
        if not tokens:
            return StepTotals(load_bytes=load_bytes)
        attn_flops = (global_pairs2 * 0.5 * lc.global_flops_per_pair + sliding_pairs * lc.sliding_flops_per_pair
                      + chunked_pairs * lc.chunked_flops_per_pair)
        kv_bytes = (2 * tokens * lc.kv_bytes_per_token + states * lc.recurrent_state_bytes
                    + global_read * lc.global_kv_bytes_per_token + sliding_read * lc.sliding_kv_bytes_per_token
                    + chunked_read * lc.chunked_kv_bytes_per_token)
        return self._step_totals(tokens, sampled, head_rows, attn_flops, kv_bytes, load_bytes, decode_only)

    def _step_totals(self, tokens: int, sampled: int, head_rows: int, attn_flops: float, kv_bytes: float,
                     load_bytes: float, decode_only: bool) -> StepTotals:
        """The step's totals from its token counts, attention FLOPs and KV bytes: the weights' and the
        LM head's share."""
        head = self.lm_head_params
        vocab = head + self.embedding_params
        tp = self.tensor_parallel_size
        bpp = self.weight_bytes_per_param / tp
        weights = min(self.total_params - vocab, (self.active_params - vocab) * tokens) * bpp
        head_flops = head_rows * 2.0 * head / tp
        head_bytes = head * bpp if head and head_rows else 0.0
        return StepTotals(tokens, sampled, tokens * self._flops_per_token, weights, head_flops, head_bytes,
                          attn_flops, kv_bytes, load_bytes, decode_only, head_rows)


def _roof(compute: float, memory: float, norm: float) -> float:
    """A kernel's time from its compute and memory times: their ``norm``-norm (inf: the larger)."""
    hi, lo = (compute, memory) if compute > memory else (memory, compute)
    if norm == math.inf or not lo:
        return hi
    return float(hi * (1.0 + (lo / hi) ** norm) ** (1.0 / norm))


def _chunked_pairs(c: int, n: int, chunk: int) -> tuple[int, int]:
    """Chunked attention of ``n`` tokens after ``c``: the (query, key) pairs, the sum of
    ``p % chunk + 1`` over ``p`` in ``[c, c + n)``, and the cached keys read, ``c % chunk``."""
    r = c % chunk
    if r + n <= chunk:
        return n * (2 * r + n + 1) // 2, r
    q1, r1 = divmod(c + n, chunk)
    return ((q1 - c // chunk) * chunk * (chunk + 1) + r1 * (r1 + 1) - r * (r + 1)) // 2, r


def _lm_head_params(lm_head: str, config: Mapping[str, Any], vocab: object, tie_word_embeddings: bool | None,
                    name: str) -> tuple[float, float]:
    """``(LM head, separate input embedding)`` parameters charged apart from the layers: none
    ``per_token``; the output projection (and the embedding when untied) ``per_sample``."""
    if lm_head == "per_token":
        return 0.0, 0.0
    if lm_head != "per_sample":
        raise InvalidInputError(f"lm_head must be 'per_token' or 'per_sample', got {lm_head!r}")
    cfg = text_config(config)
    hidden = cfg.get("hidden_size")
    for field_name, value in (("vocab_size", vocab), ("hidden_size", hidden)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidInputError(f"{name}: lm_head='per_sample' needs a positive integer {field_name}, "
                                    f"got {value!r}")
    assert isinstance(vocab, int) and isinstance(hidden, int)
    tied = tie_word_embeddings
    if tied is None:
        tied = bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings", True)))
    head = float(vocab * hidden)
    return head, 0.0 if tied else head


class StepTotals(NamedTuple):
    """One step's work on one rank, by kind (``CostModel._totals``)."""

    tokens: int = 0
    """New tokens (M of the step's matmuls)."""
    sampled: int = 0
    """Sequences that sample (rows of the LM head)."""
    body_flops: float = 0.0
    """Matmul FLOPs of the layers (and recurrent updates), without the LM head and attention."""
    weight_bytes: float = 0.0
    """Layer weights read (without the LM head)."""
    head_flops: float = 0.0
    head_bytes: float = 0.0
    attn_flops: float = 0.0
    """Attention FLOPs of every layer kind."""
    kv_bytes: float = 0.0
    """KV read and written, recurrent states read and written (per sequence 2 states; ``d + 4`` for a
    verify pass over ``d`` drafts)."""
    load_bytes: float = 0.0
    """External-tier bytes."""
    decode_only: bool = False
    """Every sequence computes at most one token (and the drafts it verifies)."""
    head_rows: int = 0
    """Rows of the LM head: one per sampling sequence and one per draft it verifies."""


# ---------------------------------------------------------------------- calibration

_MIN_EFFICIENCY = 0.01


def _fit_rows(model: CostModel, samples: Sequence[tuple[Sequence[SeqWork], float]]
              ) -> list[tuple[float, float, float, float, float]]:
    """Per sample: FLOPs / peak, bytes / peak, the fixed time (TP and loads), sampled sequences, the
    measurement."""
    if not samples:
        raise InvalidInputError("fit_efficiency needs at least one sample, got none")
    hw = model.hardware
    rows: list[tuple[float, float, float, float, float]] = []
    for i, (work, seconds) in enumerate(samples):
        if not seconds > 0:
            raise InvalidInputError(f"calibration sample {i}: 'seconds' must be > 0, got {seconds!r}")
        b = model.breakdown(work)
        fixed = b["load_s"] + b["overhead_s"] - model.efficiency.step_overhead_s
        rows.append((b["flops"] / hw.bf16_flops, b["bytes"] / hw.bandwidth, fixed, b["sampled"], float(seconds)))
    return rows


def fit_efficiency(model: CostModel, samples: Sequence[tuple[Sequence[SeqWork], float]]) -> Efficiency:
    """The ``compute``, ``memory``, ``step_overhead_s`` and ``sample_overhead_s`` that best predict
    measured step times.

    Minimises the sum of squared relative errors by a coarse-to-fine grid over compute and memory
    efficiency in [0.01, 1] (log-spaced), with the best overheads (>= 0; per step, and per sampled
    sequence) solved exactly at each point; a faint penalty keeps ``sample_overhead_s`` at 0 where
    it would fit no better. ``tp_overhead_s_per_layer`` is kept from ``model``. An efficiency
    the samples cannot tell (e.g. compute when every sample is memory-bound) stays near ``model``'s.
    """
    rows = _fit_rows(model, samples)
    weights = [1.0 / (y * y) for *_, y in rows]
    sum_w = sum(weights)
    sum_ws = sum(w * r[3] for w, r in zip(weights, rows))
    sum_wss = sum(w * r[3] * r[3] for w, r in zip(weights, rows))
    prior_c, prior_m = model.efficiency.compute, model.efficiency.memory

    def cost(c: float, m: float) -> tuple[float, float, float]:
        # Residuals d = measured - roofline; overheads o (per step) and q (per sampled sequence) fit d.
        d = [y - max(f / c, b / m) - fixed for f, b, fixed, _, y in rows]
        wd = sum(w * x for w, x in zip(weights, d))
        wsd = sum(w * r[3] * x for w, r, x in zip(weights, rows, d))
        wdd = sum(w * x * x for w, x in zip(weights, d))

        def err(o: float, q: float) -> float:
            # The small last term prefers no per-sample cost where one would only stand in for
            # per-sequence bytes (e.g. decode-only samples, where both grow with the batch).
            sq = wdd - 2 * o * wd - 2 * q * wsd + o * o * sum_w + 2 * o * q * sum_ws + q * q * sum_wss
            return sq + 1e-6 * q * q * sum_wss / len(rows)

        candidates = [(max(0.0, wd / sum_w), 0.0), (0.0, max(0.0, wsd / sum_wss) if sum_wss else 0.0)]
        det = sum_w * sum_wss - sum_ws * sum_ws
        if det > 1e-12 * sum_w * sum_wss:
            o, q = (wd * sum_wss - wsd * sum_ws) / det, (wsd * sum_w - wd * sum_ws) / det
            if o >= 0 and q >= 0:
                candidates.append((o, q))
        best_err, best_o, best_q = min((err(o, q), o, q) for o, q in candidates)
        # A tiny pull towards the prior decides between efficiencies the samples cannot tell apart.
        return best_err + 1e-9 * (math.log(c / prior_c) ** 2 + math.log(m / prior_m) ** 2), best_o, best_q

    lo = math.log(_MIN_EFFICIENCY)
    grid = [math.exp(lo * (1 - k / 40)) for k in range(41)]  # 0.01 .. 1, ratio ~1.12
    best = min((cost(c, m)[0], c, m) for c in grid for m in grid)
    _, c_best, m_best = best
    ratio = grid[1] / grid[0]
    for _ in range(8):
        cs = _around(c_best, ratio)
        ms = _around(m_best, ratio)
        best = min((cost(c, m)[0], c, m) for c in cs for m in ms)
        _, c_best, m_best = best
        ratio = ratio ** 0.25
    _, overhead, per_sample = cost(c_best, m_best)
    return Efficiency(compute=c_best, memory=m_best, step_overhead_s=overhead,
                      tp_overhead_s_per_layer=model.efficiency.tp_overhead_s_per_layer,
                      sample_overhead_s=per_sample)


def _around(x: float, ratio: float, steps: int = 4) -> list[float]:
    """Log-spaced points from ``x / ratio`` to ``x * ratio``, clipped to [0.01, 1]."""
    points = {min(1.0, max(_MIN_EFFICIENCY, x * ratio ** (k / steps))) for k in range(-steps, steps + 1)}
    return sorted(points)


def load_calibration(path: str | Path) -> list[tuple[list[SeqWork], float]]:
    """Measured ``(work, seconds)`` steps from a calibration JSON file (format: ``docs/SIMULATOR.md``)."""
    return [(list(step.work), step.seconds) for step in load_profile(path).steps]


def load_profile(path: str | Path) -> Profile:
    """A calibration profile: the measured steps of a calibration file with their modes and meta
    (format: ``docs/SIMULATOR.md``, "The cost model"); any defect is one ``InvalidInputError`` naming the file, the
    sample and the field."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise InvalidInputError(f"no calibration file at {p}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"calibration file {p} cannot be read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"calibration file {p} is not valid JSON: {exc}") from None
    try:
        return parse_profile(data, source=str(p))
    except InvalidInputError as exc:
        raise InvalidInputError(f"calibration file {p}: {exc}") from None


def parse_profile(data: Any, source: str = "") -> Profile:
    """``load_profile`` of an already decoded JSON document."""
    samples = data.get("samples") if isinstance(data, dict) else None
    if not isinstance(samples, list) or not samples:
        raise InvalidInputError("expected an object with a non-empty 'samples' list")
    meta = data.get("meta", {})
    if not isinstance(meta, dict):
        raise InvalidInputError(f"'meta' must be an object, got {meta!r}")
    kernel = meta.get("window_kernel", "masked")
    if kernel not in ("exact", "masked"):
        raise InvalidInputError(f"meta 'window_kernel' must be 'exact' or 'masked', got {kernel!r}")
    out: list[ProfileStep] = []
    for i, sample in enumerate(samples):
        if not isinstance(sample, dict):
            raise InvalidInputError(f"calibration sample {i}: expected an object with 'work' and 'seconds'")
        seconds = sample.get("seconds")
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds > 0:
            raise InvalidInputError(f"calibration sample {i}: 'seconds' must be a number > 0, got {seconds!r}")
        mode = sample.get("mode")
        if mode is not None and (not isinstance(mode, str) or not mode):
            raise InvalidInputError(f"calibration sample {i}: 'mode' must be a non-empty string such as "
                                    f"'decode-graph', got {mode!r}")
        work = sample.get("work")
        if not isinstance(work, list) or not work:
            raise InvalidInputError(f"calibration sample {i}: 'work' must be a non-empty list of "
                                    f"[num_new_tokens, context_len] pairs, got {work!r}")
        seqs = []
        for j, entry in enumerate(work):
            if (not isinstance(entry, list) or len(entry) not in (2, 3, 4)
                    or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in entry)
                    or (len(entry) == 4 and entry[3] > 1)):
                raise InvalidInputError(
                    f"calibration sample {i}: 'work'[{j}] must be [num_new_tokens, context_len], "
                    f"[num_new_tokens, context_len, num_loaded_tokens] or [num_new_tokens, context_len, "
                    f"num_loaded_tokens, sampled 0/1] of integers >= 0, got {entry!r}"
                )
            n, c, *rest = entry
            seqs.append(SeqWork(n, c, rest[0] if rest else 0, bool(rest[1]) if len(rest) > 1 else True))
        if not any(w.num_new_tokens for w in seqs):
            raise InvalidInputError(f"calibration sample {i}: no sequence in 'work' computes a token")
        out.append(ProfileStep(tuple(seqs), float(seconds), mode))
    return Profile(tuple(out), kernel, meta, source)


def calibrate(model: CostModel, calibration: Efficiency | str | Path) -> CostModel:
    """``model`` with the given efficiencies, with the data-sheet defaults (``"data-sheet"``: the one
    roofline on the GPU's data-sheet peaks, what every GPU used before built-in profiles), or with
    those fitted to a calibration file: the step-shaped fit (``fit_step_model``) when its steps carry
    a ``mode``, else ``fit_efficiency``."""
    if isinstance(calibration, Efficiency):
        return replace(model, efficiency=calibration, efficiency_source="given")
    if calibration == DATA_SHEET:
        return replace(model, efficiency=DEFAULT_EFFICIENCY, efficiency_source="data sheet")
    profile = load_profile(calibration)
    if any(step.mode is not None for step in profile.steps):
        eff = fit_step_model(replace(model, window_kernel=profile.window_kernel), profile.steps)
    else:
        eff = fit_efficiency(model, [(list(step.work), step.seconds) for step in profile.steps])
    return replace(model, efficiency=eff, efficiency_source=f"fitted to {calibration}")


# ---------------------------------------------------------------------- step-shaped fit

GRAPH_MODES = ("graph",)
"""A profile step whose ``mode`` ends in ``-graph`` ran under a CUDA graph; any other mode ran eagerly."""


@dataclass(frozen=True)
class ProfileStep:
    """One measured step of a calibration profile."""

    work: tuple[SeqWork, ...]
    seconds: float
    mode: str | None = None
    """e.g. ``prefill-eager``, ``decode-graph``, ``mixed-eager``; ``None``: not said (eager unless
    the model's ``cuda_graphs`` makes a decode-only step a graph)."""

    @property
    def graph(self) -> bool | None:
        """Whether the step ran under a CUDA graph (``None``: the model decides)."""
        if self.mode is None:
            return None
        return self.mode.rsplit("-", 1)[-1] in GRAPH_MODES

    @property
    def kind(self) -> str:
        """``prefill``, ``decode`` or ``mixed``: the mode's first word, else from the work."""
        if self.mode is not None:
            return self.mode.split("-", 1)[0]
        decoding = [w.num_new_tokens <= 1 for w in self.work if w.num_new_tokens]
        return "decode" if all(decoding) else "prefill" if not any(decoding) else "mixed"


@dataclass(frozen=True)
class Profile:
    """Measured steps of one model on one GPU (``load_profile``)."""

    steps: tuple[ProfileStep, ...]
    window_kernel: WindowKernel = "masked"
    """How the measured engine ran sliding-window prefill (``CostModel.window_kernel``)."""
    meta: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""


FIT_PARAMETERS = ("compute", "gemm_m_half", "memory", "attention_compute", "launch_s_per_layer",
                  "graph_launch_s_per_layer", "activation_traffic")
"""What ``fit_step_model`` fits; the other fields of ``Efficiency`` come from its ``prior``."""

DEFAULT_HOST_S_PER_LAYER = 130e-6
"""Host time per layer of an eager PyTorch step: a prior, not fitted (the H100 steps of a 62-layer
model never wait for the host). The measured decoder's layer is about 27 PyTorch operators; the
same layer on CPU tensors of tiny shapes takes 186 us of host time on the 2-core development
machine, and a GPU server's CPU is faster per operator but pays the CUDA launch on top."""

_STEP_PRIOR = Efficiency(compute=0.7, memory=0.8, step_overhead_s=0.0, attention_compute=0.4, gemm_m_half=64.0,
                         launch_s_per_layer=30e-6, graph_launch_s_per_layer=5e-6,
                         host_s_per_layer=DEFAULT_HOST_S_PER_LAYER, cuda_graphs=True, activation_traffic=1.0)


class _Row(NamedTuple):
    mm: float  # matmul seconds at full peak
    tokens: int
    weights: float  # weight seconds at full bandwidth
    head: float
    sampled: int  # rows of the LM head
    head_w: float
    attn: float
    kv: float
    act: float  # activation seconds at full bandwidth and traffic 1
    layers: int
    graph: bool
    fixed: float  # seconds that do not depend on fitted parameters (TP, loads, step and sample overheads)
    seconds: float


def _rows(model: CostModel, steps: Sequence[ProfileStep], prior: Efficiency) -> list[_Row]:
    hw = model.hardware
    rows = []
    for i, step in enumerate(steps):
        if not step.seconds > 0:
            raise InvalidInputError(f"calibration step {i}: 'seconds' must be > 0, got {step.seconds!r}")
        st = model._totals(step.work)
        if not st.tokens:
            raise InvalidInputError(f"calibration step {i}: no sequence computes a token")
        graph = step.graph
        if graph is None:
            graph = prior.cuda_graphs and st.decode_only
        fixed = (prior.step_overhead_s + st.sampled * prior.sample_overhead_s + model._forward_overhead_s
                 + st.load_bytes * model._seconds_per_tier_byte)
        rows.append(_Row(st.body_flops / hw.bf16_flops, st.tokens, st.weight_bytes / hw.bandwidth,
                         st.head_flops / hw.bf16_flops, st.head_rows, st.head_bytes / hw.bandwidth,
                         st.attn_flops / hw.bf16_flops, st.kv_bytes / hw.bandwidth,
                         st.tokens * model.activation_bytes_per_token / hw.bandwidth,
                         model.num_layers, graph, fixed,
                         step.seconds))
    return rows


def _predict(r: _Row, p: Sequence[float], host: float, norm: float) -> float:
    """``CostModel._time`` of the step-shaped model on precomputed totals; ``p`` as ``FIT_PARAMETERS``."""
    c, half, m, a, launch, graph_launch, act = p
    t = _roof(r.mm * (r.tokens + half) / (r.tokens * c), r.weights / m, norm)
    if r.sampled and r.head:
        t += _roof(r.head * (r.sampled + half) / (r.sampled * c), r.head_w / m, norm)
    t += r.attn / a + (r.kv + r.act * act) / m
    if r.graph:
        t += r.layers * graph_launch
    else:
        t = max(t + r.layers * launch, r.layers * host)
    return t + r.fixed


_LOWER = (0.01, 0.0, 0.01, 0.01, 0.0, 0.0, 0.0)
_UPPER = (1.0, 1e5, 1.0, 1.0, 0.1, 0.1, 10.0)


def _clip(p: Sequence[float]) -> list[float]:
    return [min(hi, max(lo, v)) for v, lo, hi in zip(p, _LOWER, _UPPER)]


def fit_step_model(model: CostModel, steps: Sequence[ProfileStep], prior: Efficiency | None = None) -> Efficiency:
    """The step-shaped ``Efficiency`` whose ``FIT_PARAMETERS`` best predict measured steps.

    Minimises the sum of squared log errors (relative errors) by Nelder-Mead over the logarithms of
    the parameters, restarted from its result until it stops improving. ``step_overhead_s``,
    ``sample_overhead_s``, ``host_s_per_layer``, ``tp_overhead_s_per_layer`` and ``cuda_graphs``
    come from ``prior`` (by default no step or sample overhead and ``DEFAULT_HOST_S_PER_LAYER``): on
    the steps of one model a per-step cost cannot be told from a per-layer one, and eager steps of a
    large model never wait for the host. A parameter the steps do not exercise (e.g. graph launch
    without graph steps) stays near the prior's.
    """
    if not steps:
        raise InvalidInputError("fit_step_model needs at least one measured step, got none")
    if prior is None:
        prior = _STEP_PRIOR
    elif not prior.step_shaped:
        prior = replace(_STEP_PRIOR, tp_overhead_s_per_layer=prior.tp_overhead_s_per_layer)
    rows = _rows(model, steps, prior)
    host, norm = prior.host_s_per_layer, prior.roofline_norm
    start = [getattr(prior, name) for name in FIT_PARAMETERS]
    floor = (0.0, 1.0, 0.0, 0.0, 1e-7, 1e-7, 0.01)  # log-space offsets: these may reach 0
    logs0 = [math.log(v + f) for v, f in zip(start, floor)]

    def params(x: Sequence[float]) -> list[float]:
        return _clip([math.exp(v) - f for v, f in zip(x, floor)])

    def cost(x: Sequence[float]) -> float:
        p = params(x)
        err = sum(math.log(_predict(r, p, host, norm) / r.seconds) ** 2 for r in rows)
        # A faint pull towards the prior decides what the steps cannot tell.
        return err + 1e-6 * sum((a - b) ** 2 for a, b in zip(x, logs0))

    x, best = logs0, cost(logs0)
    for _ in range(20):
        x, value = _nelder_mead(cost, x, step=0.3)
        if value > best - 1e-10:
            best = min(best, value)
            break
        best = value
    c, half, m, a, launch, graph_launch, act = params(x)
    return replace(prior, compute=c, gemm_m_half=half, memory=m, attention_compute=a, launch_s_per_layer=launch,
                   graph_launch_s_per_layer=graph_launch, activation_traffic=act)


def _nelder_mead(f: Any, x0: Sequence[float], step: float, iterations: int = 600) -> tuple[list[float], float]:
    """Minimise ``f`` from ``x0`` (a simplex of sides ``step``); returns (x, f(x))."""
    n = len(x0)
    simplex = [list(x0)] + [[v + (step if i == j else 0.0) for j, v in enumerate(x0)] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iterations):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < 1e-12 * (1 + abs(values[0])):
            break
        centroid = [sum(x[j] for x in simplex[:-1]) / n for j in range(n)]
        worst = simplex[-1]
        reflected = [c + (c - w) for c, w in zip(centroid, worst)]
        fr = f(reflected)
        if fr < values[0]:
            expanded = [c + 2 * (c - w) for c, w in zip(centroid, worst)]
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = [c + 0.5 * (w - c) for c, w in zip(centroid, worst)]
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                best = simplex[0]
                simplex = [best] + [[b + 0.5 * (v - b) for b, v in zip(best, x)] for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    i = min(range(n + 1), key=values.__getitem__)
    return simplex[i], values[i]


# ---------------------------------------------------------------------- built-in profiles

PROFILE_DIR = Path(__file__).parent / "profiles"
"""Package data: measured profiles (``profiles/README.md`` says where each comes from)."""

BUILTIN_PROFILES: dict[str, tuple[str, str]] = {
    "h100-80gb": ("gemma-3-27b", "h100_gemma-3-27b_steps.json"),
}
"""GPU id -> (model preset the profile measured, file in ``PROFILE_DIR``)."""

H100_EFFICIENCY = Efficiency(
    compute=0.6295, memory=0.8086, step_overhead_s=0.0, sample_overhead_s=0.0, attention_compute=0.3141,
    gemm_m_half=0.0, launch_s_per_layer=63.8e-6, graph_launch_s_per_layer=29.5e-6, activation_traffic=0.4635,
    host_s_per_layer=DEFAULT_HOST_S_PER_LAYER, cuda_graphs=True,
)
"""``fit_step_model`` on the built-in H100 profile (``builtin_profile("h100-80gb")``), rounded; a
test refits it. The GPU's data-sheet peaks are 989 TFLOP/s bf16 and 3.35 TB/s."""

_BUILTIN_EFFICIENCY: dict[str, Efficiency] = {"h100-80gb": H100_EFFICIENCY}


def builtin_profile(gpu_id: str) -> Profile | None:
    """The measured profile shipped for ``gpu_id``, or None (the GPU keeps data-sheet defaults)."""
    entry = BUILTIN_PROFILES.get(gpu_id)
    return replace(load_profile(PROFILE_DIR / entry[1]), source=f"built-in {entry[1]}") if entry else None


def default_efficiency(gpu_id: str) -> tuple[Efficiency, str]:
    """The efficiencies a GPU gets unless told otherwise, and where they come from: the fit of its
    built-in profile, or ``DEFAULT_EFFICIENCY`` on its data-sheet peaks."""
    eff = _BUILTIN_EFFICIENCY.get(gpu_id)
    if eff is None:
        return DEFAULT_EFFICIENCY, "data sheet"
    model, name = BUILTIN_PROFILES[gpu_id]
    return eff, f"calibrated profile {name} ({model} steps measured on {gpu_id})"

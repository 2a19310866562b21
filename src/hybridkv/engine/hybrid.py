"""``hybrid-tiny``: a small hybrid of attention and Mamba-2 layers, the engine's second built-in model.

Six layers (Mamba-2, full attention, Mamba-2, sliding window, Mamba-2, full attention), hidden size
64, bytes as tokens, seeded weights. Every logit and state is bitwise the same however a prompt
is split, and states live in the pool's own pages.
See docs/ENGINE.md, "``hybrid-tiny``".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from collections.abc import Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from hybridkv.core import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheSpec,
    MambaSpec,
    RecurrentState,
    SlidingWindowSpec,
    StateStep,
)
from hybridkv.engine.config import EngineConfig, parse_dtype
from hybridkv.engine.kv_pool import layer_slots
from hybridkv.engine.model import PagedKVCache, StepInputs, apply_rope, paged_attention, rms_norm, rope_tables
from hybridkv.errors import InvalidInputError

MODEL_ID = "hybrid-tiny"


@dataclass(frozen=True)
class HybridConfig:
    layers: tuple[str, ...] = ("mamba", "full", "mamba", "sliding", "mamba", "full")
    vocab_size: int = 258
    hidden_size: int = 64
    intermediate_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 32
    sliding_window: int = 48
    ssm_heads: int = 4
    ssm_head_dim: int = 16
    state_size: int = 32
    conv_kernel: int = 4
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32_768
    seed: int = 0

    @property
    def d_inner(self) -> int:
        return self.ssm_heads * self.ssm_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the convolution: ``x``, ``B`` and ``C``."""
        return self.d_inner + 2 * self.state_size

    @property
    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """One layer's state: conv inputs ``[kernel - 1, channels]`` and ``S`` ``[heads, head dim, state size]``."""
        return (self.conv_kernel - 1, self.conv_channels), (self.ssm_heads, self.ssm_head_dim, self.state_size)

    @property
    def state_bytes(self) -> int:
        (a, b), (h, p, n) = self.state_shapes
        return 4 * (a * b + h * p * n)


def rowwise(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` one row at a time: a row's result never depends on how many rows the call has
    (a dense matmul may pick another kernel, or another summation order, for another row count)."""
    if not len(x):
        return x.new_empty(0, weight.shape[0])
    return torch.stack([torch.mv(weight, row) for row in x])


SERIAL = 4096
"""Elements an elementwise call computes at most: torch's CPU kernels run calls this small on one
thread (the default grain is 32,768 elements; GELU's own threshold is 6,144)."""


def by_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` (elementwise) over ``x`` ``[rows, width]``, ``SERIAL`` elements a call at most: split
    between threads, an element may fall to the scalar loop (whose ``exp`` may differ in the last bit)
    depending on how many rows the call has; on one thread, rows whose width is a multiple of the
    vector width never do."""
    rows = max(1, SERIAL // max(1, x[0].numel())) if len(x) else 1
    if len(x) <= rows:
        return fn(x)
    return torch.cat([fn(x[i:i + rows]) for i in range(0, len(x), rows)])


@dataclass
class AttentionWeights:
    qkv: torch.Tensor
    o: torch.Tensor


@dataclass
class MambaWeights:
    in_proj: torch.Tensor
    """``[z, x B C, dt]`` from the hidden state."""
    conv: torch.Tensor
    """``[kernel, channels]``: row ``k`` weighs the input ``kernel - 1 - k`` tokens back."""
    conv_bias: torch.Tensor
    dt_bias: torch.Tensor
    a: torch.Tensor
    """``A`` per head (negative)."""
    d: torch.Tensor
    out_proj: torch.Tensor


@dataclass
class HybridLayer:
    mixer: AttentionWeights | MambaWeights
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class HybridWeights:
    """The model's weights (float32), with the engine's model interface (``models.ModelWeights``)."""

    config: HybridConfig
    embed: torch.Tensor
    layers: list[HybridLayer]
    lm_head: torch.Tensor

    @classmethod
    def generate(cls, config: HybridConfig | None = None, device: str | torch.device = "cpu") -> HybridWeights:
        """Weights drawn from ``config.seed``: linear layers scaled by ``1/sqrt(fan in)``, so activations
        stay near unit size; Mamba-2's usual ``A`` and ``dt`` ranges."""
        cfg = config or HybridConfig()
        gen = torch.Generator().manual_seed(cfg.seed)

        def normal(*shape: int, std: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * std

        def linear(out: int, inp: int, gain: float = 1.0) -> torch.Tensor:
            return normal(out, inp, std=gain / inp ** 0.5)

        def uniform(n: int, lo: float, hi: float) -> torch.Tensor:
            return lo + (hi - lo) * torch.rand(n, generator=gen)

        d, h = cfg.hidden_size, cfg.ssm_heads
        layers = []
        for kind in cfg.layers:
            mixer: AttentionWeights | MambaWeights
            if kind == "mamba":
                dt = torch.exp(uniform(h, -4.6, -2.3))  # 0.01 .. 0.1
                mixer = MambaWeights(
                    in_proj=linear(cfg.d_inner + cfg.conv_channels + h, d),
                    conv=normal(cfg.conv_kernel, cfg.conv_channels, std=cfg.conv_kernel ** -0.5),
                    conv_bias=normal(cfg.conv_channels, std=0.1),
                    dt_bias=dt + torch.log(-torch.expm1(-dt)),  # softplus(dt_bias) == dt
                    a=-uniform(h, 1.0, 8.0), d=torch.ones(h), out_proj=linear(d, cfg.d_inner))
            else:
                qkv_rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                mixer = AttentionWeights(qkv=linear(qkv_rows, d), o=linear(d, cfg.num_heads * cfg.head_dim))
            layers.append(HybridLayer(mixer, linear(2 * cfg.intermediate_size, d), linear(d, cfg.intermediate_size)))
        weights = cls(cfg, normal(cfg.vocab_size, d), layers, linear(cfg.vocab_size, d, gain=4.0))
        return weights.to(torch.device(device))

    def to(self, device: torch.device) -> HybridWeights:
        return _moved(self, device)  # type: ignore[no-any-return]

    @property
    def device(self) -> torch.device:
        return self.embed.device

    # ------------------------------------------------------------------ the engine's model interface
    @property
    def max_position_embeddings(self) -> int:
        return self.config.max_position_embeddings

    @property
    def kv_shape(self) -> tuple[int, int]:
        return self.config.num_kv_heads, self.config.head_dim

    def prefill_context_cost(self) -> float:
        """0: the tiny model's steps cost little whatever their context (every prompt token counts one)."""
        return 0.0

    def engine_config(self, config: EngineConfig, device: torch.device) -> EngineConfig:
        """The weights are dense float32 whatever the config; ``dtype`` is the attention KV's."""
        if config.weights == "gguf":
            raise InvalidInputError(f"{MODEL_ID} has dense float32 weights only (no gguf format)")
        if self.device != device:
            raise InvalidInputError(f"the {MODEL_ID} weights are on {self.device}; the config asks for {device}")
        return replace(config, weights="dense")

    def layer_specs(self, config: EngineConfig) -> dict[str, KVCacheSpec]:
        cfg = self.config
        kv_bytes = torch.tensor([], dtype=parse_dtype(config.dtype)).element_size()
        specs: dict[str, KVCacheSpec] = {}
        for i, kind in enumerate(cfg.layers):
            attention = {"block_size": config.block_size, "num_kv_heads": cfg.num_kv_heads,
                         "head_size": cfg.head_dim, "dtype_bytes": kv_bytes}
            if kind == "mamba":
                specs[f"layers.{i}"] = MambaSpec(block_size=config.block_size, state_bytes=cfg.state_bytes)
            elif kind == "sliding":
                specs[f"layers.{i}"] = SlidingWindowSpec(**attention, sliding_window=cfg.sliding_window)
            else:
                specs[f"layers.{i}"] = FullAttentionSpec(**attention)
        return specs

    def build_model(self, kv: PagedKVCache, layout: KVCacheLayout, group_windows: list[int | None]) -> HybridModel:
        return HybridModel(self, kv, layout, group_windows)


def _moved(obj: Any, device: torch.device) -> Any:
    """A copy of a weights dataclass with every tensor on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        return [_moved(v, device) for v in obj]
    if isinstance(obj, HybridConfig):
        return obj
    return type(obj)(**{k: _moved(v, device) for k, v in vars(obj).items()})


class StatePages:
    """Recurrent states in the pool's pages: the state at a table index is one page per part."""

    def __init__(self, kv: PagedKVCache, states: Seq[RecurrentState], config: HybridConfig) -> None:
        self.shapes = config.state_shapes
        self.state_bytes = state_bytes = config.state_bytes
        self.part_bytes = [s.part_bytes for s in states]
        self.kv = kv
        half = kv.keys[0][:kv.block_size].numel() * kv.keys[0].element_size()
        for s in states:
            if s.state_bytes != state_bytes or s.part_bytes > 2 * half:
                raise InvalidInputError(f"recurrent state {s}: the model's state is {state_bytes} bytes in pages of "
                                        f"{2 * half}")

    def _pages(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot ``slot``'s K and V tensors as bytes, ``[num_blocks, half page]`` each."""
        n = self.kv.num_blocks
        return self.kv.keys[slot].view(torch.uint8).view(n, -1), self.kv.values[slot].view(torch.uint8).view(n, -1)

    def read(self, state: int, slot: int, pages: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv and SSM state in ``pages`` (None: zeros) of layer ``slot`` of recurrent state ``state``."""
        shapes = self.shapes
        if pages is None:
            device = self.kv.keys[0].device
            return torch.zeros(shapes[0], device=device), torch.zeros(shapes[1], device=device)
        k, v = self._pages(slot)
        ids = torch.tensor(pages, device=k.device)
        raw = torch.cat([k[ids], v[ids]], dim=1)[:, :self.part_bytes[state]].reshape(-1)[:self.state_bytes]
        flat = raw.contiguous().view(torch.float32)
        conv = shapes[0][0] * shapes[0][1]
        return flat[:conv].view(shapes[0]), flat[conv:].view(shapes[1])

    def write(self, state: int, slot: int, pages: tuple[int, ...], conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Store a layer's state into ``pages``."""
        part = self.part_bytes[state]
        raw = torch.cat([conv.reshape(-1), ssm.reshape(-1)]).view(torch.uint8)
        data = F.pad(raw, (0, len(pages) * part - len(raw))).view(len(pages), part)
        k, v = self._pages(slot)
        ids = torch.tensor(pages, device=k.device)
        half = k.shape[1]
        k[ids, :min(part, half)] = data[:, :half]
        if part > half:
            v[ids, :part - half] = data[:, half:]


class HybridModel:
    """The forward pass of ``hybrid-tiny`` over the paged cache (``model.EngineModel``)."""

    def __init__(self, weights: HybridWeights, kv: PagedKVCache, layout: KVCacheLayout,
                 group_windows: list[int | None]) -> None:
        self.w = weights
        self.cfg = weights.config
        self.kv = kv
        self.group_windows = group_windows
        self.layer_slots = layer_slots(layout, len(self.cfg.layers))
        self.state_slots: dict[int, tuple[int, int]] = {}
        """Per Mamba layer: its recurrent state (index into ``layout.recurrent_states``) and its slot there."""
        for s, state in enumerate(layout.recurrent_states):
            for m, name in enumerate(state.layer_names):
                self.state_slots[int(name.rsplit(".", 1)[1])] = (s, m)
        self.pages = StatePages(kv, layout.recurrent_states, self.cfg)
        self.held: dict[int, list[tuple[StateStep, int, int, dict[int, tuple[torch.Tensor, torch.Tensor]]]]] = {}
        """Per sequence with drafts in the last forward pass (by its first row): per Mamba layer its plan,
        state and slot, and the conv and SSM states after each position from ``drafts_from`` on,
        kept until ``accept_drafts`` stores those the verification reached."""

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of final-normed hidden states."""
        return rowwise(hidden, self.w.lm_head)

    def scoring_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.lm_head

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        """Float32 logits ``[len(logits_rows), vocab]``; writes the step's K/V and states into the pool."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        self.held.clear()  # states of a step whose drafts were never verified (it failed)
        x = F.embedding(step.input_ids, self.w.embed)
        # RoPE tables a thread's worth of positions at a time (as ``by_rows``).
        n = SERIAL // cfg.head_dim
        tables = [rope_tables(step.positions[i:i + n], cfg.head_dim, cfg.rope_theta, torch.float32)
                  for i in range(0, len(step.positions), n)]
        cos, sin = torch.cat([c for c, _ in tables]), torch.cat([s for _, s in tables])
        for i, layer in enumerate(self.w.layers):
            h = rms_norm(x, None, eps)
            if isinstance(layer.mixer, MambaWeights):
                x = x + self._mamba(i, layer.mixer, h, step)
            else:
                x = x + self._attention(i, layer.mixer, h, (cos, sin), step)
            gate, up = rowwise(rms_norm(x, None, eps), layer.gate_up).chunk(2, dim=-1)
            x = x + rowwise(by_rows(lambda g: F.gelu(g, approximate="tanh"), gate) * up, layer.down)
        if not len(step.logits_rows):
            return torch.empty(0, cfg.vocab_size)
        x = rms_norm(x[step.logits_rows], None, eps)
        return x if step.hidden_only else self.lm_head(x)

    def _attention(self, i: int, w: AttentionWeights, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   step: StepInputs) -> torch.Tensor:
        cfg = self.cfg
        t, nh, nkv, hd = h.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = rowwise(h, w.qkv)
        qk = apply_rope(rms_norm(qkv[:, :(nh + nkv) * hd].reshape(t, nh + nkv, hd), None, cfg.rms_norm_eps), *rope)
        v = qkv[:, (nh + nkv) * hd:].reshape(t, nkv, hd)
        group, slot = self.layer_slots[i]
        out = paged_attention(self.kv, step, group, slot, self.group_windows[group], qk[:, :nh], qk[:, nh:], v,
                              hd ** -0.5, raw_pages=True)
        return rowwise(out.reshape(t, -1), w.o)

    def _mamba(self, i: int, w: MambaWeights, h: torch.Tensor, step: StepInputs) -> torch.Tensor:
        cfg = self.cfg
        proj = rowwise(h, w.in_proj)
        di, ch = cfg.d_inner, cfg.conv_channels
        z, xbc, dt = proj[:, :di], proj[:, di:di + ch], proj[:, di + ch:]
        y = torch.empty(h.shape[0], cfg.d_inner, device=h.device)
        state, slot = self.state_slots[i]
        for span in step.states:
            rows = slice(span.row, span.row + span.count)
            plan = span.steps[state]
            kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
            if plan.drafts_from is not None:
                kept = {}
                self.held.setdefault(span.row, []).append((plan, state, slot, kept))
            y[rows] = self._scan(w, xbc[rows], dt[rows], plan, state, slot, span.position, kept)
        return rowwise(rms_norm(y * by_rows(F.silu, z), None, cfg.rms_norm_eps), w.out_proj)

    def accept_drafts(self, ends: Mapping[int, int]) -> None:
        """After the drafts of the last forward pass were verified: per sequence (its first row in
        the batch) whose accepted tokens end at ``ends[row]``, store the states the verification
        reached (``StateStep.after_acceptance``: the boundaries the accepted drafts crossed, the
        running state at the end). A sequence left out (it failed) stores nothing more."""
        for row, layers in self.held.items():
            end = ends.get(row)
            if end is None:
                continue
            for plan, state, slot, kept in layers:
                for p, pages in plan.after_acceptance(end):
                    self.pages.write(state, slot, pages, *kept[p])
        self.held.clear()

    def _scan(self, w: MambaWeights, xbc: torch.Tensor, dt: torch.Tensor, plan: StateStep, state: int, slot: int,
              start: int, kept: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """One sequence's tokens ``start ..``: the conv and the recurrence from the state ``plan`` reads,
        the state stored after each position ``plan`` writes (with drafts: only its ``certain``
        writes, and ``kept`` receives the state after each position from ``plan.drafts_from`` on).
        Outputs ``[tokens, d_inner]``."""
        cfg = self.cfg
        k, n, di, ns = cfg.conv_kernel, len(xbc), cfg.d_inner, cfg.state_size
        conv_state, s = self.pages.read(state, slot, plan.read)
        inputs = torch.cat([conv_state, xbc])  # row r holds position start - (k - 1) + r
        u = inputs[0:n] * w.conv[0]
        for j in range(1, k):
            u = u + inputs[j:j + n] * w.conv[j]
        u = by_rows(F.silu, u + w.conv_bias)
        writes = dict(plan.certain)
        first = n + 1 if kept is None or plan.drafts_from is None else plan.drafts_from - start
        if first == 0 and kept is not None:
            kept[start] = conv_state, s
        out = torch.empty(n, cfg.ssm_heads, cfg.ssm_head_dim, device=xbc.device)
        for r in range(n):
            xh, b, c = u[r, :di].view(cfg.ssm_heads, cfg.ssm_head_dim), u[r, di:di + ns], u[r, di + ns:]
            delta = F.softplus(dt[r] + w.dt_bias)
            s = s * torch.exp(delta * w.a)[:, None, None] + (delta[:, None] * xh)[:, :, None] * b
            out[r] = (s * c).sum(-1) + w.d[:, None] * xh
            pages = writes.get(start + r + 1)
            if pages is not None:
                self.pages.write(state, slot, pages, inputs[r + 1:r + k], s)
            if r + 1 >= first and kept is not None:
                kept[start + r + 1] = inputs[r + 1:r + k], s
        return out.view(n, di)


class ByteTokenizer:
    """Bytes as tokens (UTF-8), then BOS and EOS (the engine's ``Tokenizer`` interface)."""

    bos_token_id = 256
    eos_token_id = 257
    vocab_size = 258
    chat_template = None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return [self.bos_token_id] * add_bos + list(text.encode("utf-8"))

    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; bytes that are not valid UTF-8 become U+FFFD."""
        out: list[str] = []
        run = bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not skip_special_tokens:
                out.append("<bos>" if i == self.bos_token_id else "<eos>")
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def decode_incremental(self, ids: Seq[int], prefix_offset: int, read_offset: int,
                           skip_special_tokens: bool = True, final: bool = False) -> tuple[str, int, int]:
        """Text added by ``ids[read_offset:]`` as ``(new_text, prefix_offset, read_offset)``: a character
        whose bytes have not all arrived waits (``final`` releases it)."""
        if not 0 <= prefix_offset <= read_offset <= len(ids):
            raise InvalidInputError(
                f"need 0 <= prefix_offset ({prefix_offset}) <= read_offset ({read_offset}) <= len(ids) ({len(ids)})"
            )
        end = len(ids) if final else len(ids) - _incomplete_tail(ids[read_offset:])
        return self.decode(ids[read_offset:end], skip_special_tokens), end, end


def _incomplete_tail(ids: Seq[int]) -> int:
    """How many trailing byte tokens start a UTF-8 character whose other bytes are still to come."""
    for n in range(1, min(4, len(ids)) + 1):
        c = ids[-n]
        if c >= 256:
            return 0
        if c & 0xC0 == 0x80:  # a continuation byte: look further back
            continue
        need = 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 1
        return n if need > n else 0
    return 0

"""Gemma 3 text forward pass over a paged KV cache whose block tables come from hybridkv.

One step runs a packed batch; attention runs per part (a prefill chunk's query tile, or all
decodes together). Every row's arithmetic depends on its token, its position and the cached K/V
alone, so caching, chunking and batching never change an output.
See docs/ENGINE.md, "The forward pass over paged KV".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from hybridkv.core import StateStep
from hybridkv.engine import cpu_kernels

if TYPE_CHECKING:
    from hybridkv.engine.weights import Gemma3Config, Gemma3Weights, LayerWeights

logger = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm, float32 in and out; ``weight`` already holds ``1 + w`` (as the GGUF stores it).

    One fused kernel (``F.rms_norm``: the same formula, bitwise equal in fp32 on this build)
    instead of six small ops: a decode step runs 91 of them."""
    return F.rms_norm(x.float(), (x.shape[-1],), weight, eps)


def rope_tables(positions: torch.Tensor, head_dim: int, base: float, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, 1, head_dim]`` for rotate-half RoPE."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
                               / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


KEY_TILE = 128
"""Keys per attention tile; tiles start at absolute positions that are multiples of it."""


def tiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
                    ) -> torch.Tensor:
    """Float32 attention ``[B, Q, H, D]`` of ``q`` ``[B, Q, H, D]`` over ``k``, ``v`` ``[B, L, KVH, D]`` (keys
    ``KEY_TILE``-aligned to absolute positions, ``L`` a multiple of it) where ``mask`` ``[B, Q, L]`` is True.

    Each query's result depends on its own row and the keys it sees only, not on how many queries
    or keys the call holds: scores are one float32 matmul with the query heads of each KV head as
    rows (row-independent: its row count is a multiple of 4); the softmax uses the exact maximum
    over visible keys; values and the softmax denominator are reduced per key tile (a matmul of
    fixed depth ``KEY_TILE``, a sum of ``KEY_TILE`` terms) and the tiles added in position order
    (``cumsum``: sequential), so tiles a query does not see add exact zeros wherever they are."""
    b, nq, h, d = q.shape
    length, kvh = k.shape[1], k.shape[2]
    rows, tiles = nq * (h // kvh), length // KEY_TILE
    qg = (q * scale).reshape(b, nq, kvh, h // kvh, d).transpose(1, 2).reshape(b, kvh, rows, d)
    scores = torch.matmul(qg, k.float().permute(0, 2, 3, 1))  # [B, KVH, rows, L]
    scores.view(b, kvh, nq, h // kvh, length).masked_fill_(~mask[:, None, :, None, :], float("-inf"))
    probs = scores.sub_(scores.amax(-1, keepdim=True)).exp_().view(b, kvh, rows, tiles, KEY_TILE)
    values = v.float().permute(0, 2, 1, 3).reshape(b, kvh, tiles, KEY_TILE, d)
    weighted = torch.matmul(probs.transpose(2, 3), values).cumsum(2)[:, :, -1]  # [B, KVH, rows, D]
    out = weighted / probs.sum(-1).cumsum(-1)[..., -1:]
    return out.reshape(b, kvh, nq, h // kvh, d).transpose(1, 2).reshape(b, nq, h, d)


CUDA_DECODE_ATTENTION = True
"""On a GPU, single-query parts (decodes, in graphs and eagerly alike) use ``decode_attention``."""


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float
                     ) -> torch.Tensor:
    """Float32 attention ``[B, 1, H, D]`` of one query per row (``q`` ``[B, 1, H, D]``) over ``k``, ``v``
    ``[B, L, KVH, D]``, ``bias`` ``[B, 1, L]`` being 0 where a key is seen and -inf where not.

    ``tiled_attention`` 's result in about 6 kernels instead of ~20 (a GPU decode step is bound by
    the number of its kernels, each a few microseconds): scores, scale and mask in one ``baddbmm``,
    one softmax, one ``bmm``; the query heads sharing a KV head are that head's rows. Its rounding
    differs from ``tiled_attention`` 's (a GPU is not bitwise batch-invariant anyway); the CPU keeps
    ``tiled_attention``."""
    b, _, h, d = q.shape
    length, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    qg = q.reshape(b * kvh, g, d)
    kt = k.float().permute(0, 2, 3, 1).reshape(b * kvh, d, length)
    mask = bias.expand(b, kvh, length).reshape(b * kvh, 1, length)
    probs = torch.softmax(torch.baddbmm(mask, qg, kt, alpha=scale), dim=-1)
    out = torch.bmm(probs, v.float().permute(0, 2, 1, 3).reshape(b * kvh, length, d))
    return out.reshape(b, 1, h, d)


@dataclass
class AttentionPart:
    """One attention call: some queries of the packed batch against keys gathered by slot."""

    query_rows: torch.Tensor
    """``[B, Q]`` indices into the packed batch."""
    mask: torch.Tensor
    """``[B, Q, L]`` True where a query may see a key; key ``j`` of row ``b`` is at a position
    ``KEY_TILE``-aligned start + ``j``, ``L`` a multiple of ``KEY_TILE``."""
    key_slots: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per hybridkv group of this part's kind: ``[B, L]`` key slots (block id * block size + offset;
    slots of the null block where the window sees no key)."""
    every_row: bool = False
    """The part's queries are the step's rows in order, one each (a decode-only step): its result is
    the attention output as it is, no gather or scatter (it is then its window's only part)."""
    _bias: torch.Tensor | None = field(default=None, init=False, repr=False)

    @property
    def bias(self) -> torch.Tensor:
        """``mask`` as float32 0 / -inf, computed once per step (every layer of the part's window uses it)."""
        if self._bias is None:
            self._bias = torch.zeros(self.mask.shape, device=self.mask.device).masked_fill_(~self.mask, float("-inf"))
        return self._bias


@dataclass(frozen=True)
class StateSpan:
    """One sequence's rows of the packed batch and the recurrent states its step reads and writes."""

    row: int
    """Its first row in the packed batch."""
    position: int
    """The position of that row (the tokens computed before the step)."""
    count: int
    steps: tuple[StateStep, ...]
    """Per ``layout.recurrent_states``: the pages to read the state from and to write it into."""


@dataclass
class StepInputs:
    """Everything one forward pass needs, built by the engine from the scheduler's output."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: list[torch.Tensor]
    """Per group: the slot each new token's K/V is written to."""
    parts: dict[int | None, list[AttentionPart]]
    """Attention parts by the window of the groups they serve (``None``: full attention)."""
    logits_rows: torch.Tensor
    """Rows of the packed batch whose next-token logits are needed."""
    hidden_only: bool = False
    """Return the final-normed hidden states of ``logits_rows`` instead of logits: the caller runs
    ``Gemma3Model.lm_head`` on slices of them (scoring every prompt position at once would not fit)."""
    states: list[StateSpan] = field(default_factory=list)
    """Per scheduled sequence, when the model has recurrent layers (empty otherwise)."""


class EngineModel(Protocol):
    """What ``LLMEngine`` runs: a forward pass over one step's packed batch and the LM head."""

    @property
    def vocab_size(self) -> int: ...

    def forward(self, step: StepInputs) -> torch.Tensor:
        """Float32 logits ``[len(logits_rows), vocab]`` (final-normed hidden states when ``hidden_only``);
        writes the step's KV and recurrent states into the cache."""
        ...

    def scoring_head(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The exact float32 head that turns ``hidden_only`` rows into logits."""
        ...


class PagedKVCache:
    """The KV tensors: as many key and value tensors as the largest group has layers, shared by all groups."""

    def __init__(self, num_blocks: int, block_size: int, group_layers: list[int], num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.group_layers = group_layers
        """Layers of each group: a block of group ``g`` holds a page in the first ``group_layers[g]`` tensors."""
        slots = max(group_layers)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(slots)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(slots)]
        self.block_size = block_size
        self.num_blocks = num_blocks

    def _block(self, layers: int, block_id: int) -> list[torch.Tensor]:
        rows = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        return [t[rows] for j in range(layers) for t in (self.keys[j], self.values[j])]

    def read_block(self, group: int, block_id: int) -> bytes:
        """One block of ``group`` as bytes: K then V of each of its layers (a connector payload)."""
        parts = self._block(self.group_layers[group], block_id)
        flat = torch.stack(parts).cpu()
        return (flat.view(torch.int16) if flat.dtype == torch.bfloat16 else flat).numpy().tobytes()

    def write_block(self, group: int, block_id: int, payload: bytes) -> None:
        """The inverse of ``read_block``."""
        parts = self._block(self.group_layers[group], block_id)
        nbytes = sum(p.numel() * p.element_size() for p in parts)
        if len(payload) != nbytes:
            raise ValueError(f"a block of group {group} holds {nbytes} bytes, the payload has {len(payload)}")
        dtype = parts[0].dtype
        raw = torch.frombuffer(bytearray(payload), dtype=torch.int16 if dtype == torch.bfloat16 else dtype)
        data = (raw.view(torch.bfloat16) if dtype == torch.bfloat16 else raw).view(len(parts), *parts[0].shape)
        for dst, src in zip(parts, data):
            dst.copy_(src)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class Gemma3Model:
    """The forward pass.

    ``layer_slots[i] = (group, slot)`` places layer ``i`` in the KV cache; ``group_windows[g]`` is
    the sliding window group ``g`` attends over (``None``: all previous tokens). The window comes
    from the layout, not the layer, so a layout that plans every layer as full attention runs the
    model without its windows (the tests' negative control).

    The residual stream, the norms and attention are float32 whatever the weights; k, v and the KV
    cache are in ``weights.dtype``; each projection runs in its weights' own format.
    """

    def __init__(self, weights: Gemma3Weights, kv: PagedKVCache, layer_slots: list[tuple[int, int]],
                 group_windows: list[int | None]) -> None:
        self.w = weights
        self.cfg: Gemma3Config = weights.config
        self.kv = kv
        self.layer_slots = layer_slots
        self.group_windows = group_windows
        self.dtype = weights.dtype
        self.embed_scale = torch.tensor(self.cfg.hidden_size ** 0.5, dtype=weights.embed.dtype, device=weights.device)
        cfg = self.cfg
        self.kernels = (weights.device.type == "cpu" and cpu_kernels.available() and cfg.hidden_size % 8 == 0
                        and cpu_kernels.attention_supported(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                                            kv.keys[0].dtype))
        """The layer runs on hybridkv's CPU kernels (norms, RoPE, GeGLU, attention; ``cpu_kernels``)."""

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def scoring_head(self) -> ScoringHead:
        return ScoringHead(self)

    @torch.inference_mode()
    def forward(self, step: StepInputs) -> torch.Tensor:
        """Float32 logits ``[len(logits_rows), vocab]``; writes the new tokens' K/V into the cache."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        x = (self.w.embed.lookup(step.input_ids) * self.embed_scale).float()
        ropes = {
            True: rope_tables(step.positions, cfg.head_dim, cfg.rope_theta_local, torch.float32),
            False: rope_tables(step.positions, cfg.head_dim, cfg.rope_theta_global, torch.float32),
        }
        if self.kernels:
            x = self._kernel_layers(x.contiguous(), ropes, step)
        else:
            x = self._torch_layers(x, ropes, step)
        if not len(step.logits_rows):  # only prefill chunks that end mid-prompt: no LM head
            return torch.empty(0, cfg.vocab_size)
        x = rms_norm(x[step.logits_rows], self.w.final_norm, eps)
        return x if step.hidden_only else self.w.embed.logits(x)

    def _kernel_layers(self, x: torch.Tensor, ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]],
                       step: StepInputs) -> torch.Tensor:
        """The decoder layers on hybridkv's CPU kernels: the residual stream ``x`` updated in place."""
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        t, nh, nkv, hd = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        tables = {local: (cos.reshape(t, hd), sin.reshape(t, hd)) for local, (cos, sin) in ropes.items()}
        layers = self.w.layers
        h = cpu_kernels.rms_norm(x, layers[0].attn_norm, eps)
        for i, layer in enumerate(layers):
            group, slot = self.layer_slots[i]
            qkv = layer.qkv(h).float()
            cpu_kernels.qk_norm_rope(qkv, nh + nkv, hd, layer.qk_norm, eps, *tables[not cfg.is_global(i)])
            q, k, v = (qkv[:, a * hd:b * hd].view(t, b - a, hd) for a, b in
                       ((0, nh), (nh, nh + nkv), (nh + nkv, nh + 2 * nkv)))
            out = paged_attention(self.kv, step, group, slot, self.group_windows[group], q, k, v, cfg.attn_scale)
            h = cpu_kernels.rms_norm(layer.o(out.reshape(t, -1)).float(), layer.post_attn_norm, eps, residual=x,
                                     then=layer.ffn_norm)
            h = layer.down(cpu_kernels.gelu_mul(layer.gate_up(h).float())).float()
            after = layers[i + 1].attn_norm if i + 1 < len(layers) else None
            h = cpu_kernels.rms_norm(h, layer.post_ffn_norm, eps, residual=x, then=after)
        return x

    def _torch_layers(self, x: torch.Tensor, ropes: dict[bool, tuple[torch.Tensor, torch.Tensor]],
                      step: StepInputs) -> torch.Tensor:
        cfg = self.cfg
        eps = cfg.rms_norm_eps
        for i, layer in enumerate(self.w.layers):
            local = not cfg.is_global(i)
            group, slot = self.layer_slots[i]
            h = self._attention(layer, rms_norm(x, layer.attn_norm, eps), ropes[local], step, group, slot)
            x = x + rms_norm(h, layer.post_attn_norm, eps)
            gate, up = layer.gate_up(rms_norm(x, layer.ffn_norm, eps)).chunk(2, dim=-1)
            h = layer.down(F.gelu(gate, approximate="tanh") * up)
            x = x + rms_norm(h, layer.post_ffn_norm, eps)
        return x

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Exact float32 logits ``[rows, vocab]`` of final-normed hidden states (the tied embedding),
        as scoring needs them (the sampling head may screen with an approximation first)."""
        return self.w.embed.exact_logits(hidden)

    def _attention(self, layer: LayerWeights, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                   step: StepInputs, group: int, slot: int) -> torch.Tensor:
        cfg = self.cfg
        t = h.shape[0]
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv = layer.qkv(h)
        # Per-head RMSNorm and RoPE on q and k together: [T, heads + kv heads, head_dim], float32.
        qk = apply_rope(rms_norm(qkv[:, :(nh + nkv) * hd].reshape(t, nh + nkv, hd), None, cfg.rms_norm_eps)
                        * layer.qk_norm, *rope)
        v = qkv[:, (nh + nkv) * hd:].reshape(t, nkv, hd)
        out = paged_attention(self.kv, step, group, slot, self.group_windows[group], qk[:, :nh], qk[:, nh:], v,
                              cfg.attn_scale)
        return layer.o(out.reshape(t, -1))


def paged_attention(kv: PagedKVCache, step: StepInputs, group: int, slot: int, window: int | None,
                    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
                    raw_pages: bool = False) -> torch.Tensor:
    """Float32 attention ``[T, heads, head_dim]`` of the step's queries ``q``: writes the new tokens'
    ``k``, ``v`` ``[T, kv heads, head_dim]`` into KV slot ``slot`` at group ``group``'s slots, then
    attends each of the step's parts over the keys read back from the cache (hybridkv's CPU kernel
    where it runs: masked keys take no part at all; else ``tiled_attention``).

    ``raw_pages``: pages may hold other bytes than K/V (a recurrent state's, before the page was
    reused): the masked slots of a tile may read as NaN, which a zero weight does not cancel, so
    non-finite values are zeroed (a real value is always finite)."""
    k_cache, v_cache = kv.keys[slot], kv.values[slot]
    slots = step.slot_mapping[group]
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))
    nkv, hd = k.shape[1], k.shape[2]
    if k_cache.device.type == "cpu" and cpu_kernels.available() and cpu_kernels.attention_supported(
            q.shape[1], nkv, hd, k_cache.dtype):
        flat_q = q.flatten(1)
        flat_out = torch.empty(q.shape[0], q.shape[1] * hd)
        for part in step.parts[window]:
            cpu_kernels.attention(flat_q, q.shape[1], nkv, hd, part.query_rows, part.key_slots[group], part.mask,
                                  k_cache, v_cache, scale, flat_out)
        return flat_out.view(q.shape)
    out = torch.empty_like(q)
    for part in step.parts[window]:
        query = q[:, None] if part.every_row else q[part.query_rows]
        key_slots = part.key_slots[group]
        flat = key_slots.reshape(-1)
        gathered = (*key_slots.shape, nkv, hd)
        kp = k_cache.index_select(0, flat).view(gathered)  # [B, L, KVH, D], read back as cached
        vp = v_cache.index_select(0, flat).view(gathered)
        if raw_pages:
            vp = vp.nan_to_num(0.0, 0.0, 0.0)
        if kp.is_cuda and CUDA_DECODE_ATTENTION and part.mask.shape[1] == 1:
            result = decode_attention(query, kp, vp, part.bias, scale)
        else:
            result = tiled_attention(query, kp, vp, part.mask, scale)
        if part.every_row:
            return result.view_as(q)
        out[part.query_rows] = result
    return out


class ScoringHead:
    """The head scoring needs for every prompt position, built at its first use: with hybridkv's CPU
    kernels and the GGUF's 8-bit embedding codes, those codes in the quantized matmul (the embedding's
    weights exactly, 190 MB; activations rounded to int16 per 32, logits within ~1e-4 of float32);
    otherwise one dense float32 ``[vocab, hidden]`` matrix (671 MB for Gemma 3 270M; a float32
    embedding is used as it is). ``Gemma3Model.lm_head`` dequantizes the codes a vocabulary slice at
    a time on every call, which costs more than the matrix product itself."""

    BUILD_ROWS = 8192

    def __init__(self, model: Gemma3Model) -> None:
        self.model = model
        self._weight: torch.Tensor | None = None
        self._codes: cpu_kernels.QuantMatrix | None = None

    @property
    def weight(self) -> torch.Tensor:
        """``[vocab, hidden]`` float32: row ``t`` is token ``t``'s embedding exactly as the head uses it."""
        if self._weight is None:
            start = time.perf_counter()
            embed = self.model.w.embed
            own = getattr(embed, "weight", None)
            if isinstance(own, torch.Tensor) and own.dtype == torch.float32:
                self._weight = own
            else:
                vocab, hidden = self.model.cfg.vocab_size, self.model.cfg.hidden_size
                weight = torch.empty(vocab, hidden, dtype=torch.float32, device=embed.device)
                with torch.inference_mode():
                    for i in range(0, vocab, self.BUILD_ROWS):
                        ids = torch.arange(i, min(i + self.BUILD_ROWS, vocab), device=embed.device)
                        weight[i:i + len(ids)] = embed.lookup(ids).float()
                self._weight = weight
                logger.info("built the float32 scoring head in %.1f s (%d MB)", time.perf_counter() - start,
                            weight.numel() * 4 >> 20)
        return self._weight

    def _quantized(self) -> cpu_kernels.QuantMatrix | None:
        """The embedding's 8-bit codes in the CPU kernels' matmul, where both exist."""
        if self._codes is None:
            embed = self.model.w.embed
            codes = getattr(embed, "codes", None)
            if not (isinstance(codes, torch.Tensor) and codes.dtype == torch.int8 and self.model.kernels):
                return None
            scale = getattr(embed, "scale")  # noqa: B009 (ScreenedEmbedding's per-32 scales)
            self._codes = cpu_kernels.QuantMatrix(codes, scale, torch.zeros_like(scale))
        return self._codes

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of final-normed hidden states ``[rows, hidden]``."""
        quantized = self._quantized()
        if quantized is not None:
            return quantized(hidden)
        return torch.matmul(hidden.float(), self.weight.T)

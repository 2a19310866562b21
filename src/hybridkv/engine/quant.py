"""Weight-only quantized matmuls on the CPU: the GGUF's own per-group codes, run by hybridkv's
kernels (``cpu_kernels``: 4- and 8-bit codes as they are, float32 results) or, where those cannot be
built, by torch's int4-packed CPU kernel (``PackedLinear``: 8-bit codes as two nibbles, bf16).
Types without affine groups of 32 are requantized to 8-bit codes.
See docs/ENGINE.md, "Quantized matmuls".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.errors import InvalidInputError

GROUP = 32
"""Weights per quantization group (along the input dimension)."""

_Q8_0, _Q5_0, _Q4_K = 8, 6, 12


def int4_kernels_available() -> bool:
    """Whether this torch build has the CPU int4-packed weight matmul."""
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and hasattr(
        torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


@dataclass(frozen=True)
class GroupCodes:
    """``w[n, k] = scale[n, k // 32] * codes[n, k] + zero[n, k // 32]``."""

    codes: torch.Tensor
    """int16 ``[N, K]``: 0..15 for 4-bit types, -128..127 otherwise."""
    scale: torch.Tensor
    """float32 ``[N, K // 32]``."""
    zero: torch.Tensor
    """float32 ``[N, K // 32]``."""

    @property
    def bits(self) -> int:
        """4 if every code is in 0..15 (packs as it is), else 8."""
        return 4 if int(self.codes.min()) >= 0 and int(self.codes.max()) <= 15 else 8

    def rows(self, start: int, stop: int) -> GroupCodes:
        """The codes of output rows ``start:stop``."""
        return GroupCodes(self.codes[start:stop], self.scale[start:stop], self.zero[start:stop])

    @staticmethod
    def stack(parts: list[GroupCodes]) -> GroupCodes:
        """The codes of the matrices stacked along the output dimension (like ``torch.cat``)."""
        return GroupCodes(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                          torch.cat([p.zero for p in parts]))

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        codes = self.codes.float().view(n, k // GROUP, GROUP)
        return (codes * self.scale[..., None] + self.zero[..., None]).view(n, k)


def _fp16(blocks: np.ndarray, offset: int) -> torch.Tensor:
    """The fp16 at byte ``offset`` of every block (row of ``blocks``) as float32 ``[blocks]``."""
    d = np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16)[:, 0]
    return torch.from_numpy(d.astype(np.float32))


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """``[..., n]`` bytes to ``[..., 2n]`` 4-bit values: all low nibbles, then all high nibbles."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def gguf_codes(qtype: int, raw: np.ndarray, shape: tuple[int, ...]) -> GroupCodes | None:
    """The codes and per-group scales a GGUF tensor stores, read from its blocks (no float round
    trip), for the types whose groups of 32 are one affine map of integer codes: Q8_0 and Q5_0
    (``w = d * code``) and Q4_K (``w = d * sc * q - dmin * m``). None for other types."""
    if len(shape) != 2 or shape[1] % GROUP:
        return None
    n, k = shape
    groups = (n, k // GROUP)
    if qtype == _Q8_0:  # 34-byte blocks: fp16 d, 32 int8 codes
        blocks = raw.reshape(-1, 34)
        int8 = torch.from_numpy(np.ascontiguousarray(blocks[:, 2:]).view(np.int8)).to(torch.int16)
        d = _fp16(blocks, 0)
        return GroupCodes(int8.view(n, k), d.view(groups), torch.zeros(groups))
    if qtype == _Q5_0:  # 22-byte blocks: fp16 d, 32 high bits (u32), 16 bytes of low nibbles
        blocks = raw.reshape(-1, 22)
        high = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32)
        bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16)
        q5 = (_nibbles(blocks[:, 6:]).astype(np.int16) | (bits << 4)) - 16
        d = _fp16(blocks, 0)
        return GroupCodes(torch.from_numpy(q5).view(n, k), d.view(groups), torch.zeros(groups))
    if qtype == _Q4_K:  # 144-byte blocks of 256: fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 of codes
        from gguf.quants import Q4_K

        blocks = raw.reshape(-1, 144)
        d, dmin = _fp16(blocks, 0), _fp16(blocks, 2)
        sc, mins = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        scale = d[:, None] * torch.from_numpy(sc.astype(np.float32))
        zero = -dmin[:, None] * torch.from_numpy(mins.astype(np.float32))
        q4 = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).astype(np.int16)  # sub-blocks 2i (low), 2i+1 (high)
        return GroupCodes(torch.from_numpy(q4).view(n, k), scale.reshape(groups), zero.reshape(groups))
    return None


def float_codes(weight: torch.Tensor) -> GroupCodes:
    """8-bit symmetric codes per group of 32 of a float ``[N, K]`` weight (scale = max |w| / 127)."""
    n, k = weight.shape
    if k % GROUP:
        raise ValueError(f"the input dimension {k} is not a multiple of {GROUP}")
    grouped = weight.float().view(n, k // GROUP, GROUP)
    scale = grouped.abs().amax(-1) / 127
    codes = torch.round(grouped / torch.where(scale == 0, 1.0, scale)[..., None])
    return GroupCodes(codes.to(torch.int16).view(n, k), scale, torch.zeros_like(scale))


def requantize_4bit(codes: GroupCodes, group: int = GROUP) -> GroupCodes:
    """4-bit asymmetric codes (min/max per ``group`` weights) of any codes' weights: lossy unless
    they already are 4-bit with groups of 32."""
    if codes.bits == 4 and group == GROUP:
        return codes
    w = codes.dequantize()
    n, k = w.shape
    grouped = w.view(n, k // group, group)
    lo, hi = grouped.amin(-1), grouped.amax(-1)
    scale = (hi - lo) / 15
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = torch.round((grouped - lo[..., None]) / safe[..., None]).clamp(0, 15)
    # GroupCodes is per 32; spread each group's scale and zero over its 32-weight sub-groups.
    rep = group // GROUP
    return GroupCodes(q.to(torch.int16).view(n, k), scale.repeat_interleave(rep, 1), lo.repeat_interleave(rep, 1))


class PackedLinear:
    """``x @ W.T`` with ``W`` held as int4-packed codes (4-bit: one pass; 8-bit: hi and lo nibbles)."""

    __slots__ = ("packed", "scales_zeros", "group", "doubled", "out_features", "in_features")

    CHUNK_ROWS = 8192
    """Rows packed at a time (the packing works on blocks of rows; chunks bound the int32 temporaries)."""

    def __init__(self, codes: GroupCodes, group: int = GROUP) -> None:
        n, k = codes.codes.shape
        if n % 16 or k % group or group % GROUP:
            raise ValueError(f"cannot pack a {n} x {k} weight in groups of {group} (rows: a multiple of 16)")
        self.out_features, self.in_features = n, k
        self.group = group
        self.doubled = codes.bits == 8
        parts = [self._pack(codes.rows(i, i + self.CHUNK_ROWS)) for i in range(0, n, self.CHUNK_ROWS)]
        self.packed = torch.cat([p for p, _ in parts])
        self.scales_zeros = torch.cat([sz for _, sz in parts], dim=1)

    @classmethod
    def stack(cls, parts: list[PackedLinear]) -> PackedLinear:
        """Packed weights stacked along the output dimension (packing is row-block wise: the same bytes)."""
        first = parts[0]
        if any((p.group, p.doubled, p.in_features) != (first.group, first.doubled, first.in_features) for p in parts):
            raise ValueError("only packed weights of one format and input size stack")
        out = cls.__new__(cls)
        out.group, out.doubled, out.in_features = first.group, first.doubled, first.in_features
        out.out_features = sum(p.out_features for p in parts)
        out.packed = torch.cat([p.packed for p in parts])
        out.scales_zeros = torch.cat([p.scales_zeros for p in parts], dim=1)
        return out

    def _pack(self, codes: GroupCodes) -> tuple[torch.Tensor, torch.Tensor]:
        step = self.group // GROUP
        scale, zero = codes.scale[:, ::step], codes.zero[:, ::step]
        c = codes.codes.to(torch.int32)
        if self.doubled:  # code = 16 * hi + lo, hi in -8..7, lo in 0..15
            q = torch.cat([torch.div(c, 16, rounding_mode="floor") + 8, torch.remainder(c, 16)], dim=1)
            # hi half: (hi + 8 - 8) * 16 s + 0; lo half: (lo - 8) * s + (8 s + z)
            scale, zero = torch.cat([16 * scale, scale], 1), torch.cat([torch.zeros_like(zero), 8 * scale + zero], 1)
        else:  # the kernel's (q - 8) * s + z for w = s * q + zero
            q, zero = c, 8 * scale + zero
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        return packed, torch.stack([scale.T, zero.T], dim=-1).to(torch.bfloat16).contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """bf16 ``[M, out_features]`` of ``x`` ``[M, in_features]`` (any float dtype; run in bf16)."""
        xb = x.to(torch.bfloat16)
        if self.doubled:
            xb = torch.cat([xb, xb], dim=-1)
        out: torch.Tensor = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.group, self.scales_zeros)
        return out

    def to(self, device: torch.device) -> PackedLinear:
        if device.type != "cpu":
            raise InvalidInputError(f"packed GGUF weights run on the CPU only, not on {device}; use dense weights")
        return self

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * 2


CUDA_LINEAR = True
"""On a GPU, ``DenseLinear`` runs ``F.linear`` at every row count (``bench/engine_gpu.py`` compares)."""


class DenseLinear:
    """``x @ weight.T`` with a float weight (fp32 or bf16); the input is cast to the weight's dtype."""

    __slots__ = ("weight",)

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """For a few rows (decode batches) ``weight @ x.T`` runs a different CPU GEMM path that is up to
        4x faster (measured on the 262,144 x 640 LM head: 2-4 rows in 35-45 ms instead of 125-170 ms);
        for many rows ``F.linear`` is as fast or faster."""
        x = x.to(self.weight.dtype)
        if x.is_cuda and CUDA_LINEAR:  # one GEMM kernel, no transposed copy (what a CUDA graph replays)
            return torch.nn.functional.linear(x, self.weight)
        if x.shape[0] <= 64:
            return torch.matmul(self.weight, x.T).T.contiguous()
        return torch.nn.functional.linear(x, self.weight)

    def to(self, device: torch.device) -> DenseLinear:
        return DenseLinear(self.weight.to(device))

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()


def gguf_kernels_available() -> bool:
    """Whether the gguf weights format can run here (hybridkv's CPU kernels or torch's int4 ones)."""
    from hybridkv.engine import cpu_kernels

    return cpu_kernels.available() or int4_kernels_available()


class GGUFLinear:
    """A GGUF matrix as its codes, one kernel for every row count: each row's result is a function
    of that row alone, so a token computes the same whether it is one row of a decode step or of a
    prefill chunk of any size. The kernel is hybridkv's (``cpu_kernels.QuantMatrix``: float32 out)
    where it runs here, else torch's int4 kernel (``PackedLinear``: bf16 out), chosen when the
    weights load."""

    __slots__ = ("matrix",)

    def __init__(self, codes: GroupCodes) -> None:
        from hybridkv.engine import cpu_kernels

        self.matrix: PackedLinear | cpu_kernels.QuantMatrix = (
            cpu_kernels.QuantMatrix(codes.codes, codes.scale, codes.zero) if cpu_kernels.available()
            else PackedLinear(codes))

    @property
    def in_features(self) -> int:
        return self.matrix.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, out_features]``, float32 or bf16 (the kernel's)."""
        return self.matrix(x)

    def to(self, device: torch.device) -> GGUFLinear:
        if device.type != "cpu":
            raise InvalidInputError(f"packed GGUF weights run on the CPU only, not on {device}; use dense weights")
        return self

    @property
    def nbytes(self) -> int:
        return self.matrix.nbytes

"""The tied token embedding of Gemma 3: row lookups for the input, the LM head for the output.

``DenseEmbedding`` is the exact float matrix; ``ScreenedEmbedding`` keeps the GGUF's 8-bit codes
and screens the head with a 4-bit copy, recomputing each row's top ``rescore`` logits exactly.
See docs/ENGINE.md, "The LM head".
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hybridkv.engine.quant import GROUP, DenseLinear, GroupCodes, PackedLinear, requantize_4bit
from hybridkv.errors import InvalidInputError

if TYPE_CHECKING:
    from hybridkv.engine.cpu_kernels import QuantMatrix


class DenseEmbedding:
    """The embedding as a float matrix ``[vocab, hidden]`` (fp32 or bf16)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self._head = DenseLinear(weight)

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``[T, hidden]`` in the weight's dtype."""
        return torch.nn.functional.embedding(ids, self.weight)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[M, vocab]`` of final hidden states ``x`` ``[M, hidden]``."""
        return self._head(x).float()

    exact_logits = logits
    """The head is exact already."""

    def to(self, device: torch.device) -> DenseEmbedding:
        return DenseEmbedding(self.weight.to(device))

    @property
    def nbytes(self) -> int:
        return self._head.nbytes


class ScreenedEmbedding:
    """8-bit codes for lookups and exact rescoring, a 4-bit packed copy to screen the head."""

    SCREEN_MAX_ROWS = 16

    def __init__(self, codes: GroupCodes, screen_group: int = 128, rescore: int = 32) -> None:
        if codes.bits != 8 or bool((codes.zero != 0).any()):
            raise ValueError("the screened embedding needs symmetric 8-bit codes (Q8_0)")
        self.codes = codes.codes.to(torch.int8)
        self.scale = codes.scale
        self.vocab_size, self.hidden_size = self.codes.shape
        self.rescore = min(rescore, self.vocab_size)
        self.screen = screen_matrix(codes, screen_group)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The float32 rows of ``ids`` (any shape), exactly as the float32 path holds them."""
        codes = self.codes[ids].float()
        grouped = codes.view(*codes.shape[:-1], -1, GROUP) * self.scale[ids][..., None]
        return grouped.view(codes.shape)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[M, vocab]``: for up to ``SCREEN_MAX_ROWS`` rows the 4-bit screen with each
        row's top ``rescore`` recomputed exactly; for more (scoring many positions) all exact."""
        x = x.float()
        if x.shape[0] > self.SCREEN_MAX_ROWS:
            return self.exact_logits(x)
        out = self.screen(x).float()
        top = top_indices(out, self.rescore)  # [M, k]
        # A product and a sum over the hidden dimension: each row's logits whatever the row count
        # (a batched matmul's were not: a request's logits would depend on its batch).
        exact = (self.rows(top) * x[:, None, :]).sum(-1)
        return out.scatter_(1, top, exact)

    def exact_logits(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 head of ``x`` from the 8-bit codes, dequantized a slice of the vocabulary at a time."""
        out = torch.empty(x.shape[0], self.vocab_size)
        step = PackedLinear.CHUNK_ROWS
        for i in range(0, self.vocab_size, step):
            ids = torch.arange(i, min(i + step, self.vocab_size))
            torch.matmul(x, self.rows(ids).T, out=out[:, i:i + step])
        return out

    def to(self, device: torch.device) -> ScreenedEmbedding:
        if device.type != "cpu":
            raise InvalidInputError(f"packed GGUF weights run on the CPU only, not on {device}; use dense weights")
        return self

    @property
    def nbytes(self) -> int:
        return self.codes.numel() + self.scale.numel() * 4 + self.screen.nbytes


def screen_matrix(codes: GroupCodes, group: int) -> PackedLinear | QuantMatrix:
    """The head's 4-bit copy (``group`` weights a scale): hybridkv's CPU kernels where they run, else
    torch's int4 kernel. Requantized a slice of the vocabulary at a time (bounded temporaries)."""
    from hybridkv.engine import cpu_kernels

    step = PackedLinear.CHUNK_ROWS
    parts = [requantize_4bit(codes.rows(i, i + step), group) for i in range(0, codes.codes.shape[0], step)]
    if not cpu_kernels.available():
        return PackedLinear.stack([PackedLinear(p, group) for p in parts])
    every = group // GROUP
    return cpu_kernels.QuantMatrix(torch.cat([p.codes for p in parts]), torch.cat([p.scale[:, ::every] for p in parts]),
                                   torch.cat([p.zero[:, ::every] for p in parts]), group)


def top_indices(values: torch.Tensor, k: int, block: int = 128) -> torch.Tensor:
    """The indices ``[M, k]`` of the ``k`` largest of each row of ``values`` ``[M, N]`` (unordered; ties
    broken arbitrarily), ~5x faster than ``topk`` on a 262k vocabulary: the ``k`` blocks with the
    largest maxima hold every one of the ``k`` largest values (a block holding one of them has a
    maximum at least the k-th largest value, and at most ``k`` blocks do), so ``topk`` runs on those."""
    m, n = values.shape
    if n % block or n // block < k:
        return values.topk(k, dim=-1, sorted=False).indices
    blocks = values.view(m, n // block, block)
    best = blocks.amax(-1).topk(k, dim=-1, sorted=False).indices  # [M, k] block ids
    candidates = blocks.gather(1, best[..., None].expand(m, k, block)).view(m, k * block)
    pick = candidates.topk(k, dim=-1, sorted=False).indices  # [M, k] into candidates
    return best.gather(1, pick // block) * block + pick % block

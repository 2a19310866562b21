"""Sliding-window attention: a token attends to the last W tokens, itself included."""

from __future__ import annotations

from collections.abc import Mapping

from hybridkv.core._util import cdiv
from hybridkv.core.block_pool import NULL_BLOCK
from hybridkv.core.kinds.base import KindManager, KindRule
from hybridkv.core.specs import SlidingWindowSpec


class SlidingWindowRule(KindRule):
    """A hit at L needs only the ``cdiv(W - 1, block_size)`` blocks before L (the window)."""

    __slots__ = ("window", "contiguous")

    def __init__(self, spec: SlidingWindowSpec, group: int, *, enable_caching: bool) -> None:
        super().__init__(spec, group, enable_caching=enable_caching)
        self.window = spec.sliding_window
        self.contiguous = cdiv(spec.sliding_window - 1, spec.block_size)

    def find_longest_cache_hit(self, hashes: list[bytes], cached: Mapping[bytes, int],
                               max_tokens: int) -> tuple[int, list[int]]:
        get = cached.get
        need = self.contiguous
        n = min(max_tokens // self.block_size, len(hashes))
        run: list[int] = []  # cached blocks right to left, ending at index i + len(run)
        i = n - 1
        while i >= 0:
            hit = get(hashes[i])
            if hit is None:
                run.clear()
                i -= 1
                continue
            run.append(hit)
            if len(run) >= need:
                end = i + len(run)
                return end * self.block_size, [NULL_BLOCK] * i + run[::-1]
            i -= 1
        # A run that starts at block 0 is a hit even when shorter than the window.
        return len(run) * self.block_size, run[::-1]

    def hit_span(self, boundary: int) -> tuple[int, int]:
        end = boundary // self.block_size
        return max(0, end - self.contiguous), end

    @property
    def hit_reads(self) -> int | None:
        return max(1, self.contiguous)  # a window of one token still needs the block it ends in

    def skipped_tokens(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1)

    def drop_point(self, index: int) -> int:
        return (index + 1) * self.block_size + self.window - 1


class SlidingWindowManager(KindManager):
    """The tables of a sliding-window group: blocks behind the window are dropped."""

    drops_blocks = True
    __slots__ = ()

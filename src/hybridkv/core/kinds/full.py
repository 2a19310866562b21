"""Full (global) attention: every token attends to every earlier token."""

from __future__ import annotations

from collections.abc import Mapping

from hybridkv.core.kinds.base import NEVER, KindManager, KindRule, scan_left_to_right


class FullAttentionRule(KindRule):
    """A hit is the cached chain from the left, up to the first miss (MLA included)."""

    downward_closed = True
    __slots__ = ()

    def find_longest_cache_hit(self, hashes: list[bytes], cached: Mapping[bytes, int],
                               max_tokens: int) -> tuple[int, list[int]]:
        blocks = scan_left_to_right(cached, hashes, 0, min(max_tokens // self.block_size, len(hashes)))
        return len(blocks) * self.block_size, blocks

    @property
    def hit_reads(self) -> int | None:
        return NEVER


class FullAttentionManager(KindManager):
    """The tables of a full-attention group: every block stays until the sequence is freed."""

    __slots__ = ()

"""Chunked local attention (Llama 4): a token attends to the earlier tokens of its own chunk."""

from __future__ import annotations

from collections.abc import Mapping

from hybridkv.core._util import cdiv
from hybridkv.core.block_pool import NULL_BLOCK
from hybridkv.core.kinds.base import KindManager, KindRule, scan_left_to_right
from hybridkv.core.specs import ChunkedLocalAttentionSpec
from hybridkv.errors import InvalidInputError


class ChunkedLocalAttentionRule(KindRule):
    """Blocks before the current chunk are null in a hit; the chunk's blocks must be cached."""

    __slots__ = ("chunk",)

    def __init__(self, spec: ChunkedLocalAttentionSpec, group: int, *, enable_caching: bool) -> None:
        if spec.attention_chunk_size % spec.block_size:  # a chunk must start on a block boundary
            raise InvalidInputError(f"group {group}: attention_chunk_size={spec.attention_chunk_size} is not a "
                                    f"multiple of block_size={spec.block_size}")
        super().__init__(spec, group, enable_caching=enable_caching)
        self.chunk = spec.attention_chunk_size

    def find_longest_cache_hit(self, hashes: list[bytes], cached: Mapping[bytes, int],
                               max_tokens: int) -> tuple[int, list[int]]:
        chunk_start = (max_tokens // self.chunk) * self.chunk
        first = chunk_start // self.block_size
        end = min(max_tokens // self.block_size, len(hashes))
        blocks = scan_left_to_right(cached, hashes, first, end) if first < end else []
        return chunk_start + len(blocks) * self.block_size, [NULL_BLOCK] * first + blocks

    def hit_span(self, boundary: int) -> tuple[int, int]:
        return (boundary // self.chunk) * self.chunk // self.block_size, boundary // self.block_size

    def skipped_tokens(self, num_computed: int) -> int:
        return (num_computed // self.chunk) * self.chunk

    def drop_point(self, index: int) -> int:
        return cdiv((index + 1) * self.block_size, self.chunk) * self.chunk


class ChunkedLocalAttentionManager(KindManager):
    """The tables of a chunked-local group: blocks of finished chunks are dropped."""

    drops_blocks = True
    __slots__ = ()

"""One manager class per layer kind: hit rules and window rules."""

from __future__ import annotations

from hybridkv.core._util import cdiv
from hybridkv.core.block_pool import NULL_BLOCK, BlockPool
from hybridkv.core.kinds.base import NEVER, KindManager, scan_left_to_right
from hybridkv.core.sequence import Sequence
from hybridkv.core.specs import ChunkedLocalAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec


class FullAttentionManager(KindManager):
    """Global attention: a hit is the cached chain from the left, up to the first miss."""

    downward_closed = True
    __slots__ = ()

    def find_longest_cache_hit(self, hashes: list[bytes], max_tokens: int) -> tuple[int, list[int]]:
        blocks = scan_left_to_right(self.pool, self.group, hashes, 0, min(max_tokens // self.block_size, len(hashes)))
        return len(blocks) * self.block_size, blocks


class SlidingWindowManager(KindManager):
    """Sliding window of W tokens: a hit at L needs only the ``cdiv(W - 1, bs)`` blocks before L."""

    __slots__ = ("window", "contiguous")

    def __init__(self, spec: KVCacheSpec, group: int, pool: BlockPool, *, bound: int, enable_caching: bool) -> None:
        super().__init__(spec, group, pool, bound=bound, enable_caching=enable_caching)
        assert isinstance(spec, SlidingWindowSpec)
        self.window = spec.sliding_window
        self.contiguous = cdiv(spec.sliding_window - 1, spec.block_size)

    def find_longest_cache_hit(self, hashes: list[bytes], max_tokens: int) -> tuple[int, list[int]]:
        index = self.pool.index[self.group]
        need = self.contiguous
        n = min(max_tokens // self.block_size, len(hashes))
        run: list[int] = []  # cached blocks right to left, ending at index i + len(run)
        i = n - 1
        while i >= 0:
            hit = index.get(hashes[i])
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

    def hit_window(self, boundary: int) -> tuple[int, int]:
        end = boundary // self.block_size
        return max(0, end - self.contiguous), end

    def skipped_tokens(self, num_computed: int) -> int:
        return max(0, num_computed - self.window + 1)

    def drop_point(self, index: int) -> int:
        return (index + 1) * self.block_size + self.window - 1


class ChunkedLocalAttentionManager(KindManager):
    """Attention within chunks of C tokens: blocks before the current chunk are null hits."""

    __slots__ = ("chunk",)

    def __init__(self, spec: KVCacheSpec, group: int, pool: BlockPool, *, bound: int, enable_caching: bool) -> None:
        super().__init__(spec, group, pool, bound=bound, enable_caching=enable_caching)
        assert isinstance(spec, ChunkedLocalAttentionSpec)
        self.chunk = spec.attention_chunk_size

    def find_longest_cache_hit(self, hashes: list[bytes], max_tokens: int) -> tuple[int, list[int]]:
        chunk_start = (max_tokens // self.chunk) * self.chunk
        first = chunk_start // self.block_size
        end = min(max_tokens // self.block_size, len(hashes))
        blocks = scan_left_to_right(self.pool, self.group, hashes, first, end) if first < end else []
        return chunk_start + len(blocks) * self.block_size, [NULL_BLOCK] * first + blocks

    def hit_window(self, boundary: int) -> tuple[int, int]:
        return (boundary // self.chunk) * self.chunk // self.block_size, boundary // self.block_size

    def skipped_tokens(self, num_computed: int) -> int:
        return (num_computed // self.chunk) * self.chunk

    def drop_point(self, index: int) -> int:
        return cdiv((index + 1) * self.block_size, self.chunk) * self.chunk


class MambaManager(KindManager):
    """Recurrent state with checkpoints (modes ``align`` and ``all``).

    Table entry ``i`` holds the state after ``(i + 1) * block_size`` tokens once that block is
    full; the running state lives in the last entry. In ``align`` mode a step allocates one
    block, for the state at the step's end, and entries in between stay null; the entry a
    state was read from is dropped once the next one is written. A hit resumes from the latest
    cached checkpoint.
    """

    __slots__ = ("align",)

    def __init__(self, spec: KVCacheSpec, group: int, pool: BlockPool, *, bound: int, enable_caching: bool) -> None:
        super().__init__(spec, group, pool, bound=bound, enable_caching=enable_caching)
        assert isinstance(spec, MambaSpec)
        self.align = spec.mode == "align"

    def find_longest_cache_hit(self, hashes: list[bytes], max_tokens: int) -> tuple[int, list[int]]:
        index = self.pool.index[self.group]
        for i in range(min(max_tokens // self.block_size, len(hashes)) - 1, -1, -1):
            hit = index.get(hashes[i])
            if hit is not None:
                return (i + 1) * self.block_size, [NULL_BLOCK] * i + [hit]
        return 0, []

    def hit_window(self, boundary: int) -> tuple[int, int]:
        end = boundary // self.block_size
        return max(0, end - 1), end

    def skipped_tokens(self, num_computed: int) -> int:
        return max(0, num_computed - 1) if self.align else 0

    def drop_point(self, index: int) -> int:
        return (index + 1) * self.block_size + 1 if self.align else NEVER

    def _new_indices(self, length: int, num_computed: int, num_tokens: int) -> range:
        if not self.align:
            return super()._new_indices(length, num_computed, num_tokens)
        end = cdiv(num_tokens, self.block_size)
        return range(end - 1, end) if end > length else range(end, end)

    def whole_sequence_blocks(self, num_tokens: int) -> int:
        return self.bound if self.align else super().whole_sequence_blocks(num_tokens)

    def cache_full_blocks(self, seq_id: str, hashes: list[bytes], num_tokens: int) -> None:
        if not self.align:
            super().cache_full_blocks(seq_id, hashes, num_tokens)
            return
        # Only a step that ends on a block boundary leaves a checkpoint: the state after exactly
        # (i + 1) * block_size tokens, in the block the step wrote.
        if not self.caching:
            return
        table = self.tables[seq_id]
        end = num_tokens // self.block_size
        if num_tokens % self.block_size == 0 and self.num_cached[seq_id] < end <= min(len(table), len(hashes)):
            b = table[end - 1]
            if b != NULL_BLOCK and self.pool.block_hash[b] is None:
                self.pool.cache_blocks(self.group, [b], [hashes[end - 1]])
        self.num_cached[seq_id] = max(self.num_cached[seq_id], end)


class MambaNoCacheManager(KindManager):
    """Recurrent state without checkpoints (mode ``none``): one block per sequence, no hits."""

    __slots__ = ()

    def find_longest_cache_hit(self, hashes: list[bytes], max_tokens: int) -> tuple[int, list[int]]:
        return 0, []

    def hit_window(self, boundary: int) -> tuple[int, int]:
        return 0, 0

    def _new_indices(self, length: int, num_computed: int, num_tokens: int) -> range:
        return range(0, 1) if length == 0 else range(0, 0)

    def whole_sequence_blocks(self, num_tokens: int) -> int:
        return 1

    def idle_limit(self, seq_id: str) -> int:
        return NEVER if self.tables.get(seq_id) else 0


class CrossAttentionManager(KindManager):
    """Cross attention: blocks for the encoder tokens, allocated once, never prefix-cached.

    It does not constrain decoder-side hits: its KV comes from the encoder pass.
    """

    constrains_hits = False
    __slots__ = ("encoder_tokens",)

    def __init__(self, spec: KVCacheSpec, group: int, pool: BlockPool, *, bound: int, enable_caching: bool) -> None:
        super().__init__(spec, group, pool, bound=bound, enable_caching=enable_caching)
        self.encoder_tokens: dict[str, int] = {}

    def find_longest_cache_hit(self, hashes: list[bytes], max_tokens: int) -> tuple[int, list[int]]:
        return max_tokens, []

    def hit_window(self, boundary: int) -> tuple[int, int]:
        return 0, 0

    def prepare(self, seq: Sequence) -> None:
        self.encoder_tokens[seq.seq_id] = seq.num_encoder_tokens

    def num_new_blocks(self, seq_id: str, hit_blocks: list[int], num_computed: int,
                       num_external: int, num_tokens: int) -> int:
        if seq_id in self.tables:
            return 0
        return cdiv(self.encoder_tokens.get(seq_id, 0), self.block_size)

    def whole_sequence_blocks(self, num_tokens: int) -> int:
        return 0  # counted by num_new_blocks at the first allocation

    def idle_limit(self, seq_id: str) -> int:
        return NEVER if seq_id in self.tables else 0

    def grow_range(self, seq_id: str, num_computed: int, num_tokens: int) -> range:
        return range(0)  # all blocks come with the first allocation

    def adopt(self, seq_id: str, blocks: list[int]) -> None:
        self.num_cached[seq_id] = 0

    def extend(self, seq_id: str, num_computed: int, num_tokens: int, *, allow_reserved: bool) -> list[int]:
        if seq_id in self.tables:
            return []
        n = cdiv(self.encoder_tokens.get(seq_id, 0), self.block_size)
        new = self.pool.allocate(n, allow_reserved=allow_reserved) if n else []
        self.tables[seq_id] = list(new)
        self.num_cached.setdefault(seq_id, 0)
        return new

    def pop_table(self, seq_id: str) -> tuple[int, list[int]]:
        self.encoder_tokens.pop(seq_id, None)
        return super().pop_table(seq_id)


class NoCacheManager(KindManager):
    """Encoder-only attention: no KV cache, no blocks, no constraint on hits."""

    constrains_hits = False
    __slots__ = ()

    def find_longest_cache_hit(self, hashes: list[bytes], max_tokens: int) -> tuple[int, list[int]]:
        return max_tokens, []

    def hit_window(self, boundary: int) -> tuple[int, int]:
        return 0, 0

    def _new_indices(self, length: int, num_computed: int, num_tokens: int) -> range:
        return range(0, 0)

    def whole_sequence_blocks(self, num_tokens: int) -> int:
        return 0

    def idle_limit(self, seq_id: str) -> int:
        return NEVER

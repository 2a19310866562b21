"""The per-group manager interface and the behaviour most kinds share.

One manager per KV-cache group. It owns the group's block tables and answers four questions
for its kind: the longest cache hit, which tokens the attention no longer needs, how many
blocks an allocation takes, and which blocks a hit at a given position needs (for retention).

Token layout of one allocation, left to right::

    | computed (or local hit) | external | new | lookahead |

``computed`` tokens already have KV in the table (for a new sequence: the adopted hit);
``external`` tokens get blocks an external tier writes; ``new`` tokens are computed this step;
``lookahead`` tokens get slots but are never registered in the prefix cache.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import compress, takewhile

from hybridkv.core._util import cdiv
from hybridkv.core.block_pool import NULL_BLOCK, BlockPool
from hybridkv.core.sequence import Sequence
from hybridkv.core.specs import KVCacheSpec

_NOTHING = range(0)

NEVER = 1 << 62
"""A token count no sequence reaches: the limit of a group that never has work to do."""


class KindManager:
    """Block tables of one group. Subclasses override the kind-specific hooks."""

    # Does the group's hit constrain the hit all groups agree on?
    constrains_hits = True
    # Is the hit downward-closed (a hit at L means a hit at every shorter aligned length)?
    downward_closed = False

    __slots__ = ("spec", "group", "pool", "block_size", "bound", "caching", "tables", "num_cached", "num_dropped")

    def __init__(
        self, spec: KVCacheSpec, group: int, pool: BlockPool, *, bound: int, enable_caching: bool
    ) -> None:
        self.spec = spec
        self.group = group
        self.pool = pool
        self.block_size = spec.block_size
        self.bound = bound  # spec.max_blocks_per_request(...): the seed-001 per-request bound
        self.caching = enable_caching and spec.prefix_cacheable
        self.tables: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}  # leading table entries already registered
        self.num_dropped: dict[str, int] = {}  # leading table entries already dropped (all null)

    # ------------------------------------------------------------------ hits
    def find_longest_cache_hit(self, hashes: list[bytes], max_tokens: int) -> tuple[int, list[int]]:
        """Longest hit of at most ``max_tokens`` tokens: (tokens, block ids with 0 for null)."""
        raise NotImplementedError

    def hit_window(self, boundary: int) -> tuple[int, int]:
        """Block indices ``[first, end)`` whose KV a hit ending at token ``boundary`` reads."""
        return 0, boundary // self.block_size

    # ------------------------------------------------------------------ windows
    def skipped_tokens(self, num_computed: int) -> int:
        """Leading tokens the attention of the next token no longer reads."""
        return 0

    def drop_point(self, index: int) -> int:
        """Fewest computed tokens at which table entry ``index`` is skipped (``NEVER`` if never)."""
        return NEVER

    def remove_skipped(self, seq_id: str, num_computed: int) -> list[tuple[int, int]]:
        """Null out wholly skipped blocks; return ``(index, block)`` pairs, last index first.

        The caller releases the returned blocks (through the retention policy).
        """
        skipped = self.skipped_tokens(num_computed)
        if not skipped:
            return []
        table = self.tables.get(seq_id)
        if not table:
            return []
        end = min(skipped // self.block_size, len(table))
        start = self.num_dropped.get(seq_id, 0)
        if end <= start:
            return []
        self.num_dropped[seq_id] = end
        freed: list[tuple[int, int]] = []
        for i in range(end - 1, start - 1, -1):
            b = table[i]
            if b != NULL_BLOCK:
                freed.append((i, b))
                table[i] = NULL_BLOCK
        return freed

    # ------------------------------------------------------------------ allocation
    def prepare(self, seq: Sequence) -> None:
        """Note what the kind needs to know about a sequence before its first allocation."""

    def held_blocks(self, seq_id: str) -> int:
        """Non-null blocks the sequence holds in this group."""
        table = self.tables.get(seq_id, [])
        return len(table) - table.count(NULL_BLOCK)

    def adoptable(self, hit_blocks: list[int], num_computed: int) -> list[int]:
        """The hit blocks a new sequence keeps once ``num_computed`` tokens (hit + external) are in."""
        skipped = min(self.skipped_tokens(num_computed) // self.block_size, len(hit_blocks))
        return [NULL_BLOCK] * skipped + hit_blocks[skipped:] if skipped else hit_blocks

    def num_new_blocks(self, seq_id: str, hit_blocks: list[int], num_computed: int,
                       num_external: int, num_tokens: int) -> int:
        """Fresh blocks an allocation up to ``num_tokens`` slots needs (hit blocks excluded).

        For a new sequence ``hit_blocks`` is its adopted hit and ``num_computed`` the hit length;
        for a running one ``hit_blocks`` is empty.
        """
        if seq_id in self.tables:
            return len(self.grow_range(seq_id, num_computed, num_tokens))
        length = len(hit_blocks)
        computed = num_computed + num_external
        count = 0
        if num_external:  # allocated in a phase of its own (see ``extend``), so counted apart
            ext = self._new_indices(length, computed, computed)
            count = len(ext)
            length = max(length, ext.stop)
        return count + len(self._new_indices(length, computed, num_tokens))

    def _new_indices(self, length: int, num_computed: int, num_tokens: int) -> range:
        """Indices past ``length`` that need a real block to hold ``num_tokens`` slots."""
        first = max(length, self.skipped_tokens(num_computed) // self.block_size)
        return range(first, cdiv(num_tokens, self.block_size))

    def whole_sequence_blocks(self, num_tokens: int) -> int:
        """Blocks held at the peak for a sequence of ``num_tokens`` tokens (seed-001 bound)."""
        return min(cdiv(num_tokens, self.block_size), self.bound)

    def adopt(self, seq_id: str, blocks: list[int]) -> None:
        """Start a table from adopted hit blocks (the caller has touched them)."""
        self.tables[seq_id] = list(blocks)
        self.num_cached[seq_id] = len(blocks)
        self.num_dropped[seq_id] = _leading_nulls(blocks)

    def extend(self, seq_id: str, num_computed: int, num_tokens: int, *, allow_reserved: bool) -> list[int]:
        """Grow the table to hold ``num_tokens`` slots; return the fresh block ids."""
        if seq_id not in self.tables:
            self.tables[seq_id] = []
            self.num_cached[seq_id] = 0
        return self.grow(seq_id, self.grow_range(seq_id, num_computed, num_tokens), allow_reserved=allow_reserved)

    def grow_range(self, seq_id: str, num_computed: int, num_tokens: int) -> range:
        """Table indices that need a fresh block for the table to hold ``num_tokens`` slots."""
        table = self.tables[seq_id]
        if -(-num_tokens // self.block_size) <= len(table):
            return _NOTHING  # the table already covers the step (most steps)
        return self._new_indices(len(table), num_computed, num_tokens)

    def grow(self, seq_id: str, indices: range, *, allow_reserved: bool) -> list[int]:
        """Give ``indices`` (from ``grow_range``) fresh blocks, null entries before them; return the blocks."""
        table = self.tables[seq_id]
        if indices.stop <= len(table):
            return []
        new = self.pool.allocate(len(indices), allow_reserved=allow_reserved) if indices else []
        table.extend([NULL_BLOCK] * (indices.start - len(table)))
        table.extend(new)
        return new

    def idle_limit(self, seq_id: str) -> int:
        """Most slots (computed + new + lookahead tokens) a running sequence's step can reach, with at
        least one new token, while this group has no block to allocate, register or drop."""
        bs = self.block_size
        limit = len(self.tables[seq_id]) * bs  # past it, a block to allocate
        if self.caching:
            registered = (self.num_cached[seq_id] + 1) * bs - 1  # past it, a full block to register
            limit = registered if registered < limit else limit
        # A step reaching ``dropped`` slots has computed at most dropped - 1 tokens: nothing to drop yet.
        dropped = self.drop_point(self.num_dropped.get(seq_id, 0))
        return dropped if dropped < limit else limit

    def cache_full_blocks(self, seq_id: str, hashes: list[bytes], num_tokens: int) -> None:
        """Register the non-null full blocks covering the first ``num_tokens`` tokens."""
        if not self.caching:
            return
        table = self.tables[seq_id]
        start = self.num_cached[seq_id]
        end = min(num_tokens // self.block_size, len(hashes), len(table))
        if end <= start:
            return
        ids = table[start:end]
        hs = hashes[start:end]
        block_hash = self.pool.block_hash
        new = [b != NULL_BLOCK and block_hash[b] is None for b in ids]
        if not all(new):  # null entries and blocks cached already (adopted hits) stay as they are
            ids = list(compress(ids, new))
            hs = list(compress(hs, new))
        self.pool.cache_blocks(self.group, ids, hs)
        self.num_cached[seq_id] = end

    def pop_table(self, seq_id: str) -> tuple[int, list[int]]:
        """Forget the sequence; return ``(offset, entries)``: its table from the first entry not
        yet dropped (everything before ``offset`` is null). The caller frees the blocks."""
        self.num_cached.pop(seq_id, None)
        offset = self.num_dropped.pop(seq_id, 0)
        table = self.tables.pop(seq_id, [])
        return offset, table[offset:]


def _leading_nulls(blocks: list[int]) -> int:
    """How many entries at the start of a hit table are the null block.

    In a hit the null entries always lead (positions behind a window, before a chunk, superseded
    states), so a binary search finds the first real block.
    """
    return bisect_left(blocks, True, key=bool)


def scan_left_to_right(pool: BlockPool, group: int, hashes: list[bytes], start: int, end: int) -> list[int]:
    """Cached blocks for ``hashes[start:end]`` up to the first miss."""
    # takewhile(bool, ...) stops at the first miss (cached block ids are never 0), so the chain
    # costs one C-speed dict lookup per block and nothing past its end.
    return list(takewhile(bool, map(pool.index[group].get, hashes[start:end])))  # type: ignore[arg-type]

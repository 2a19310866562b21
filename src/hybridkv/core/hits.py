"""The hybrid coordinator: one hit all groups agree on, and adoption in two phases.

Hits of different kinds are not alike: full attention's hit is downward-closed (a hit at L is
a hit at every shorter length), a sliding window's or a recurrent state's is not (a hit at L
says nothing about L - 16). The agreed hit is therefore a fixed point: full-attention groups
set an upper bound once, then the other groups are re-queried whenever the bound shrinks,
until one pass changes nothing. Every length is rounded to ``alignment``, a boundary every
group's block size divides.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.core._util import gcd_all, lcm_all
from hybridkv.core.block_pool import NULL_BLOCK, BlockPool
from hybridkv.core.hashing import BlockHasher
from hybridkv.core.kinds import KindManager
from hybridkv.core.sequence import Sequence


@dataclass(frozen=True, slots=True)
class CacheHit:
    """The prefix of a sequence every group can serve from the cache.

    ``block_ids[g]`` is group ``g``'s table prefix for the hit (0 = null block).
    ``full_hit_tokens`` is how far the growing (full-attention) groups alone matched, and
    ``max_hit_tokens`` the longest hit the sequence allowed (its length - 1, aligned): a full
    match that stops short of it marks a shared-prefix junction.
    """

    seq_id: str
    num_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    full_hit_tokens: int = 0
    max_hit_tokens: int = 0
    epoch: int = -1
    """The pool's eviction count at lookup: while unchanged, every hit block is still cached."""

    @property
    def num_blocks(self) -> int:
        """Non-null blocks the hit adopts, over all groups."""
        return sum(1 for ids in self.block_ids for b in ids if b != NULL_BLOCK)


class Coordinator:
    """Fans allocation out to the per-group managers and finds agreed hits."""

    __slots__ = ("pool", "groups", "hasher", "hash_block_size", "alignment", "anchor", "_first",
                 "_rest")

    def __init__(self, pool: BlockPool, groups: list[KindManager], hasher: BlockHasher) -> None:
        self.pool = pool
        self.groups = groups
        self.hasher = hasher
        cacheable = [g for g in groups if g.caching]
        self.hash_block_size = gcd_all([g.block_size for g in cacheable]) or 1
        self.alignment = lcm_all([g.block_size for g in groups if g.constrains_hits])
        self._first = [g for g in groups if g.constrains_hits and g.downward_closed]
        self._rest = [g for g in groups if g.constrains_hits and not g.downward_closed]
        # The anchor: the first growing, cached group. Retention ties windows to its blocks.
        self.anchor: KindManager | None = next(
            (g for g in groups if g.caching and g.spec.grows_with_sequence and g.downward_closed), None
        )

    # ------------------------------------------------------------------ hashes
    def hashes(self, seq: Sequence, group: KindManager) -> list[bytes]:
        """The sequence's block hashes at ``group``'s block size."""
        if not group.caching:
            return []
        base = seq.block_hashes(self.hasher, self.hash_block_size)
        k = group.block_size // self.hash_block_size
        # Chained hashes: the hash at the last sub-block fingerprints the whole larger block.
        return base if k == 1 else base[k - 1 :: k]

    # ------------------------------------------------------------------ hits
    def find_hit(self, seq: Sequence) -> CacheHit:
        """The longest prefix every group can serve, without side effects."""
        align = self.alignment
        max_hit = (seq.num_tokens - 1) // align * align
        found: dict[int, list[int]] = {}
        bound = max_hit
        for g in self._first:
            tokens, blocks = g.find_longest_cache_hit(self.hashes(seq, g), bound)
            found[g.group] = blocks
            bound = min(bound, tokens // align * align)
        full_hit = bound
        changed = True
        while changed and bound > 0:
            changed = False
            for g in self._rest:
                tokens, blocks = g.find_longest_cache_hit(self.hashes(seq, g), bound)
                found[g.group] = blocks
                if tokens < bound:
                    bound = tokens // align * align
                    changed = True
        block_ids = tuple(
            tuple(found.get(g.group, ())[: bound // g.block_size]) if g.constrains_hits and bound else ()
            for g in self.groups
        )
        return CacheHit(seq.seq_id, bound, block_ids, full_hit, max_hit, self.pool.evictions)

    # ------------------------------------------------------------------ allocation
    def adopt(self, seq: Sequence, hit_blocks: list[list[int]], live: list[list[int]],
              free: list[list[int]]) -> None:
        """Phase 1 of seed 002: reference the local hit blocks of *every* group first.

        Only after this may any group allocate (phase 2): an allocation pops free blocks, and a
        hit block not yet referenced is a free block it could pop. ``live[g]`` is group ``g``'s
        hit without null entries and ``free[g]`` its unreferenced blocks.
        """
        for g, blocks, held, unheld in zip(self.groups, hit_blocks, live, free):
            self.pool.touch(held, unheld)
            g.adopt(seq.seq_id, blocks)

"""The prefix hit every group agrees on.

Hits of different kinds are not alike: full attention's hit is downward-closed (a hit at L is a
hit at every shorter length), a sliding window's or a recurrent state's is not (a hit at L says
nothing about L - 16). The agreed hit is therefore a fixed point: downward-closed groups set an
upper bound once, then the other groups are re-queried whenever the bound shrinks, until one
pass changes nothing. Every length is rounded to the *hit alignment*, a boundary every group's
block size divides.

``agreed_hit`` is the one implementation of that rule. The manager runs it against the device
pool's index; external tiers and cluster indexes run it against what they hold, so a hit means
the same everywhere. ``verify_group_hit`` checks a hit the manager did not just find (from another
manager, hand-built, stale) against the pool, group by group, before anything is adopted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hybridkv.core.block_pool import NULL_BLOCK, BlockPool
from hybridkv.core.kinds import KindManager
from hybridkv.errors import InvalidInputError


@dataclass(frozen=True, slots=True)
class CacheHit:
    """The prefix of a sequence every group can serve from the cache.

    ``block_ids[g]`` is group ``g``'s table prefix for the hit (0 = null block).
    ``full_hit_tokens`` is how far the downward-closed (full-attention) groups alone matched, and
    ``max_hit_tokens`` the longest hit the sequence allowed (its length - 1, aligned): a full match
    that stops short of it marks a shared-prefix junction.
    ``epoch``, ``owner`` and ``content`` let the manager that found the hit accept it cheaply: the
    pool's eviction count at lookup, the manager itself, and the block hash at the hit's end (the
    chain covers the whole prefix and the cache salt). A hit without them is verified block by block.
    """

    seq_id: str
    num_tokens: int
    block_ids: tuple[tuple[int, ...], ...]
    full_hit_tokens: int = 0
    max_hit_tokens: int = 0
    epoch: int = -1
    owner: object = None
    content: bytes | None = None

    @property
    def num_blocks(self) -> int:
        """Non-null blocks the hit adopts, over all groups."""
        return sum(1 for ids in self.block_ids for b in ids if b != NULL_BLOCK)


def agreed_hit(groups: Sequence[KindManager], hashes: Callable[[KindManager], list[bytes]],
               cached: Callable[[KindManager], Mapping[bytes, int]], max_hit: int, alignment: int
               ) -> tuple[int, int, list[list[int]]]:
    """The longest prefix of at most ``max_hit`` tokens every group can serve.

    ``hashes(g)`` is the sequence's block hashes at group ``g``'s block size and ``cached(g)`` the
    mapping of the hashes ``g`` holds to block ids. Returns ``(tokens, full_hit_tokens, blocks)``:
    the agreed hit, how far the downward-closed groups alone reached, and per group (in order)
    its table prefix for the hit (empty for groups that do not constrain hits).
    """
    found: dict[int, list[int]] = {}
    bound = max_hit
    rest: list[KindManager] = []
    for g in groups:
        if not g.constrains_hits:
            continue
        if not g.downward_closed:
            rest.append(g)
            continue
        tokens, blocks = g.find_longest_cache_hit(hashes(g), cached(g), bound)
        found[g.group] = blocks
        bound = min(bound, tokens // alignment * alignment)
    full_hit = bound
    changed = True
    while changed and bound > 0:
        changed = False
        for g in rest:
            tokens, blocks = g.find_longest_cache_hit(hashes(g), cached(g), bound)
            found[g.group] = blocks
            if tokens < bound:
                bound = tokens // alignment * alignment
                changed = True
    blocks_per_group = [
        found.get(g.group, [])[: bound // g.block_size] if g.constrains_hits and bound else []
        for g in groups
    ]
    return bound, full_hit, blocks_per_group


def verify_group_hit(g: KindManager, pool: BlockPool, hashes: list[bytes], ids: object, num_tokens: int,
                     owner: str) -> None:
    """Raise ``InvalidInputError`` unless ``ids`` is what group ``g`` reads for a hit of ``num_tokens``
    tokens (null before the group's span, real blocks in it) and every block in the span holds the
    sequence's own hash (``hashes``) in ``pool``, in this group."""
    where = f"hit of {num_tokens} tokens for {owner}, group {g.group}"
    if not isinstance(ids, tuple) or any(type(b) is not int for b in ids):
        raise InvalidInputError(f"{where}: block ids must be a tuple of integers")
    if not num_tokens or not g.constrains_hits:
        if any(ids):
            raise InvalidInputError(f"{where}: the group adopts no blocks, got {ids}")
        return
    first, end = g.hit_span(num_tokens)
    if len(ids) != num_tokens // g.block_size:
        raise InvalidInputError(f"{where}: {len(ids)} block ids, the hit needs {num_tokens // g.block_size}")
    if any(ids[:first]):
        raise InvalidInputError(f"{where}: blocks before index {first} are outside what a hit reads")
    span = ids[first:end]
    if not all(0 < b < pool.num_blocks for b in span):
        raise InvalidInputError(f"{where}: block ids {span} must all be in 1..{pool.num_blocks - 1}")
    if [pool.block_hash[b] for b in span] != hashes[first:end] or any(pool.block_group[b] != g.group for b in span):
        raise InvalidInputError(
            f"{where}: the blocks do not hold this sequence's prefix (evicted since the lookup, "
            f"found for other tokens, or by another manager): look the sequence up again"
        )

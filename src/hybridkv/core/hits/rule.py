"""The hit rule: the prefix hit every group agrees on (``agreed_hit``), with block ids.

A fixed point: downward-closed groups (full attention) bound the hit once, the others are asked
again whenever it shrinks. ``HitRules`` runs it without a pool (tiers, indexes);
``verify_group_hit`` checks a hit the manager did not just find.
See docs/ARCHITECTURE.md, "The hit rule and its forms".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.core._util import gcd_all, lcm_all
from hybridkv.core.block_pool import NULL_BLOCK, BlockPool
from hybridkv.core.hashing import BlockHasher, HashAlgorithm
from hybridkv.core.kinds import KindRule, kind_rule_for
from hybridkv.core.layout import KVCacheLayout
from hybridkv.core.sequence import KVSequence
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


LOSS_CAUSES = ("window_evicted", "state_evicted", "state_not_checkpointed")
"""Why a hybrid hit stops short of its full-attention prefix: a sliding-window or chunked-local
group lacks blocks the hit reads (dropped, then evicted); a recurrent group lacks the state there,
because eviction took it, or because no step ever checkpointed it there."""


def hit_losses(groups: Sequence[KindRule], hashes: Callable[[KindRule], list[bytes]],
               cached: Callable[[KindRule], Mapping[bytes, int]], max_hit: int, alignment: int,
               evicted: Callable[[KindRule, list[bytes]], bool]) -> dict[str, int]:
    """Why the agreed hit stops short of the full-attention match: ``agreed_hit``'s cuts, each
    attributed to its cause (``{cause: tokens}``, summing to the gap). ``evicted(g, hashes)`` says
    whether eviction took any of a recurrent group's states at those block hashes."""
    losses: dict[str, int] = {}

    def record(g: KindRule, bound: int, cut: int) -> None:
        if not g.registers_when_computed:
            cause = "window_evicted"
        else:
            states = hashes(g)[cut // g.block_size:bound // g.block_size]
            cause = "state_evicted" if evicted(g, states) else "state_not_checkpointed"
        losses[cause] = losses.get(cause, 0) + bound - cut

    agreed_hit(groups, hashes, cached, max_hit, alignment, on_cut=record)
    return losses


def agreed_hit(groups: Sequence[KindRule], hashes: Callable[[KindRule], list[bytes]],
               cached: Callable[[KindRule], Mapping[bytes, int]], max_hit: int, alignment: int,
               on_cut: Callable[[KindRule, int, int], None] | None = None
               ) -> tuple[int, int, list[list[int]]]:
    """The longest prefix of at most ``max_hit`` tokens every group can serve.

    ``hashes(g)`` is the sequence's block hashes at group ``g``'s block size and ``cached(g)`` the
    mapping of the hashes ``g`` holds to block ids. Returns ``(tokens, full_hit_tokens, blocks)``:
    the agreed hit, how far the downward-closed groups alone reached, and per group (in order)
    its table prefix for the hit (empty for groups that do not constrain hits). ``on_cut(g, bound,
    cut)``, when given, hears each time a group that is not downward-closed lowers the bound.
    """
    found: dict[int, list[int]] = {}
    bound = max_hit
    rest: list[KindRule] = []
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
                cut = tokens // alignment * alignment
                if on_cut is not None:
                    on_cut(g, bound, cut)
                bound = cut
                changed = True
    blocks_per_group = [
        found.get(g.group, [])[: bound // g.block_size] if g.constrains_hits and bound else []
        for g in groups
    ]
    return bound, full_hit, blocks_per_group


def verify_group_hit(g: KindRule, pool: BlockPool, hashes: list[bytes], ids: object, num_tokens: int,
                     owner: str) -> None:
    """Raise ``InvalidInputError`` unless ``ids`` is what group ``g`` reads for a hit of ``num_tokens``
    tokens (null before the group's span, real blocks in it) and every block in the span holds the
    sequence's own hash (``hashes``) in ``pool``, in this group."""
    where = f"hit of {num_tokens} tokens for {owner}, group {g.group}"
    if not isinstance(ids, tuple) or any(type(b) is not int for b in ids):
        raise InvalidInputError(f"{where}: block ids must be a tuple of integers")
    if not num_tokens or not g.constrains_hits:
        if ids:
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


class HitRules:
    """The hit rules of a layout, without a pool: how much of a sequence a cache holding given block
    hashes per group could serve. External tiers and cluster indexes use it to answer "what would
    this cache hit?" exactly as a ``KVCacheManager`` with the same layout would; the manager holds
    one (``KVCacheManager.rules``), and its groups' tables follow the same rules.

    The rules of a kind do not depend on ``max_model_len`` or ``max_num_batched_tokens`` (they bound
    a manager's tables): they are taken so that the rules are built as the manager is.
    """

    def __init__(self, layout: KVCacheLayout, max_model_len: int, max_num_batched_tokens: int | None = None, *,
                 enable_prefix_caching: bool = True, hash_algorithm: HashAlgorithm = "sha256") -> None:
        self.layout = layout
        self.groups: list[KindRule] = [
            kind_rule_for(g.spec, i, enable_caching=enable_prefix_caching) for i, g in enumerate(layout.groups)
        ]
        caching = [g for g in self.groups if g.caching]
        self.caching_groups = [g.group for g in caching]
        """Indices of the groups that keep a prefix cache (the only ones with hashes)."""
        self.hash_block_size = gcd_all([g.block_size for g in caching]) or 1
        self.hit_alignment = lcm_all([g.block_size for g in self.groups if g.constrains_hits])
        self.hasher = BlockHasher(hash_algorithm)
        self.hits_possible = bool(caching) and all(g.caching for g in self.groups if g.constrains_hits)

    def block_hashes(self, seq: KVSequence, group: int) -> list[bytes]:
        """The sequence's full-block hashes at ``group``'s block size (empty without a cache). The list
        is cached on the sequence: do not mutate it."""
        g = self.groups[group]
        if not g.caching:
            return []
        base = seq.block_hashes(self.hasher, self.hash_block_size)
        k = g.block_size // self.hash_block_size
        # Chained hashes: the hash at the last sub-block fingerprints the whole larger block.
        return base if k == 1 else base[k - 1 :: k]

    def hit_span(self, group: int, num_tokens: int) -> range:
        """Table indices of ``group`` a hit ending at ``num_tokens`` reads."""
        g = self.groups[group]
        first, end = g.hit_span(num_tokens) if g.caching or not g.constrains_hits else (0, 0)
        return range(first, end)

    def longest_hit(self, seq: KVSequence, cached: Mapping[int, Mapping[bytes, Any]], *, start: int = 0,
                    limit: int | None = None, hashes: Callable[[int], list[bytes]] | None = None) -> int:
        """The longest hit (tokens, at most ``limit``, never the last token) every group can serve when
        group ``g`` holds the hashes that are keys of ``cached[g]`` and the sequence's first ``start``
        tokens are a hit already (a local prefix an external tier extends). ``hashes(g)`` may supply
        the sequence's hashes per group (default: ``block_hashes``)."""
        align = self.hit_alignment
        cap = (seq.num_tokens - 1) // align * align
        if limit is not None:
            cap = min(cap, limit // align * align)
        if cap <= start or not self.hits_possible:
            return start
        of = hashes or (lambda group: self.block_hashes(seq, group))
        empty: dict[bytes, Any] = {}

        def held(g: KindRule) -> Mapping[bytes, Any]:
            have = cached.get(g.group, empty)
            if not start:
                return have
            local = dict.fromkeys(of(g.group)[: start // g.block_size], 1)
            local.update(have)
            return local

        tokens, _, _ = agreed_hit(self.groups, lambda g: of(g.group), held, cap, align)
        return max(tokens, start)

"""The fast form of the hit rule: the agreed hit as a length only, for an index's hot path.

``FastHits`` serves layouts whose constraining groups decide a hit by the blocks before it alone
(``KindRule.hit_reads``); ``FastHits.for_rules`` returns None for any other layout.
See docs/ARCHITECTURE.md, "The hit rule and its forms".
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hybridkv.core.hits.rule import HitRules
from hybridkv.core.kinds.base import NEVER


class FastHits:
    """The hit length for a layout whose kinds say what a hit reads (see the module docstring)."""

    __slots__ = ("alignment", "chains", "spans")

    def __init__(self, alignment: int, chains: list[tuple[int, int]], spans: list[tuple[int, int, int]]) -> None:
        self.alignment = alignment
        self.chains = chains
        """``(group, block_size)`` of the downward-closed (full-attention) groups."""
        self.spans = spans
        """``(group, block_size, blocks needed before the hit point)`` of the other groups."""

    @classmethod
    def for_rules(cls, rules: HitRules) -> FastHits | None:
        """The fast form of ``rules``, or None when a constraining group's hit is not decided by the
        blocks before it alone (``KindRule.hit_reads``)."""
        if not rules.hits_possible:
            return None
        chains: list[tuple[int, int]] = []
        spans: list[tuple[int, int, int]] = []
        for g in rules.groups:
            if not g.constrains_hits:
                continue
            need = g.hit_reads
            if need is None or g.downward_closed != (need == NEVER):
                return None
            if g.downward_closed:
                chains.append((g.group, g.block_size))
            else:
                spans.append((g.group, g.block_size, need))
        return cls(rules.hit_alignment, chains, spans)

    def longest_hit(self, num_tokens: int, held: Mapping[int, Mapping[bytes, object]],
                    hashes: Callable[[int], list[bytes]], limit: int | None = None) -> int:
        """The longest hit (tokens, never the last token, at most ``limit``) when group ``g`` holds the
        keys of ``held[g]``; ``hashes(g)`` is the request's hashes at ``g``'s block size."""
        align = self.alignment
        bound = (num_tokens - 1) // align * align
        if limit is not None:
            bound = min(bound, limit // align * align)
        empty: Mapping[bytes, object] = {}
        for group, size in self.chains:
            if bound <= 0:
                return 0
            h = hashes(group)
            n = min(bound // size, len(h))
            flags = list(map(held.get(group, empty).__contains__, h[:n]))
            if False in flags:
                n = flags.index(False)
            bound = min(bound, n * size // align * align)
        return self.settle(bound, held, hashes)

    def settle(self, bound: int, held: Mapping[int, Mapping[bytes, object]],
               hashes: Callable[[int], list[bytes]]) -> int:
        """The longest hit at most ``bound`` (aligned, within the chains) that every window and
        checkpoint group agrees on: the fixed point over the ``spans`` groups."""
        align = self.alignment
        empty: Mapping[bytes, object] = {}
        changed = True
        while changed and bound > 0:
            changed = False
            for group, size, need in self.spans:
                tokens = _span_hit(hashes(group), held.get(group, empty), size, need, bound)
                if tokens < bound:
                    bound = tokens // align * align
                    changed = True
        return max(0, bound)


def _span_hit(h: list[bytes], held: Mapping[bytes, object], size: int, need: int, max_tokens: int) -> int:
    """The longest ``e * size <= max_tokens`` with blocks ``[max(0, e - need), e)`` all held (0: none)."""
    contains = held.__contains__
    e = min(max_tokens // size, len(h))
    while e > 0:
        a = max(0, e - need)
        flags = list(map(contains, h[a:e]))
        try:
            last_missing = len(flags) - 1 - flags[::-1].index(False)
        except ValueError:
            return e * size
        e = a + last_missing
    return 0

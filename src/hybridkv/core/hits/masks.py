"""The bitmask form of the hit rule: ``FastHits.longest_hit`` for many caches at once.

Each cache owns one bit; per block of a request a mask holds the bits of the caches that hold it.
``chain_reach`` and ``chain_ends`` find every cache's full-attention chain, ``settle_together``
checks the window and checkpoint groups per hit point; ``hits_together`` composes them.
See docs/ARCHITECTURE.md, "The hit rule and its forms".
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable
from functools import reduce
from itertools import accumulate
from operator import and_, neg

from hybridkv.core.hits.fast import FastHits

Masks = Callable[[int, int], tuple[list[int], int]]
"""``masks(group, n)``: per block of the request's first ``n`` at ``group``'s block size (all of
them when it has fewer; a longer list is read only that far), the bits of the caches holding it in
``group``, and the shift of the caches' bits in those masks (cache ``b``'s bit there is ``b << shift``:
several groups may share one mask)."""


def hits_together(fast: FastHits, everyone: int, top: int, masks: Masks) -> dict[int, int]:
    """Hit point -> the bits of the caches (of ``everyone``) whose agreed hit ends there, for the
    layout of ``fast``; points are in units of its alignment, from 1 to ``top`` (the request's
    longest hit); caches without a hit are in none. For each cache, ``fast.longest_hit`` with a
    bound of ``top`` points, over the blocks its bits mark."""
    if top <= 0 or not everyone:
        return {}
    align = fast.alignment
    reach = [everyone]
    for i, (g, size) in enumerate(fast.chains):
        k = align // size
        got, shift = masks(g, top * k)
        if not got or not got[0] >> shift & everyone:
            return {}  # no cache holds the chain's first block: no hit
        r = chain_reach(got[: top * k], everyone << shift, k)
        if shift:
            r = [bits >> shift for bits in r]
        reach = r if i == 0 else list(map(and_, reach, r))
    at = chain_ends(reach) if fast.chains else {top: everyone}
    if at and fast.spans:
        hi = max(at)
        spans = []
        for g, size, need in fast.spans:
            k = align // size
            got, shift = masks(g, hi * k)
            spans.append((got, shift, k, need))
        at = settle_together(at, spans)
    return at


def chain_reach(masks: list[int], replicas: int, step: int) -> list[int]:
    """Per point ``q`` (0, 1, ...), the bits of ``replicas`` set in each of ``masks[:q * step]``: the
    masks of a request's chain AND-ed in order, one in ``step``. Each is a subset of the one before."""
    reach = list(accumulate(masks, and_, initial=replicas))
    return reach if step == 1 else reach[::step]


def chain_ends(reach: list[int]) -> dict[int, int]:
    """Point -> the caches whose reach (``chain_reach``) ends there, for points above 0.

    A reach is a subset of the one before, so never a larger number: the end of each distinct
    reach is found by bisection (keys negated to ascend), one per distinct reach."""
    at: dict[int, int] = {}
    n, end, bits = len(reach), 0, reach[0]
    while True:
        end = bisect_right(reach, -bits, end, key=neg)  # one past the last point ``bits`` reaches
        after = reach[end] if end < n else 0
        if end > 1:
            at[end - 1] = bits & ~after
        if not after:
            return at
        bits = after


def settle_together(at: dict[int, int], spans: list[tuple[list[int], int, int, int]]) -> dict[int, int]:
    """``FastHits.settle`` for the caches of ``at`` (point -> the bits of the caches there, points
    in units of the hit alignment), the window and checkpoint groups read from masks: the bits
    settled at each point. ``spans``: per span group, the masks of the request's blocks from the
    first, the shift of the group's bits in them, its blocks per point and the blocks it needs
    before a hit point.

    A cache's settled hit is the longest point at most its start where every span group holds the
    blocks it needs. Caches at one point are checked together (one AND over a window's masks);
    one that lacks a block moves to the next lower point that group accepts (``last_window``) and
    is checked again there, in the next round, by every group."""
    done: dict[int, int] = {}
    while at:
        moved: dict[int, int] = {}
        for q, ok in at.items():
            for masks, shift, k, need in spans:
                e = q * k
                want = ok << shift
                held = reduce(and_, masks[e - need if e > need else 0 : e], want)
                if held != want:
                    lost = want ^ held
                    while lost:
                        bit = lost & -lost
                        lost ^= bit
                        end = last_window(bytes(map(bool, map(bit.__and__, masks[:e]))), e - 1, need, k)
                        if end:
                            moved[end // k] = moved.get(end // k, 0) | bit >> shift
                    ok = held >> shift
                    if not ok:
                        break
            if ok:
                done[q] = done.get(q, 0) | ok
        at = moved
    return done


def last_window(held: bytes, top: int, need: int, k: int) -> int:
    """The largest end ``e <= top``, a positive multiple of ``k``, with ``held[max(0, e - need) : e]``
    all ones (0: none). ``held`` has one byte per block, 1 where it is held.

    Valid ends lie in runs of held blocks: in a run ``[start, stop)`` they are ``start + need ..
    stop`` (``1 .. stop`` when the run starts at the first block). The runs are found from the top
    down by searching the bytes, so a cache that lacks a long stretch of window blocks moves past
    it in a few searches, not one block at a time."""
    window = b"\x01" * need
    while top > 0:
        s = held.rfind(window, 0, top)  # the highest full window that ends at or below top
        if s < 0:  # none: only the windows cut at the first block, within its leading run
            gap = held.find(b"\x00", 0, top)
            return (top if gap < 0 else gap) // k * k
        start = held.rfind(b"\x00", 0, s) + 1
        end = (s + need) // k * k
        if end >= (start + need if start else 1):
            return end
        top = start - 1
    return 0

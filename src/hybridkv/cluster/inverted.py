"""Which replicas hold a block hash, and every replica's hit from one walk of a request's chain.

``ReplicaMasks`` keeps, per (medium, group), one map from block hash to a bitmask of the replicas
whose caches hold it (each replica owns one bit). It lives beside each replica's own counts
(``ReplicaView.media``) and is kept equal to them: bit ``b`` is set in ``maps[(m, g)][h]`` exactly
while the replica of bit ``b`` holds ``h`` in group ``g`` of its medium ``m``.

``predict_together`` predicts the hit of replicas that hash and lay out blocks alike (one hash
scheme, one set of group block sizes, windows and alignment, one medium each; see
``ReplicaView.joint_key``). It is ``FastHits.longest_hit`` for each of them, with the
full-attention chains walked once for all:

* the masks of the request's chain hashes, AND-ed in order (``accumulate``): replica ``b``'s chain
  is as long as the run of leading masks with bit ``b``;
* then, per replica with a non-empty chain, the window and checkpoint groups from its own counts
  (``FastHits.settle``), at the hit points below its chain, longest first.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from functools import reduce
from itertools import repeat
from operator import and_, or_
from typing import TYPE_CHECKING

from hybridkv.cluster.replica import Prediction, RequestKeys

if TYPE_CHECKING:
    from hybridkv.cluster.replica import ReplicaView

JointKey = Hashable
"""What replicas predicted together share (``ReplicaView.joint_key``)."""


class ReplicaMasks:
    """Per (medium, group): block hash -> bitmask of the replicas holding it (never 0)."""

    __slots__ = ("maps", "used", "version")

    def __init__(self) -> None:
        self.maps: dict[tuple[str, int], dict[bytes, int]] = {}
        self.used = 0
        """The bits given to replicas."""
        self.version = 0
        """Bumped whenever a replica's ``joint_key`` may have changed (or a replica came or went)."""

    def allocate(self) -> int:
        """A bit no replica has (the lowest free one)."""
        bit = ~self.used & (self.used + 1)
        self.used |= bit
        self.version += 1
        return bit

    def release(self, bit: int) -> None:
        """Give ``bit`` back; its replica must hold nothing any more (``ReplicaView.clear``)."""
        self.used &= ~bit
        self.version += 1

    def group(self, medium: str, group: int) -> dict[bytes, int]:
        """The map of ``group`` on ``medium`` (created empty)."""
        found = self.maps.get((medium, group))
        if found is None:
            found = self.maps[(medium, group)] = {}
        return found


_NONE: dict[bytes, int] = {}


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        bit = mask & -mask
        mask ^= bit
        out.append(bit)
    return out


def chain_runs(hashes: list[bytes], n: int, held: dict[bytes, int], replicas: int) -> list[tuple[int, int]]:
    """The replicas of ``replicas`` by how many of ``hashes[:n]`` each holds in a row from the first:
    ``(length, their bits)`` per length above 0."""
    if n <= 0 or not held.get(hashes[0], 0) & replicas:
        return []
    masks = list(map(held.get, hashes[:n], repeat(0, n)))
    # A replica's chain ends at the first mask without its bit: the first place of some distinct
    # mask (a chain's masks take few distinct values; ``dict.fromkeys`` lists them in order of
    # first place).
    runs = []
    alive = replicas
    for mask in dict.fromkeys(masks):
        lost = alive & ~mask
        if lost:
            first = masks.index(mask)
            if first:
                runs.append((first, lost))
            alive &= mask
    if alive:
        runs.append((n, alive))
    return runs


def settle_together(align: int, at: dict[int, int], spans: list[tuple[list[bytes], list[int], int, int]]
                    ) -> dict[int, int]:
    """``FastHits.settle`` for the replicas of ``at`` (hit point -> the bits of the replicas there),
    the window and checkpoint groups read from masks: the bits settled at each point. ``spans``:
    per span group, the request's hashes, their masks, the block size and the blocks needed
    before a hit point.

    The settled hit is the longest aligned point at most the start where every span group holds the
    blocks it needs, so replicas at one point are checked together (one AND over a window's masks);
    one that lacks a block moves to the aligned start of the last block it lacks (the next point
    that group could accept) and is checked there again, with the replicas already at that point."""
    done: dict[int, int] = {}
    while at:
        point = max(at)
        ok = at.pop(point)
        for h, masks, size, need in spans:
            e = min(point // size, len(h))
            if e * size != point:  # this group has no hit point in (e * size, point]
                low = e * size // align * align
                if low > 0:
                    at[low] = at.get(low, 0) | ok
                ok = 0
                break
            held = reduce(and_, masks[max(0, e - need):e], ok)
            if held != ok:
                for bit in _bits(ok & ~held):
                    j = e - 1
                    while masks[j] & bit:
                        j -= 1
                    low = j * size // align * align
                    if low > 0:
                        at[low] = at.get(low, 0) | bit
                ok = held
                if not ok:
                    break
        if ok:
            done[point] = ok
    return done


def predict_together(keys: RequestKeys, views: Sequence[ReplicaView], medium: str,
                     masks: ReplicaMasks) -> list[Prediction]:
    """The hits of ``views`` (alike: one ``joint_key``, each holding blocks on ``medium`` alone), as
    each view's ``predict`` would find them."""
    first = views[0]
    layout = first.layout
    fast, rules = layout.fast, layout.rules
    assert fast is not None and rules is not None
    scheme, hbs, short = first.scheme, rules.hash_block_size, bool(first.short_hashes)
    align = fast.alignment
    bound = (keys.sequence.num_tokens - 1) // align * align
    everyone = reduce(or_, [view.bit for view in views], 0)
    at: dict[int, int] = {}  # hit point the chains allow -> the bits of the replicas there
    for i, (group, size) in enumerate(fast.chains):
        h = keys.hashes(scheme, hbs, size, short)
        n = min(bound // size, len(h)) if bound > 0 else 0
        runs = chain_runs(h, n, masks.maps.get((medium, group), _NONE), everyone)
        if i == 0:
            for length, bits in runs:
                point = length * size // align * align
                if point > 0:
                    at[point] = at.get(point, 0) | bits
        else:  # each replica's point, cut by this chain
            lengths = {bit: length for length, bits in runs for bit in _bits(bits)}
            cut: dict[int, int] = {}
            for point, bits in at.items():
                for bit in _bits(bits):
                    p = min(point, min(point // size, lengths.get(bit, 0)) * size // align * align)
                    if p > 0:
                        cut[p] = cut.get(p, 0) | bit
            at = cut
        everyone = reduce(or_, at.values(), 0)
    if at and fast.spans:
        top = max(at)
        spans = []
        for group, size, need in fast.spans:
            h = keys.hashes(scheme, hbs, size, short)
            m = min(top // size, len(h))
            spans.append((h, list(map(masks.maps.get((medium, group), _NONE).get, h[:m], repeat(0, m))), size, need))
        at = settle_together(align, at, spans)
    out = [view.no_hit for view in views]
    if at:
        place = {view.bit: i for i, view in enumerate(views)}
        for point, bits in at.items():
            for bit in _bits(bits):
                i = place[bit]
                out[i] = Prediction(views[i].name, point, ((medium, point),))
    return out

"""Which replicas hold a block hash, and every replica's hit from one walk of a request's chain.

``ReplicaMasks`` keeps, per medium, one map from block hash to a bitmask of the replicas whose
caches hold it, for ``SLOTS`` groups at once: each replica owns one bit per group, its bit for group
``g`` being its replica bit shifted by ``g % SLOTS`` in map ``g // SLOTS`` (replica bits are
``SLOTS`` places apart). A request's hashes at one block size are the same for every group of that
size, so one lookup per hash reads a full-attention group and its window group together. The
masks live beside each replica's own counts (``ReplicaView.media``) and are kept equal to them:
the bit of replica ``b`` and group ``g`` is set for ``h`` exactly while ``b`` holds ``h`` in group
``g`` of that medium.

``predict_together`` predicts the hit of replicas that hash and lay out blocks alike (one hash
scheme, one set of group block sizes, windows and alignment, one medium each; see
``ReplicaView.joint_key`` and ``JointGroup``). It is ``FastHits.longest_hit`` for each of them,
every step a mask operation over all of them at once:

* the masks of the request's chain hashes, AND-ed in order (``chain_reach``): replica ``b``'s chain
  is as long as the run of leading masks with bit ``b``; where each replica's run ends is found by
  bisection, once per distinct run end (``chain_ends``);
* the window and checkpoint groups (``settle_together``): the replicas whose chains end at one hit
  point are checked together, one AND over the masks of the blocks a group needs before it; a
  replica that lacks one moves to the next point that group accepts (``last_window``, a few byte
  searches however far down it is) and is checked again there.

The predictions themselves are values, shared per replica and hit point (``JointGroup``).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Hashable, Sequence
from functools import reduce
from itertools import accumulate, repeat
from operator import and_, neg, or_
from typing import TYPE_CHECKING

from hybridkv.cluster.replica import Prediction, RequestKeys

if TYPE_CHECKING:
    from hybridkv.cluster.replica import ReplicaView

JointKey = Hashable
"""What replicas predicted together share (``ReplicaView.joint_key``)."""


_NONE: dict[bytes, int] = {}
SLOTS = 2
"""Groups per map: group ``g``'s bits are in map ``g // SLOTS``, a replica's bit shifted by ``g % SLOTS``."""


class ReplicaMasks:
    """Per medium and run of ``SLOTS`` groups: block hash -> the bits of the replicas' groups holding
    it (never 0). Replica bits are ``SLOTS`` apart, so one lookup of a hash answers for every group
    of the run (the request's hashes at equal block sizes are equal)."""

    __slots__ = ("maps", "used", "version")

    def __init__(self) -> None:
        self.maps: dict[tuple[str, int], dict[bytes, int]] = {}
        self.used = 0
        """The bits given to replicas."""
        self.version = 0
        """Bumped whenever a replica's ``joint_key`` may have changed (or a replica came or went)."""

    def allocate(self) -> int:
        """A replica bit no replica has (the lowest free one, a multiple of ``SLOTS`` places)."""
        bit = 1
        while self.used & bit:
            bit <<= SLOTS
        self.used |= bit
        self.version += 1
        return bit

    def release(self, bit: int) -> None:
        """Give ``bit`` back; its replica must hold nothing any more (``ReplicaView.clear``)."""
        self.used &= ~bit
        self.version += 1

    def group(self, medium: str, group: int) -> tuple[dict[bytes, int], int]:
        """The map of ``group`` on ``medium`` (created empty), and the shift of its replicas' bits there."""
        key = (medium, group // SLOTS)
        found = self.maps.get(key)
        if found is None:
            found = self.maps[key] = {}
        return found, group % SLOTS

    def holders(self, medium: str, group: int, h: bytes) -> int:
        """The bits of the replicas that hold ``h`` in ``group`` on ``medium``."""
        shift = group % SLOTS
        return self.maps.get((medium, group // SLOTS), _NONE).get(h, 0) >> shift & _spread(self.used)


def _spread(used: int) -> int:
    """Every replica bit up to the highest of ``used`` (the places a replica bit can have)."""
    out, bit = 0, 1
    while bit <= used:
        out |= bit
        bit <<= SLOTS
    return out


_MAX_SHARED = 4096
"""Predictions a joint group keeps per replica (one per hit point) before it starts over."""


class JointGroup:
    """Replicas predicted together: alike views (one ``joint_key``) holding blocks on one medium, and
    what their predictions share (valid while the masks' version is unchanged)."""

    __slots__ = ("medium", "views", "everyone", "no_hits", "hits", "hashing", "alignment", "chains", "spans")

    def __init__(self, medium: str, views: Sequence[ReplicaView]) -> None:
        first = views[0]
        fast, rules = first.layout.fast, first.layout.rules
        assert fast is not None and rules is not None, "joint views have fast hit rules (ReplicaView.joint_key)"
        self.medium = medium
        self.views = {view.bit: view for view in views}
        """The views by their bits."""
        self.everyone = reduce(or_, self.views, 0)
        """The bits of the views."""
        self.no_hits = {view.name: view.no_hit for view in views}
        """Every view's name and its prediction of no hit, in the order of ``views``."""
        self.hits: dict[int, dict[int, Prediction]] = {view.bit: {} for view in views}
        """Per view's bit, hit point -> the prediction of that hit, shared by the lookups that find it
        (predictions are values; a router's requests keep landing on the same hit points)."""
        self.hashing = (first.scheme, rules.hash_block_size, bool(first.short_hashes))
        """How the views hash a request (``RequestKeys.hashes``' first, second and last arguments)."""
        align = self.alignment = fast.alignment
        self.chains = [((medium, g // SLOTS), g % SLOTS, size, align // size) for g, size in fast.chains]
        """Per full-attention group: its map's key in the masks, the shift of its bits there, its block
        size and its blocks per aligned point."""
        self.spans = [((medium, g // SLOTS), g % SLOTS, size, align // size, need) for g, size, need in fast.spans]
        """Per window or checkpoint group: the same, and the blocks it needs before a hit point."""

    def prediction(self, bit: int, point: int) -> Prediction:
        """The prediction of a ``point``-token hit on the medium for the view of ``bit``, shared."""
        hits = self.hits[bit]
        found = hits.get(point)
        if found is None:
            if len(hits) >= _MAX_SHARED:
                hits.clear()
            found = hits[point] = Prediction(self.views[bit].name, point, ((self.medium, point),))
        return found


def chain_reach(masks: list[int], replicas: int, step: int) -> list[int]:
    """Per point ``q`` (0, 1, ...), the bits of ``replicas`` set in each of ``masks[:q * step]``: the
    masks of a request's chain AND-ed in order, one in ``step``. Each is a subset of the one before."""
    reach = list(accumulate(masks, and_, initial=replicas))
    return reach if step == 1 else reach[::step]


def chain_ends(reach: list[int]) -> dict[int, int]:
    """Point -> the replicas whose reach (``chain_reach``) ends there, for points above 0.

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
    """``FastHits.settle`` for the replicas of ``at`` (point -> the bits of the replicas there, points
    in units of the hit alignment), the window and checkpoint groups read from masks: the bits
    settled at each point. ``spans``: per span group, the masks of the request's blocks from the
    first, the shift of the group's bits in them, its blocks per point and the blocks it needs
    before a hit point.

    A replica's settled hit is the longest point at most its start where every span group holds the
    blocks it needs. Replicas at one point are checked together (one AND over a window's masks);
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
    down by searching the bytes, so a replica that lacks a long stretch of window blocks moves past
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


def predict_together(keys: RequestKeys, group: JointGroup, masks: ReplicaMasks) -> dict[str, Prediction]:
    """Per view of ``group`` (in its order), the hit its ``predict`` would find."""
    scheme, hbs, short = group.hashing
    maps, align, everyone = masks.maps, group.alignment, group.everyone
    top = (keys.sequence.num_tokens - 1) // align  # hit points are 1 .. top alignments
    found: dict[tuple[tuple[str, int], int], list[int]] = {}  # (map, block size) -> the request's masks
    reach = [everyone]
    for i, (key, shift, size, k) in enumerate(group.chains):
        h = keys.hashes(scheme, hbs, size, short)
        n = min(top * k, len(h))
        held = maps.get(key, _NONE)
        if n <= 0 or not held.get(h[0], 0) >> shift & everyone:
            reach = [everyone]  # no replica holds the chain's first block: no hit
            break
        got = found[(key, size)] = list(map(held.get, h, repeat(0, n)))  # ``repeat`` bounds it to n
        r = chain_reach(got, everyone << shift, k)
        if shift:
            r = [bits >> shift for bits in r]
        reach = r if i == 0 else list(map(and_, reach, r))
    at = chain_ends(reach)
    if at and group.spans:
        hi = max(at)
        spans = []
        for key, shift, size, k, need in group.spans:
            known = found.get((key, size))  # a chain's masks at this size hold this group's bits too
            if known is None:
                known = list(map(maps.get(key, _NONE).get, keys.hashes(scheme, hbs, size, short), repeat(0, hi * k)))
            spans.append((known, shift, k, need))
        at = settle_together(at, spans)
    out = group.no_hits.copy()
    hits = group.hits
    for q, bits in at.items():
        point = q * align
        while bits:
            bit = bits & -bits
            bits ^= bit
            hit = hits[bit].get(point) or group.prediction(bit, point)
            out[hit.replica] = hit
    return out

"""Which replicas hold a block hash, and every replica's hit from one walk of a request's chain.

``ReplicaMasks`` keeps, per medium, maps from block hash to a bitmask of the replicas holding it
(``SLOTS`` groups to a map), equal to each replica's own counts; ``predict_together`` runs the
bitmask form of the hit rule (``hybridkv.core.hits.hits_together``) for replicas that hash and lay
out blocks alike (``JointGroup``). See docs/CLUSTER.md, "Costs".
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from functools import reduce
from itertools import repeat
from operator import or_
from typing import TYPE_CHECKING

from hybridkv.cluster.replica import Prediction, RequestKeys
from hybridkv.core import FastHits, hits_together

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

    __slots__ = ("medium", "views", "everyone", "no_hits", "hits", "hashing", "fast", "where")

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
        self.fast: FastHits = fast
        """The views' hit rule (its fast form: the bitmask form's layout)."""
        self.where = {g: ((medium, g // SLOTS), g % SLOTS, size)
                      for g, size in [*fast.chains, *((g, size) for g, size, _ in fast.spans)]}
        """Per group the rule reads: its map's key in the masks, the shift of its bits there, its block size."""

    def prediction(self, bit: int, point: int) -> Prediction:
        """The prediction of a ``point``-token hit on the medium for the view of ``bit``, shared."""
        hits = self.hits[bit]
        found = hits.get(point)
        if found is None:
            if len(hits) >= _MAX_SHARED:
                hits.clear()
            found = hits[point] = Prediction(self.views[bit].name, point, ((self.medium, point),))
        return found


def predict_together(keys: RequestKeys, group: JointGroup, masks: ReplicaMasks) -> dict[str, Prediction]:
    """Per view of ``group`` (in its order), the hit its ``predict`` would find."""
    scheme, hbs, short = group.hashing
    maps, fast, everyone = masks.maps, group.fast, group.everyone
    align = fast.alignment
    top = (keys.sequence.num_tokens - 1) // align  # hit points are 1 .. top alignments
    out = group.no_hits.copy()
    key, shift, size = group.where[fast.chains[0][0]]
    h = keys.hashes(scheme, hbs, size, short)
    if top <= 0 or not h or not maps.get(key, _NONE).get(h[0], 0) >> shift & everyone:
        return out  # no replica holds the chain's first block: no hit
    found: dict[tuple[tuple[str, int], int], list[int]] = {}  # (map, block size) -> the request's masks

    def held(g: int, n: int) -> tuple[list[int], int]:
        key, shift, size = group.where[g]
        got = found.get((key, size))  # a chain's masks at this size hold another group's bits too
        if got is None:
            got = found[(key, size)] = list(map(maps.get(key, _NONE).get, keys.hashes(scheme, hbs, size, short),
                                                repeat(0, n)))  # ``repeat`` bounds it to n
        return got, shift

    hits = group.hits
    for q, bits in hits_together(fast, everyone, top, held).items():
        point = q * align
        while bits:
            bit = bits & -bits
            bits ^= bit
            hit = hits[bit].get(point) or group.prediction(bit, point)
            out[hit.replica] = hit
    return out

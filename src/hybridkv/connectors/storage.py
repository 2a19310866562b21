"""What an external tier keeps of a sequence: per group, the blocks a later hit can use.

``StoreHitSpans`` keeps every block of growing groups and, for the other groups, the hit spans of
checkpoints (junctions, prompt ends, answer boundaries, an interval); ``StoreSpansSpill`` (the
default) every block, those outside the spans at low priority; ``StoreAll`` every block.
Specification: docs/TIERS.md, "Storage policies".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from hybridkv.core import KVCacheManager, KVSequence, MambaSpec
from hybridkv.errors import InvalidInputError

Offer = tuple[int, int, bytes]
"""``(table index, block id, block hash)`` of one block to store."""


class StoragePolicy:
    """Which registered blocks of a sequence a connector offers its tiers (docs/TIERS.md, "Storage
    policies")."""

    name = "policy"

    def offers(self, manager: KVCacheManager, seq: KVSequence, start: int, end: int,
               junctions: Iterable[int] = ()) -> dict[int, list[Offer]]:
        """Per caching group, the blocks to store after a step computed tokens ``[start, end)``.

        ``junctions`` are extra checkpoint positions (token counts) the caller knows of."""
        raise NotImplementedError

    def prioritized(self, manager: KVCacheManager, seq: KVSequence, start: int, end: int,
                    junctions: Iterable[int] = (), *, with_low: bool = True
                    ) -> tuple[dict[int, list[Offer]], dict[int, list[Offer]]]:
        """``(normal, low)``: the blocks to store at normal and at low priority (evicted first). A policy
        without priorities offers everything at normal priority. ``with_low=False``: the caller takes
        no low-priority blocks now (every tier would skip them), so ``low`` may be left empty."""
        return self.offers(manager, seq, start, end, junctions), {}


@dataclass(frozen=True)
class StoreAll(StoragePolicy):
    """Every registered block of every group, as soon as it is computed."""

    name = "all"

    def offers(self, manager: KVCacheManager, seq: KVSequence, start: int, end: int,
               junctions: Iterable[int] = ()) -> dict[int, list[Offer]]:
        return {g: manager.registered_blocks(seq, g, start, end) for g in manager.caching_groups}


@dataclass(frozen=True)
class StoreHitSpans(StoragePolicy):
    """Growing groups every block, recurrent groups their registered states, every other group the
    span a hit needs at each checkpoint (junctions, the prompt's end, the answer's boundaries, every
    ``interval`` tokens)."""

    interval: int = 0
    """Also a checkpoint every this many tokens (rounded up to the hit alignment); 0: none."""
    end_align: int = 0
    """The prompt-end checkpoint is the prompt's length rounded down to a multiple of this (and of the
    hit alignment); 0: the hit alignment."""
    answer_ends: bool = True
    """Also a checkpoint at every hit-aligned boundary past the prompt (the answer's possible ends)."""

    name = "hit-spans"

    def __post_init__(self) -> None:
        for field in ("interval", "end_align"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInputError(f"StoreHitSpans.{field} must be a non-negative integer, got {value!r}")
        if not isinstance(self.answer_ends, bool):
            raise InvalidInputError(f"StoreHitSpans.answer_ends must be a bool, got {self.answer_ends!r}")

    def checkpoints(self, manager: KVCacheManager, seq: KVSequence, start: int, end: int,
                    junctions: Iterable[int] = ()) -> list[int]:
        """Checkpoint positions in ``(start, end]`` (ascending, multiples of the hit alignment, > 0)."""
        return sorted({*self._points(manager, seq, start, end, junctions), *self._answer_points(manager, seq, start,
                                                                                                  end)})

    def _answer_points(self, manager: KVCacheManager, seq: KVSequence, start: int, end: int) -> range:
        """The answer's boundaries in ``(start, end]`` (none without ``answer_ends``)."""
        align, prompt = manager.hit_alignment, seq.num_prompt_tokens
        if not self.answer_ends or end <= prompt:
            return range(0)
        return range((max(start, prompt) // align + 1) * align, end + 1, align)

    def _points(self, manager: KVCacheManager, seq: KVSequence, start: int, end: int,
                junctions: Iterable[int] = ()) -> set[int]:
        """The checkpoints in ``(start, end]`` but the answer's boundaries."""
        align = manager.hit_alignment
        points = {p for p in junctions if start < p <= end and p % align == 0}
        points.update(manager.junctions(seq, start, end))
        prompt = seq.num_prompt_tokens
        grain = _lcm(self.end_align, align) if self.end_align else align
        last = prompt // grain * grain
        for p in (last, prompt - align if last == prompt else 0):
            if start < p <= end and p > 0:
                points.add(p // align * align)
        if self.interval:
            step = -(-self.interval // align) * align
            points.update(range((start // step + 1) * step, end + 1, step))
        points.discard(0)
        return points

    def offers(self, manager: KVCacheManager, seq: KVSequence, start: int, end: int,
               junctions: Iterable[int] = ()) -> dict[int, list[Offer]]:
        return self._split(manager, seq, start, end, junctions, spill=False)[0]

    def _split(self, manager: KVCacheManager, seq: KVSequence, start: int, end: int, junctions: Iterable[int],
               *, spill: bool) -> tuple[dict[int, list[Offer]], dict[int, list[Offer]]]:
        """``(spans, rest)``: per group the blocks hits need (every registered block of a growing or
        recurrent group; the window or chunk before each checkpoint otherwise), and with ``spill``
        the window groups' other registered blocks in ``(start, end]`` (one walk of a group's
        blocks for both)."""
        normal: dict[int, list[Offer]] = {}
        low: dict[int, list[Offer]] = {}
        points: set[int] | None = None
        answer = self._answer_points(manager, seq, start, end)
        # An answer boundary's span less what the previous one (offered by the call that computed it)
        # held: one block per boundary in a window group, not the whole window again.
        previous = start // manager.hit_alignment * manager.hit_alignment
        offered = previous if answer and previous >= self._answer_points(manager, seq, 0, end).start else 0
        for g in manager.caching_groups:
            spec = manager.layout.groups[g].spec
            if spec.grows_with_sequence or _recurrent(manager, g):
                normal[g] = manager.registered_blocks(seq, g, start, end)
                continue
            if points is None:
                points = self._points(manager, seq, start, end, junctions)
            wanted = _spans(manager, g, points)
            if answer:
                wanted |= _spans(manager, g, answer) - (_spans(manager, g, [offered]) if offered else set())
            bs = manager.group_block_size(g)
            if not wanted:  # no checkpoint in range: nothing needed, the rest as it is
                normal[g] = []
                rest = manager.registered_blocks(seq, g, start, end) if spill else []
            else:
                # A checkpoint's span ends at or before ``end`` and may reach back before ``start``.
                lo, hi = min(wanted) * bs, (max(wanted) + 1) * bs
                regs = manager.registered_blocks(seq, g, *((min(lo, start), end) if spill else (lo, hi)))
                normal[g] = [o for o in regs if o[0] in wanted]
                first = start // bs
                rest = [o for o in regs if o[0] >= first and o[0] not in wanted] if spill else []
            if rest:
                low[g] = rest
        return normal, low


@dataclass(frozen=True)
class StoreSpansSpill(StoreHitSpans):
    """``StoreHitSpans``' blocks at normal priority and every other registered block at low priority:
    everything while a tier has room, the hit spans under pressure (docs/TIERS.md, "Storage policies")."""

    name = "spans+spill"

    def offers(self, manager: KVCacheManager, seq: KVSequence, start: int, end: int,
               junctions: Iterable[int] = ()) -> dict[int, list[Offer]]:
        normal, low = self.prioritized(manager, seq, start, end, junctions)
        return {g: normal[g] + low.get(g, []) for g in normal}

    def prioritized(self, manager: KVCacheManager, seq: KVSequence, start: int, end: int,
                    junctions: Iterable[int] = (), *, with_low: bool = True
                    ) -> tuple[dict[int, list[Offer]], dict[int, list[Offer]]]:
        """``StoreHitSpans.offers`` at normal priority; the rest of each window group's registered
        blocks in ``(start, end]`` at low priority (none with ``with_low=False``: then only the
        spans are walked)."""
        return self._split(manager, seq, start, end, junctions, spill=with_low)


def _spans(manager: KVCacheManager, group: int, points: Iterable[int]) -> set[int]:
    """Table indices of ``group`` that hits ending at ``points`` need (``hit_span`` at each)."""
    wanted: set[int] = set()
    for p in points:
        wanted.update(manager.hit_span(group, p))
    return wanted


def _recurrent(manager: KVCacheManager, group: int) -> bool:
    """A recurrent group: its cache holds states, which the manager registers only at its checkpoints."""
    return isinstance(manager.layout.groups[group].spec, MambaSpec)


def _lcm(a: int, b: int) -> int:
    from math import gcd

    return a * b // gcd(a, b)


class JunctionMemory:
    """Shared-prefix junctions the connector's lookups found, by the growing group's block hash there
    (an LRU of at most ``capacity``): a later store of a sequence passing one writes a checkpoint."""

    __slots__ = ("capacity", "_known")

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._known: OrderedDict[bytes, None] = OrderedDict()

    def add(self, key: bytes) -> None:
        known = self._known
        if key in known:
            known.move_to_end(key)
            return
        known[key] = None
        if len(known) > self.capacity:
            known.popitem(last=False)

    def positions(self, hashes: list[bytes], block_size: int, start: int, end: int) -> list[int]:
        """Token positions in ``(start, end]`` whose growing block (ending there) is a known junction."""
        known = self._known
        if not known:
            return []
        first, last = start // block_size, min(end // block_size, len(hashes))
        return [(i + 1) * block_size for i in range(first, last) if hashes[i] in known]

    def __len__(self) -> int:
        return len(self._known)

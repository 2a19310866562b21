"""How much of a sequence the external tiers can serve, in a logarithmic number of probes.

The hit is the device cache's own rule (``HitRules.longest_hit``) over what batched existence
probes found: a ``fanout``-ary search of the growing groups' chain, runs doubling around the blocks
the other groups' rules ask about. Specification: docs/TIERS.md, "Lookup".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, cast

from hybridkv.core import HitRules, KVSequence

Probe = Callable[[list[tuple[int, int]]], list[bool]]
"""Whether some tier holds block ``index`` of ``group``, for each ``(group, index)``: one probe."""


@dataclass
class ProbeCount:
    """Probes (batched existence checks) and the blocks they asked about."""

    probes: int = 0
    blocks: int = 0


class _Prefix(Mapping[int, int]):
    """A group known to hold the blocks before index ``end`` (a chain found by the search)."""

    __slots__ = ("end",)

    def __init__(self, end: int) -> None:
        self.end = end

    def get(self, index: int, default: int | None = None) -> int | None:  # type: ignore[override]
        return 1 if 0 <= index < self.end else default

    def __getitem__(self, index: int) -> int:
        if 0 <= index < self.end:
            return 1
        raise KeyError(index)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.end))

    def __len__(self) -> int:
        return self.end


class _Runs:
    """The on-demand groups of one block size, which probe together, and their current run length."""

    __slots__ = ("members", "run")

    def __init__(self) -> None:
        self.members: list[_OnDemand] = []
        self.run = 8


class _OnDemand(Mapping[int, int]):
    """A group whose blocks are probed when the rules ask, in doubling runs shared with the other
    groups of ``runs``; blocks before ``local`` are held already (the local hit)."""

    __slots__ = ("group", "local", "size", "probe", "known", "runs")

    def __init__(self, group: int, local: int, size: int, probe: Probe, runs: _Runs) -> None:
        self.group = group
        self.local = local
        self.size = size
        self.probe = probe
        self.known: dict[int, bool] = {}
        self.runs = runs
        runs.members.append(self)

    def get(self, index: int, default: int | None = None) -> int | None:  # type: ignore[override]
        if index < self.local:
            return 1
        there = self.known.get(index)
        if there is None:
            self._fetch(index)
            there = self.known[index]
        return 1 if there else default

    def _fetch(self, index: int) -> None:
        """One probe: the run around ``index``, in this group and every other group of its block size."""
        runs = self.runs
        lo, hi = max(self.local, index - runs.run + 1), min(self.size, index + runs.run)
        items: list[tuple[int, int]] = []
        owners: list[dict[int, bool]] = []
        for member in runs.members:
            known = member.known
            wanted = [i for i in range(lo, hi) if i not in known]
            if member is self and index not in wanted:
                wanted.append(index)
            items += [(member.group, i) for i in wanted]
            owners += [known] * len(wanted)
        for (_, i), known, there in zip(items, owners, self.probe(items)):
            known[i] = there
        runs.run = min(runs.run * 2, 1 << 12)

    def __getitem__(self, index: int) -> int:
        got = self.get(index)
        if got is None:
            raise KeyError(index)
        return got

    def __iter__(self) -> Iterator[int]:  # the blocks known held (the rules never iterate)
        return iter([i for i, there in self.known.items() if there])

    def __len__(self) -> int:
        return sum(self.known.values())


def chain_end(group: int, first: int, end: int, probe: Probe, fanout: int) -> int:
    """The index after the last block of ``group`` a tier holds, searching ``[first, end)`` and
    assuming the tier holds a prefix of the chain (blocks before ``first`` are held already)."""
    lo, hi = first, end  # blocks [first, lo) held; the chain ends in [lo, hi]
    while lo < hi:
        span = hi - lo
        k = min(fanout, span)
        points = [lo + -(-span * (j + 1) // k) - 1 for j in range(k)]
        there = probe([(group, p) for p in points])
        miss = next((j for j, ok in enumerate(there) if not ok), None)
        if miss is None:
            lo = hi
        else:
            hi = points[miss]
            lo = points[miss - 1] + 1 if miss else lo
    return lo


def probe_hit(rules: HitRules, seq: KVSequence, start: int, cap: int, probe: Probe,
              fanout: int = 16) -> tuple[int, int]:
    """``(hit, chain)``: the longest hit in ``[start, cap]`` every group can serve from the tiers (or
    ``start``), and how far the growing groups' chain reaches (a junction when ``hit < chain < cap``).

    ``start`` is the local hit (a multiple of the hit alignment), ``cap`` the longest allowed hit.
    """
    align = rules.hit_alignment
    if cap <= start or not rules.hits_possible:
        return start, start
    layout = rules.layout
    bound = cap
    cached: dict[int, Mapping[int, int]] = {}
    for g in rules.caching_groups:
        bs = layout.groups[g].spec.block_size
        if layout.groups[g].spec.grows_with_sequence and rules.groups[g].downward_closed:
            end = chain_end(g, start // bs, cap // bs, probe, fanout)
            cached[g] = _Prefix(end)
            bound = min(bound, end * bs // align * align)
    chain = bound
    if bound <= start:
        return start, chain
    runs: dict[int, _Runs] = {}
    for g in rules.caching_groups:
        if g not in cached:
            bs = layout.groups[g].spec.block_size
            cached[g] = _OnDemand(g, start // bs, bound // bs, probe, runs.setdefault(bs, _Runs()))
    sizes = {g: cap // layout.groups[g].spec.block_size for g in rules.caching_groups}
    hit = rules.longest_hit(seq, by_position(cached), limit=bound, hashes=positions(sizes))
    for group_runs in runs.values():
        group_runs.members.clear()  # members and runs refer to each other: freed now, not by the collector
    return max(hit, start), chain


def by_position(cached: Mapping[int, Mapping[int, int]]) -> Mapping[int, Mapping[bytes, Any]]:
    """``cached`` (per group, block positions held) as ``HitRules`` takes it (hashes held): positions
    stand in for hashes (docs/TIERS.md, "Lookup")."""
    return cast("Mapping[int, Mapping[bytes, Any]]", cached)


def positions(sizes: Mapping[int, int]) -> Callable[[int], list[bytes]]:
    """Per group, its block positions ``0 .. sizes[g] - 1`` in place of its block hashes."""
    return lambda g: cast("list[bytes]", range(sizes.get(g, 0)))

"""The block pool: ids, reference counts, free tiers, the prefix-cache index and events.

The pool knows nothing about attention. It hands out block ids, counts references, remembers
which full blocks hold which content hash (per group), and decides which free block to reuse
next. Block 0 is the null block: never allocated, freed or counted.

A free block (reference count 0) sits in exactly one tier; allocation takes from the first
non-empty tier, so the tiers *are* the eviction order:

1. ``uncached`` -- freed blocks without a hash (nothing to lose), last freed first;
2. ``fresh``    -- never-used blocks ``next_fresh .. num_blocks - 1`` (a counter, no memory);
3. ``low``      -- cached blocks that can serve no hit (window blocks dropped mid-sequence,
   windows released with their prefix), oldest first;
4. ``lru``      -- cached blocks, least recently freed first (the reference engine's LRU);
5. ``retained`` -- window/state blocks a future hit needs (seed 004), each tied to an
   *anchor*: the full-attention block whose prefix the window completes. Evicting the anchor
   releases its windows into ``low``. Retained blocks whose anchor is held by a running
   sequence are *reserved*: an admission cannot take them, a running sequence's growth can
   (oldest first), so retention never stalls a sequence that is already running.

Eviction is lazy: a cached block keeps its hash (and can still be hit) until it is reused.
Tiers 1, 3, 4 and 5 are O(1) for insert, remove and pop (a list and ordered dicts).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from hybridkv.errors import InvalidInputError

NULL_BLOCK = 0

# Tier tags, one byte per block.
_HELD = 0
_UNCACHED = 1
_FRESH = 2
_LOW = 3
_LRU = 4
_RETAINED = 5
_TIER_NAMES = {_HELD: "held", _UNCACHED: "uncached", _FRESH: "fresh", _LOW: "low", _LRU: "lru",
               _RETAINED: "retained"}


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the prefix cache of ``group`` (hashes and ids in the same order)."""

    group: int
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks of ``group`` left the prefix cache (their ids were reused)."""

    group: int
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


# Hot loops below are plain ``for`` loops and comprehensions over lists of ints: on CPython 3.11+
# they run specialised list bytecodes and beat ``map``/``compress`` chains of slot wrappers.


class BlockPool:
    """Block ids ``1 .. num_blocks - 1``, their reference counts, hashes and free tiers."""

    __slots__ = (
        "num_blocks",
        "num_groups",
        "enable_caching",
        "enable_events",
        "ref_cnt",
        "block_hash",
        "_block_group",
        "_tier",
        "index",
        "_uncached",
        "_next_fresh",
        "_low",
        "_lru",
        "_retained",
        "_anchored",
        "_num_reserved",
        "_events",
        "evictions",
        "_dups",
    )

    def __init__(
        self,
        num_blocks: int,
        num_groups: int = 1,
        *,
        enable_caching: bool = True,
        enable_events: bool = False,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise InvalidInputError(
                f"num_blocks must be an integer >= 2 (block 0 is the null block), got {num_blocks!r}"
            )
        if not 1 <= num_groups <= 255:
            raise InvalidInputError(f"num_groups must be in 1..255, got {num_groups}")
        self.num_blocks = num_blocks
        self.num_groups = num_groups
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._block_group = bytearray(num_blocks)
        self._tier = bytearray([_FRESH]) * num_blocks
        self._tier[NULL_BLOCK] = _HELD
        # Per group: hash -> the block that serves it; further blocks with the same hash (two
        # sequences computed one prefix at once) wait in `_dups` and take over on eviction.
        self.index: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        self._dups: list[dict[bytes, list[int]]] = [{} for _ in range(num_groups)]
        self._uncached: list[int] = []
        self._next_fresh = 1
        self._low: OrderedDict[int, None] = OrderedDict()
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._retained: OrderedDict[int, int] = OrderedDict()  # window block -> anchor block
        self._anchored: dict[int, dict[int, None]] = {}  # anchor block -> its retained windows
        self._num_reserved = 0  # retained blocks whose anchor has ref_cnt > 0
        self._events: list[KVCacheEvent] = []
        self.evictions = 0  # hashes dropped so far: a hit looked up at the same count is still valid

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        """Blocks a running sequence's allocation could take now (every free tier)."""
        return (
            len(self._uncached)
            + (self.num_blocks - self._next_fresh)
            + len(self._low)
            + len(self._lru)
            + len(self._retained)
        )

    @property
    def num_admissible_blocks(self) -> int:
        """Blocks a new sequence's allocation could take now (reserved windows excluded)."""
        return self.num_free_blocks - self._num_reserved

    @property
    def num_retained_blocks(self) -> int:
        """Blocks kept in the retained tier."""
        return len(self._retained)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is in the prefix cache (held or free)."""
        return sum(1 for h in self.block_hash if h is not None)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by sequences."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    # ------------------------------------------------------------------ lookup
    def get_cached_block(self, group: int, block_hash: bytes) -> int | None:
        """A block of ``group`` holding ``block_hash``, or None."""
        return self.index[group].get(block_hash)

    # ------------------------------------------------------------------ allocate
    def unreferenced(self, block_ids: list[int]) -> list[int]:
        """The blocks of ``block_ids`` (null entries skipped) that no sequence references."""
        ref = self.ref_cnt
        return [b for b in block_ids if not ref[b] and b != NULL_BLOCK]

    def admission_cost(self, hit_blocks: Iterable[int], free: list[int] | None = None) -> int:
        """Admissible free blocks that adopting ``hit_blocks`` (a touch) would consume.

        A free hit block leaves its tier; a free anchor that becomes held turns its retained
        windows (those not among the hits) into reserved blocks. ``free`` may pass
        ``unreferenced(hit_blocks)`` when the caller has it already.
        """
        ref = self.ref_cnt
        if free is None:
            free = self.unreferenced(list(hit_blocks))
        if not self._retained or not free:
            return len(free)
        hits = set(free)
        cost = 0
        for b in hits:
            anchor = self._retained.get(b)
            if anchor is None or ref[anchor] == 0:
                cost += 1
            windows = self._anchored.get(b)
            if windows:
                cost += sum(1 for w in windows if w not in hits)
        return cost

    def touch(self, block_ids: Iterable[int], free: list[int] | None = None) -> None:
        """Take one more reference on each (cached) block, removing free ones from their tier.

        ``free`` may pass ``unreferenced(block_ids)`` when the caller has it already.
        """
        ref = self.ref_cnt
        blocks = block_ids if isinstance(block_ids, list) else list(block_ids)
        tier = self._tier
        if free is None:
            free = self.unreferenced(blocks)
        if self._anchored:
            # Free blocks leave their tier one by one, each counted at once so that an anchor and
            # its window touched together keep the reservation count right.
            taken: list[int] = []
            for b in free:
                if tier[b] != _HELD:  # skips a block listed twice
                    self._take_free(b)
                    ref[b] += 1
                    taken.append(b)
                    windows = self._anchored.get(b)
                    if windows:
                        self._num_reserved += len(windows)
            for b in blocks:
                ref[b] += 1
            for b in taken:  # counted twice above
                ref[b] -= 1
        else:  # no retained windows: no reservations to keep
            for b in free:
                if tier[b] != _HELD:
                    self._take_free(b)
            for b in blocks:
                ref[b] += 1
        ref[NULL_BLOCK] = 0  # null entries were counted above; the null block has no count

    def _take_free(self, b: int) -> None:
        """Take the free cached block ``b`` out of its tier (it becomes held)."""
        t = self._tier[b]
        if t == _LRU:
            del self._lru[b]
        elif t == _LOW:
            del self._low[b]
        elif t == _RETAINED:
            self._unretain(b)
        else:
            raise AssertionError(f"touch of block {b} in tier {_TIER_NAMES[t]}: not cached")
        self._tier[b] = _HELD

    def allocate(self, num_blocks: int, *, allow_reserved: bool) -> list[int]:
        """Take ``num_blocks`` free blocks (reference count 1 each), evicting cached ones lazily.

        The caller has checked the count; running out here is a bug, not a miss.
        """
        out: list[int] = []
        uncached = self._uncached
        if uncached:  # tier 1 in bulk: last freed first
            take = min(num_blocks, len(uncached))
            out = uncached[len(uncached) - take:]
            out.reverse()
            del uncached[len(uncached) - take:]
        if len(out) < num_blocks and self._next_fresh < self.num_blocks:  # tier 2 in bulk
            fresh = min(num_blocks - len(out), self.num_blocks - self._next_fresh)
            out.extend(range(self._next_fresh, self._next_fresh + fresh))
            self._next_fresh += fresh
        if len(out) < num_blocks:
            self._evict_into(out, num_blocks, allow_reserved)
        ref = self.ref_cnt
        tier = self._tier
        for b in out:
            ref[b] = 1
            tier[b] = _HELD
        return out

    def _evict_into(self, out: list[int], num_blocks: int, allow_reserved: bool) -> None:
        """Fill ``out`` up to ``num_blocks`` from the cached tiers (``low``, ``lru``, then ``retained``)."""
        low, lru = self._low, self._lru
        if not self._anchored:
            # No retained windows: an eviction releases none into ``low``, so each tier is drained
            # in turn, the common case of ``_evict`` inline.
            hashes, groups, index = self.block_hash, self._block_group, self.index
            for od in (low, lru):
                while od and len(out) < num_blocks:
                    b = od.popitem(last=False)[0]
                    group, h = groups[b], hashes[b]
                    if h in self._dups[group] or self.enable_events:
                        self._evict(b)
                    else:  # the only block holding h
                        del index[group][h]  # type: ignore[arg-type]
                        hashes[b] = None
                        self.evictions += 1
                    out.append(b)
        while len(out) < num_blocks:
            if low:
                b = low.popitem(last=False)[0]
            elif lru:
                b = lru.popitem(last=False)[0]
            elif self._retained and allow_reserved:
                b = next(iter(self._retained))
                self._unretain(b)
            else:
                self._give_back(out)
                raise AssertionError(
                    f"allocate({num_blocks}) ran out of blocks after {len(out)}: the caller must "
                    f"check num_free_blocks first"
                )
            self._evict(b)
            out.append(b)

    def _give_back(self, blocks: list[int]) -> None:
        """Undo a partial ``allocate``: the taken blocks become free and uncached."""
        for b in blocks:
            self.ref_cnt[b] = 0
            self._tier[b] = _UNCACHED
            self._uncached.append(b)

    def _evict(self, b: int) -> None:
        """Drop ``b``'s hash from the cache (it is being reused) and release its windows."""
        h = self.block_hash[b]
        if h is None:
            return
        group = self._block_group[b]
        idx = self.index[group]
        dups = self._dups[group]
        if not dups:  # the common case: no duplicates in the group, so ``b`` serves ``h``
            del idx[h]
        elif idx[h] == b:
            others = dups.get(h)
            if others:
                idx[h] = others.pop(0)  # the oldest duplicate serves next (the reference's order)
                if not others:
                    del dups[h]
            else:
                del idx[h]
        else:
            others = dups[h]
            others.remove(b)
            if not others:
                del dups[h]
        self.block_hash[b] = None
        self.evictions += 1
        if self.enable_events:
            self._events.append(BlockRemoved(group, (h,)))
        windows = self._anchored.pop(b, None) if self._anchored else None
        if windows:
            # The prefix these windows complete is gone: they can serve no hit any more.
            for w in windows:
                del self._retained[w]
                self._tier[w] = _LOW
                self._low[w] = None

    def _unretain(self, w: int) -> None:
        anchor = self._retained.pop(w)
        windows = self._anchored[anchor]
        del windows[w]
        if not windows:
            del self._anchored[anchor]
        if self.ref_cnt[anchor] > 0:
            self._num_reserved -= 1

    # ------------------------------------------------------------------ free
    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block; the first listed is reused first.

        Blocks reaching zero go to ``uncached`` without a hash, to the ``lru`` tail with one.
        """
        ref = self.ref_cnt
        released: list[int] = []
        for b in block_ids:
            r = ref[b] - 1
            ref[b] = r
            if not r:  # a block listed twice reaches zero once
                released.append(b)
        # Null entries counted the null block down (never to zero: it starts at 0); reset it. A
        # block freed more often than referenced goes negative: check_invariants() reports it.
        ref[NULL_BLOCK] = 0
        tier = self._tier
        hashes = self.block_hash
        lru = self._lru
        for b in released:
            if hashes[b] is None:
                tier[b] = _UNCACHED
                self._uncached.append(b)
            else:
                tier[b] = _LRU
                lru[b] = None
        anchored = self._anchored
        if anchored:
            for b in released:
                windows = anchored.get(b)
                if windows:
                    self._num_reserved -= len(windows)

    def free_low(self, block_ids: Iterable[int]) -> None:
        """Like ``free``, but cached blocks reaching zero go to the ``low`` tier."""
        self._free_to(block_ids, _LOW, NULL_BLOCK)

    def free_retained(self, block_ids: Iterable[int], anchor: int) -> None:
        """Like ``free``, but cached blocks reaching zero are retained, tied to ``anchor``.

        ``anchor`` must be a cached block of another group; when it is evicted the windows go
        to ``low``. Without a cached anchor this is a plain ``free``; a block that anchors windows
        itself, or an anchor that is retained, is never retained (one level deep).
        """
        if anchor == NULL_BLOCK or self.block_hash[anchor] is None:
            self.free(block_ids)
        else:
            self._free_to(block_ids, _RETAINED, anchor)

    def _free_to(self, block_ids: Iterable[int], tag: int, anchor: int) -> None:
        """``free`` with cached blocks that reach zero sent to tier ``tag`` (``low`` or ``retained``)."""
        ref = self.ref_cnt
        for b in block_ids:
            if b == NULL_BLOCK:
                continue
            r = ref[b] - 1
            if r < 0:
                raise AssertionError(f"block {b} freed more often than referenced")
            ref[b] = r
            if r:
                continue
            if self.block_hash[b] is None:
                self._tier[b] = _UNCACHED
                self._uncached.append(b)
            elif tag == _LOW:
                self._tier[b] = _LOW
                self._low[b] = None
            elif b in self._anchored or self._tier[anchor] == _RETAINED:
                # Retention is one level deep: an anchor is never retained itself (its windows would
                # count as admissible yet sit behind it), so such a block joins the LRU instead.
                self._tier[b] = _LRU
                self._lru[b] = None
            else:
                self._tier[b] = _RETAINED
                self._retained[b] = anchor
                self._anchored.setdefault(anchor, {})[b] = None
                if ref[anchor] > 0:
                    self._num_reserved += 1
            windows = self._anchored.get(b)
            if windows:
                self._num_reserved -= len(windows)

    def retain_free(self, block_ids: Iterable[int], anchor: int) -> int:
        """Move free cached blocks (``low`` or ``lru``) into the retained tier under ``anchor``.

        Used when a junction is discovered after its window was already freed. Returns how
        many blocks moved.
        """
        if anchor == NULL_BLOCK or self.block_hash[anchor] is None or self._tier[anchor] == _RETAINED:
            return 0
        moved = 0
        anchor_held = self.ref_cnt[anchor] > 0
        for b in block_ids:
            t = self._tier[b]
            if b == NULL_BLOCK or t not in (_LOW, _LRU) or b in self._anchored:
                continue
            if t == _LOW:
                del self._low[b]
            else:
                del self._lru[b]
            self._tier[b] = _RETAINED
            self._retained[b] = anchor
            self._anchored.setdefault(anchor, {})[b] = None
            if anchor_held:
                self._num_reserved += 1
            moved += 1
        return moved

    # ------------------------------------------------------------------ cache
    def cache_blocks(self, group: int, block_ids: list[int], block_hashes: list[bytes]) -> None:
        """Enter full, held blocks of ``group`` into the prefix cache under their hashes."""
        idx = self.index[group]
        hashes = self.block_hash
        gid = self._block_group
        for b, h in zip(block_ids, block_hashes):
            hashes[b] = h
            gid[b] = group
            if idx.setdefault(h, b) != b:  # another block serves h already: b waits as a duplicate
                self._dups[group].setdefault(h, []).append(b)
        if self.enable_events and block_ids:
            self._events.append(BlockStored(group, tuple(block_hashes), tuple(block_ids)))

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False) while any block is held."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        for tier in (self._low, self._lru, self._retained):
            for b in tier:
                self._tier[b] = _UNCACHED
                self._uncached.append(b)
            tier.clear()
        self._anchored.clear()
        self._num_reserved = 0
        self.evictions += 1
        for idx in self.index:
            idx.clear()
        for dups in self._dups:
            dups.clear()
        self.block_hash = [None] * self.num_blocks
        if self.enable_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Events since the last call (empty unless the pool was built with events on)."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Verify every structural invariant of the pool; raise AssertionError naming the first broken."""
        n = self.num_blocks
        ref, tier = self.ref_cnt, self._tier
        assert ref[NULL_BLOCK] == 0 and tier[NULL_BLOCK] == _HELD, "null block must never be counted"
        assert 1 <= self._next_fresh <= n, f"next_fresh {self._next_fresh} outside 1..{n}"
        counts = {t: 0 for t in _TIER_NAMES}
        for b in range(1, n):
            t = tier[b]
            counts[t] += 1
            if t == _HELD:
                assert ref[b] > 0, f"block {b} is held with ref_cnt {ref[b]}"
            else:
                assert ref[b] == 0, f"block {b} is free ({_TIER_NAMES[t]}) with ref_cnt {ref[b]}"
            if t == _FRESH:
                assert b >= self._next_fresh, f"fresh block {b} below next_fresh {self._next_fresh}"
            if t in (_UNCACHED, _FRESH):
                assert self.block_hash[b] is None, f"{_TIER_NAMES[t]} block {b} has a hash"
            if t in (_LOW, _LRU, _RETAINED):
                assert self.block_hash[b] is not None, f"{_TIER_NAMES[t]} block {b} has no hash"
        assert counts[_FRESH] == n - self._next_fresh, "fresh counter disagrees with tier tags"
        assert counts[_UNCACHED] == len(self._uncached) == len(set(self._uncached)), "uncached list"
        for name, tag, od in (("low", _LOW, self._low), ("lru", _LRU, self._lru),
                              ("retained", _RETAINED, self._retained)):
            assert counts[tag] == len(od), f"{name} tier holds {len(od)}, tags say {counts[tag]}"
            for b in od:
                assert tier[b] == tag, f"block {b} in {name} tier tagged {_TIER_NAMES[tier[b]]}"
        assert self.num_free_blocks == n - 1 - counts[_HELD], "free count not conserved"
        reserved = 0
        for anchor, windows in self._anchored.items():
            assert windows, f"anchor {anchor} has an empty window set"
            assert self.block_hash[anchor] is not None, f"anchor {anchor} is not cached"
            for w in windows:
                assert self._retained.get(w) == anchor, f"window {w} not retained under {anchor}"
            if ref[anchor] > 0:
                reserved += len(windows)
        assert sum(len(w) for w in self._anchored.values()) == len(self._retained), "retained tier"
        assert reserved == self._num_reserved, f"reserved count {self._num_reserved} != {reserved}"
        for group, (idx, dups) in enumerate(zip(self.index, self._dups)):
            for h, others in dups.items():
                assert others and h in idx, f"group {group}: duplicates of a hash no block serves"
            for h, first in idx.items():
                for b in (first, *dups.get(h, ())):
                    assert self.block_hash[b] == h, f"index of group {group} maps a hash to block {b}"
                    assert self._block_group[b] == group, f"block {b} indexed in the wrong group"
        indexed = sum(len(idx) for idx in self.index) + sum(len(o) for d in self._dups for o in d.values())
        assert indexed == self.num_cached_blocks, "hashed blocks missing from the index"

"""A simulated KV tier: keys and nominal block sizes under a byte budget, no payload.

``SimTier`` implements the connectors' ``KVTier`` interface for the simulator (``sim.tiers``):
low-priority entries are evicted first, then normal ones, least recently used first within each;
a read answers with one byte naming the tier. Its bulk ``KVTier.offer`` puts a store's keys in as
few dict operations as leave the tier exactly as puts one by one would (a hypothesis test in
tests/sim/test_sim_tiers.py compares the two).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from itertools import filterfalse, repeat
from typing import TYPE_CHECKING

from hybridkv.connectors.base import BlockOffer, Guard, KVTier
from hybridkv.errors import InvalidInputError

if TYPE_CHECKING:
    from hybridkv.sim.tiers import TierSpec


def tier_key_group(key: bytes) -> bytes:
    """The group index, as written, in a tier key ``hkv1/<namespace>/<group>/<hash>`` (``frame.tier_key``)."""
    i = key.index(b"/", 5) + 1
    return key[i : key.index(b"/", i)]


class SimTier(KVTier):
    """A ``KVTier`` of keys and nominal block sizes under a byte budget: low-priority entries evicted
    first, then normal ones, least recently used first within each (``KVTier.priorities``).

    ``get_many`` answers a held key with a 1-byte value, the tier's ``index``: the caller learns which
    tier served the block (``SimConnector``'s ``PlaceholderCodec`` serves it as the payload, unchecked).
    """

    priorities = True

    def __init__(self, spec: TierSpec, index: int, block_bytes: Mapping[int, int]) -> None:
        super().__init__()
        if not 0 <= index < 256:
            raise InvalidInputError(f"at most 256 simulated tiers, got index {index}")
        self.spec = spec
        self.name = spec.kind
        self.index = index
        self.capacity_bytes = spec.capacity_bytes
        self.used_bytes = 0
        self.low_bytes = 0
        """Bytes of the low-priority entries (part of ``used_bytes``)."""
        self._tag = bytes([index])
        self._block_bytes = {str(g).encode(): size for g, size in block_bytes.items()}  # keyed as in tier keys
        self._group_bytes = dict(block_bytes)
        self._sizes = (max(1, min(block_bytes.values(), default=1)), max(1, max(block_bytes.values(), default=1)))
        self._entries: OrderedDict[bytes, int] = OrderedDict()  # key -> nominal bytes, LRU first
        self._low: OrderedDict[bytes, int] = OrderedDict()  # the low-priority ones, LRU first
        self.medium = spec.medium

    def record_changes(self, on: bool = True) -> None:
        """Log the keys that enter and leave the tier (``take_changes``): what a cluster's index
        learns of a replica's tier from its KV events."""
        if not on:
            self._changes = None
        elif self._changes is None:
            self._changes = deque()

    def _left(self, key: bytes) -> None:
        if self._changes is not None:
            self._changes.append((False, key))

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        entries, low = self._entries, self._low
        return [k in entries or k in low for k in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for k in keys:
            size = self._entries.get(k)
            if size is None and k in self._low:  # served a hit: promoted to normal
                size = self._entries[k] = self._low.pop(k)
                self.low_bytes -= size
                self.stats.low_promotions += 1
            if size is None:
                self.stats.misses += 1
                out.append(None)
                continue
            self._entries.move_to_end(k)
            self.stats.hits += 1
            self.stats.bytes_read += size
            out.append(self._tag)
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]], low: bool = False) -> None:
        entries, lows = self._entries, self._low
        for key, _value in items:
            size = self._block_bytes[tier_key_group(key)]
            if size > self.capacity_bytes:
                continue  # would evict everything and still not fit
            as_low = low and key not in entries  # a normal entry stays normal
            old = entries.pop(key, None)
            if old is None:
                old = lows.pop(key, None)
                self.low_bytes -= old or 0
            if old is not None:
                self.used_bytes -= old
            self._put_one(key, size, as_low, old is None)
            if old is not None and key not in entries and key not in lows:
                self._left(key)

    def offer(self, offer: BlockOffer, batch: int, guard: Guard) -> tuple[list[bytes], int]:
        """``KVTier.offer`` in one call, by the keys' nominal sizes (the values are placeholders, never
        built; this tier never raises, so ``guard`` is not needed): ``offer_keys``."""
        sizes: list[int] = []
        for group, count in offer.runs:
            sizes += repeat(self._group_bytes[group], count)
        return self.offer_keys(offer.keys, sizes, offer.low, batch), 0

    def offer_keys(self, keys: Sequence[bytes], sizes: Sequence[int], low: bool, batch: int) -> list[bytes]:
        """``KVTier.offer``'s steps for these keys of these nominal ``sizes``: per batch of ``batch``
        keys, those the tier lacks are put (``put_many``), then, for a normal offer, those it holds
        at low priority are promoted (``prioritize_many``). The same steps in the same order, so the
        same end state. Returns the keys put (offered while absent, whether or not they fitted).

        When the tier holds none of ``keys`` (the common case) the batching changes nothing, and
        the whole list goes in at once; a batch's absent keys go in at once (``_put_fresh``) when
        their evictions reach only entries older than the batch (the steady state of a full tier):
        dict operations on the whole batch instead of a loop per key, the same end state."""
        entries, lows = self._entries, self._low
        if entries.keys().isdisjoint(keys) and lows.keys().isdisjoint(keys):
            if low and self._skips_low():
                self.stats.low_skipped += len(keys)
            elif not self._put_fresh(keys, sizes, low):
                for key, size in zip(keys, sizes):
                    self._put_one(key, size, low)
            return list(keys)
        put: list[bytes] = []
        for lo in range(0, len(keys), batch):
            block = keys[lo : lo + batch]
            block_sizes = sizes[lo : lo + batch]
            if low and self._skips_low():
                skipped = list(filterfalse(entries.__contains__, block))
                put += skipped
                self.stats.low_skipped += len(skipped)
                continue
            absent: Sequence[bytes]
            absent_sizes: Sequence[int]
            present: list[bytes] = []
            if entries.keys().isdisjoint(block) and lows.keys().isdisjoint(block):
                absent, absent_sizes = block, block_sizes
            else:
                held = [k in entries or k in lows for k in block]
                absent = [k for k, there in zip(block, held) if not there]
                absent_sizes = [n for n, there in zip(block_sizes, held) if not there]
                present = [k for k, there in zip(block, held) if there]
            put += absent  # absent before the batch, so absent until put: keys of one store are distinct
            if absent and not self._put_fresh(absent, absent_sizes, low):
                for key, size in zip(absent, absent_sizes):
                    self._put_one(key, size, low)
            if not low:
                for key in present:
                    if key in lows:
                        size = entries[key] = lows.pop(key)
                        self.low_bytes -= size
                        self.stats.low_promotions += 1
        return put

    def takes_low_puts(self, min_bytes: int) -> bool:
        """As ``KVTier.takes_low_puts``, by the keys' nominal block sizes (``min_bytes`` is ignored:
        this tier sizes a key by its group, not by its value)."""
        return bool(self._low) or self.used_bytes + self._sizes[0] <= self.capacity_bytes

    def _skips_low(self) -> bool:
        """Every low put is skipped and counted: a full tier without low entries (a key larger than
        the whole tier would not be counted, so then the puts go key by key)."""
        return self._sizes[1] <= self.capacity_bytes and not self.takes_low_puts(0)

    def _put_one(self, key: bytes, size: int, low: bool, logged: bool = True) -> None:
        """Put one absent key of a known size: evict (low entries first; a low put evicts no normal
        entry) until it fits, or count it skipped. ``logged``: log its entry (False: a key put again,
        held all along)."""
        entries, lows, stats, log = self._entries, self._low, self.stats, self._changes
        capacity = self.capacity_bytes
        if size > capacity:
            return  # would evict everything and still not fit
        while self.used_bytes + size > capacity:
            if lows:
                gone, evicted = lows.popitem(last=False)
                self.used_bytes -= evicted
                self.low_bytes -= evicted
                stats.low_evictions += 1
            elif low:
                break
            else:
                gone, evicted = entries.popitem(last=False)
                self.used_bytes -= evicted
            stats.evictions += 1
            if log is not None:
                log.append((False, gone))
        if self.used_bytes + size > capacity:
            stats.low_skipped += 1  # a low entry never evicts a normal one
            return
        if log is not None and logged:
            log.append((True, key))
        (lows if low else entries)[key] = size
        self.used_bytes += size
        self.low_bytes += size if low else 0
        stats.puts += 1
        stats.bytes_written += size
        stats.low_puts += low

    def _put_fresh(self, keys: Sequence[bytes], sizes: Sequence[int], low: bool) -> bool:
        """Put ``keys`` (none held) at once when that ends as ``_put_one`` key by key would: the
        entries to evict (oldest low ones first, then, for a normal put, the oldest normal ones)
        all predate the batch. Key by key, each put evicts from the head until it fits, so the
        evicted entries are the shortest head whose bytes cover the batch's excess, which this
        evicts before adding the batch at the tail. A low batch needing more than the low entries
        hold goes to ``_put_low_overflow``. Returns False, changing nothing, for a batch larger than
        the tier (or one ``_put_low_overflow`` refuses)."""
        total = sum(sizes)
        need = self.used_bytes + total - self.capacity_bytes
        n_low = n_normal = freed = 0
        if need > 0:
            if total > self.capacity_bytes:
                return False
            if low and self.low_bytes < need:
                return self._put_low_overflow(keys, sizes, total)
            # Old entries cover ``need`` (the tier holds used_bytes >= need), so no new one is reached.
            lows, entries, log = self._low, self._entries, self._changes
            while freed < need and lows:
                gone, size = lows.popitem(last=False)
                freed += size
                n_low += 1
                if log is not None:
                    log.append((False, gone))
            self.low_bytes -= freed
            while freed < need:
                gone, size = entries.popitem(last=False)
                freed += size
                n_normal += 1
                if log is not None:
                    log.append((False, gone))
        if self._changes is not None:
            self._changes.extend((True, k) for k in keys)
        (self._low if low else self._entries).update(zip(keys, sizes))
        self.used_bytes += total - freed
        self.low_bytes += total if low else 0
        st = self.stats
        st.evictions += n_low + n_normal
        st.low_evictions += n_low
        st.puts += len(keys)
        st.bytes_written += total
        st.low_puts += len(keys) if low else 0
        return True

    def _put_low_overflow(self, keys: Sequence[bytes], sizes: Sequence[int], total: int) -> bool:
        """A low batch (none held) larger than the room the low entries have (``capacity`` less the
        normal entries, which a low put never evicts), put at once as ``_put_one`` key by key
        would: each key evicts the oldest low entries, every old one and then the batch's own
        earliest, so the batch's longest suffix that fits is what stays. Returns False, changing
        nothing, when a single key exceeds that room (key by key, it would be skipped)."""
        room = self.capacity_bytes - (self.used_bytes - self.low_bytes)
        if max(sizes) > room:
            return self._put_low_past_room(keys, sizes, room)
        kept, first = 0, len(keys)
        while first and kept + sizes[first - 1] <= room:
            first -= 1
            kept += sizes[first]
        lows = self._low
        evicted = len(lows) + first
        if self._changes is not None:  # keys[:first] went in and out again: no change
            self._changes.extend((False, k) for k in lows)
            self._changes.extend((True, k) for k in keys[first:])
        lows.clear()
        lows.update(zip(keys[first:], sizes[first:]))
        self.used_bytes += kept - self.low_bytes
        self.low_bytes = kept
        st = self.stats
        st.evictions += evicted
        st.low_evictions += evicted
        st.puts += len(keys)
        st.bytes_written += total
        st.low_puts += len(keys)
        return True

    def _put_low_past_room(self, keys: Sequence[bytes], sizes: Sequence[int], room: int) -> bool:
        """A low batch (none held) with keys larger than ``room`` (the bytes the low entries can
        have), put at once as ``_put_one`` key by key would: such a key evicts every low entry and is
        skipped, so the last one leaves no low entry before it; the keys after it go in from
        there. Returns False, changing nothing, when a key exceeds the whole tier."""
        if max(sizes) > self.capacity_bytes:
            return False  # such a key is passed over without a count: key by key
        last = max(i for i, n in enumerate(sizes) if n > room)
        put = [n for n in sizes[: last + 1] if n <= room]  # went in, and out again by ``last`` at the latest
        evicted = len(self._low) + len(put)
        if self._changes is not None:  # those of ``put`` went in and out again: no change
            self._changes.extend((False, k) for k in self._low)
        self._low.clear()
        self.used_bytes -= self.low_bytes
        self.low_bytes = 0
        st = self.stats
        st.evictions += evicted
        st.low_evictions += evicted
        st.puts += len(put)
        st.low_puts += len(put)
        st.bytes_written += sum(put)
        st.low_skipped += last + 1 - len(put)
        rest, rest_sizes = keys[last + 1 :], sizes[last + 1 :]
        if rest and not self._put_fresh(rest, rest_sizes, True):
            for key, size in zip(rest, rest_sizes):
                self._put_one(key, size, True)
        return True

    def delete(self, key: bytes) -> None:
        old = self._entries.pop(key, None)
        if old is None:
            old = self._low.pop(key, None)
            self.low_bytes -= old or 0
        if old is not None:
            self.used_bytes -= old
            self._left(key)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        entries, lows = self._entries, self._low
        touch, touch_low = entries.move_to_end, lows.move_to_end
        for k in keys:
            if k in entries:
                touch(k)
            elif k in lows:
                touch_low(k)

    def prioritize_many(self, keys: Sequence[bytes]) -> None:
        lows = self._low
        for k in keys:
            if k in lows:
                size = self._entries[k] = lows.pop(k)
                self.low_bytes -= size
                self.stats.low_promotions += 1

    def entries_per_group(self) -> dict[int, int]:
        """How many blocks of each group the tier holds."""
        out: dict[int, int] = {}
        for entries in (self._entries, self._low):
            for k in entries:
                g = int(tier_key_group(k))
                out[g] = out.get(g, 0) + 1
        return out

    def low_priority_entries(self) -> int:
        """How many entries the tier holds at low priority."""
        return len(self._low)

    def __len__(self) -> int:
        return len(self._entries) + len(self._low)

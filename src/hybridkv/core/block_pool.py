"""The block pool: ids, reference counts, free queues, the prefix-cache index and events.

The pool knows nothing about attention. Block 0 is the null block: never allocated, freed or
counted. A free block sits in exactly one free queue (``uncached``, ``fresh``, ``low``, ``lru``,
then the retention policy's ``KeptQueue``); allocation takes from the first non-empty one, so the
queues are the eviction order. Eviction is lazy: a cached block can be hit until it is reused.
See docs/ARCHITECTURE.md, "The block pool and its free queues".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from hybridkv.core._util import gather
from hybridkv.errors import InvalidInputError

NULL_BLOCK = 0

# Queue tags, one byte per block.
HELD = 0
UNCACHED = 1
FRESH = 2
LOW = 3
LRU = 4
KEPT = 5
QUEUE_NAMES = {HELD: "held", UNCACHED: "uncached", FRESH: "fresh", LOW: "low", LRU: "lru", KEPT: "kept"}


@dataclass(frozen=True)
class BlockStored:
    """Full blocks entered the prefix cache of ``group`` (hashes and ids in the same order).

    When the manager knows them: ``parent_block_hash`` is the hash of the block before the first
    (None for a sequence's first block), ``token_ids`` the tokens of the stored blocks in order,
    ``block_size`` the group's block size (0 when unknown).
    """

    group: int
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    parent_block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks of ``group`` left the prefix cache (their ids were reused)."""

    group: int
    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KeptQueue(Protocol):
    """The last free queue, owned by a retention policy (``retention.KeptBlocks`` implements it)."""

    num_reserved: int
    """Kept blocks an admission may not take."""

    @property
    def depended_on(self) -> Container[int]:
        """Blocks (outside the queue) whose eviction ``on_evicted`` must hear of: kept blocks depend on them."""
        ...

    def __len__(self) -> int:
        """Blocks in the queue."""
        ...

    def take(self, block: int) -> None:
        """``block`` leaves the queue: a sequence adopts it."""
        ...

    def pop(self, allow_reserved: bool) -> int | None:
        """The next block to evict (it leaves the queue), or None when only reserved ones are left
        and ``allow_reserved`` is false."""
        ...

    def on_evicted(self, block: int) -> list[int]:
        """``block`` lost its hash: the kept blocks that depended on it leave the queue (returned)."""
        ...

    def on_held(self, blocks: list[int]) -> None:
        """``blocks`` went from free to held."""
        ...

    def on_freed(self, blocks: list[int]) -> None:
        """``blocks`` went from held to free."""
        ...

    def check_invariants(self) -> None:
        """The queue's own invariants (AssertionError naming the broken one)."""
        ...


class FreeQueue:
    """Free cached blocks in the order they joined, oldest first: appending, taking from the front
    (a run in one list slice) and removing from anywhere are O(1).

    A removed block's entry stays in ``items`` and is skipped once it reaches the front. ``stale[b]``
    counts ``b``'s entries that no longer stand for it (every entry but the newest while ``b`` is in
    the queue, all of them once it left), so an entry whose block is not in ``stale`` is live, and
    the front's first ``n`` entries are the first ``n`` blocks when none of them is in ``stale``.
    Entries before ``head`` are gone; the list is cut once they are half of it, and rebuilt from the
    live blocks once stale entries outnumber them (so a queue that is never taken from, whose blocks
    leave and come back, stays as long as its blocks).
    """

    __slots__ = ("items", "head", "size", "stale", "num_stale")
    slack = 1024
    """Gone or stale entries the list may carry before it is cut or rebuilt."""

    def __init__(self) -> None:
        self.items: list[int] = []
        self.head = 0
        self.size = 0
        """Blocks in the queue (live entries)."""
        self.stale: dict[int, int] = {}
        self.num_stale = 0

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[int]:
        """The blocks, oldest first."""
        skip = dict(self.stale)
        for b in self.items[self.head:]:
            n = skip.get(b)
            if n:
                skip[b] = n - 1
            else:
                yield b

    def append(self, block: int) -> None:
        """``block`` (not in the queue) joins at the back."""
        self.items.append(block)
        self.size += 1

    def extend(self, blocks: list[int]) -> None:
        """``blocks`` (none in the queue, each once) join at the back in order."""
        self.items += blocks
        self.size += len(blocks)

    def remove(self, block: int) -> None:
        """``block`` (in the queue) leaves it."""
        self.stale[block] = self.stale.get(block, 0) + 1
        self.size -= 1
        self.num_stale += 1
        if self.num_stale > self.size + self.slack:
            self.items = list(self)
            self.head = 0
            self.stale.clear()
            self.num_stale = 0

    def front(self, n: int) -> list[int]:
        """The oldest blocks, at most ``n`` (``n <= len(self)``), up to the first stale entry: the
        run ``drop_front`` can take in one slice (empty when the front entry is stale)."""
        run = self.items[self.head:self.head + n]
        stale = self.stale
        if stale and not stale.keys().isdisjoint(run):
            del run[next(i for i, b in enumerate(run) if b in stale):]
        return run

    def drop_front(self, n: int) -> None:
        """Take the first ``n`` blocks ``front`` returned."""
        self.head += n
        self.size -= n
        self._cut()

    def pop_front(self) -> int:
        """Take the oldest block (the queue is not empty)."""
        items, stale = self.items, self.stale
        while True:
            b = items[self.head]
            self.head += 1
            n = stale.get(b) if stale else None
            if not n:
                break
            if n == 1:
                del stale[b]
            else:
                stale[b] = n - 1
            self.num_stale -= 1
        self.size -= 1
        self._cut()
        return b

    def clear(self) -> None:
        """Empty the queue."""
        self.items = []
        self.head = self.size = self.num_stale = 0
        self.stale.clear()

    def _cut(self) -> None:
        if self.head > self.slack and 2 * self.head > len(self.items):
            del self.items[:self.head]
            self.head = 0

    def check_invariants(self, name: str) -> None:
        """Counts agree with the entries, and no block is in the queue twice (``name`` labels errors)."""
        entries = len(self.items) - self.head
        assert entries == self.size + self.num_stale, f"{name} queue: {entries} entries, {self.size} live + " \
                                                        f"{self.num_stale} stale"
        assert sum(self.stale.values()) == self.num_stale and all(self.stale.values()), f"{name} queue: stale counts"
        live = list(self)
        assert len(live) == len(set(live)) == self.size, f"{name} queue lists a block twice"


# Hot loops below are plain ``for`` loops and comprehensions over lists of ints: on CPython 3.11+
# they run specialised list bytecodes and beat ``map``/``compress`` chains of slot wrappers.


class BlockPool:
    """Block ids ``1 .. num_blocks - 1``, their reference counts, hashes and free queues."""

    __slots__ = (
        "num_blocks",
        "num_groups",
        "enable_caching",
        "enable_events",
        "ref_cnt",
        "block_hash",
        "block_group",
        "_queue",
        "index",
        "_uncached",
        "_next_fresh",
        "_low",
        "_lru",
        "kept",
        "_events",
        "evictions",
        "_dups",
        "_remembered",
    )

    def __init__(
        self,
        num_blocks: int,
        num_groups: int = 1,
        *,
        enable_caching: bool = True,
        enable_events: bool = False,
        kept_queue: Callable[[list[int]], KeptQueue] | None = None,
    ) -> None:
        """``kept_queue``, when given, builds the last free queue from the pool's reference counts
        (``retention.KeptBlocks``; a retention policy that keeps no blocks passes None)."""
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
        self.block_group = bytearray(num_blocks)
        """The group a cached block is indexed under (meaningless while it has no hash)."""
        self._queue = bytearray([FRESH]) * num_blocks
        self._queue[NULL_BLOCK] = HELD
        # Per group: hash -> the block that serves it; further blocks with the same hash (two
        # sequences computed one prefix at once) wait in `_dups` and take over on eviction.
        self.index: list[dict[bytes, int]] = [{} for _ in range(num_groups)]
        self._dups: list[dict[bytes, list[int]]] = [{} for _ in range(num_groups)]
        self._uncached: list[int] = []
        self._next_fresh = 1
        self._low = FreeQueue()
        self._lru = FreeQueue()
        self.kept = kept_queue(self.ref_cnt) if kept_queue is not None else None
        self._events: list[KVCacheEvent] = []
        self.evictions = 0  # hashes dropped so far: a hit looked up at the same count is still valid
        self._remembered: dict[int, OrderedDict[bytes, None]] = {}
        """Per group that asked (``remember_evictions``): the hashes it lost to eviction, newest last."""

    # ------------------------------------------------------------------ counts
    @property
    def num_free_blocks(self) -> int:
        """Blocks a running sequence's allocation could take now (every free queue)."""
        free = len(self._uncached) + (self.num_blocks - self._next_fresh) + self._low.size + self._lru.size
        return free + len(self.kept) if self.kept is not None else free

    @property
    def num_admissible_blocks(self) -> int:
        """Blocks a new sequence's allocation could take now (reserved kept blocks excluded)."""
        free = self.num_free_blocks
        return free - self.kept.num_reserved if self.kept is not None else free

    @property
    def num_kept_blocks(self) -> int:
        """Blocks in the kept queue (a retention policy's)."""
        return len(self.kept) if self.kept is not None else 0

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose hash is in the prefix cache (held or free)."""
        return sum(1 for h in self.block_hash if h is not None)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by sequences."""
        return 1.0 - self.num_free_blocks / (self.num_blocks - 1)

    def queue_of(self, block: int) -> str:
        """The name of the queue ``block`` sits in (``held`` when referenced)."""
        return QUEUE_NAMES[self._queue[block]]

    # ------------------------------------------------------------------ lookup
    def get_cached_block(self, group: int, block_hash: bytes) -> int | None:
        """A block of ``group`` holding ``block_hash``, or None."""
        return self.index[group].get(block_hash)

    # ------------------------------------------------------------------ take references
    def unreferenced(self, block_ids: list[int]) -> list[int]:
        """The blocks of ``block_ids`` (null entries skipped) that no sequence references."""
        ref = self.ref_cnt
        return [b for b in block_ids if not ref[b] and b != NULL_BLOCK]

    def touch(self, block_ids: list[int], free: list[int] | None = None) -> None:
        """Take one more reference on each (cached) block, removing free ones from their queue.

        ``free`` may pass ``unreferenced(block_ids)`` when the caller has it already.
        """
        ref = self.ref_cnt
        if free is None:
            free = self.unreferenced(block_ids)
        if free:
            queue = self._queue
            taken: list[int] = []
            for b in free:
                t = queue[b]
                if t == LRU:
                    self._lru.remove(b)
                elif t == LOW:
                    self._low.remove(b)
                elif t == KEPT:
                    self.kept.take(b)  # type: ignore[union-attr]
                elif t == HELD:  # listed twice
                    continue
                else:
                    raise AssertionError(f"touch of block {b} in queue {QUEUE_NAMES[t]}: not cached")
                queue[b] = HELD
                taken.append(b)
            if self.kept is not None:
                self.kept.on_held(taken)
        for b in block_ids:
            ref[b] += 1
        ref[NULL_BLOCK] = 0  # null entries were counted above; the null block has no count

    def allocate(self, num_blocks: int, *, allow_reserved: bool) -> list[int]:
        """Take ``num_blocks`` free blocks (reference count 1 each), evicting cached ones lazily.

        The caller has checked the count; running out here is a bug, not a miss.
        """
        out: list[int] = []
        uncached = self._uncached
        if uncached:  # queue 1 in bulk: last freed first
            take = min(num_blocks, len(uncached))
            out = uncached[len(uncached) - take:]
            out.reverse()
            del uncached[len(uncached) - take:]
        if len(out) < num_blocks and self._next_fresh < self.num_blocks:  # queue 2 in bulk
            fresh = min(num_blocks - len(out), self.num_blocks - self._next_fresh)
            out.extend(range(self._next_fresh, self._next_fresh + fresh))
            self._next_fresh += fresh
        if len(out) < num_blocks:
            self._evict_into(out, num_blocks, allow_reserved)
        ref = self.ref_cnt
        queue = self._queue
        for b in out:
            ref[b] = 1
            queue[b] = HELD
        return out

    def _evict_into(self, out: list[int], num_blocks: int, allow_reserved: bool) -> None:
        """Fill ``out`` up to ``num_blocks`` from the cached queues (``low``, ``lru``, then ``kept``)."""
        low, lru = self._low, self._lru
        kept = self.kept
        depended_on = kept.depended_on if kept is not None else None
        hashes, groups, index, dups = self.block_hash, self.block_group, self.index, self._dups
        slow = self.enable_events
        bulk = True  # until a run is refused: then block by block for the rest of the call
        while len(out) < num_blocks:
            # ``low`` first: an evicted anchor releases its kept blocks into ``low``, and they go next.
            queue = low if low.size else lru
            if queue.size:
                n = min(num_blocks - len(out), queue.size)
                if bulk and n > 1:
                    run = queue.front(n)
                    if len(run) > 1:
                        if self._evict_run(queue, run, out):
                            continue
                        bulk = False
                b = queue.pop_front()
            else:
                got = kept.pop(allow_reserved) if kept is not None and len(kept) else None
                if got is None:
                    self._give_back(out)
                    raise AssertionError(
                        f"allocate({num_blocks}) ran out of blocks after {len(out)}: the caller must "
                        f"check num_free_blocks first"
                    )
                self._evict(got)
                out.append(got)
                continue
            group, h = groups[b], hashes[b]
            if slow or h in dups[group] or (depended_on and b in depended_on) or group in self._remembered:
                self._evict(b)
            else:  # inline ``_evict`` for the common block: the only one holding h, none depending on it
                del index[group][h]  # type: ignore[arg-type]
                hashes[b] = None
                self.evictions += 1
            out.append(b)

    def _evict_run(self, queue: FreeQueue, victims: list[int], out: list[int]) -> bool:
        """Evict ``victims``, the oldest blocks of ``queue``, into ``out`` in one loop without
        per-block checks, when each alone holds its hash and no kept block depends on any (what the
        per-block path does for such blocks, in the same order). Returns False, changing nothing,
        otherwise."""
        depended_on = self.kept.depended_on if self.kept is not None else None
        if depended_on and any(map(depended_on.__contains__, victims)):
            return False
        hashes, groups, index, dups = self.block_hash, self.block_group, self.index, self._dups
        if self._remembered and not self._remembered.keys().isdisjoint(gather(groups, victims)):
            return False  # a group whose evictions are remembered: the per-block path records them
        if any(dups):  # conservative, in C: a victim's hash among any group's duplicates refuses the run
            victim_hashes = gather(hashes, victims)
            if any(not d.keys().isdisjoint(victim_hashes) for d in dups if d):
                return False
        if self.enable_events:  # one event per run of one group's blocks, in eviction order
            events = self._events
            run_group, run = groups[victims[0]], [hashes[victims[0]]]
            for b in victims[1:]:
                group = groups[b]
                if group != run_group:
                    events.append(BlockRemoved(run_group, tuple(run)))  # type: ignore[arg-type]
                    run_group, run = group, []
                run.append(hashes[b])
            events.append(BlockRemoved(run_group, tuple(run)))  # type: ignore[arg-type]
        queue.drop_front(len(victims))
        for b in victims:
            del index[groups[b]][hashes[b]]  # type: ignore[arg-type]
            hashes[b] = None
        self.evictions += len(victims)
        out += victims
        return True

    def _give_back(self, blocks: list[int]) -> None:
        """Undo a partial ``allocate``: the taken blocks become free and uncached."""
        for b in blocks:
            self.ref_cnt[b] = 0
            self._queue[b] = UNCACHED
            self._uncached.append(b)

    def _evict(self, b: int) -> None:
        """Drop ``b``'s hash from the cache (it is reused or proved stale); blocks kept on it go to ``low``."""
        h = self.block_hash[b]
        if h is None:
            return
        group = self.block_group[b]
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
        remembered = self._remembered.get(group)
        if remembered is not None:
            remembered[h] = None
            remembered.move_to_end(h)
            if len(remembered) > self.num_blocks:
                remembered.popitem(last=False)
        if self.enable_events:
            self._events.append(BlockRemoved(group, (h,)))
        if self.kept is not None:
            for w in self.kept.on_evicted(b):
                self._queue[w] = LOW
                self._low.append(w)

    # ------------------------------------------------------------------ release references
    def free(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference on each block; the first listed is reused first. Returns the blocks
        that became free.

        Blocks reaching zero go to ``uncached`` without a hash, to the ``lru`` tail with one.
        """
        ref, queue, hashes, uncached = self.ref_cnt, self._queue, self.block_hash, self._uncached
        released: list[int] = []
        cached: list[int] = []
        for b in block_ids:
            r = ref[b] - 1
            ref[b] = r
            if not r:  # a block listed twice reaches zero once
                released.append(b)
                if hashes[b] is None:
                    queue[b] = UNCACHED
                    uncached.append(b)
                else:
                    queue[b] = LRU
                    cached.append(b)
        self._lru.extend(cached)
        # Null entries counted the null block down (never to zero: it starts at 0); reset it. A
        # block freed more often than referenced goes negative: check_invariants() reports it.
        ref[NULL_BLOCK] = 0
        if self.kept is not None:
            self.kept.on_freed(released)
        return released

    def free_low(self, block_ids: Iterable[int]) -> None:
        """Like ``free``, but cached blocks reaching zero go to the ``low`` queue."""
        self._place_released(self._release(block_ids), LOW, self._low)

    def unkeep(self, anchors: Iterable[int]) -> int:
        """The blocks kept under ``anchors`` leave the kept queue for ``low``: still cached, evicted
        first. Returns how many moved. (The queue unties them as when an anchor is evicted.)"""
        moved = 0
        if self.kept is not None and self.kept.depended_on:
            queue, low = self._queue, self._low
            for a in anchors:
                for w in self.kept.on_evicted(a):
                    queue[w] = LOW
                    low.append(w)
                    moved += 1
        return moved

    def free_kept(self, block_ids: Iterable[int], admit: Callable[[int], bool]) -> None:
        """Like ``free``, but cached blocks reaching zero go to the kept queue when ``admit(block)``
        (which enters them into the queue's own structures) says so, else to the ``lru`` tail."""
        self._place_released(self._release(block_ids), LRU, self._lru, admit)

    def _place_released(self, released: list[int], state: int, order: FreeQueue,
                        admit: Callable[[int], bool] | None = None) -> None:
        """Put blocks that reached zero in their queue: ``uncached`` without a hash, else the kept queue
        where ``admit(block)`` says so, else the tail of ``order`` (the queue ``state`` names)."""
        hashes, queue, uncached = self.block_hash, self._queue, self._uncached
        cached: list[int] = []
        for b in released:
            if hashes[b] is None:
                queue[b] = UNCACHED
                uncached.append(b)
            elif admit is not None and admit(b):
                queue[b] = KEPT
            else:
                queue[b] = state
                cached.append(b)
        order.extend(cached)

    def _release(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference on each non-null block; return those that reached zero (told to the
        kept queue before they join a queue, so a block becoming free is counted once)."""
        ref = self.ref_cnt
        released: list[int] = []
        for b in block_ids:
            if b == NULL_BLOCK:
                continue
            r = ref[b] - 1
            if r < 0:
                raise AssertionError(f"block {b} freed more often than referenced")
            ref[b] = r
            if not r:
                released.append(b)
        if released and self.kept is not None:
            self.kept.on_freed(released)
        return released

    def keep_free(self, block_ids: Iterable[int], admit: Callable[[int], bool]) -> int:
        """Move free cached blocks (``low`` or ``lru``) into the kept queue where ``admit(block)``
        says so. Returns how many moved."""
        moved = 0
        queue = self._queue
        for b in block_ids:
            t = queue[b]
            if b == NULL_BLOCK or t not in (LOW, LRU) or not admit(b):
                continue
            if t == LOW:
                self._low.remove(b)
            else:
                self._lru.remove(b)
            queue[b] = KEPT
            moved += 1
        return moved

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Drop the hashes of held blocks whose content was never computed (the step that was to
        compute them did not run): they must never serve a hit."""
        for b in block_ids:
            if b != NULL_BLOCK and self.block_hash[b] is not None:
                self._evict(b)

    def remember_evictions(self, groups: Iterable[int]) -> None:
        """Record, for these groups, the hashes eviction takes from the cache (the latest
        ``num_blocks`` per group), so ``was_evicted`` can tell a lost entry from one never cached."""
        self._remembered = {g: OrderedDict() for g in groups}

    def was_evicted(self, group: int, block_hash: bytes) -> bool:
        """Whether eviction took ``block_hash`` from ``group`` (a group given to ``remember_evictions``)
        and it has not been cached again since."""
        remembered = self._remembered.get(group)
        return remembered is not None and block_hash in remembered and block_hash not in self.index[group]

    # ------------------------------------------------------------------ cache
    def cache_blocks(self, group: int, block_ids: list[int], block_hashes: list[bytes], *,
                     parent: bytes | None = None, token_ids: tuple[int, ...] = (), block_size: int = 0) -> None:
        """Enter full, held blocks of ``group`` into the prefix cache under their hashes (the keyword
        arguments only describe them in the ``BlockStored`` event)."""
        idx = self.index[group]
        hashes = self.block_hash
        gid = self.block_group
        for b, h in zip(block_ids, block_hashes):
            hashes[b] = h
            gid[b] = group
            if idx.setdefault(h, b) != b:  # another block serves h already: b waits as a duplicate
                self._dups[group].setdefault(h, []).append(b)
        if self.enable_events and block_ids:
            self._events.append(BlockStored(group, tuple(block_hashes), tuple(block_ids), parent, token_ids,
                                            block_size))

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Refused (False) while any block is held."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        kept = self.kept
        while kept is not None and len(kept):
            b = kept.pop(True)
            assert b is not None
            self._uncached.append(b)
        for queue in (self._low, self._lru):
            self._uncached.extend(queue)
            queue.clear()
        for b in self._uncached:
            self._queue[b] = UNCACHED
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
        ref, queue = self.ref_cnt, self._queue
        assert ref[NULL_BLOCK] == 0 and queue[NULL_BLOCK] == HELD, "null block must never be counted"
        assert self.block_hash[NULL_BLOCK] is None, "null block must never have a hash"
        assert 1 <= self._next_fresh <= n, f"next_fresh {self._next_fresh} outside 1..{n}"
        counts = dict.fromkeys(QUEUE_NAMES, 0)
        for b in range(1, n):
            t = queue[b]
            counts[t] += 1
            if t == HELD:
                assert ref[b] > 0, f"block {b} is held with ref_cnt {ref[b]}"
            else:
                assert ref[b] == 0, f"block {b} is free ({QUEUE_NAMES[t]}) with ref_cnt {ref[b]}"
            if t == FRESH:
                assert b >= self._next_fresh, f"fresh block {b} below next_fresh {self._next_fresh}"
            if t in (UNCACHED, FRESH):
                assert self.block_hash[b] is None, f"{QUEUE_NAMES[t]} block {b} has a hash"
            if t in (LOW, LRU, KEPT):
                assert self.block_hash[b] is not None, f"{QUEUE_NAMES[t]} block {b} has no hash"
        assert counts[FRESH] == n - self._next_fresh, "fresh counter disagrees with queue tags"
        assert counts[UNCACHED] == len(self._uncached) == len(set(self._uncached)), "uncached list"
        for name, tag, od in (("low", LOW, self._low), ("lru", LRU, self._lru)):
            od.check_invariants(name)
            assert counts[tag] == len(od), f"{name} queue holds {len(od)}, tags say {counts[tag]}"
            for b in od:
                assert queue[b] == tag, f"block {b} in {name} queue tagged {QUEUE_NAMES[queue[b]]}"
        kept = len(self.kept) if self.kept is not None else 0
        assert counts[KEPT] == kept, f"kept queue holds {kept}, tags say {counts[KEPT]}"
        if self.kept is not None:
            self.kept.check_invariants()
        assert self.num_free_blocks == n - 1 - counts[HELD], "free count not conserved"
        for group, (idx, dups) in enumerate(zip(self.index, self._dups)):
            for h, others in dups.items():
                assert others and h in idx, f"group {group}: duplicates of a hash no block serves"
            for h, first in idx.items():
                for b in (first, *dups.get(h, ())):
                    assert self.block_hash[b] == h, f"index of group {group} maps a hash to block {b}"
                    assert self.block_group[b] == group, f"block {b} indexed in the wrong group"
        indexed = sum(len(idx) for idx in self.index) + sum(len(o) for d in self._dups for o in d.values())
        assert indexed == self.num_cached_blocks, "hashed blocks missing from the index"

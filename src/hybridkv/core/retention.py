"""Retention: which freed blocks are kept longer, and for how long (window retention).

A policy (``NoRetention``, ``WindowRetention``) decides which free queue of the pool each released
block joins; each manager builds its own ``Retainer`` from one. ``KeptBlocks`` is the pool's last
free queue: window and state blocks kept as long as their anchor stays cached, reserved while a
running sequence holds the anchor.
See docs/ARCHITECTURE.md, "Retention" and "Window retention".
"""

from __future__ import annotations

from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from hybridkv.core._util import page_by_page
from hybridkv.core.block_pool import NULL_BLOCK, BlockPool
from hybridkv.core.hits import CacheHit
from hybridkv.core.kinds import KindManager
from hybridkv.core.sequence import KVSequence
from hybridkv.errors import InvalidInputError

HashesOf = Callable[[KVSequence, KindManager], list[bytes]]


class KeptBlocks:
    """The pool's last free queue: kept blocks, each tied to the anchor block whose prefix it completes.

    Implements ``block_pool.KeptQueue``. ``ref_cnt`` is the pool's reference-count list (read only).
    """

    __slots__ = ("kept", "by_anchor", "num_reserved", "ref_cnt")

    def __init__(self, ref_cnt: list[int]) -> None:
        self.kept: OrderedDict[int, int] = OrderedDict()
        """Kept block -> its anchor, oldest first."""
        self.by_anchor: dict[int, dict[int, None]] = {}
        """Anchor -> the blocks kept on it."""
        self.num_reserved = 0
        """Kept blocks whose anchor is held."""
        self.ref_cnt = ref_cnt

    def __len__(self) -> int:
        return len(self.kept)

    @property
    def depended_on(self) -> dict[int, dict[int, None]]:
        """The anchors: blocks whose eviction releases the blocks kept under them."""
        return self.by_anchor

    def admits(self, block: int, anchor: int) -> bool:
        """Enter ``block`` (free and cached) under ``anchor`` unless that would nest retention: an
        anchor is never kept itself, and a kept block never anchors others. True if it entered."""
        if block in self.by_anchor or anchor in self.kept or block in self.kept:
            return False
        self.kept[block] = anchor
        self.by_anchor.setdefault(anchor, {})[block] = None
        if self.ref_cnt[anchor] > 0:
            self.num_reserved += 1
        return True

    def take(self, block: int) -> None:
        anchor = self.kept.pop(block)
        windows = self.by_anchor[anchor]
        del windows[block]
        if not windows:
            del self.by_anchor[anchor]
        if self.ref_cnt[anchor] > 0:
            self.num_reserved -= 1

    def pop(self, allow_reserved: bool) -> int | None:
        # An admission never needs a kept block: the unreserved ones are reached through their
        # anchors (free, hence in ``low`` or ``lru``), whose eviction releases them to ``low``.
        if not allow_reserved or not self.kept:
            return None
        block = next(iter(self.kept))
        self.take(block)
        return block

    def on_evicted(self, block: int) -> list[int]:
        windows = self.by_anchor.pop(block, None) if self.by_anchor else None
        if not windows:
            return []
        held = self.ref_cnt[block] > 0
        for w in windows:
            del self.kept[w]
        if held:
            self.num_reserved -= len(windows)
        return list(windows)

    def on_held(self, blocks: list[int]) -> None:
        by_anchor = self.by_anchor
        if by_anchor:
            for b in blocks:
                windows = by_anchor.get(b)
                if windows:
                    self.num_reserved += len(windows)

    def on_freed(self, blocks: list[int]) -> None:
        by_anchor = self.by_anchor
        if by_anchor:
            for b in blocks:
                windows = by_anchor.get(b)
                if windows:
                    self.num_reserved -= len(windows)

    def admission_cost(self, free_hits: list[int]) -> int:
        """Admissible free blocks a new sequence consumes by adopting the free blocks ``free_hits``.

        A free hit block leaves its free queue (a reserved kept block was not admissible anyway); a free
        anchor that becomes held turns its kept blocks that are not among the hits into reserved ones.
        """
        if not self.kept:
            return len(free_hits)
        kept, by_anchor, ref = self.kept, self.by_anchor, self.ref_cnt
        hits = set(free_hits)
        cost = 0
        for b in hits:
            anchor = kept.get(b)
            if anchor is None or ref[anchor] == 0:
                cost += 1
            windows = by_anchor.get(b)
            if windows:
                cost += sum(1 for w in windows if w not in hits)
        return cost

    def check_invariants(self) -> None:
        """Every kept block is tied to exactly one non-kept anchor; the reserved count is exact."""
        reserved = 0
        for anchor, windows in self.by_anchor.items():
            assert windows, f"anchor {anchor} has an empty set of kept blocks"
            assert anchor not in self.kept, f"anchor {anchor} is kept itself (retention is one level deep)"
            for w in windows:
                assert self.kept.get(w) == anchor, f"kept block {w} not tied to anchor {anchor}"
                assert w not in self.by_anchor, f"kept block {w} anchors others"
            if self.ref_cnt[anchor] > 0:
                reserved += len(windows)
        assert sum(len(w) for w in self.by_anchor.values()) == len(self.kept), "kept blocks without an anchor"
        assert reserved == self.num_reserved, f"reserved count {self.num_reserved} != {reserved}"


# ---------------------------------------------------------------------- policies
class RetentionPolicy:
    """A retention policy: configuration shared by any number of managers, each building its own
    ``Retainer``."""

    name: ClassVar[str] = "base"
    kept_queue: ClassVar[type[KeptBlocks] | None] = None
    """The pool's last free queue the policy needs (None: it keeps no blocks)."""

    def build(self, pool: BlockPool, groups: list[KindManager], hashes: HashesOf, alignment: int) -> Retainer:
        """The per-manager runtime of the policy."""
        raise NotImplementedError


@dataclass(frozen=True)
class NoRetention(RetentionPolicy):
    """Plain LRU: the reference engine's eviction order."""

    name: ClassVar[str] = "none"

    def build(self, pool: BlockPool, groups: list[KindManager], hashes: HashesOf, alignment: int) -> Retainer:
        return Retainer(pool, groups)


@dataclass(frozen=True)
class WindowRetention(RetentionPolicy):
    """Keep the window/state blocks future prefix hits need, tied to the chain they complete.

    ``max_junctions``: junctions remembered (least recently seen forgotten first).
    ``retain_at_lookup``: when an admission finds a junction whose window is already free, take
    it out of the eviction order at once.
    ``keep_ends``: treat a released sequence's computed end (rounded down to the hit alignment) as
    a junction. While it runs, the blocks it drops that a hit at its current end still needs (the
    state a recurrent group wrote at the last block boundary it crossed: one per group) go to the
    LRU tail instead of ``low``, and to ``low`` once the end moves past them.

    A state a sequence checkpointed at one of its ``checkpoint_hints`` goes to the LRU when dropped,
    not to ``low`` (window blocks there are not spared: docs/ARCHITECTURE.md, "Checkpoint hints").
    """

    name: ClassVar[str] = "window"
    kept_queue: ClassVar[type[KeptBlocks] | None] = KeptBlocks
    max_junctions: int = 1 << 16
    retain_at_lookup: bool = True
    keep_ends: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.max_junctions, int) or self.max_junctions <= 0:
            raise InvalidInputError(f"max_junctions must be a positive integer, got {self.max_junctions!r}")

    def build(self, pool: BlockPool, groups: list[KindManager], hashes: HashesOf, alignment: int) -> Retainer:
        assert isinstance(pool.kept, KeptBlocks), "window retention needs the pool's kept queue"
        return WindowRetainer(self, pool, pool.kept, groups, hashes, alignment)


def make_policy(retention: str | RetentionPolicy) -> RetentionPolicy:
    """A policy from a name (``"none"``, ``"window"``) or a policy object."""
    if isinstance(retention, RetentionPolicy):
        return retention
    if retention == "none":
        return NoRetention()
    if retention == "window":
        return WindowRetention()
    raise InvalidInputError(
        f"unknown retention policy {retention!r}; choose 'none' or 'window' or pass a policy object"
    )


# ---------------------------------------------------------------------- runtimes
def _last_first(offset: int, entries: list[int]) -> list[tuple[int, int]]:
    """``(index, block)`` of a table's non-null entries from ``offset`` on, last index first."""
    return [(offset + i, entries[i]) for i in range(len(entries) - 1, -1, -1) if entries[i]]


class Retainer:
    """The runtime of ``NoRetention``: released blocks go to the pool's ordinary free queues."""

    __slots__ = ("pool", "groups", "pages")
    tracks_admissions: ClassVar[bool] = False
    """Does ``on_admit`` do anything (the manager skips the call otherwise)?"""

    def __init__(self, pool: BlockPool, groups: list[KindManager]) -> None:
        self.pool = pool
        self.groups = groups
        self.pages: dict[int, tuple[int, ...]] = {}
        """Per recurrent state spread over several pages, its first page's group: the groups of the
        others (same rules, same table shape; released with the first, index by index)."""

    def on_admit(self, seq: KVSequence, hit: CacheHit) -> None:
        """A new sequence adopted ``hit``."""

    def junctions(self, seq: KVSequence, start: int, end: int) -> list[int]:
        """Remembered junctions of ``seq`` in ``(start, end]``, ascending token positions."""
        return []

    def admission_cost(self, free_hits: list[int]) -> int:
        """Admissible free blocks that adopting the free hit blocks ``free_hits`` consumes."""
        return len(free_hits)

    def release_dropped(self, group: KindManager, seq: KVSequence, freed: list[tuple[int, int]]) -> None:
        """Release blocks a window dropped; ``freed`` is ``(index, block)``, last index first."""
        self.pool.free([b for _, b in freed])

    def release_sequence(self, seq: KVSequence, tables: list[tuple[int, list[int]]], computed: int) -> None:
        """Release all of a sequence's blocks (finished or preempted), group by group.

        ``tables[g]`` is ``(offset, entries)``: group ``g``'s table from index ``offset`` on
        (earlier entries were dropped). Within a group the last block goes first, so a
        sequence's tail is evicted before the prefix it shares with others. ``computed`` is the
        sequence's computed-token count as the manager trusts it.
        """
        free = self.pool.free
        for _, entries in tables:
            entries.reverse()  # the lists are the sequence's own, popped already
            free(entries)

    def reset(self) -> None:
        """The prefix cache was cleared."""

    def stats(self) -> dict[str, int]:
        """Counters for reports."""
        return {}

    def check_invariants(self) -> None:
        """The policy's own invariants (AssertionError naming the broken one)."""


class RunningEnd:
    """Blocks a running sequence dropped (to the LRU tail) that a hit at its current ``end`` needs:
    ``(group, table index, block, hash)``."""

    __slots__ = ("end", "blocks")

    def __init__(self, end: int) -> None:
        self.end = end
        self.blocks: list[tuple[KindManager, int, int, bytes | None]] = []


class WindowRetainer(Retainer):
    """The runtime of ``WindowRetention`` for one manager."""

    __slots__ = ("policy", "kept", "hashes", "alignment", "anchor", "window_groups", "_junctions", "_ends",
                 "_counters")
    tracks_admissions = True

    def __init__(self, policy: WindowRetention, pool: BlockPool, kept: KeptBlocks, groups: list[KindManager],
                 hashes: HashesOf, alignment: int) -> None:
        super().__init__(pool, groups)
        self.policy = policy
        self.kept = kept
        self.hashes = hashes
        self.alignment = alignment
        # The anchor group: the first growing, cached, downward-closed group (full attention).
        self.anchor: KindManager | None = next(
            (g for g in groups if g.caching and g.spec.grows_with_sequence and g.downward_closed), None
        )
        self.window_groups = [g for g in groups if g.caching and not g.downward_closed]
        self._junctions: OrderedDict[bytes, None] = OrderedDict()  # anchor hash at the junction
        self._ends: dict[str, RunningEnd] = {}
        """Per running sequence, the blocks it dropped (to the LRU tail) that a hit at its current end needs."""
        self._counters = {"junctions_found": 0, "retained": 0, "released_low": 0, "retained_late": 0,
                          "end_retained": 0}

    # ------------------------------------------------------------------ junctions
    def on_admit(self, seq: KVSequence, hit: CacheHit) -> None:
        anchor = self.anchor
        junction = hit.full_hit_tokens
        if anchor is None or not 0 < junction < hit.max_hit_tokens:
            return
        key = self.hashes(seq, anchor)[junction // anchor.block_size - 1]
        if key in self._junctions:
            self._junctions.move_to_end(key)
        else:
            self._junctions[key] = None
            self._counters["junctions_found"] += 1
            if len(self._junctions) > self.policy.max_junctions:
                self._junctions.popitem(last=False)
        if not self.policy.retain_at_lookup:
            return
        # The window at the junction may already be free (dropped by the sequence that computed
        # the prefix): take it out of the eviction order now.
        pool = self.pool
        anchor_block = pool.get_cached_block(anchor.group, key)
        if anchor_block is None:
            return
        admit = self._admit_under(anchor_block)
        for g in self.window_groups:
            first, end = g.hit_span(junction)
            hashes = self.hashes(seq, g)
            index = pool.index[g.group]
            ids = [index.get(hashes[i]) for i in range(first, min(end, len(hashes)))]
            self._counters["retained_late"] += pool.keep_free([b for b in ids if b], admit)

    def junctions(self, seq: KVSequence, start: int, end: int) -> list[int]:
        anchor = self.anchor
        if anchor is None or not self._junctions:
            return []
        bs, align, known = anchor.block_size, self.alignment, self._junctions
        hashes = self.hashes(seq, anchor)
        first = start // bs
        last = min(end // bs, len(hashes))
        if known.keys().isdisjoint(hashes[first:last]):
            return []
        return [(i + 1) * bs for i in range(first, last) if hashes[i] in known and (i + 1) * bs % align == 0]

    def _admit_under(self, anchor_block: int) -> Callable[[int], bool]:
        admits = self.kept.admits
        return lambda b: admits(b, anchor_block)

    def _junction_anchors(self, seq: KVSequence, group: KindManager, lo: int, hi: int) -> list[tuple[int, int]]:
        """Junctions ``(boundary, anchor block)`` whose window in ``group`` meets blocks ``lo..hi``."""
        anchor = self.anchor
        assert anchor is not None
        align = self.alignment
        hashes = self.hashes(seq, anchor)
        table = anchor.tables.get(seq.seq_id, [])
        pool = self.pool
        # A window of ``span`` blocks ending at boundary B meets block i iff i < B / bs <= i + span.
        span = group.hit_span(1 << 40)
        span_tokens = (span[1] - span[0]) * group.block_size
        start = (lo * group.block_size // align + 1) * align
        stop = min(hi * group.block_size + span_tokens, len(hashes) * anchor.block_size)
        known = self._junctions
        out: list[tuple[int, int]] = []
        if known.keys().isdisjoint(hashes[max(0, start // anchor.block_size - 1) : stop // anchor.block_size]):
            return out  # no junction in reach (the common case), found in one set operation
        for boundary in range(start, stop + 1, align):
            i = boundary // anchor.block_size - 1
            if hashes[i] in known:
                b = table[i] if i < len(table) else NULL_BLOCK
                if b == NULL_BLOCK or pool.block_hash[b] is None:
                    b = pool.get_cached_block(anchor.group, hashes[i]) or NULL_BLOCK
                if b != NULL_BLOCK:
                    out.append((boundary, b))
        return out

    def _classify(self, group: KindManager, seq: KVSequence, freed: list[tuple[int, int]], dropped: bool,
                  end: tuple[int, int] | None = None) -> None:
        """Release ``freed`` (``(index, block)``, last index first): a block inside the window of a
        junction (or of ``end``: ``(boundary, anchor block)``) is kept under that junction's anchor,
        a dropped one outside the window a replay of the prompt would read goes to ``low``, the rest
        to the LRU."""
        if not freed:
            return
        junctions = self._junction_anchors(seq, group, freed[-1][0], freed[0][0]) if self._junctions else []
        if end is not None:
            junctions.append(end)
        windows = [(group.hit_span(boundary), a) for boundary, a in junctions]
        align = self.alignment
        replay = group.hit_span((seq.num_prompt_tokens - 1) // align * align)
        # A state checkpointed at one of the sequence's hints was written to be found: dropped, it
        # goes to the LRU, not ``low``. Window blocks there are not spared (docs/ARCHITECTURE.md,
        # "Checkpoint hints": a window's span, wasted where no request parts, costs hits).
        marked = getattr(seq, "checkpoint_hints", None) if dropped and group.checkpoints else None
        spared = [group.hit_span(h // align * align) for h in marked] if marked else []
        # The class changes only at span edges: cut ``freed`` there and class each piece once.
        edges = {e for span, _ in windows for e in span}
        if dropped:
            edges.update(replay)
            edges.update(e for span in spared for e in span)
        negated = [-i for i, _ in freed]  # ascending, for bisect
        cuts = [bisect_right(negated, -e) for e in sorted(edges, reverse=True)] + [len(freed)]
        # Consecutive pieces of one class are released in one call, in ``freed``'s order.
        run_class: tuple[str, int] = ("", NULL_BLOCK)
        run_start = position = 0
        for cut in cuts:
            if cut <= position:
                continue
            i = freed[position][0]
            anchor = next((a for (first, end), a in windows if first <= i < end), None) if windows else None
            if anchor is not None:
                cls = ("kept", anchor)
            elif dropped and not replay[0] <= i < replay[1] and not any(f <= i < e for f, e in spared):
                cls = ("low", NULL_BLOCK)
            else:
                cls = ("lru", NULL_BLOCK)
            if cls != run_class:
                self._release_run(run_class, [b for _, b in freed[run_start:position]])
                run_start, run_class = position, cls
            position = cut
        self._release_run(run_class, [b for _, b in freed[run_start:]])

    def _release_run(self, cls: tuple[str, int], blocks: list[int]) -> None:
        """Release ``blocks`` of one class: kept under anchor ``cls[1]``, to ``low``, or to the LRU."""
        if not blocks:
            return
        kind, anchor = cls
        if kind == "kept":
            self.pool.free_kept(blocks, self._admit_under(anchor))
            self._counters["retained"] += len(blocks)
        elif kind == "low":
            self.pool.free_low(blocks)
            self._counters["released_low"] += len(blocks)
        else:
            self.pool.free(blocks)

    # ------------------------------------------------------------------ release
    def admission_cost(self, free_hits: list[int]) -> int:
        return self.kept.admission_cost(free_hits)

    def release_dropped(self, group: KindManager, seq: KVSequence, freed: list[tuple[int, int]]) -> None:
        if self.anchor is None or not group.caching:
            super().release_dropped(group, seq, freed)
            return
        if self.policy.keep_ends:
            freed = self._keep_for_end(group, seq, freed)
        self._classify(group, seq, freed, dropped=True)

    def release_sequence(self, seq: KVSequence, tables: list[tuple[int, list[int]]], computed: int) -> None:
        if self.anchor is None:
            super().release_sequence(seq, tables, computed)
            return
        end: tuple[int, int] | None = None
        if self.policy.keep_ends:
            end = self._final_end(seq, computed, tables[self.anchor.group])
        # Windows first, while their anchors are still held (the reservation count moves with
        # them); anchors after.
        groups = self.groups
        order = sorted(range(len(tables)), key=lambda k: groups[k].downward_closed)
        later_pages = {k for pages in self.pages.values() for k in pages}
        for k in order:
            g = groups[k]
            offset, entries = tables[k]
            if g.caching and not g.downward_closed:
                if k in later_pages:
                    continue  # released with its state's first page
                freed = _last_first(offset, entries)
                pages = self.pages.get(k)
                if pages:
                    freed = page_by_page(freed, [_last_first(*tables[p]) for p in pages])
                # The sequence's own anchor table is gone already: blocks are looked up by hash.
                self._classify(g, seq, freed, dropped=False, end=end)
            else:
                entries.reverse()
                self.pool.free(entries)

    # ------------------------------------------------------------------ the sequence's end
    def _end_anchor(self, seq: KVSequence, end: int, table: list[int]) -> int | None:
        """The cached anchor block at token ``end`` (> 0): ``table``'s entry if it holds the
        sequence's own hash, else the block the prefix cache serves that hash from."""
        anchor = self.anchor
        assert anchor is not None
        i = end // anchor.block_size - 1
        hashes = self.hashes(seq, anchor)
        if i >= len(hashes):
            return None
        b = table[i] if i < len(table) else NULL_BLOCK
        if b != NULL_BLOCK and self.pool.block_hash[b] == hashes[i]:
            return b
        return self.pool.get_cached_block(anchor.group, hashes[i])

    def _keep_for_end(self, group: KindManager, seq: KVSequence, freed: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Release to the LRU tail the dropped blocks of ``freed`` that a hit at the sequence's current
        end needs (a recurrent state dropped during decode, the first block of a window), remembering
        them: kept at the sequence's release if its end is still there, sent to ``low`` once the end
        moves on. Returns the blocks left to classify."""
        end = seq.num_computed_tokens // self.alignment * self.alignment
        sid = seq.seq_id
        running = self._ends.get(sid)
        if running is not None and running.end != end:
            del self._ends[sid]
            self._let_go(seq, running)
            running = None
        if end <= 0 or not freed or (seq.num_computed_tokens + 1) % self.alignment == 0:
            return freed  # no end yet, or the step being allocated moves it (a window's usual drop point)
        first, stop = group.hit_span(end)
        if freed[0][0] < first or freed[-1][0] >= stop:
            return freed  # nothing dropped inside the end's span (the common case)
        # ``freed`` is last index first: the end's span is one slice of it; a block inside a
        # junction's window stays with that junction (``_classify``).
        lo = next(k for k, (i, _) in enumerate(freed) if i < stop)
        hi = next((k for k, (i, _) in enumerate(freed) if i < first), len(freed))
        windows = self._windows(seq, group, first, stop)
        keep = [(i, b) for i, b in freed[lo:hi] if not any(w0 <= i < w1 for (w0, w1), _ in windows)]
        if not keep:
            return freed
        released = set(self.pool.free([b for _, b in keep]))
        block_hash = self.pool.block_hash
        if running is None:
            running = self._ends[sid] = RunningEnd(end)
        running.blocks += [(group, i, b, block_hash[b]) for i, b in keep if b in released and block_hash[b] is not None]
        taken = {b for _, b in keep}
        return [(i, b) for i, b in freed if b not in taken]

    def _windows(self, seq: KVSequence, group: KindManager, first: int, stop: int) -> list[tuple[tuple[int, int], int]]:
        """``(span, anchor block)`` of the remembered junctions whose window in ``group`` meets
        blocks ``first .. stop - 1``."""
        if not self._junctions or stop <= first:
            return []
        return [(group.hit_span(boundary), a) for boundary, a in self._junction_anchors(seq, group, first, stop - 1)]

    def _let_go(self, seq: KVSequence, running: RunningEnd) -> None:
        """Send the blocks remembered for an end the sequence has moved past where dropped blocks go
        (``_classify``; those another sequence adopted or pressure evicted since are no longer the
        sequence's)."""
        pool = self.pool
        by_group: dict[KindManager, list[tuple[int, int]]] = {}
        for g, i, b, h in running.blocks:
            if pool.block_hash[b] == h and pool.queue_of(b) == "lru":
                by_group.setdefault(g, []).append((i, b))
        for g, blocks in by_group.items():
            blocks.sort(reverse=True)
            pool.touch([b for _, b in blocks])
            self._classify(g, seq, blocks, dropped=True)

    def _final_end(self, seq: KVSequence, computed: int, anchor_table: tuple[int, list[int]]) -> tuple[int, int] | None:
        """``(end, anchor block)`` of a released sequence: its ``computed`` tokens rounded down to the
        hit alignment, with the blocks it dropped earlier that a hit there needs taken out of the
        eviction order; None when nothing is cached there."""
        sid = seq.seq_id
        end = computed // self.alignment * self.alignment
        running = self._ends.pop(sid, None)
        if running is not None and running.end != end:
            self._let_go(seq, running)
        offset, entries = anchor_table
        anchor_block = self._end_anchor(seq, end, [NULL_BLOCK] * offset + entries) if end > 0 else None
        if anchor_block is None:
            return None
        admit = self._admit_under(anchor_block)
        pool = self.pool
        for g in self.window_groups:
            first, stop = g.hit_span(end)
            hashes = self.hashes(seq, g)
            index = pool.index[g.group]
            stop = min(stop, len(hashes))
            # Free blocks of the end's window (dropped earlier) are kept under the anchor there; one
            # inside a junction's window under that junction's anchor (it outlives the end's).
            ids = [index.get(hashes[i]) for i in range(first, stop)]
            windows = self._windows(seq, g, first, stop)
            for (w0, w1), a in windows:
                junction = ids[max(0, w0 - first) : max(0, w1 - first)]
                self._counters["end_retained"] += pool.keep_free([b for b in junction if b], self._admit_under(a))
            self._counters["end_retained"] += pool.keep_free([b for b in ids if b], admit)
        return end, anchor_block

    def reset(self) -> None:
        self._junctions.clear()
        self._ends.clear()

    def stats(self) -> dict[str, int]:
        return {**self._counters, "junctions_known": len(self._junctions)}

    def check_invariants(self) -> None:
        pool = self.pool  # the kept queue's own invariants are checked by the pool's
        for w, anchor in self.kept.kept.items():
            assert pool.queue_of(w) == "kept", f"kept block {w} sits in queue {pool.queue_of(w)}"
            assert pool.block_hash[anchor] is not None, f"anchor {anchor} of kept block {w} is not cached"
            assert pool.queue_of(anchor) != "kept", f"anchor {anchor} is kept"

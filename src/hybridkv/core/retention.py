"""Retention policies: where freed blocks go in the pool's eviction order (seed 004).

A prefix hit in a hybrid model needs every group: the full-attention chain of the whole
prefix *and* the window (or state) blocks just before the hit point. Window blocks are freed
as the window moves, long before the chain they complete, so under plain LRU they are
evicted first and hybrid hit rates collapse. A policy decides, for every block a sequence
releases, which free tier it joins:

* ``NoRetention`` (``"none"``) -- the reference engine's behaviour: cached blocks join the LRU
  tail, uncached ones are reused first.
* ``WindowRetention`` (``"window"``) -- windows ending at shared-prefix *junctions* (where a
  lookup found the full-attention chain matching further than the rest of the prompt) are
  retained for exactly as long as the full-attention block at the junction stays cached;
  windows dropped mid-sequence that end at no junction and no replay boundary can serve no
  hit and are evicted before every other cached block. Junctions are remembered (by the
  chain's hash), so a prefix recomputed after eviction keeps its window too.

Retention never stalls admission: a retained window is released with its chain, and a running
sequence's growth may take retained blocks as a last resort (see ``block_pool``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from hybridkv.core.block_pool import NULL_BLOCK
from hybridkv.core.kinds import KindManager
from hybridkv.core.sequence import Sequence
from hybridkv.errors import InvalidInputError

if TYPE_CHECKING:
    from hybridkv.core.hits import CacheHit, Coordinator


class NoRetention:
    """Plain LRU: the reference engine's eviction order."""

    name = "none"

    def __init__(self) -> None:
        self.coord: Coordinator | None = None

    def bind(self, coord: Coordinator) -> None:
        """Attach to one manager's coordinator (a policy object serves one manager)."""
        if self.coord is not None and self.coord is not coord:
            raise InvalidInputError(f"retention policy {self.name!r} is already bound to another manager")
        self.coord = coord

    def on_admit(self, seq: Sequence, hit: CacheHit) -> None:
        """A new sequence adopted ``hit``."""

    def release_dropped(self, group: KindManager, seq: Sequence, freed: list[tuple[int, int]]) -> None:
        """Release blocks a window dropped; ``freed`` is ``(index, block)``, last index first."""
        assert self.coord is not None
        self.coord.pool.free([b for _, b in freed])

    def release_sequence(self, seq: Sequence, tables: list[tuple[int, list[int]]]) -> None:
        """Release all of a sequence's blocks (finished or preempted), group by group.

        ``tables[g]`` is ``(offset, entries)``: group ``g``'s table from index ``offset`` on
        (earlier entries were dropped). Within a group the last block goes first, so a
        sequence's tail is evicted before the prefix it shares with others.
        """
        assert self.coord is not None
        for _, entries in tables:
            self.coord.pool.free(entries[::-1])

    def reset(self) -> None:
        """The prefix cache was cleared."""

    def stats(self) -> dict[str, int]:
        """Counters for reports."""
        return {}


class WindowRetention(NoRetention):
    """Keep the window/state blocks future prefix hits need, tied to the chain they complete."""

    name = "window"

    def __init__(self, *, max_junctions: int = 1 << 16, retain_at_lookup: bool = True) -> None:
        super().__init__()
        if max_junctions <= 0:
            raise InvalidInputError(f"max_junctions must be positive, got {max_junctions}")
        self.max_junctions = max_junctions
        self.retain_at_lookup = retain_at_lookup
        self._junctions: OrderedDict[bytes, None] = OrderedDict()  # anchor hash at the junction
        self._counters = {"junctions_found": 0, "retained": 0, "released_low": 0, "retained_late": 0}

    # ------------------------------------------------------------------ junctions
    def on_admit(self, seq: Sequence, hit: CacheHit) -> None:
        coord = self.coord
        assert coord is not None
        anchor = coord.anchor
        junction = hit.full_hit_tokens
        if anchor is None or not 0 < junction < hit.max_hit_tokens:
            return
        anchor_hashes = coord.hashes(seq, anchor)
        key = anchor_hashes[junction // anchor.block_size - 1]
        if key in self._junctions:
            self._junctions.move_to_end(key)
        else:
            self._junctions[key] = None
            self._counters["junctions_found"] += 1
            if len(self._junctions) > self.max_junctions:
                self._junctions.popitem(last=False)
        if not self.retain_at_lookup:
            return
        # The window at the junction may already be free (dropped by the sequence that computed
        # the prefix): take it out of the eviction order now.
        anchor_block = coord.pool.get_cached_block(anchor.group, key)
        if anchor_block is None:
            return
        for g in self._window_groups():
            first, end = g.hit_window(junction)
            hashes = coord.hashes(seq, g)
            ids = [coord.pool.get_cached_block(g.group, hashes[i]) for i in range(first, min(end, len(hashes)))]
            self._counters["retained_late"] += coord.pool.retain_free([b for b in ids if b], anchor_block)

    def _window_groups(self) -> list[KindManager]:
        assert self.coord is not None
        return [g for g in self.coord.groups if g.caching and not g.downward_closed]

    def _junction_anchors(self, seq: Sequence, group: KindManager, lo: int, hi: int) -> list[tuple[int, int]]:
        """Junctions ``(boundary, anchor block)`` whose window in ``group`` meets blocks ``lo..hi``."""
        coord = self.coord
        assert coord is not None and coord.anchor is not None
        anchor = coord.anchor
        align = coord.alignment
        hashes = coord.hashes(seq, anchor)
        table = anchor.tables.get(seq.seq_id, [])
        span = group.hit_window(1 << 40)
        span_tokens = (span[1] - span[0]) * group.block_size
        start = (lo * group.block_size // align + 1) * align
        stop = min((hi + 1) * group.block_size + span_tokens, len(hashes) * anchor.block_size)
        out: list[tuple[int, int]] = []
        for boundary in range(start, stop + 1, align):
            i = boundary // anchor.block_size - 1
            if hashes[i] in self._junctions:
                b = table[i] if i < len(table) else NULL_BLOCK
                if b == NULL_BLOCK or coord.pool.block_hash[b] is None:
                    b = coord.pool.get_cached_block(anchor.group, hashes[i]) or NULL_BLOCK
                if b != NULL_BLOCK:
                    out.append((boundary, b))
        return out

    def _classify(self, group: KindManager, seq: Sequence, freed: list[tuple[int, int]],
                  dropped: bool) -> None:
        pool = self.coord.pool  # type: ignore[union-attr]
        idxs = [i for i, _ in freed]
        junctions = self._junction_anchors(seq, group, min(idxs), max(idxs)) if freed else []
        windows = [(group.hit_window(boundary), a) for boundary, a in junctions]
        align = self.coord.alignment  # type: ignore[union-attr]
        replay = group.hit_window((seq.num_prompt_tokens - 1) // align * align)
        for i, b in freed:
            anchor = next((a for (first, end), a in windows if first <= i < end), None)
            if anchor is not None:
                pool.free_retained((b,), anchor)
                self._counters["retained"] += 1
            elif dropped and not replay[0] <= i < replay[1]:
                pool.free_low((b,))
                self._counters["released_low"] += 1
            else:
                pool.free((b,))

    def release_dropped(self, group: KindManager, seq: Sequence, freed: list[tuple[int, int]]) -> None:
        coord = self.coord
        assert coord is not None
        if coord.anchor is None or not group.caching:
            super().release_dropped(group, seq, freed)
            return
        self._classify(group, seq, freed, dropped=True)

    def release_sequence(self, seq: Sequence, tables: list[tuple[int, list[int]]]) -> None:
        coord = self.coord
        assert coord is not None
        if coord.anchor is None:
            super().release_sequence(seq, tables)
            return
        # Windows first, so that their anchors (still held) are known; anchors are freed after.
        order = sorted(range(len(tables)), key=lambda k: coord.groups[k].downward_closed)
        for k in order:
            g = coord.groups[k]
            offset, entries = tables[k]
            if g.caching and not g.downward_closed:
                freed = [(offset + i, entries[i]) for i in range(len(entries) - 1, -1, -1) if entries[i]]
                # The sequence's own anchor table is gone already: look blocks up by hash.
                self._classify(g, seq, freed, dropped=False)
            else:
                coord.pool.free(entries[::-1])

    def reset(self) -> None:
        self._junctions.clear()

    def stats(self) -> dict[str, int]:
        return {**self._counters, "junctions_known": len(self._junctions)}


def make_policy(retention: str | NoRetention) -> NoRetention:
    """A policy object from a name (``"none"``, ``"window"``) or a policy instance."""
    if isinstance(retention, NoRetention):
        return retention
    if retention == "none":
        return NoRetention()
    if retention == "window":
        return WindowRetention()
    raise InvalidInputError(
        f"unknown retention policy {retention!r}; choose 'none' or 'window' or pass a policy object"
    )

"""The per-group interface every kind implements: a stateless rule, and the tables most kinds share.

``KindRule`` says what a hit is for its kind (no state, no pool: ``HitRules`` holds only these);
``KindManager`` owns a group's block tables in a ``KVCacheManager`` and follows the rule. One
allocation's tokens: ``| computed (or local hit) | external | new | lookahead |``.
See docs/ARCHITECTURE.md, "Kinds: a rule and the tables that follow it".
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from itertools import takewhile

from hybridkv.core._util import cdiv, gather
from hybridkv.core.block_pool import NULL_BLOCK, BlockPool
from hybridkv.core.sequence import KVSequence
from hybridkv.core.specs import KVCacheSpec
from hybridkv.errors import InvalidInputError

NOTHING = range(0)

NEVER = 1 << 62
"""A token count no sequence reaches: the limit of a group that never has work to do."""

Indices = range | list[int]
"""Table indices, ascending."""


class KindRule:
    """What a hit of one group's kind is, and which leading tokens its attention no longer reads.
    Stateless; subclasses override the kind-specific rules."""

    constrains_hits = True
    """Does the group's hit bound the hit all groups agree on?"""
    downward_closed = False
    """Is a hit at L also a hit at every shorter aligned length (full attention)?"""
    registers_when_computed = False
    """Are blocks entered into the prefix cache only once the caller reports their tokens computed
    (recurrent state: a state is an input of the step that computes it, so no sequence admitted in
    the same step may resume from it), instead of when the step that computes them is allocated
    (attention: a step writes every layer's KV before any token of the step reads it)?"""

    __slots__ = ("spec", "group", "block_size", "caching")

    def __init__(self, spec: KVCacheSpec, group: int, *, enable_caching: bool) -> None:
        self.spec = spec
        self.group = group
        self.block_size = spec.block_size
        self.caching = enable_caching and spec.prefix_cacheable

    def find_longest_cache_hit(self, hashes: list[bytes], cached: Mapping[bytes, int],
                               max_tokens: int) -> tuple[int, list[int]]:
        """Longest hit of at most ``max_tokens`` tokens: (tokens, block ids with 0 for null).

        ``hashes`` are the sequence's block hashes at this group's block size; ``cached`` maps a
        hash to the (non-zero) block holding it.
        """
        raise NotImplementedError

    def hit_span(self, boundary: int) -> tuple[int, int]:
        """Block indices ``[first, end)`` whose content a hit ending at token ``boundary`` reads."""
        return 0, boundary // self.block_size

    @property
    def hit_reads(self) -> int | None:
        """How many blocks before a hit point decide a hit there, when nothing else does: a hit at
        block boundary ``e`` is one exactly when blocks ``[max(0, e - hit_reads), e)`` are all held
        (``NEVER``: every block from the first, full attention's chain). None when the kind's hit
        has another shape (a chunk) or is none. The fast and bitmask forms of the hit rule
        (``hybridkv.core.hits``) mirror only kinds that say."""
        return None

    def skipped_tokens(self, num_computed: int) -> int:
        """Leading tokens the attention of the next token no longer reads."""
        return 0

    def drop_point(self, index: int) -> int:
        """Fewest computed tokens at which table entry ``index`` is skipped (``NEVER`` if never)."""
        return NEVER


class KindManager:
    """Block tables of one group, following its kind's rule (``rule``). Subclasses override the
    kind-specific table rules."""

    holds_lookahead = True
    """Do lookahead (speculative) tokens get slots in this group's table (a table that follows the
    decoder's tokens: attention, and a recurrent state with checkpoints, whose accepted tokens may
    end in a later entry)? Cross attention, encoder-only attention and a recurrent state without
    checkpoints (one block) do not."""

    drops_blocks = False
    """Does the kind stop reading leading blocks as a sequence grows (a window, a chunk, a superseded
    state), so that allocations release them (``skipped_tokens``)?"""
    prepares = False
    """Does the kind note something about a sequence before its first allocation (``prepare``)?"""

    __slots__ = ("rule", "spec", "group", "pool", "block_size", "bound", "caching", "constrains_hits",
                 "downward_closed", "registers_when_computed", "tables", "num_cached", "num_dropped")

    def __init__(self, rule: KindRule, pool: BlockPool, *, bound: int) -> None:
        self.rule = rule
        """The group's hit rule (the manager's ``HitRules`` holds the same one)."""
        self.spec = rule.spec
        self.group = rule.group
        self.pool = pool
        self.block_size = rule.block_size
        self.bound = bound
        """``spec.max_blocks_per_request``: the most blocks a sequence holds here at once."""
        self.caching = rule.caching
        self.constrains_hits = rule.constrains_hits
        self.downward_closed = rule.downward_closed
        self.registers_when_computed = rule.registers_when_computed
        """The rule's traits, read where the tables are (``KindRule``)."""
        self.tables: dict[str, list[int]] = {}
        self.num_cached: dict[str, int] = {}
        """Per sequence, the leading table entries whose registration is settled."""
        self.num_dropped: dict[str, int] = {}
        """Per sequence, the leading table entries already dropped (all null)."""

    # ------------------------------------------------------------------ the rule
    def hit_span(self, boundary: int) -> tuple[int, int]:
        """The rule's ``hit_span``."""
        return self.rule.hit_span(boundary)

    def skipped_tokens(self, num_computed: int) -> int:
        """The rule's ``skipped_tokens``."""
        return self.rule.skipped_tokens(num_computed)

    def drop_point(self, index: int) -> int:
        """The rule's ``drop_point``."""
        return self.rule.drop_point(index)

    # ------------------------------------------------------------------ tables
    def prepare(self, seq: KVSequence, checkpoints: list[tuple[int, int]]) -> None:
        """Note what the kind needs before a sequence's first allocation: its encoder tokens, and
        the ``(token position, rank)`` where a recurrent group should leave a state checkpoint."""

    @property
    def checkpoints(self) -> bool:
        """Does the kind write state checkpoints inside a prefill where the manager plans them (``plan``)?"""
        return False

    def plan(self, start: int, end: int, junctions: list[int], alignment: int) -> list[tuple[int, int]]:
        """``(position, rank)`` of the checkpoints a prefill from ``start`` to the prompt's last aligned
        boundary ``end`` should write (kinds that ``checkpoints``)."""
        return []

    def state_entries(self, seq_id: str, num_computed: int, num_tokens: int
                      ) -> tuple[int | None, list[tuple[int, int]]]:
        """Recurrent kinds: the table index a step over ``[num_computed, num_tokens)`` reads its state
        from (None: the zero state) and the ``(position, index)`` pairs it writes the state after
        ``position`` tokens into, ascending (the last is ``num_tokens``: the running state)."""
        raise InvalidInputError(f"group {self.group} ({self.spec.kind}) keeps no recurrent state")

    @property
    def draft_span(self) -> int | None:
        """The most new and lookahead tokens one step with drafts may span (None: only
        ``max_num_batched_tokens`` bounds it)."""
        return None

    def note_verified(self, seq_id: str, known: int, verified: int) -> None:
        """Recurrent kinds: after a step with drafts whose new tokens ended at ``known``, its accepted
        tokens end at ``verified``: note the checkpoints the accepted drafts reached."""

    def held_blocks(self, seq_id: str) -> int:
        """Non-null blocks the sequence holds in this group."""
        table = self.tables.get(seq_id, [])
        return len(table) - table.count(NULL_BLOCK)

    def adoptable(self, hit_blocks: list[int], num_computed: int) -> list[int]:
        """The hit blocks a new sequence keeps once ``num_computed`` tokens (hit + external) are in."""
        skipped = min(self.rule.skipped_tokens(num_computed) // self.block_size, len(hit_blocks))
        return [NULL_BLOCK] * skipped + hit_blocks[skipped:] if skipped else hit_blocks

    def plan_indices(self, seq_id: str, hit_blocks: Sequence[int], num_computed: int, num_external: int,
                     num_tokens: int) -> Indices:
        """Table indices that need a fresh block for the table to hold ``num_tokens`` slots.

        For a new sequence ``hit_blocks`` is its adopted hit and ``num_computed`` the hit length;
        for a running one ``hit_blocks`` is empty and ``num_external`` 0.
        """
        table = self.tables.get(seq_id)
        if table is None:
            return self._new_indices(len(hit_blocks), num_computed + num_external, num_tokens)
        if -(-num_tokens // self.block_size) <= len(table):
            return NOTHING  # the table already covers the step (most steps)
        return self._new_indices(len(table), num_computed, num_tokens)

    def _new_indices(self, length: int, num_computed: int, num_tokens: int) -> Indices:
        """Indices past ``length`` that need a real block to hold ``num_tokens`` slots."""
        first = max(length, self.rule.skipped_tokens(num_computed) // self.block_size)
        return range(first, cdiv(num_tokens, self.block_size))

    def adopt(self, seq_id: str, blocks: list[int]) -> None:
        """Start a table from adopted hit blocks (the caller has touched them; the list becomes the table)."""
        self.tables[seq_id] = blocks
        self.num_cached[seq_id] = len(blocks)
        self.num_dropped[seq_id] = _leading_nulls(blocks)

    def grow(self, seq_id: str, indices: Indices, *, allow_reserved: bool) -> list[int]:
        """Give ``indices`` (from ``plan_indices``) fresh blocks, null entries in the gaps; return them."""
        table = self.tables[seq_id]
        if not indices:
            return []
        pool = self.pool
        new = pool.allocate(len(indices), allow_reserved=allow_reserved)
        if isinstance(indices, range):
            table.extend([NULL_BLOCK] * (indices.start - len(table)))
            table.extend(new)
        else:
            for i, b in zip(indices, new):
                table.extend([NULL_BLOCK] * (i - len(table)))
                table.append(b)
        return new

    def remove_skipped(self, seq_id: str, num_computed: int) -> list[tuple[int, int]]:
        """Null out wholly skipped blocks; return ``(index, block)`` pairs, last index first.

        The caller releases the returned blocks (through the retention policy).
        """
        skipped = self.rule.skipped_tokens(num_computed)
        if not skipped:
            return []
        table = self.tables.get(seq_id)
        if not table:
            return []
        end = min(skipped // self.block_size, len(table))
        start = self.num_dropped.get(seq_id, 0)
        if end <= start:
            return []
        self.num_dropped[seq_id] = end
        dropped = table[start:end]
        table[start:end] = [NULL_BLOCK] * (end - start)
        return [(i, b) for i, b in zip(range(end - 1, start - 1, -1), reversed(dropped)) if b != NULL_BLOCK]

    def idle_limit(self, seq_id: str) -> int:
        """Most slots (computed + new + lookahead tokens) a running sequence's step can reach, with at
        least one new token, while this group has no block to allocate, register or drop."""
        bs = self.block_size
        limit = len(self.tables[seq_id]) * bs  # past it, a block to allocate
        if self.caching:
            registered = (self.num_cached[seq_id] + 1) * bs - 1  # past it, a full block to register
            limit = registered if registered < limit else limit
        # A step reaching ``dropped`` slots has computed at most dropped - 1 tokens: nothing to drop yet.
        dropped = self.rule.drop_point(self.num_dropped.get(seq_id, 0))
        return dropped if dropped < limit else limit

    def register(self, seq_id: str, hashes: list[bytes], num_computed: int, num_tokens: int,
                 token_ids: Sequence[int] | None = None) -> None:
        """Enter into the prefix cache the full blocks of the first ``num_tokens`` tokens (those the
        step being allocated will compute: ``num_computed`` is what is computed already).
        ``token_ids`` (the sequence's, when the pool records events) describe the stored blocks."""
        if not self.caching:
            return
        table = self.tables[seq_id]
        start = self.num_cached[seq_id]
        end = min(num_tokens // self.block_size, len(hashes), len(table))
        if end <= start:
            return
        pool = self.pool
        block_hash = pool.block_hash
        blocks = table[start:end]
        runs: list[Sequence[int]]
        if NULL_BLOCK not in blocks and gather(block_hash, blocks).count(None) == len(blocks):
            runs = [range(start, end)]  # the common case: all fresh, checked in C
        else:  # null entries and blocks cached already (adopted hits) stay as they are
            indices = [i for i in range(start, end) if table[i] != NULL_BLOCK and block_hash[table[i]] is None]
            contiguous = indices and indices[-1] - indices[0] + 1 == len(indices)
            runs = [indices] if contiguous else [[i] for i in indices]
        for run in runs:
            self._cache_run(pool, table, hashes, run, token_ids)
        self.num_cached[seq_id] = end

    def _cache_run(self, pool: BlockPool, table: list[int], hashes: list[bytes], indices: Sequence[int],
                   token_ids: Sequence[int] | None) -> None:
        """Cache the blocks at consecutive table ``indices``."""
        first, end = indices[0], indices[-1] + 1
        if not pool.enable_events:
            pool.cache_blocks(self.group, table[first:end], hashes[first:end])
            return
        bs = self.block_size
        tokens = tuple(token_ids[first * bs:end * bs]) if token_ids is not None else ()
        pool.cache_blocks(self.group, table[first:end], hashes[first:end], parent=hashes[first - 1] if first else None,
                          token_ids=tokens, block_size=bs)

    def uncomputed_blocks(self, seq_id: str, num_computed: int) -> list[int]:
        """Blocks this sequence registered whose tokens it has not computed (their step never ran):
        to uncache at free. ``num_computed`` is at least the hit the sequence adopted, so adopted
        blocks (another sequence's content) are never among them."""
        end = self.num_cached.get(seq_id, 0)
        first = num_computed // self.block_size
        if end <= first or self.registers_when_computed:
            return []
        return [b for b in self.tables[seq_id][first:end] if b != NULL_BLOCK]

    def pop_table(self, seq_id: str) -> tuple[int, list[int]]:
        """Forget the sequence; return ``(offset, entries)``: its table from the first entry not
        yet dropped (everything before ``offset`` is null). The caller frees the blocks."""
        self.num_cached.pop(seq_id, None)
        offset = self.num_dropped.pop(seq_id, 0)
        table = self.tables.pop(seq_id, [])
        return offset, table[offset:] if offset else table

    def check_table(self, seq_id: str, num_computed: int) -> None:
        """Kind-specific invariants of one table (AssertionError naming the broken one)."""
        table = self.tables[seq_id]
        held = len(table) - table.count(NULL_BLOCK)
        assert held <= self.bound, (
            f"sequence {seq_id!r} holds {held} blocks in group {self.group}; the per-request bound is {self.bound}"
        )
        dropped = self.num_dropped.get(seq_id, 0)
        assert all(b == NULL_BLOCK for b in table[:dropped]), (
            f"sequence {seq_id!r} group {self.group}: a dropped entry still holds a block"
        )


def _leading_nulls(blocks: list[int]) -> int:
    """How many entries at the start of a hit table are the null block.

    In a hit the null entries always lead (positions behind a window, before a chunk, superseded
    states), so a binary search finds the first real block.
    """
    return bisect_left(blocks, True, key=bool)


def scan_left_to_right(cached: Mapping[bytes, int], hashes: list[bytes], start: int, end: int) -> list[int]:
    """Cached blocks for ``hashes[start:end]`` up to the first miss."""
    # takewhile(bool, ...) stops at the first miss (cached block ids are never 0), so the chain
    # costs one C-speed dict lookup per block and nothing past its end.
    return list(takewhile(bool, map(cached.get, hashes[start:end])))  # type: ignore[arg-type]

"""Recurrent state (Mamba, linear attention): a constant-size state per sequence, with checkpoints.

Table entry ``i`` holds the state after ``(i + 1) * block_size`` tokens (a checkpoint) or, last,
the running state. Mode ``align`` checkpoints where later requests are known or likely to resume
(at most ``checkpoint_blocks`` per step), mode ``all`` at every block boundary. A checkpoint enters
the prefix cache only once the caller reports its tokens computed. A step with drafts gets the
state entries of every position its accepted tokens may end at (it stays within one block in mode
``align``); the entries past the accepted end are freed and a checkpoint past it is never registered.
See docs/ARCHITECTURE.md, "Recurrent state tables", "Recurrent checkpoints" and "Speculative decoding".
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq

from hybridkv.core._util import cdiv
from hybridkv.core.block_pool import NULL_BLOCK, BlockPool
from hybridkv.core.kinds.base import NEVER, NOTHING, Indices, KindManager, KindRule
from hybridkv.core.sequence import KVSequence
from hybridkv.core.specs import MambaSpec
from hybridkv.errors import InvalidInputError


class MambaRule(KindRule):
    """Recurrent state with checkpoints (modes ``align`` and ``all``): a hit is the latest state cached."""

    registers_when_computed = True
    __slots__ = ("align",)

    def __init__(self, spec: MambaSpec, group: int, *, enable_caching: bool) -> None:
        super().__init__(spec, group, enable_caching=enable_caching)
        self.align = spec.mode == "align"
        """Mode ``align``: a sequence drops the states it no longer reads (mode ``all`` keeps every one)."""

    def find_longest_cache_hit(self, hashes: list[bytes], cached: Mapping[bytes, int],
                               max_tokens: int) -> tuple[int, list[int]]:
        get = cached.get
        for i in range(min(max_tokens // self.block_size, len(hashes)) - 1, -1, -1):
            hit = get(hashes[i])
            if hit is not None:
                return (i + 1) * self.block_size, [NULL_BLOCK] * i + [hit]
        return 0, []

    def hit_span(self, boundary: int) -> tuple[int, int]:
        end = boundary // self.block_size
        return max(0, end - 1), end

    @property
    def hit_reads(self) -> int | None:
        return 1 if self.align else None

    def skipped_tokens(self, num_computed: int) -> int:
        return max(0, num_computed - 1) if self.align else 0

    def drop_point(self, index: int) -> int:
        return (index + 1) * self.block_size + 1 if self.align else NEVER


class MambaManager(KindManager):
    """The tables of a recurrent group with checkpoints (modes ``align`` and ``all``)."""

    drops_blocks = True
    prepares = True
    __slots__ = ("align", "checkpoint_blocks", "plans", "pending")

    def __init__(self, rule: MambaRule, pool: BlockPool, *, bound: int) -> None:
        super().__init__(rule, pool, bound=bound)
        self.align = rule.align
        spec = rule.spec
        assert isinstance(spec, MambaSpec)
        self.checkpoint_blocks = spec.checkpoint_blocks
        self.plans: dict[str, list[tuple[int, int]]] = {}
        """Per sequence (align mode), ``(position, rank)`` of the checkpoints still ahead, ascending by
        position; rank 0 is a junction, 1 the prompt's end, 2 an interval checkpoint."""
        self.pending: dict[str, list[int]] = {}
        """Per sequence, table indices written by a step and registered once it is computed."""

    @property
    def draft_span(self) -> int | None:
        """Mode ``align``: a step with drafts spans at most one block (``block_size`` new and lookahead
        tokens), so it holds at most two states, the admission bound's least (the one it reads, and
        the one its accepted tokens end in)."""
        return self.block_size if self.align else None

    # ------------------------------------------------------------------ allocation
    @property
    def checkpoints(self) -> bool:
        return self.align

    def plan(self, start: int, end: int, junctions: list[int], alignment: int) -> list[tuple[int, int]]:
        """``(position, rank)`` of the checkpoints a prefill from ``start`` to the prompt's last
        aligned boundary ``end`` should write: ``junctions`` (rank 0), ``end`` itself (1), every
        ``checkpoint_interval`` tokens when the spec sets it (2); ascending by position."""
        ranks: dict[int, int] = {}
        interval = self.spec.checkpoint_interval  # type: ignore[attr-defined]
        if interval:
            step = cdiv(interval, alignment) * alignment
            ranks.update(dict.fromkeys(range((start // step + 1) * step, end + 1, step), 2))
        ranks[end] = 1
        ranks.update(dict.fromkeys((p for p in junctions if start < p <= end), 0))
        return sorted(ranks.items())

    def prepare(self, seq: KVSequence, checkpoints: list[tuple[int, int]]) -> None:
        if self.align and self.caching and checkpoints:
            self.plans[seq.seq_id] = checkpoints

    def plan_indices(self, seq_id: str, hit_blocks: Seq[int], num_computed: int, num_external: int,
                     num_tokens: int) -> Indices:
        if not self.align:
            return super().plan_indices(seq_id, hit_blocks, num_computed, num_external, num_tokens)
        table = self.tables.get(seq_id)
        length = len(hit_blocks) if table is None else len(table)
        start = num_computed + num_external
        out: list[int] = []
        if num_external:  # the state at the end of the loaded tokens, written by the connector
            out.append(cdiv(start, self.block_size) - 1)
            length = max(length, cdiv(start, self.block_size))
        plan = self.plans.get(seq_id)
        if plan:
            for p in self._chosen(plan, start, num_tokens):
                if p // self.block_size > length:
                    out.append(p // self.block_size - 1)
        end = cdiv(num_tokens, self.block_size)
        if end > length and (not out or out[-1] < end - 1):
            out.append(end - 1)
        return out or NOTHING

    def _chosen(self, plan: list[tuple[int, int]], start: int, end: int) -> list[int]:
        """The planned checkpoints a step over ``[start, end)`` writes (``start < p < end``): at most
        ``checkpoint_blocks``, by rank, the latest first within a rank; ascending."""
        inside = [(rank, -p) for p, rank in plan if start < p < end]
        if len(inside) > self.checkpoint_blocks:
            inside = sorted(inside)[: self.checkpoint_blocks]
        return sorted(-p for _, p in inside)

    def note_step(self, seq_id: str, num_computed: int, num_external: int, num_tokens: int) -> None:
        """After an allocation for tokens ``[num_computed, num_tokens)`` (``num_external`` of them
        loaded): remember the entries this step writes a checkpoint into, to register once computed."""
        if not self.caching:
            return
        bs = self.block_size
        start = num_computed + num_external
        if self.align:
            ends = [start] if num_external else []
            plan = self.plans.get(seq_id)
            if plan:
                ends += self._chosen(plan, start, num_tokens)
                rest = [(p, rank) for p, rank in plan if p > num_tokens]
                if rest:
                    self.plans[seq_id] = rest
                else:
                    del self.plans[seq_id]
            if num_tokens % bs == 0:
                ends.append(num_tokens)
            indices = [p // bs - 1 for p in ends if p % bs == 0 and p > 0]
        else:
            indices = list(range(max(self.num_cached[seq_id], num_computed // bs), num_tokens // bs))
        if indices:
            self.pending.setdefault(seq_id, []).extend(indices)
        self.num_cached[seq_id] = max(self.num_cached[seq_id], num_tokens // bs)

    def note_verified(self, seq_id: str, known: int, verified: int) -> None:
        """After a step with drafts whose new tokens ended at ``known``: its accepted drafts end at
        ``verified``. Remember the block boundaries in ``(known, verified]`` it crossed (the engine
        wrote the state there, ``StateStep.after_acceptance``), to register like the step's own; a
        boundary among the rejected drafts is never noted."""
        if not self.caching or verified <= known:
            return
        table = self.tables[seq_id]
        bs = self.block_size
        indices = [i for i in range(max(self.num_cached[seq_id], known // bs), min(verified // bs, len(table)))
                   if table[i] != NULL_BLOCK]
        if indices:
            self.pending.setdefault(seq_id, []).extend(indices)
        self.num_cached[seq_id] = max(self.num_cached[seq_id], verified // bs)

    def register(self, seq_id: str, hashes: list[bytes], num_computed: int, num_tokens: int,
                 token_ids: Seq[int] | None = None) -> None:
        """Enter the pending checkpoints whose tokens are computed (``num_tokens`` is ignored: the
        step being allocated has not run yet)."""
        pending = self.pending.get(seq_id)
        if not pending:
            return
        table = self.tables[seq_id]
        pool = self.pool
        block_hash = pool.block_hash
        still: list[int] = []
        for i in pending:
            if (i + 1) * self.block_size > num_computed:
                still.append(i)
                continue
            b = table[i] if i < len(table) else NULL_BLOCK
            if b != NULL_BLOCK and block_hash[b] is None and i < len(hashes):
                self._cache_run(pool, table, hashes, [i], token_ids)
        if still:
            self.pending[seq_id] = still
        else:
            del self.pending[seq_id]

    def state_entries(self, seq_id: str, num_computed: int, num_tokens: int
                      ) -> tuple[int | None, list[tuple[int, int]]]:
        # Entry i holds the state after a position in (i * bs, (i + 1) * bs]: the step reads the entry
        # of ``num_computed`` and writes, for every entry from the one it reads up to the one of
        # ``num_tokens``, the state at the entry's end (or at ``num_tokens``) where the allocation
        # gave it a block. The entry read is the sequence's own running state unless the step starts
        # on a boundary, and then it is not written: a cached checkpoint is never overwritten.
        table = self.tables[seq_id]
        bs = self.block_size
        last = cdiv(num_tokens, bs) - 1
        read = cdiv(num_computed, bs) - 1 if num_computed else None
        if last >= len(table) or (read is not None and table[read] == NULL_BLOCK):
            raise InvalidInputError(
                f"sequence {seq_id!r} group {self.group}: no blocks for a step over tokens "
                f"[{num_computed}, {num_tokens}) (allocate the step first)"
            )
        writes = [(min((i + 1) * bs, num_tokens), i) for i in range(num_computed // bs, last + 1)
                  if i == last or table[i] != NULL_BLOCK]
        return read, writes

    def idle_limit(self, seq_id: str) -> int:
        if seq_id in self.pending:
            return 0  # the next allocation registers what this step computed
        return super().idle_limit(seq_id)

    def pop_table(self, seq_id: str) -> tuple[int, list[int]]:
        self.plans.pop(seq_id, None)
        self.pending.pop(seq_id, None)
        return super().pop_table(seq_id)

    def check_table(self, seq_id: str, num_computed: int) -> None:
        super().check_table(seq_id, num_computed)
        table = self.tables[seq_id]
        if self.align and table:
            assert table[-1] != NULL_BLOCK, f"sequence {seq_id!r} group {self.group}: no running state"


class MambaNoCacheRule(KindRule):
    """Recurrent state without checkpoints (mode ``none``): no hits."""

    __slots__ = ()

    def find_longest_cache_hit(self, hashes: list[bytes], cached: Mapping[bytes, int],
                               max_tokens: int) -> tuple[int, list[int]]:
        return 0, []

    def hit_span(self, boundary: int) -> tuple[int, int]:
        return 0, 0


class MambaNoCacheManager(KindManager):
    """Recurrent state without checkpoints (mode ``none``): one block per sequence."""

    holds_lookahead = False  # one block whatever the step: the engine writes the accepted end's state there
    __slots__ = ()

    def plan_indices(self, seq_id: str, hit_blocks: Seq[int], num_computed: int, num_external: int,
                     num_tokens: int) -> Indices:
        table = self.tables.get(seq_id)
        return NOTHING if table else range(0, 1)

    def state_entries(self, seq_id: str, num_computed: int, num_tokens: int
                      ) -> tuple[int | None, list[tuple[int, int]]]:
        if not self.tables.get(seq_id):
            raise InvalidInputError(f"sequence {seq_id!r} group {self.group}: no state block (allocate first)")
        return (0 if num_computed else None), [(num_tokens, 0)]

    def idle_limit(self, seq_id: str) -> int:
        return NEVER if self.tables.get(seq_id) else 0

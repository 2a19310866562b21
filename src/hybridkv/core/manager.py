"""The engine-facing KV-cache manager: lookup, allocate, free.

``allocate`` is one path for new and running sequences: validate everything, plan against the
free blocks, then apply (two-phase adoption); a short guard returns at once when a running
sequence's step has nothing to allocate, register or drop.
See docs/ARCHITECTURE.md, "The life of one request".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from itertools import chain

from hybridkv.core._util import gather, page_by_page
from hybridkv.core.block_pool import NULL_BLOCK, BlockPool, KVCacheEvent
from hybridkv.core.hashing import HashAlgorithm
from hybridkv.core.hits import LOSS_CAUSES, CacheHit, HitRules, agreed_hit, hit_losses, verify_group_hit
from hybridkv.core.kinds import KindManager, KindRule, kind_manager_for
from hybridkv.core.layout import KVCacheLayout
from hybridkv.core.retention import RetentionPolicy, make_policy
from hybridkv.core.sequence import KVSequence, is_kv_sequence
from hybridkv.errors import InvalidInputError, SequenceTooLongError, UnknownSequenceError

MAX_PREEMPTED_MARKS = 1 << 16
"""The most preempted sequences awaiting re-admission the manager remembers (the oldest go first)."""


@dataclass
class KVCacheStats:
    """Counters since the manager was built (or since ``reset_stats``)."""

    admissions: int = 0
    queried_tokens: int = 0
    """Prompt tokens of admitted sequences (a re-admission after preemption counts again)."""
    hit_tokens: int = 0
    """Tokens of those served from the local prefix cache."""
    external_tokens: int = 0
    """Tokens an external tier supplied at admission."""
    allocation_failures: int = 0
    lost_hit_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(LOSS_CAUSES, 0))
    """Prompt tokens of admitted sequences the full-attention groups held but the hit could not
    serve, by cause (``hybridkv.core.hits.LOSS_CAUSES``): what a hybrid layout lost against a
    cache of full attention only."""
    retention: dict[str, int] = field(default_factory=dict)
    readmissions: int = 0
    """Admissions of sequences freed with ``preempted=True`` (also counted in ``admissions``)."""
    readmitted_queried_tokens: int = 0
    """Their tokens (also counted in ``queried_tokens``)."""
    readmitted_hit_tokens: int = 0
    """Their tokens served from the local prefix cache (also counted in ``hit_tokens``): mostly the
    victim's own blocks found again, not reuse between requests."""
    readmitted_external_tokens: int = 0
    """Their tokens an external tier supplied (also counted in ``external_tokens``)."""

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens`` (0 before any admission)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    @property
    def first_admission_hit_rate(self) -> float:
        """The hit rate of first admissions alone, re-admissions after a preemption left out (vLLM's
        ``prefix_cache_hits / prefix_cache_queries``, which counts a preempted request's lookups
        apart): the prefix reuse between requests (0 before any first admission)."""
        queried = self.queried_tokens - self.readmitted_queried_tokens
        return (self.hit_tokens - self.readmitted_hit_tokens) / queried if queried else 0.0


@dataclass(frozen=True)
class StateStep:
    """Where one step of one sequence finds and leaves a recurrent state (``state_steps``).

    A state is a page list: one block id per part (``KVCacheLayout.recurrent_states``)."""

    read: tuple[int, ...] | None
    """The pages holding the state the step starts from (None: the zero state)."""
    writes: tuple[tuple[int, tuple[int, ...]], ...]
    """``(p, pages)``, ascending: store the state after ``p`` tokens into ``pages``. Every ``p`` but
    the last is a checkpoint the manager planned; the last is the step's end (the running state).
    For a step with drafts, only ``certain`` are unconditional: see ``after_acceptance``."""
    drafts_from: int | None = None
    """For a step with drafts: the tokens before them (the step's new tokens end here; every
    position after it is a draft). None for a step without drafts."""

    @property
    def certain(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """The writes to make whatever the verification accepts (during the forward pass): all of
        them without drafts, else those at or before ``drafts_from``."""
        if self.drafts_from is None:
            return self.writes
        return tuple(w for w in self.writes if w[0] <= self.drafts_from)

    def after_acceptance(self, end: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """For a step with drafts whose accepted tokens end at ``end`` (``drafts_from <= end <=``
        the step's end): the writes still to make, ``(p, pages)``: store the state after ``p``
        tokens into ``pages``. The boundaries the accepted drafts crossed, then the running state at
        ``end`` into the pages of the first write at or past it; nothing past ``end`` (a rejected
        draft's checkpoint is never written, its pages are freed by ``release_lookahead``)."""
        base = self.drafts_from
        if base is None or not base <= end <= self.writes[-1][0]:
            raise InvalidInputError(f"accepted end {end} outside the step's drafts ({base}..{self.writes[-1][0]})")
        out = []
        for p, pages in self.writes:
            if p >= end:
                if p > base:  # else the certain write at ``end`` holds it already
                    out.append((end, pages))
                break
            if p > base:
                out.append((p, pages))
        return tuple(out)


def _empty_lists(n: int) -> Callable[[], tuple[list[int], ...]]:
    """A function returning a tuple of ``n`` fresh empty lists (a literal: several times faster
    than a generator, on the path most decode steps take)."""
    literals: dict[int, Callable[[], tuple[list[int], ...]]] = {
        1: lambda: ([],), 2: lambda: ([], []), 3: lambda: ([], [], []), 4: lambda: ([], [], [], [])
    }
    return literals.get(n) or (lambda: tuple([] for _ in range(n)))


def _count(name: str, value: object) -> int:
    """``value`` if it is a non-negative int, else an ``InvalidInputError`` naming it."""
    if type(value) is not int or value < 0:  # bool is a subclass of int, not an int here
        raise InvalidInputError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def _checked_config(layout: KVCacheLayout, max_model_len: int, max_num_batched_tokens: int | None) -> int:
    """The manager's arguments are well formed; returns ``max_num_batched_tokens`` (default ``max_model_len``)."""
    if not isinstance(layout, KVCacheLayout):
        raise InvalidInputError(f"layout must be a KVCacheLayout, got {type(layout).__name__}")
    if _count("max_model_len", max_model_len) == 0:
        raise InvalidInputError("max_model_len must be positive")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max_model_len
    if _count("max_num_batched_tokens", max_num_batched_tokens) == 0:
        raise InvalidInputError("max_num_batched_tokens must be positive")
    return max_num_batched_tokens


class KVCacheManager:
    """Paged KV-cache manager for hybrid models: prefix caching, admission, window dropping.

    ``max_num_batched_tokens`` (default ``max_model_len``) is the largest number of tokens a
    sequence is given in one step; it sets the per-request block bound of window kinds.
    """

    def __init__(
        self,
        layout: KVCacheLayout,
        max_model_len: int,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        *,
        retention: str | RetentionPolicy = "window",
        hash_algorithm: HashAlgorithm = "sha256",
        enable_events: bool = False,
    ) -> None:
        max_num_batched_tokens = _checked_config(layout, max_model_len, max_num_batched_tokens)
        self.layout = layout
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.policy = make_policy(retention)
        self.rules = HitRules(layout, max_model_len, max_num_batched_tokens,
                              enable_prefix_caching=self.enable_prefix_caching, hash_algorithm=hash_algorithm)
        """The layout's hit rules without the pool (what another cache holding given hashes could serve):
        the hashes, the hit alignment and the span of a hit are read there."""
        self.hasher = self.rules.hasher
        self.pool = BlockPool(layout.num_blocks, len(layout.groups), enable_caching=self.enable_prefix_caching,
                              enable_events=enable_events, kept_queue=self.policy.kept_queue)
        self.groups: list[KindManager] = [
            kind_manager_for(rule, self.pool, max_num_batched_tokens=max_num_batched_tokens,
                             max_model_len=max_model_len)
            for rule in self.rules.groups
        ]
        self.hash_block_size = self.rules.hash_block_size
        """Granularity of the sequence's block hashes (every caching group's block size is a multiple)."""
        self.hit_alignment = self.rules.hit_alignment
        """Every hit, local or external, is a multiple of this many tokens."""
        self.retainer = self.policy.build(self.pool, self.groups, self.block_hashes, self.hit_alignment)
        self._sort_groups()
        self._tracks_admissions = self.retainer.tracks_admissions
        self._start_bookkeeping()
        self._no_new_blocks = _empty_lists(len(self.groups))
        self._stats = KVCacheStats()
        self._preempted: dict[str, None] = {}
        """The ids of sequences freed as preempted, in order, until their next admission or free."""
        self._token = object()  # the identity hits found here carry
        self.pool.remember_evictions(g.group for g in self._deferred)

    def _sort_groups(self) -> None:
        """The groups each step of ``allocate`` (and ``free``) visits, by what their kinds do."""
        self._caching = [g for g in self.groups if g.caching]
        # The pages of a recurrent state after its first: groups with the first's rules and table shape.
        # Their dropped blocks go to retention with the first's, in one call, index by index (a state's
        # pages then also leave the cache together); their idle limits are the first's.
        self._pages: dict[int, list[KindManager]] = {
            st.groups[0]: [self.groups[g] for g in st.groups[1:]]
            for st in self.layout.recurrent_states if len(st.groups) > 1
        }
        followers = {g.group for pages in self._pages.values() for g in pages}
        self._droppers = [g for g in self.groups
                          if g.drops_blocks and g.group not in followers]
        self._limiters = [g for g in self.groups if g.group not in followers]
        self.retainer.pages = {first: tuple(g.group for g in pages) for first, pages in self._pages.items()}
        self._deferred = [g for g in self._caching if g.registers_when_computed]
        self._checkpointing = [g for g in self._deferred if g.checkpoints]
        self._preparing = [g for g in self.groups if g.prepares]
        spans = [g.draft_span for g in self.groups if g.draft_span is not None]
        self._draft_span = min(spans, default=None)
        self._whole_steps = bool(self._deferred)

    def _start_bookkeeping(self) -> None:
        """The per-sequence records, empty: no sequence holds blocks yet."""
        self._seqs: dict[str, KVSequence] = {}
        # Per running Sequence object (keyed by identity): the slot count up to which a step has
        # nothing to allocate, drop or register in any group (most decodes), so ``allocate`` can
        # return at once.
        self._idle_until: dict[KVSequence, int] = {}
        # Per running sequence, from its last allocation: (base, known, ceiling): the tokens computed
        # before it, the tokens it gave slots to (the step's end), and the most slots the idle steps
        # after it may reach. The next allocation must report at least ``base`` computed tokens
        # (less is a rewind) and at most ``ceiling`` (more were never given slots); with a recurrent
        # group, at least ``known``: a state exists only once its whole step ran, so a step cannot
        # be re-planned or run in part. ``free`` trusts a count between ``base`` and ``ceiling`` and
        # otherwise takes ``base`` (the step never ran).
        self._progress: dict[str, tuple[int, int, int]] = {}
        # Per running sequence, (tokens, slots): the most tokens any allocation gave slots to as
        # computed, external or new tokens (never drafts: no block is registered past them), and the
        # most slots, lookahead included, any allocation gave since its admission or its last
        # ``release_lookahead`` (which keeps the blocks of the verified tokens only). A table that
        # holds lookahead slots has no entry past what these slots need.
        self._reach: dict[str, tuple[int, int]] = {}
        # Running sequences whose hit took blocks another sequence was to compute in the same step,
        # freed before it ran: that KV will never be written, so they cannot go on (free them).
        self._orphaned: dict[str, str] = {}
        # Per running sequence whose last allocation had drafts: (base, known, total), the tokens
        # computed before it, its new tokens' end and its lookahead slots' end (``state_steps``).
        self._drafting: dict[str, tuple[int, int, int]] = {}
        self._losses: dict[str, dict[str, int]] = {}  # per running sequence admitted on a shortened hit

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now (free, including evictable cached ones)."""
        return self.pool.num_free_blocks

    @property
    def num_admissible_blocks(self) -> int:
        """Blocks a *new* sequence could take now (kept blocks reserved for running prefixes excluded)."""
        return self.pool.num_admissible_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by sequences."""
        return self.pool.usage

    @property
    def stats(self) -> KVCacheStats:
        """Queried / hit prompt tokens and other counters since start."""
        self._stats.retention = self.retainer.stats()
        return self._stats

    @property
    def retention(self) -> RetentionPolicy:
        """The retention policy (a configuration object)."""
        return self.policy

    @property
    def num_sequences(self) -> int:
        """Sequences currently holding blocks."""
        return len(self._seqs)

    @property
    def hash_algorithm(self) -> str:
        """The block hash (``sha256`` unless the opt-in non-cryptographic one was chosen)."""
        return self.hasher.algorithm

    @property
    def caching_groups(self) -> list[int]:
        """Indices of the groups that keep a prefix cache."""
        return list(self.rules.caching_groups)

    def blocks_needed_when_empty(self, num_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` tokens holds at its peak: the admission bound,
        ``sum(spec.blocks_for_tokens(...))`` over the groups, as pool sizing and the capacity report count it."""
        mnbt, mml = self.max_num_batched_tokens, self.max_model_len
        return sum(g.spec.blocks_for_tokens(num_tokens, mnbt, mml) for g in self.groups)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens fits in the empty pool."""
        if num_tokens > self.max_model_len:
            return False
        return self.blocks_needed_when_empty(num_tokens) <= self.layout.num_blocks - 1

    def block_table(self, seq_id: str) -> tuple[tuple[int, ...], ...]:
        """The sequence's block ids, one tuple per group (0 = null block)."""
        if not isinstance(seq_id, str) or seq_id not in self._seqs:
            raise UnknownSequenceError(f"sequence {seq_id!r} holds no blocks")
        return tuple(tuple(g.tables.get(seq_id, ())) for g in self.groups)

    def state_steps(self, seq_id: str, num_computed: int, num_tokens: int) -> tuple[StateStep, ...]:
        """For a step computing tokens ``[num_computed, num_tokens)`` of a running sequence (call it
        after the step's ``allocate``; ``num_computed`` includes tokens an external tier loaded), one
        ``StateStep`` per ``layout.recurrent_states``: the pages to read the state from and the pages
        to write it into, after each planned checkpoint and at the step's end. Read before writing:
        the read pages may be the last written ones (a step that stays inside one block).

        For a step with drafts (``num_tokens`` past its new tokens, at most its lookahead slots'
        end) the writes cover every position the accepted tokens may end at and ``drafts_from`` is
        set: make the ``certain`` writes, keep the state after each draft position, and once the
        drafts are verified make ``after_acceptance(end)`` (then ``release_lookahead``)."""
        if not isinstance(seq_id, str) or seq_id not in self._seqs:
            raise UnknownSequenceError(f"sequence {seq_id!r} holds no blocks")
        if _count("num_computed", num_computed) >= _count("num_tokens", num_tokens):
            raise InvalidInputError(f"a step computes at least one token: num_computed={num_computed} "
                                    f">= num_tokens={num_tokens}")
        drafting = self._drafting.get(seq_id)
        drafts_from = None
        if drafting is not None and num_computed == drafting[0] and num_tokens > drafting[1]:
            drafts_from = drafting[1]
            if num_tokens > drafting[2]:
                raise InvalidInputError(f"sequence {seq_id!r}: a step over [{num_computed}, {num_tokens}) passes its "
                                        f"lookahead slots (they end at {drafting[2]})")
        steps = []
        for state in self.layout.recurrent_states:
            parts = [self.groups[g] for g in state.groups]
            read, writes = parts[0].state_entries(seq_id, num_computed, num_tokens)
            tables = [g.tables[seq_id] for g in parts]
            steps.append(StateStep(None if read is None else tuple(t[read] for t in tables),
                                   tuple((p, tuple(t[i] for t in tables)) for p, i in writes), drafts_from))
        return tuple(steps)

    def max_draft_tokens(self, num_new_tokens: int = 1) -> int:
        """The most lookahead tokens ``allocate`` takes with ``num_new_tokens`` new tokens: one step
        stays within ``max_num_batched_tokens`` and, with a recurrent group that checkpoints (mode
        ``align``), within one block of it (``KindManager.draft_span``)."""
        limit = self.max_num_batched_tokens if self._draft_span is None else min(self._draft_span,
                                                                                  self.max_num_batched_tokens)
        return max(0, limit - _count("num_new_tokens", num_new_tokens))

    def lost_hit_tokens(self, seq_id: str) -> dict[str, int]:
        """Why the running sequence's hit at admission stopped short of the prefix its full-attention
        groups held: tokens per cause (``hybridkv.core.hits.LOSS_CAUSES``); empty if it lost none."""
        if not isinstance(seq_id, str) or seq_id not in self._seqs:
            raise UnknownSequenceError(f"sequence {seq_id!r} holds no blocks")
        return dict(self._losses.get(seq_id, {}))

    def num_held_blocks(self, seq_id: str) -> int:
        """Non-null blocks the sequence holds, over all groups (0 for one that holds none)."""
        return sum(g.held_blocks(seq_id) for g in self.groups) if seq_id in self._seqs else 0

    def block_hashes(self, seq: KVSequence, group: KindManager | KindRule | int) -> list[bytes]:
        """The sequence's full-block hashes at ``group``'s block size (empty for a group that keeps
        no prefix cache). The list is cached on the sequence: do not mutate it."""
        return self.rules.block_hashes(seq, group if isinstance(group, int) else group.group)

    def hit_span(self, group: int, num_tokens: int) -> range:
        """Table indices of ``group`` a hit ending at token ``num_tokens`` must hold: all of them for
        full attention, the window for a sliding window, the current chunk for chunked-local
        attention, the state there for a recurrent group, none for a group that keeps no cache."""
        return self.rules.hit_span(group, num_tokens)

    def registered_blocks(self, seq: KVSequence, group: int, start_token: int, end_token: int
                          ) -> list[tuple[int, int, bytes]]:
        """``(index, block id, hash)`` of the sequence's blocks in ``group`` whose tokens end in
        ``(start_token, end_token]`` and that the prefix cache holds under the sequence's own hash
        (what an external tier may store: superseded or never-computed blocks are excluded).
        Recurrent checkpoints whose tokens are computed are registered first: the sequence's count,
        or ``end_token`` when the step that gave it slots reaches it (offering a step's blocks to a
        tier, as ``KVConnector.store`` does right after the forward pass, vouches that it ran)."""
        if self._deferred and self._seqs.get(seq.seq_id) is seq:
            computed = self._computed_tokens(seq)  # at least the step's base
            ceiling = self._progress[seq.seq_id][2]
            self._register_computed(seq, end_token if computed < end_token <= ceiling else computed)
        g = self.groups[group]
        table = g.tables.get(seq.seq_id, [])
        hashes = self.block_hashes(seq, g)
        block_hash = self.pool.block_hash
        first, last = start_token // g.block_size, min(end_token // g.block_size, len(hashes), len(table))
        if first >= last:
            return []
        blocks, own = table[first:last], hashes[first:last]
        if NULL_BLOCK not in blocks and gather(block_hash, blocks) == tuple(own):  # the common case, checked in C
            return list(zip(range(first, last), blocks, own))
        return [(i, b, h) for i, b, h in zip(range(first, last), blocks, own) if b != NULL_BLOCK and block_hash[b] == h]

    @property
    def hits_possible(self) -> bool:
        """Whether any hit can be longer than 0 tokens: prefix caching is on and every group that
        bounds hits keeps a cache (a recurrent group without checkpoints never resumes)."""
        return self.rules.hits_possible

    def group_block_size(self, group: int) -> int:
        """Tokens one block of ``group`` covers."""
        return self.groups[group].block_size

    def external_hit(self, seq: KVSequence, present: Mapping[int, Collection[bytes]], *, start: int = 0,
                     limit: int | None = None) -> int:
        """The longest hit of ``seq`` (tokens, at most ``limit``) every group can serve when its first
        ``start`` tokens are a hit already and group ``g`` can also draw on the block hashes in
        ``present[g]`` (an external tier's contents, another replica's cache). The same rules as
        ``lookup`` (``HitRules.longest_hit``): full attention needs the whole chain, a window its
        blocks before the hit point, a recurrent group the state there."""
        self._check_sequence(seq)
        cached = {g: dict.fromkeys(hashes, 1) for g, hashes in present.items()}
        return self.rules.longest_hit(seq, cached, start=start, limit=limit,
                                      hashes=lambda g: self.block_hashes(seq, g))

    # ------------------------------------------------------------------ lookup
    def lookup(self, seq: KVSequence) -> CacheHit:
        """The longest prefix every group can serve from the cache. No side effects."""
        self._check_sequence(seq)
        if not self.enable_prefix_caching or seq.seq_id in self._seqs:
            return CacheHit(seq.seq_id, 0, tuple(() for _ in self.groups), owner=self._token,
                            epoch=self.pool.evictions)
        align = self.hit_alignment
        max_hit = (seq.num_tokens - 1) // align * align
        index = self.pool.index
        tokens, full_hit, blocks = agreed_hit(
            self.rules.groups, lambda g: self.block_hashes(seq, g), lambda g: index[g.group], max_hit, align
        )
        return CacheHit(seq.seq_id, tokens, tuple(map(tuple, blocks)), full_hit, max_hit, self.pool.evictions,
                        self._token, self._content(seq, tokens))

    def _hit_losses(self, seq: KVSequence, hit: CacheHit) -> dict[str, int]:
        """Why ``hit`` (found here, being adopted) stops short of its full-attention prefix: tokens
        per cause (``hybridkv.core.hits.LOSS_CAUSES``)."""
        index = self.pool.index
        was_evicted = self.pool.was_evicted
        return hit_losses(self.rules.groups, lambda g: self.block_hashes(seq, g), lambda g: index[g.group],
                          hit.max_hit_tokens, self.hit_alignment,
                          lambda g, hashes: any(was_evicted(g.group, h) for h in hashes))

    def _content(self, seq: KVSequence, num_tokens: int) -> bytes | None:
        """The hash fingerprinting the sequence's first ``num_tokens`` tokens (and its salt)."""
        if not num_tokens or not self._caching:
            return None
        return seq.block_hashes(self.hasher, self.hash_block_size)[num_tokens // self.hash_block_size - 1]

    # ------------------------------------------------------------------ allocate
    def allocate(
        self,
        seq: KVSequence,
        num_new_tokens: int,
        hit: CacheHit | None = None,
        num_external_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        *,
        whole_sequence_must_fit: bool = False,
        reserve_lookahead_tokens: int = 0,
    ) -> tuple[list[int], ...] | None:
        """Blocks for the next step of ``seq``: new block ids per group, or None if they do not fit.

        ``num_lookahead_tokens`` (speculative drafts) get slots after the new tokens but are never
        registered; after the step, ``release_lookahead`` frees what the rejected ones held.
        ``reserve_lookahead_tokens``: the admission bound (``whole_sequence_must_fit``) counts that
        many draft slots past the sequence's end, as its decode steps will hold them.

        In order: validate (the hit is verified against the sequence), free the blocks the windows
        no longer need, count the blocks needed per group and check them against the free blocks,
        adopt the hit in every group (two-phase adoption), allocate for the external and the new
        tokens, register the full blocks this step computes.
        """
        try:
            idle = self._idle_until.get(seq)  # set only while this very object is running
        except TypeError:  # unhashable: not a Sequence, the checks below say so
            idle = None
        if idle is not None and hit is None and not num_external_tokens and not whole_sequence_must_fit:
            computed = seq.num_computed_tokens
            # A step with drafts takes the checked path: release_lookahead needs its exact progress.
            if (type(num_new_tokens) is int and type(num_lookahead_tokens) is int and not num_lookahead_tokens
                    and type(computed) is int
                    and 0 < num_new_tokens <= self.max_num_batched_tokens
                    and computed >= self._progress[seq.seq_id][self._whole_steps]
                    and computed + num_new_tokens <= idle
                    and computed + num_new_tokens <= seq.num_tokens <= self.max_model_len):
                return self._no_new_blocks()  # the step has nothing to allocate, register or drop

        # The checked path. Validate (the hit too, for a new sequence):
        adopted, computed = self._checked_step(seq, num_new_tokens, hit, num_external_tokens, num_lookahead_tokens,
                                               reserve_lookahead_tokens)
        known = computed + num_external_tokens + num_new_tokens
        total = known + num_lookahead_tokens
        bound = num_lookahead_tokens + reserve_lookahead_tokens if whole_sequence_must_fit else None
        # Free what the windows no longer need, count and check, adopt the hit (two-phase), allocate:
        if adopted is None:
            new_blocks = self._grow_running(seq, computed, known, total, bound)
        else:
            new_blocks = self._admit(seq, adopted, num_external_tokens, known, total, bound)
        if new_blocks is None:
            self._stats.allocation_failures += 1
            return None
        # Register the full blocks this step computes; note the progress (and the admission).
        self._register(seq, computed, num_external_tokens, known)
        self._note_progress(seq, computed, known, total, num_lookahead_tokens)
        if adopted is not None:
            self._count_admission(seq, adopted, num_external_tokens)
        return new_blocks

    def _checked_step(self, seq: KVSequence, num_new: int, hit: CacheHit | None, num_external: int,
                      num_lookahead: int, reserve_lookahead: int) -> tuple[CacheHit | None, int]:
        """``allocate``'s first phase, validate: everything is checked before anything changes. Returns
        the hit to adopt, verified against the sequence (None for a running sequence), and the
        tokens computed before the step."""
        self._check_step(seq, num_new, num_external, num_lookahead)
        if type(reserve_lookahead) is not int or reserve_lookahead < 0:
            raise InvalidInputError(
                f"reserve_lookahead_tokens must be a non-negative integer, got {reserve_lookahead!r}")
        if num_lookahead and self._draft_span is not None and num_new + num_lookahead > self._draft_span:
            raise InvalidInputError(
                f"sequence {seq.seq_id!r}: {num_new} new + {num_lookahead} lookahead tokens, but a step with drafts "
                f"spans at most {self._draft_span} tokens (one block of the recurrent state: "
                f"max_draft_tokens({num_new}) = {max(0, self._draft_span - num_new)})"
            )
        adopted: CacheHit | None = None
        if seq.seq_id in self._seqs:
            computed = self._check_running(seq, hit, num_external)
        else:
            adopted = self._verified_hit(seq, hit)
            computed = adopted.num_tokens
        if computed + num_external + num_new > seq.num_tokens:
            raise InvalidInputError(
                f"sequence {seq.seq_id!r}: {computed} computed + {num_external} external + "
                f"{num_new} new tokens exceed its {seq.num_tokens} tokens"
            )
        return adopted, computed

    def _grow_running(self, seq: KVSequence, computed: int, known: int, total: int,
                      bound: int | None) -> tuple[list[int], ...] | None:
        """``allocate``'s next phases for a running sequence: enter the checkpoints its last step
        computed, free the blocks its windows no longer need, count the blocks the step needs (with
        ``bound``, the admission bound for that many draft slots past its end), check them against the
        free blocks and take them; None, with nothing taken, if they do not fit."""
        sid = seq.seq_id
        if sid in self._drafting:
            self._settle_drafts(seq, computed)
        if self._deferred:
            self._register_computed(seq, computed)
        for g in self._droppers:
            freed = g.remove_skipped(sid, computed)
            pages = self._pages.get(g.group) if self._pages else None
            if pages:
                freed = page_by_page(freed, [p.remove_skipped(sid, computed) for p in pages])
            if freed:
                self.retainer.release_dropped(g, seq, freed)
        plans = [g.plan_indices(sid, (), computed, 0, total if g.holds_lookahead else known) for g in self.groups]
        need = sum(map(len, plans))
        if bound is not None:
            need = self._whole_sequence_need(seq, plans, None, bound)
        if need and need > self.pool.num_free_blocks:
            return None
        return tuple([g.grow(sid, indices, allow_reserved=True) if indices else []
                      for g, indices in zip(self.groups, plans)])

    def _admit(self, seq: KVSequence, adopted: CacheHit, external: int, known: int, total: int,
               bound: int | None) -> tuple[list[int], ...] | None:
        """``allocate``'s next phases for a new sequence: count the blocks it needs besides its hit and
        check them against the admissible blocks (None if they do not fit: nothing is adopted),
        adopt the hit in every group before any group allocates (two-phase adoption), then take the
        blocks of the external and the new tokens."""
        planned = self._plan_admission(seq, adopted, external, known, total, bound)
        if planned is None:
            return None
        hit_blocks, plans, live, free = planned
        sid = seq.seq_id
        # Why the hit is shorter than the full-attention prefix, on the pool as the lookup saw it.
        if adopted.full_hit_tokens > adopted.num_tokens:
            losses = self._hit_losses(seq, adopted)
            if losses:
                self._losses[sid] = losses
                for cause, n in losses.items():
                    self._stats.lost_hit_tokens[cause] += n
        self.pool.touch(live, free)
        for g, blocks in zip(self.groups, hit_blocks):
            g.adopt(sid, blocks)
        self._seqs[sid] = seq
        return tuple([g.grow(sid, indices, allow_reserved=False) for g, indices in zip(self.groups, plans)])

    def _plan_admission(self, seq: KVSequence, adopted: CacheHit, external: int, known: int, total: int,
                        bound: int | None
                        ) -> tuple[list[list[int]], list[range | list[int]], list[int], list[int]] | None:
        """The admission's plan: per group the hit blocks to adopt and the table indices to fill,
        the hit's live blocks and those of them now free; None if the blocks it takes (the free hit
        blocks included, with what retention reserves for them) exceed the admissible ones."""
        sid, computed, pool = seq.seq_id, adopted.num_tokens, self.pool
        start = computed + external
        hit_blocks = [g.adoptable(list(ids), start) if ids else list(ids)
                      for g, ids in zip(self.groups, adopted.block_ids)]
        for g in self._preparing:
            g.prepare(seq, self._checkpoints(seq, g, adopted, start))
        plans = [g.plan_indices(sid, blocks, computed, external, total if g.holds_lookahead else known)
                 for g, blocks in zip(self.groups, hit_blocks)]
        need = sum(map(len, plans))
        if bound is not None:
            need = self._whole_sequence_need(seq, plans, hit_blocks, bound)
        # Null entries lead a hit (window hits are mostly null): a list without one is kept as is.
        live = list(chain.from_iterable(b if not b or b[0] else filter(None, b) for b in hit_blocks))
        ref = pool.ref_cnt
        free = [b for b in live if not ref[b]]
        if pool.kept is None:
            need += len(free)
        else:
            cost = self.retainer.admission_cost(free)
            if need + cost > pool.num_admissible_blocks >= need + len(free):
                # Adopting the hit would reserve the blocks kept under its anchors and leave too
                # little for the rest: they yield to the admission (to ``low``), or a request that
                # fits an idle pool would wait for ever.
                pool.unkeep(free)
                cost = self.retainer.admission_cost(free)
            need += cost
        if need > pool.num_admissible_blocks:
            for g in self._preparing:
                g.pop_table(sid)  # forget what ``prepare`` noted
            return None
        return hit_blocks, plans, live, free

    def _note_progress(self, seq: KVSequence, computed: int, known: int, total: int, lookahead: int) -> None:
        """After a step's blocks are taken: the slot count up to which the next steps have nothing
        to do (``_idle_until``), the counts the next allocation may report (``_progress``) and the
        most tokens and slots given so far (``_reach``)."""
        sid = seq.seq_id
        limit = self.max_model_len  # the slot count up to which the next steps have nothing to do
        for g in self._limiters:
            group_limit = g.idle_limit(sid)
            if group_limit < limit:
                limit = group_limit
        ceiling = known if known > limit else limit
        if lookahead:
            ceiling = max(ceiling, total)  # verified drafts advance the count into the step's lookahead slots
            self._drafting[sid] = (computed, known, total)
            self._idle_until.pop(seq, None)  # the next allocate takes the checked path
        else:
            self._drafting.pop(sid, None)
            self._idle_until[seq] = limit
        self._progress[sid] = (computed, known, ceiling)
        reach = self._reach.get(sid)
        self._reach[sid] = (known, total) if reach is None else (max(reach[0], known), max(reach[1], total))

    def _count_admission(self, seq: KVSequence, adopted: CacheHit, external: int) -> None:
        """Count an admission (its prompt, hit and external tokens) and tell retention."""
        st = self._stats
        st.admissions += 1
        st.queried_tokens += seq.num_tokens
        st.hit_tokens += adopted.num_tokens
        st.external_tokens += external
        if self._preempted and self._preempted.pop(seq.seq_id, 0) is None:
            st.readmissions += 1
            st.readmitted_queried_tokens += seq.num_tokens
            st.readmitted_hit_tokens += adopted.num_tokens
            st.readmitted_external_tokens += external
        if self._tracks_admissions:
            self.retainer.on_admit(seq, adopted)

    def release_lookahead(self, seq: KVSequence) -> int:
        """After a step with draft (lookahead) slots was verified: free every block wholly past the
        verified tokens; returns how many blocks were freed.

        The caller has advanced ``seq.num_computed_tokens`` over the step's token and the accepted
        drafts (at most the slots the step held) and appended the accepted tokens. Drafts were never
        registered in the prefix cache (``allocate`` registers the ``num_new_tokens`` only); a block
        holding verified tokens and rejected drafts keeps only the verified ones: it is registered
        once its verified tokens fill it (here, or at a later step), and its rejected slots are written
        again before any step reads them. The next ``allocate`` starts from the verified count."""
        self._check_sequence(seq)
        sid = seq.seq_id
        if self._seqs.get(sid) is not seq:
            raise UnknownSequenceError(f"sequence {sid!r} is not running in this manager")
        computed = seq.num_computed_tokens
        _, known, ceiling = self._progress[sid]
        if type(computed) is not int or not known <= computed <= ceiling:
            raise InvalidInputError(
                f"sequence {sid!r}: num_computed_tokens={computed!r}, but after a step with drafts it can only be "
                f"{known}..{ceiling} (the step's token, then the accepted drafts)"
            )
        if computed > seq.num_tokens:
            raise InvalidInputError(
                f"sequence {sid!r}: {computed} computed tokens but only {seq.num_tokens} tokens: append the "
                f"accepted tokens first"
            )
        # The verified tokens' blocks stay, and those of tokens an earlier allocation of a step that
        # was planned again gave slots as new tokens (they may be registered: they are computed later).
        tokens = max(computed, self._reach[sid][0])
        freed = self._free_slots_past(sid, tokens, [g for g in self.groups if g.holds_lookahead])
        self._register_verified(seq, computed)
        self._idle_until.pop(seq, None)  # the next allocate takes the checked path
        self._drafting.pop(sid, None)
        self._progress[sid] = (computed, computed, computed)
        self._reach[sid] = (tokens, tokens)
        return freed

    def _free_slots_past(self, sid: str, tokens: int, groups: list[KindManager]) -> int:
        """Free the blocks of ``groups``' tables past the first ``tokens`` tokens; returns how many."""
        freed: list[int] = []
        for g in groups:
            table = g.tables[sid]
            keep = -(-tokens // g.block_size)
            if len(table) > keep:
                freed.extend(b for b in table[keep:] if b != NULL_BLOCK)
                del table[keep:]
        if freed:
            self.pool.free(freed)
        return len(freed)

    def _settle_drafts(self, seq: KVSequence, computed: int) -> None:
        """A step with drafts was not followed by ``release_lookahead``: before the next step, free the
        recurrent entries past the verified tokens (they hold no state the sequence reaches, and would
        take the next step past the admission bound) and note the boundaries accepted drafts crossed.
        Attention groups keep their slots (the next steps write them again)."""
        sid = seq.seq_id
        reach = self._reach[sid]
        tokens = max(computed, reach[0])
        recurrent = [g for g in self.groups if g.registers_when_computed and g.holds_lookahead]  # caching or not
        self._free_slots_past(sid, tokens, recurrent)
        self._register_verified(seq, computed)
        self._reach[sid] = (tokens, reach[1])
        del self._drafting[sid]

    def _whole_sequence_need(self, seq: KVSequence, plans: list[range | list[int]],
                             hit_blocks: list[list[int]] | None, num_lookahead_tokens: int) -> int:
        """Blocks the admission bound asks for: per group, the step's blocks or the sequence's peak
        (``spec.blocks_for_tokens``) less what it holds (its table, or its hit for a new sequence),
        whichever is more."""
        n = seq.num_tokens + num_lookahead_tokens
        mnbt, mml = self.max_num_batched_tokens, self.max_model_len
        need = 0
        for i, (g, indices) in enumerate(zip(self.groups, plans)):
            if hit_blocks is None:
                held = g.held_blocks(seq.seq_id)
            else:
                held = len(hit_blocks[i]) - hit_blocks[i].count(NULL_BLOCK)
            need += max(len(indices), g.spec.blocks_for_tokens(n, mnbt, mml) - held)
        return need

    def _checkpoints(self, seq: KVSequence, group: KindManager, hit: CacheHit, start: int) -> list[tuple[int, int]]:
        """Where a recurrent group (align mode) checkpoints this sequence's prefill: the lookup's
        junction and the junctions retention remembers, the prompt's end (``MambaManager.plan``)."""
        if group not in self._checkpointing:
            return []
        align = self.hit_alignment
        end = (seq.num_prompt_tokens - 1) // align * align
        if end <= start:
            return []
        junctions = self.junctions(seq, start, end)
        if start < hit.full_hit_tokens <= end:
            junctions.append(hit.full_hit_tokens)
        return group.plan(start, end, junctions, align)

    def junctions(self, seq: KVSequence, start: int, end: int) -> list[int]:
        """Positions in ``(start, end]`` where later requests are known or expected to part from
        ``seq``: the junctions retention remembers and the sequence's ``checkpoint_hints`` (its
        caller's message boundaries), rounded down to the hit alignment; ascending. Recurrent groups
        checkpoint there and tiers store there."""
        junctions = self.retainer.junctions(seq, start, end)
        hints = getattr(seq, "checkpoint_hints", None)
        if hints:
            align = self.hit_alignment
            points = {h // align * align for h in hints}
            points.update(junctions)
            junctions = sorted(p for p in points if start < p <= end)
        return junctions

    def _idle_limit(self, sid: str) -> int:
        """Slot count up to which the next steps of ``sid`` have nothing to do in any group."""
        limit = self.max_model_len
        for g in self.groups:
            group_limit = g.idle_limit(sid)
            limit = group_limit if group_limit < limit else limit
        return limit

    def _register(self, seq: KVSequence, computed: int, external: int, known: int) -> None:
        """Enter into the prefix cache the full blocks of the first ``known`` tokens (recurrent
        groups: note the checkpoints this step writes; they enter once computed)."""
        sid = seq.seq_id
        for g in self._caching:
            if g.registers_when_computed:
                g.note_step(sid, computed, external, known)  # type: ignore[attr-defined]
            elif known // g.block_size > g.num_cached[sid]:  # hashes only when the step completes a block
                g.register(sid, self.block_hashes(seq, g), computed, known,
                           self._event_tokens(seq) if self.pool.enable_events else None)

    def _register_verified(self, seq: KVSequence, computed: int) -> None:
        """Enter the attention blocks the first ``computed`` tokens fill that are not in yet: those
        accepted drafts completed (verified, so their KV is the sequence's own); and the recurrent
        states at the block boundaries the accepted drafts crossed (never one past ``computed``)."""
        sid = seq.seq_id
        if self._deferred:
            known = self._progress[sid][1]
            for d in self._deferred:
                d.note_verified(sid, known, computed)
            self._register_computed(seq, computed)
        for g in self._caching:
            if not g.registers_when_computed and computed // g.block_size > g.num_cached[sid]:
                g.register(sid, self.block_hashes(seq, g), computed, computed,
                           self._event_tokens(seq) if self.pool.enable_events else None)

    def _register_computed(self, seq: KVSequence, computed: int) -> None:
        """Enter the recurrent checkpoints of the first ``computed`` tokens (those the caller reports computed)."""
        for g in self._deferred:
            g.register(seq.seq_id, self.block_hashes(seq, g), computed, 0, self._event_tokens(seq))

    def _computed_tokens(self, seq: KVSequence) -> int:
        """The running sequence's computed-token count as its caller reports it, if that is possible
        (see ``_progress``); else what was computed before its last allocation (a caller that never
        advanced the count, or set it wrongly, loses only what is not certain)."""
        base, _, ceiling = self._progress[seq.seq_id]
        computed = seq.num_computed_tokens
        return computed if type(computed) is int and base <= computed <= ceiling else base

    def _event_tokens(self, seq: KVSequence) -> list[int] | None:
        """The sequence's token ids when the pool records events (None otherwise, or without ids)."""
        return seq.token_ids if self.pool.enable_events else None

    # ------------------------------------------------------------------ free
    def free(self, seq: KVSequence | str, *, preempted: bool = False) -> None:
        """Release every block of the sequence (finished or preempted). Idempotent.

        ``preempted``: the sequence will be admitted again (recomputed); its next admission is counted
        as a re-admission too (``KVCacheStats.readmissions`` and the ``readmitted_*`` counters). A
        free without it forgets that mark: free a preempted sequence that will not return once more
        (the scheduler does when it rejects or aborts it).

        Blocks registered for tokens the sequence never computed (a step allocated but not run, or
        one that failed: free its sequences before advancing their computed counts) leave the prefix
        cache first: they must never serve a hit.
        """
        if isinstance(seq, str):
            sid = seq
        elif is_kv_sequence(seq):
            sid = seq.seq_id
        else:
            raise InvalidInputError(f"free takes a sequence (hybridkv.Sequence or another KVSequence) or a "
                                    f"sequence id, got {type(seq).__name__}")
        stored = self._seqs.get(sid)
        if not preempted:
            self._preempted.pop(sid, None)
        elif stored is not None:
            marks = self._preempted
            marks[sid] = None
            if len(marks) > MAX_PREEMPTED_MARKS:  # a caller that never frees its dropped victims
                del marks[next(iter(marks))]
        if stored is None:
            return
        computed = self._computed_tokens(stored)
        if self._deferred:
            self._register_computed(stored, computed)
        if computed > self._progress[sid][1]:  # accepted drafts past the last step's tokens
            self._register_verified(stored, computed)
        for g in self._caching:
            stale = g.uncomputed_blocks(sid, computed)
            if stale:
                self.pool.uncache(stale)
                self._orphan_adopters(g, sid, stale)
        del self._seqs[sid]
        self._orphaned.pop(sid, None)
        self._drafting.pop(sid, None)
        self._losses.pop(sid, None)
        self._idle_until.pop(stored, None)
        self._progress.pop(sid, None)
        self._reach.pop(sid, None)
        tables = [g.pop_table(sid) for g in self.groups]
        self.retainer.release_sequence(stored, tables, computed)

    def _orphan_adopters(self, group: KindManager, sid: str, stale: list[int]) -> None:
        """Mark the sequences that adopted any of ``stale`` (blocks ``sid`` registered and never
        computed) as hit in the same step: they hold KV nobody will write."""
        ref = self.pool.ref_cnt
        shared = {b for b in stale if ref[b] > 1}
        if not shared:
            return
        for other, table in group.tables.items():
            if other != sid and not shared.isdisjoint(table):
                self._orphaned.setdefault(other, sid)
                self._idle_until.pop(self._seqs[other], None)  # its next allocate takes the checked path

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (and nothing changes) while any sequence holds blocks."""
        if self._seqs or not self.pool.reset_prefix_cache():
            return False
        self.retainer.reset()
        return True

    def reset_stats(self) -> None:
        """Zero the counters."""
        self._stats = KVCacheStats()

    def take_events(self) -> list[KVCacheEvent]:
        """Cache events (stored, removed, cleared) since the last call; needs ``enable_events``."""
        return self.pool.take_events()

    # ------------------------------------------------------------------ validation
    def _check_sequence(self, seq: KVSequence) -> None:
        if not is_kv_sequence(seq):
            raise InvalidInputError(f"expected a sequence (hybridkv.Sequence or another KVSequence), "
                                    f"got {type(seq).__name__}")
        if seq.num_tokens > self.max_model_len:
            raise SequenceTooLongError(
                f"sequence {seq.seq_id!r} has {seq.num_tokens} tokens; max_model_len is {self.max_model_len}"
            )
        computed = seq.num_computed_tokens
        if type(computed) is not int or not 0 <= computed <= seq.num_tokens:
            raise InvalidInputError(
                f"sequence {seq.seq_id!r}: num_computed_tokens={computed!r} must be an integer in "
                f"0..{seq.num_tokens}"
            )

    def _check_step(self, seq: KVSequence, num_new: int, num_external: int, num_lookahead: int) -> None:
        """The sequence and the token counts of an allocation are well formed."""
        self._check_sequence(seq)
        if not (type(num_new) is int and type(num_external) is int and type(num_lookahead) is int
                and num_new >= 0 and num_external >= 0 and num_lookahead >= 0):
            for name, value in (("num_new_tokens", num_new), ("num_external_tokens", num_external),
                                ("num_lookahead_tokens", num_lookahead)):
                _count(name, value)
        if num_new + num_lookahead > self.max_num_batched_tokens:
            raise InvalidInputError(
                f"sequence {seq.seq_id!r}: {num_new} new + {num_lookahead} lookahead tokens in one step "
                f"exceed max_num_batched_tokens={self.max_num_batched_tokens}, which the per-request bounds assume"
            )

    def _check_running(self, seq: KVSequence, hit: CacheHit | None, num_external_tokens: int) -> int:
        """A running sequence's next step is well formed: its computed-token count (returned) is one
        its last allocation allows (see ``_progress``)."""
        sid = seq.seq_id
        if self._seqs[sid] is not seq:
            raise InvalidInputError(f"another Sequence object with id {sid!r} is already running")
        if hit is not None and (not isinstance(hit, CacheHit) or hit.num_tokens or any(hit.block_ids)):
            raise InvalidInputError(
                f"sequence {sid!r} is running: a cache hit can only be passed at its first allocation"
            )
        if num_external_tokens:
            raise InvalidInputError(
                f"sequence {sid!r} is running: external tokens can only be loaded at its first allocation"
            )
        if sid in self._orphaned:
            raise InvalidInputError(
                f"sequence {sid!r} adopted blocks sequence {self._orphaned[sid]!r} was to compute in the same "
                f"step, and {self._orphaned[sid]!r} was freed before that step ran: free {sid!r} and admit "
                f"it again"
            )
        computed: int = seq.num_computed_tokens
        progress = self._progress[sid]
        lowest, ceiling = progress[self._whole_steps], progress[2]
        if not lowest <= computed <= ceiling:
            since = "that step's end" if self._whole_steps else "what was computed before it"
            what = "a rewind, or a step re-planned or run in part," if self._whole_steps else "a rewind"
            raise InvalidInputError(
                f"sequence {sid!r}: num_computed_tokens={computed}, but after its last allocation it can "
                f"only be {lowest}..{ceiling} ({since} .. the slots it holds): {what} needs free() and a "
                f"new admission"
            )
        return computed

    def _verified_hit(self, seq: KVSequence, hit: CacheHit | None) -> CacheHit:
        """The hit to adopt for a new sequence, checked against the sequence before anything changes.

        A hit this manager found for this content, with nothing evicted since, is accepted as is;
        any other (from another manager, hand-built, stale) is verified block by block: every block
        the hit's groups need must be cached here under the sequence's own hash.
        """
        sid = seq.seq_id
        if seq.num_computed_tokens:
            raise InvalidInputError(
                f"sequence {sid!r} holds no blocks but num_computed_tokens={seq.num_computed_tokens}; "
                f"reset it to 0 after a free or preemption"
            )
        empty = CacheHit(sid, 0, tuple(() for _ in self.groups))
        if hit is None:
            return empty
        if not isinstance(hit, CacheHit):
            raise InvalidInputError(f"hit must be a CacheHit from lookup(), got {type(hit).__name__}")
        if hit.seq_id != sid:
            raise InvalidInputError(f"the hit was looked up for {hit.seq_id!r}, not {sid!r}")
        n = hit.num_tokens
        align = self.hit_alignment
        if (type(n) is not int or not 0 <= n < seq.num_tokens or n % align
                or not isinstance(hit.block_ids, tuple) or len(hit.block_ids) != len(self.groups)):
            raise InvalidInputError(
                f"hit of {n!r} tokens does not fit sequence {sid!r} of {seq.num_tokens} tokens "
                f"({len(self.groups)} groups, hits are multiples of {align} tokens)"
            )
        if n and not self.enable_prefix_caching:
            raise InvalidInputError("prefix caching is off: a hit of more than 0 tokens cannot be adopted")
        if (hit.owner is self._token and hit.epoch == self.pool.evictions
                and hit.content == self._content(seq, n)):
            return hit  # found here for this very content, nothing evicted since
        for rule, ids in zip(self.rules.groups, hit.block_ids):
            verify_group_hit(rule, self.pool, self.block_hashes(seq, rule), ids, n, f"sequence {sid!r}")
        max_hit = (seq.num_tokens - 1) // align * align
        full = hit.full_hit_tokens if type(hit.full_hit_tokens) is int and n <= hit.full_hit_tokens <= max_hit else n
        return CacheHit(sid, n, tuple(tuple(ids) for ids in hit.block_ids), full, max_hit, self.pool.evictions,
                        self._token, self._content(seq, n))

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Raise AssertionError with a precise message on any broken invariant.

        Verified: the pool's structure (every block in exactly one free queue or held, free counts, the hash
        index); the retention policy's (kept blocks, anchors, reservations); every table belongs to
        a sequence holding blocks and lists a block at most once; each block's reference count equals
        the tables listing it; a block in two tables is cached; every registered table block holds the
        sequence's own hash; each group's per-kind rules (at most the per-request bound held, dropped
        entries null, a recurrent group's running state present); the idle limits are not above what
        the tables allow; draft state: no table that holds lookahead slots has an entry past what the
        sequence's slots need (after ``release_lookahead``, the verified tokens'; exactly those in a
        group that drops nothing), and no block is registered past the tokens given slots as
        computed, external or new tokens (drafts never are), and no recurrent state is registered or
        noted past them (a checkpoint among rejected drafts never is).
        """
        self.pool.check_invariants()
        self.retainer.check_invariants()
        refs: Counter[int] = Counter()
        orphans: Counter[int] = Counter()  # per block, tables of orphaned sequences listing it
        for g in self.groups:
            assert set(g.tables) <= set(self._seqs), f"group {g.group} has tables of unknown sequences"
            for sid, table in g.tables.items():
                live = self._check_table(g, sid, table)
                refs.update(live)
                if sid in self._orphaned:
                    orphans.update(live)
        self._check_references(refs, orphans)
        self._check_records()
        self._check_draft_state()
        assert len(self._idle_until) <= len(self._seqs) and all(
            self._seqs.get(seq.seq_id) is seq for seq in self._idle_until
        ), "idle limits of sequences that hold no blocks"
        assert self._preempted.keys().isdisjoint(self._seqs) and len(self._preempted) <= MAX_PREEMPTED_MARKS, \
            "a sequence marked preempted holds blocks (its admission did not count as a re-admission)"

    def _check_table(self, g: KindManager, sid: str, table: list[int]) -> list[int]:
        """Check one table of group ``g`` (each block once, the group's own rules, registered blocks
        hold the sequence's own hash and are cached under ``g``); returns its non-null blocks."""
        pool = self.pool
        live = [b for b in table if b != NULL_BLOCK]
        assert len(live) == len(set(live)), f"sequence {sid!r} has a block twice in group {g.group}"
        seq = self._seqs[sid]
        g.check_table(sid, seq.num_computed_tokens)
        for b in live:
            if pool.block_hash[b] is not None:
                assert pool.block_group[b] == g.group, (
                    f"block {b} of group {g.group} is cached under group {pool.block_group[b]}"
                )
        if g.caching:
            hashes = self.block_hashes(seq, g)
            for i, b in enumerate(table):
                if b == NULL_BLOCK or i >= len(hashes):
                    continue
                h = pool.block_hash[b]
                assert h is None or h == hashes[i], (
                    f"sequence {sid!r} group {g.group} block {b} at index {i} holds another prefix"
                )
        return live

    def _check_references(self, refs: Counter[int], orphans: Counter[int]) -> None:
        """Each block's reference count is the number of tables listing it (``refs``); a block in two
        tables is cached (tables of orphaned sequences, ``orphans``, aside)."""
        pool = self.pool
        for b in range(1, pool.num_blocks):
            r = pool.ref_cnt[b]
            assert r == refs.get(b, 0), f"block {b}: ref_cnt {r} but {refs.get(b, 0)} table references"
            assert r - orphans.get(b, 0) <= 1 or pool.block_hash[b] is not None, (
                f"block {b} is in {r} tables without being cached (only hits may share blocks)"
            )

    def _check_records(self) -> None:
        """The per-sequence records cover the sequences holding blocks, and their values are consistent."""
        for sid, seq in self._seqs.items():
            assert any(sid in g.tables for g in self.groups) or not self.groups, f"{sid!r} has no tables"
            assert self._idle_until.get(seq, 0) <= self._idle_limit(sid), f"{sid!r}: idle limit too high"
        assert self._progress.keys() == self._seqs.keys(), "progress of sequences that hold no blocks"
        assert self._orphaned.keys() <= self._seqs.keys(), "orphaned sequences that hold no blocks"
        assert self._losses.keys() <= self._seqs.keys(), "hit losses of sequences that hold no blocks"
        for sid, (base, known, ceiling) in self._progress.items():
            assert 0 <= base <= known <= ceiling, f"{sid!r}: progress {base}, {known}, {ceiling}"
        assert self._reach.keys() == self._seqs.keys(), "slot counts of sequences that hold no blocks"
        for sid, (base, known, total) in self._drafting.items():
            assert sid in self._seqs and self._progress[sid][:2] == (base, known) and known <= total, (
                f"{sid!r}: draft step {base}, {known}, {total} but progress {self._progress.get(sid)}"
            )

    def _check_draft_state(self) -> None:
        """No table that holds lookahead slots has an entry past what its slots need, and no block is
        registered past the tokens given slots as computed, external or new tokens."""
        for g in self.groups:
            for sid, table in g.tables.items():
                known, slots = self._reach[sid]
                if g.holds_lookahead:
                    # Draft slots last one step: after release_lookahead only the verified tokens' blocks
                    # stay. A table that drops blocks may stop short (its last blocks already skipped).
                    need = -(-slots // g.block_size)
                    assert len(table) == need or (g.drops_blocks and len(table) < need), (
                        f"sequence {sid!r} group {g.group}: {len(table)} table entries, but its slots ({slots}) "
                        f"need {need}"
                    )
                if g.caching and not g.registers_when_computed:
                    # Drafts are never registered: only blocks full of tokens given slots as new (or hit).
                    assert g.num_cached[sid] * g.block_size <= known, (
                        f"sequence {sid!r} group {g.group}: {g.num_cached[sid]} blocks registered, but only "
                        f"{known} tokens were given slots as computed, external or new tokens"
                    )
                elif g.caching:
                    self._check_verified_states(g, sid, table, known)

    def _check_verified_states(self, g: KindManager, sid: str, table: list[int], known: int) -> None:
        """A recurrent group registers (or notes to register) a state only at a verified position: no
        later than the tokens given slots as computed, external or new, or verified after drafts."""
        bs = g.block_size
        pending = getattr(g, "pending", {}).get(sid, ())
        assert all((i + 1) * bs <= known for i in pending), (
            f"sequence {sid!r} group {g.group}: checkpoints {sorted(pending)} noted past the {known} verified tokens"
        )
        block_hash = self.pool.block_hash
        late = [i for i in range(known // bs, len(table))
                if table[i] != NULL_BLOCK and block_hash[table[i]] is not None]
        assert not late, f"sequence {sid!r} group {g.group}: states at entries {late} registered past {known} tokens"

    def __repr__(self) -> str:
        return (
            f"KVCacheManager(num_blocks={self.layout.num_blocks}, groups={len(self.groups)}, "
            f"free={self.num_free_blocks}, sequences={len(self._seqs)}, retention={self.policy.name!r})"
        )

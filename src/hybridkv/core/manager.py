"""The engine-facing KV-cache manager (the stable API of ARCHITECTURE.md)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain, compress

from hybridkv.core.block_pool import NULL_BLOCK, BlockPool, KVCacheEvent
from hybridkv.core.hashing import BlockHasher, HashAlgorithm
from hybridkv.core.hits import CacheHit, Coordinator
from hybridkv.core.kinds import KindManager, manager_for
from hybridkv.core.kinds.base import NEVER
from hybridkv.core.layout import KVCacheLayout
from hybridkv.core.retention import NoRetention, make_policy
from hybridkv.core.sequence import Sequence
from hybridkv.core.specs import ChunkedLocalAttentionSpec
from hybridkv.errors import InvalidInputError, SequenceTooLongError, UnknownSequenceError


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
    retention: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens`` (0 before any admission)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def _empty_lists(n: int) -> Callable[[], tuple[list[int], ...]]:
    """A function returning a tuple of ``n`` fresh empty lists (a literal: several times faster
    than a generator, on the path most decode steps take)."""
    literals: dict[int, Callable[[], tuple[list[int], ...]]] = {
        1: lambda: ([],), 2: lambda: ([], []), 3: lambda: ([], [], []), 4: lambda: ([], [], [], [])
    }
    return literals.get(n) or (lambda: tuple([] for _ in range(n)))


def _check_count(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInputError(f"{name} must be a non-negative integer, got {value!r}")
    return value


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
        retention: str | NoRetention = "window",
        hash_algorithm: HashAlgorithm = "sha256",
        enable_events: bool = False,
    ) -> None:
        if not isinstance(layout, KVCacheLayout):
            raise InvalidInputError(f"layout must be a KVCacheLayout, got {type(layout).__name__}")
        self.max_model_len = _check_count("max_model_len", max_model_len)
        if max_model_len == 0:
            raise InvalidInputError("max_model_len must be positive")
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max_model_len
        self.max_num_batched_tokens = _check_count("max_num_batched_tokens", max_num_batched_tokens)
        if max_num_batched_tokens == 0:
            raise InvalidInputError("max_num_batched_tokens must be positive")
        for i, g in enumerate(layout.groups):
            spec = g.spec
            if isinstance(spec, ChunkedLocalAttentionSpec) and spec.attention_chunk_size % spec.block_size:
                raise InvalidInputError(
                    f"group {i}: attention_chunk_size={spec.attention_chunk_size} is not a multiple "
                    f"of block_size={spec.block_size}"
                )
        self.layout = layout
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(layout.num_blocks, len(layout.groups), enable_caching=enable_prefix_caching,
                              enable_events=enable_events)
        self.groups: list[KindManager] = [
            manager_for(
                g.spec, i, self.pool,
                bound=g.spec.max_blocks_per_request(self.max_num_batched_tokens, max_model_len),
                enable_caching=enable_prefix_caching,
            )
            for i, g in enumerate(layout.groups)
        ]
        self.coordinator = Coordinator(self.pool, self.groups, BlockHasher(hash_algorithm))
        self.retention = make_policy(retention)
        self.retention.bind(self.coordinator)
        self._seqs: dict[str, Sequence] = {}
        # Per running Sequence object (keyed by identity): the slot count up to which a step has
        # nothing to allocate, drop or register in any group (most decodes), so ``allocate`` can
        # return at once.
        self._idle_until: dict[Sequence, int] = {}
        self._no_new_blocks = _empty_lists(len(self.groups))
        self._stats = KVCacheStats()
        # Groups whose kind drops tokens behind a window (the others never free mid-sequence).
        self._droppers = [g for g in self.groups if type(g).skipped_tokens is not KindManager.skipped_tokens]

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation could take now (free, including evictable cached ones)."""
        return self.pool.num_free_blocks

    @property
    def num_admissible_blocks(self) -> int:
        """Blocks a *new* sequence could take now (windows reserved for running prefixes excluded)."""
        return self.pool.num_admissible_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by sequences."""
        return self.pool.usage

    @property
    def stats(self) -> KVCacheStats:
        """Queried / hit prompt tokens and other counters since start."""
        self._stats.retention = self.retention.stats()
        return self._stats

    @property
    def num_sequences(self) -> int:
        """Sequences currently holding blocks."""
        return len(self._seqs)

    def blocks_needed_when_empty(self, num_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` tokens holds at its peak (seed-001 bounds)."""
        return sum(g.whole_sequence_blocks(num_tokens) for g in self.groups)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens fits in the empty pool."""
        if num_tokens > self.max_model_len:
            return False
        return self.blocks_needed_when_empty(num_tokens) <= self.layout.num_blocks - 1

    def block_table(self, seq_id: str) -> tuple[tuple[int, ...], ...]:
        """The sequence's block ids, one tuple per group (0 = null block)."""
        if seq_id not in self._seqs:
            raise UnknownSequenceError(f"sequence {seq_id!r} holds no blocks")
        return tuple(tuple(g.tables.get(seq_id, ())) for g in self.groups)

    def lookup(self, seq: Sequence) -> CacheHit:
        """The longest prefix every group can serve from the cache. No side effects."""
        self._check_sequence(seq)
        if not self.enable_prefix_caching or seq.seq_id in self._seqs:
            return CacheHit(seq.seq_id, 0, tuple(() for _ in self.groups))
        return self.coordinator.find_hit(seq)

    # ------------------------------------------------------------------ allocate
    def allocate(
        self,
        seq: Sequence,
        num_new_tokens: int,
        hit: CacheHit | None = None,
        num_external_tokens: int = 0,
        num_lookahead_tokens: int = 0,
        *,
        whole_sequence_must_fit: bool = False,
    ) -> tuple[list[int], ...] | None:
        """Blocks for the next step of ``seq``: new block ids per group, or None if they do not fit.

        In order: free blocks the windows no longer need, count the blocks needed, check them
        against the free blocks, adopt the hit in every group (two-phase), allocate for the
        external and the new tokens, register the full blocks this step computes.
        """
        try:
            idle = self._idle_until.get(seq)  # set only while this very object is running
        except TypeError:  # unhashable: not a Sequence, the checks below say so
            idle = None
        if idle is not None and hit is None and not num_external_tokens and not whole_sequence_must_fit:
            return self._grow(seq, idle, num_new_tokens, num_lookahead_tokens)
        self._check_sequence(seq)
        for name, count in (("num_new_tokens", num_new_tokens), ("num_external_tokens", num_external_tokens),
                            ("num_lookahead_tokens", num_lookahead_tokens)):
            if type(count) is not int or count < 0:
                _check_count(name, count)
        sid = seq.seq_id
        running = sid in self._seqs
        if running:
            if self._seqs[sid] is not seq:
                raise InvalidInputError(f"another Sequence object with id {sid!r} is already running")
            if hit is not None and (hit.num_tokens or any(hit.block_ids)):
                raise InvalidInputError(
                    f"sequence {sid!r} is running: a cache hit can only be passed at its first allocation"
                )
            if num_external_tokens:
                raise InvalidInputError(
                    f"sequence {sid!r} is running: external tokens can only be loaded at its first allocation"
                )
            computed = seq.num_computed_tokens
            hit_blocks: list[list[int]] = [[] for _ in self.groups]
        else:
            if seq.num_computed_tokens:
                raise InvalidInputError(
                    f"sequence {sid!r} holds no blocks but num_computed_tokens={seq.num_computed_tokens}; "
                    f"reset it to 0 after a free or preemption"
                )
            if hit is None:
                hit = CacheHit(sid, 0, tuple(() for _ in self.groups))
            self._check_hit(seq, hit)
            computed = hit.num_tokens
            hit_blocks = [list(ids) for ids in hit.block_ids]
        known = computed + num_external_tokens + num_new_tokens
        if known > seq.num_tokens:
            raise InvalidInputError(
                f"sequence {sid!r}: {computed} computed + {num_external_tokens} external + "
                f"{num_new_tokens} new tokens exceed its {seq.num_tokens} tokens"
            )
        total = known + num_lookahead_tokens
        groups = self.groups
        pool = self.pool

        # 1. Free what the windows no longer need (before counting: it is what makes room).
        if running:
            self._drop_windows(seq, computed)
        else:
            hit_blocks = [g.adoptable(blocks, computed + num_external_tokens) if blocks else blocks
                          for g, blocks in zip(groups, hit_blocks)]
            for g in groups:
                g.prepare(seq)

        # 2. Count. 3. Check.
        need = 0
        for g, blocks in zip(groups, hit_blocks):
            step = g.num_new_blocks(sid, blocks, computed, num_external_tokens, total)
            if whole_sequence_must_fit:
                held = g.held_blocks(sid) if running else len(blocks) - blocks.count(NULL_BLOCK)
                step = max(step, g.whole_sequence_blocks(seq.num_tokens + num_lookahead_tokens) - held)
            need += step
        if running:
            available = pool.num_free_blocks
        else:
            # Null entries lead a hit (window hits are mostly null): a list without one is kept as is.
            live = [blocks if not blocks or blocks[0] else list(filter(None, blocks)) for blocks in hit_blocks]
            free = [pool.unreferenced(blocks) for blocks in live]
            if len(live) == 1:
                need += pool.admission_cost(live[0], free[0])
            else:
                need += pool.admission_cost(list(chain.from_iterable(live)), list(chain.from_iterable(free)))
            available = pool.num_admissible_blocks
        if need > available:
            self._stats.allocation_failures += 1
            return None

        # 4. Adopt the hit in every group before any group allocates (seed 002).
        if not running:
            self.coordinator.adopt(seq, hit_blocks, live, free)
            self._seqs[sid] = seq
        # 5. Allocate: external tokens first (phase 2), then new tokens.
        allow_reserved = running
        new_blocks: tuple[list[int], ...]
        if num_external_tokens:
            new_blocks = tuple(
                g.extend(sid, computed + num_external_tokens, computed + num_external_tokens,
                         allow_reserved=allow_reserved)
                for g in groups
            )
            for out, g in zip(new_blocks, groups):
                out.extend(g.extend(sid, computed + num_external_tokens, total, allow_reserved=allow_reserved))
        else:
            new_blocks = tuple(g.extend(sid, computed, total, allow_reserved=allow_reserved) for g in groups)
        # 6. Register the full blocks this step computes.
        self._register(seq, known)
        self._idle_until[seq] = self._idle_limit(sid)
        if not running:
            st = self._stats
            st.admissions += 1
            st.queried_tokens += seq.num_tokens
            st.hit_tokens += computed
            st.external_tokens += num_external_tokens
            assert hit is not None
            self.retention.on_admit(seq, hit)
        return new_blocks

    def _grow(self, seq: Sequence, idle: int, num_new_tokens: int,
              num_lookahead_tokens: int) -> tuple[list[int], ...] | None:
        """``allocate`` for a running sequence whose steps are idle up to ``idle`` slots: the per-step
        path (decodes, prefill chunks), kept lean."""
        if (type(num_new_tokens) is not int or num_new_tokens < 0
                or type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0):
            _check_count("num_new_tokens", num_new_tokens)
            _check_count("num_lookahead_tokens", num_lookahead_tokens)
        sid = seq.seq_id
        computed = seq.num_computed_tokens
        known = computed + num_new_tokens
        num_tokens = seq.num_tokens
        if known > num_tokens or not computed >= 0 or num_tokens > self.max_model_len:
            self._check_sequence(seq)
            raise InvalidInputError(
                f"sequence {sid!r}: {computed} computed + {num_new_tokens} new tokens exceed its "
                f"{num_tokens} tokens"
            )
        total = known + num_lookahead_tokens
        if total <= idle and num_new_tokens:
            return self._no_new_blocks()
        if self._droppers:
            self._drop_windows(seq, computed)
        # Count every group's need before any group allocates (a failed step allocates nothing).
        grow = [g.grow_range(sid, computed, total) for g in self.groups]
        need = sum(map(len, grow))
        if need and need > self.pool.num_free_blocks:
            self._stats.allocation_failures += 1
            return None
        new_blocks = tuple([g.grow(sid, indices, allow_reserved=True) for g, indices in zip(self.groups, grow)])
        self._register(seq, known)
        self._idle_until[seq] = self._idle_limit(sid)
        return new_blocks

    def _idle_limit(self, sid: str) -> int:
        """Slot count up to which the next steps of ``sid`` have nothing to do in any group."""
        limit = NEVER
        for g in self.groups:
            group_limit = g.idle_limit(sid)
            limit = group_limit if group_limit < limit else limit
        return limit

    def _drop_windows(self, seq: Sequence, computed: int) -> None:
        """Release the blocks every window has left behind once ``computed`` tokens are in."""
        for g in self._droppers:
            freed = g.remove_skipped(seq.seq_id, computed)
            if freed:
                self.retention.release_dropped(g, seq, freed)

    def _register(self, seq: Sequence, known: int) -> None:
        """Enter into the prefix cache the full blocks of the first ``known`` tokens."""
        if not self.enable_prefix_caching:
            return
        sid = seq.seq_id
        for g in self.groups:
            # Hashes are only fetched when the step completes a block (a decode rarely does).
            if g.caching and known // g.block_size > g.num_cached[sid]:
                g.cache_full_blocks(sid, self.coordinator.hashes(seq, g), known)

    # ------------------------------------------------------------------ free
    def free(self, seq: Sequence | str) -> None:
        """Release every block of the sequence (finished or preempted). Idempotent."""
        sid = seq if isinstance(seq, str) else seq.seq_id
        stored = self._seqs.pop(sid, None)
        if stored is not None:
            self._idle_until.pop(stored, None)
        tables = [g.pop_table(sid) for g in self.groups]
        if stored is not None:
            self.retention.release_sequence(stored, tables)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (and nothing changes) while any sequence holds blocks."""
        if self._seqs or not self.pool.reset_prefix_cache():
            return False
        self.retention.reset()
        return True

    def reset_stats(self) -> None:
        """Zero the counters."""
        self._stats = KVCacheStats()

    def take_events(self) -> list[KVCacheEvent]:
        """Cache events (stored, removed, cleared) since the last call; needs ``enable_events``."""
        return self.pool.take_events()

    # ------------------------------------------------------------------ validation
    def _check_sequence(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence):
            raise InvalidInputError(f"expected a hybridkv.Sequence, got {type(seq).__name__}")
        if seq.num_tokens > self.max_model_len:
            raise SequenceTooLongError(
                f"sequence {seq.seq_id!r} has {seq.num_tokens} tokens; max_model_len is {self.max_model_len}"
            )
        if not 0 <= seq.num_computed_tokens <= seq.num_tokens:
            raise InvalidInputError(
                f"sequence {seq.seq_id!r}: num_computed_tokens={seq.num_computed_tokens} is outside "
                f"0..{seq.num_tokens}"
            )

    def _check_hit(self, seq: Sequence, hit: CacheHit) -> None:
        if not isinstance(hit, CacheHit):
            raise InvalidInputError(f"hit must be a CacheHit from lookup(), got {type(hit).__name__}")
        if hit.seq_id != seq.seq_id:
            raise InvalidInputError(f"the hit was looked up for {hit.seq_id!r}, not {seq.seq_id!r}")
        if hit.num_tokens and (hit.num_tokens >= seq.num_tokens or len(hit.block_ids) != len(self.groups)):
            raise InvalidInputError(
                f"hit of {hit.num_tokens} tokens does not fit sequence {seq.seq_id!r} of {seq.num_tokens} tokens"
            )
        if hit.epoch == self.pool.evictions:
            return  # nothing was evicted since the lookup: the hit blocks still hold their prefix
        for g, ids in zip(self.groups, hit.block_ids):
            if not ids:
                continue
            hashes = self.coordinator.hashes(seq, g)
            # C-speed comparison of the non-null hit blocks' hashes with the sequence's.
            held = list(map(self.pool.block_hash.__getitem__, filter(None, ids)))
            if len(ids) > len(hashes) or held != list(compress(hashes, ids)):
                raise InvalidInputError(
                    f"hit blocks of group {g.group} no longer hold this prefix (evicted since the lookup): "
                    f"look the sequence up again"
                )

    # ------------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Raise AssertionError with a precise message on any broken invariant."""
        self.pool.check_invariants()
        refs: Counter[int] = Counter()
        for g in self.groups:
            assert set(g.tables) <= set(self._seqs), f"group {g.group} has tables of unknown sequences"
            for sid, table in g.tables.items():
                live = [b for b in table if b != NULL_BLOCK]
                assert len(live) == len(set(live)), f"sequence {sid!r} has a block twice in group {g.group}"
                refs.update(live)
                for b in live:
                    h = self.pool.block_hash[b]
                    if h is not None:
                        assert self.pool._block_group[b] == g.group, (
                            f"block {b} of group {g.group} is cached under group {self.pool._block_group[b]}"
                        )
                assert g.num_cached.get(sid, 0) <= len(table), f"{sid!r}: num_cached past the table"
                seq = self._seqs[sid]
                if g.caching:
                    hashes = self.coordinator.hashes(seq, g)
                    for i in range(min(g.num_cached.get(sid, 0), len(hashes))):
                        b = table[i]
                        h = self.pool.block_hash[b] if b != NULL_BLOCK else None
                        assert b == NULL_BLOCK or h is None or h == hashes[i], (
                            f"sequence {sid!r} group {g.group} block {b} at index {i} holds another prefix"
                        )
        for b in range(1, self.pool.num_blocks):
            r = self.pool.ref_cnt[b]
            assert r == refs.get(b, 0), f"block {b}: ref_cnt {r} but {refs.get(b, 0)} table references"
            assert r <= 1 or self.pool.block_hash[b] is not None, (
                f"block {b} is in {r} tables without being cached (only hits may share blocks)"
            )
        for sid in self._seqs:
            assert any(sid in g.tables for g in self.groups) or not self.groups, f"{sid!r} has no tables"
            seq = self._seqs[sid]
            assert self._idle_until.get(seq, NEVER) <= self._idle_limit(sid), f"{sid!r}: idle limit too high"
        assert len(self._idle_until) <= len(self._seqs) and all(
            self._seqs.get(seq.seq_id) is seq for seq in self._idle_until
        ), "idle limits of sequences that hold no blocks"

    def __repr__(self) -> str:
        return (
            f"KVCacheManager(num_blocks={self.layout.num_blocks}, groups={len(self.groups)}, "
            f"free={self.num_free_blocks}, sequences={len(self._seqs)}, retention={self.retention.name!r})"
        )

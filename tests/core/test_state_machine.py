"""Property-based and stateful tests of the KV-cache manager and the block pool.

* ``TestKVCacheManagerStateMachine`` drives ``KVCacheManager`` on random hybrid layouts (1-4
  groups of full, sliding-window, chunked-local, Mamba and cross attention, block sizes 4/8/16,
  small pools, both retention policies) through admissions with prefix hits and external
  tokens, chunked prefill, decode, finish, preemption and cache resets. Every step is checked
  against an independent model of the expected hit, block tables and free-block accounting,
  and ``check_invariants()`` runs after every step.
  Speculative decode steps allocate up to 8 draft slots, accept a random number of them and
  release the rest (``release_lookahead``); on a recurrent state (within one block of it) the states
  at the boundaries accepted drafts cross are registered, never one a rejected draft reached.
* ``TestBlockPoolStateMachine`` drives ``BlockPool`` directly against a full model of its free
  tiers (uncached, fresh, low, lru, retained), reference counts, hash index and events.
* Focused properties: cache salts; minimal reproductions of the bugs the machines found.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hybridkv import (
    AllBlocksCleared,
    BlockHasher,
    BlockPool,
    BlockRemoved,
    BlockStored,
    CacheHit,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    InvalidInputError,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheManager,
    KVCacheSpec,
    MambaSpec,
    Sequence,
    SlidingWindowSpec,
    UnknownSequenceError,
)
from hybridkv.core.hashing import encode_extra_keys
from hybridkv.core.retention import KeptBlocks

VOCAB = 4  # a tiny vocabulary: random suffixes collide, so prefix hits really happen
BLOCK_SIZES = (4, 8, 16)  # they divide each other: the hit alignment is the largest one
MAX_RUNNING = 6
NULL = 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class GroupCfg:
    """One KV-cache group of a generated layout, with the parameters the model needs."""

    kind: str  # full | sliding | chunked | mamba_align | mamba_none | cross
    block_size: int
    window: int = 0
    chunk: int = 0
    max_encoder_len: int = 0
    part: int = 0
    parts: int = 1
    """A recurrent state spread over ``parts`` pages: this group holds page ``part``."""

    def spec(self) -> KVCacheSpec:
        attn: dict[str, Any] = {"block_size": self.block_size, "num_kv_heads": 1, "head_size": 8}
        if self.kind == "full":
            return FullAttentionSpec(**attn)
        if self.kind == "sliding":
            return SlidingWindowSpec(**attn, sliding_window=self.window)
        if self.kind == "chunked":
            return ChunkedLocalAttentionSpec(**attn, attention_chunk_size=self.chunk)
        if self.kind == "cross":
            return CrossAttentionSpec(**attn, max_encoder_len=self.max_encoder_len)
        mode = "align" if self.kind == "mamba_align" else "none"
        return MambaSpec(block_size=self.block_size, state_bytes=64 * self.parts, mode=mode,
                         state_part=self.part, state_parts=self.parts)

    @property
    def constrains_hits(self) -> bool:
        return self.kind != "cross"

    @property
    def cacheable(self) -> bool:
        return self.kind in ("full", "sliding", "chunked", "mamba_align")

    def skip_blocks(self, num_computed: int) -> int:
        """Leading table entries that must be null once ``num_computed`` tokens are in."""
        bs = self.block_size
        if self.kind == "sliding":
            return max(0, num_computed - self.window + 1) // bs
        if self.kind == "chunked":
            return (num_computed // self.chunk) * self.chunk // bs
        if self.kind == "mamba_align":
            return max(0, num_computed - 1) // bs
        return 0

    def hit_first_block(self, n: int) -> int:
        """First block a hit of ``n`` tokens (n > 0) must hold: the KV the next token reads."""
        bs = self.block_size
        if self.kind == "sliding":
            return max(0, n - self.window + 1) // bs
        if self.kind == "chunked":
            return (n // self.chunk) * self.chunk // bs
        if self.kind == "mamba_align":
            return n // bs - 1
        return 0


@dataclass(frozen=True)
class ManagerCfg:
    groups: tuple[GroupCfg, ...]
    num_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    retention: str
    caching: bool

    def build(self) -> KVCacheManager:
        names: list[str] = []
        for i, g in enumerate(self.groups):
            names.append(names[-1] if g.part else f"layers.{i}")  # a state's pages share its layer
        layout = KVCacheLayout(
            num_blocks=self.num_blocks,
            groups=tuple(KVCacheGroup(g.spec(), (n,)) for g, n in zip(self.groups, names)),
        )
        return KVCacheManager(layout, self.max_model_len, self.max_num_batched_tokens, self.caching,
                              retention=self.retention)


KIND_CHOICES = ("full", "full", "sliding", "sliding", "sliding", "chunked", "chunked", "mamba_align",
                "mamba_align", "mamba_none", "cross")


@st.composite
def group_cfgs(draw: st.DrawFn, kinds: tuple[str, ...] = KIND_CHOICES) -> GroupCfg:
    kind = draw(st.sampled_from(kinds))
    bs = draw(st.sampled_from(BLOCK_SIZES))
    if kind == "sliding":
        return GroupCfg(kind, bs, window=draw(st.integers(2, 48)))
    if kind == "chunked":
        return GroupCfg(kind, bs, chunk=bs * draw(st.integers(1, 4)))
    if kind == "cross":
        return GroupCfg(kind, bs, max_encoder_len=draw(st.integers(1, 24)))
    return GroupCfg(kind, bs)


@st.composite
def manager_cfgs(draw: st.DrawFn) -> ManagerCfg:
    # Mostly a full-attention group first (the anchor of retention), then up to three of any kind.
    first = draw(group_cfgs(kinds=("full", "full", "full", "sliding", "chunked", "mamba_align")))
    groups = []
    for g in [first, *draw(st.lists(group_cfgs(), max_size=3))]:
        # A recurrent state sometimes spans several pages, one group each (plan_layout's split).
        parts = draw(st.sampled_from((1, 1, 2, 3))) if g.kind == "mamba_align" else 1
        groups += [replace(g, part=j, parts=parts) for j in range(parts)]
    max_model_len = draw(st.integers(48, 128))
    return ManagerCfg(
        groups=tuple(groups),
        num_blocks=draw(st.one_of(st.integers(8, 40), st.integers(41, 200))),
        max_model_len=max_model_len,
        max_num_batched_tokens=draw(st.one_of(st.integers(4, 32), st.just(max_model_len))),
        retention=draw(st.sampled_from(("none", "window"))),
        caching=draw(st.sampled_from((True,) * 9 + (False,))),
    )


def expected_hashes(tokens: list[int], salt: str | None, unit: int, block_size: int) -> list[bytes]:
    """Chained block hashes of ``tokens`` at ``block_size``, computed at the ``unit`` granularity."""
    base: list[bytes] = []
    BlockHasher("sha256").hash_full_blocks(tokens, unit, base, encode_extra_keys(salt, None))
    k = block_size // unit
    return base[k - 1 :: k]


def pool_state(pool: BlockPool) -> tuple[Any, ...]:
    """Everything the pool's future behaviour depends on, eviction order included (white box)."""
    kept = pool.kept
    assert kept is None or isinstance(kept, KeptBlocks)
    return (
        tuple(pool.ref_cnt),
        tuple(pool.block_hash),
        bytes(pool._queue),
        tuple(pool._uncached),
        pool._next_fresh,
        tuple(pool._low),
        tuple(pool._lru),
        tuple(kept.kept.items()) if kept else (),
        tuple((a, tuple(w)) for a, w in kept.by_anchor.items()) if kept else (),
        kept.num_reserved if kept else 0,
        repr(pool.index),
        repr(pool._dups),
        pool.evictions,
    )


# ---------------------------------------------------------------------------------- manager machine
class KVCacheManagerMachine(RuleBasedStateMachine):
    """The manager against a model of hits, block tables and free-block accounting."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr: KVCacheManager | None = None
        self.running: dict[str, Sequence] = {}
        self.waiting: dict[str, Sequence] = {}  # preempted, or admission failed: num_computed 0
        self.history: list[tuple[list[int], str | None]] = []
        self.next_id = 0
        self.expected_stats = {"admissions": 0, "queried_tokens": 0, "hit_tokens": 0, "external_tokens": 0,
                               "allocation_failures": 0, "readmissions": 0, "readmitted_queried_tokens": 0,
                               "readmitted_hit_tokens": 0, "readmitted_external_tokens": 0}
        self.marked: set[str] = set()  # freed with preempted=True and not admitted or freed since

    # ------------------------------------------------------------------ setup
    @initialize(cfg=manager_cfgs(),
                prefixes=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=16, max_size=64), min_size=1,
                                  max_size=3))
    def build(self, cfg: ManagerCfg, prefixes: list[list[int]]) -> None:
        self.cfg = cfg
        self.groups = cfg.groups
        self.mgr = cfg.build()
        self.pool = self.mgr.pool
        self.prefixes = prefixes
        self.mml = cfg.max_model_len
        self.mnbt = cfg.max_num_batched_tokens
        cacheable = [g.block_size for g in self.groups if g.cacheable and cfg.caching]
        self.hash_unit = math.gcd(*cacheable) if cacheable else 1
        self.align = math.lcm(*[g.block_size for g in self.groups if g.constrains_hits])
        self.bounds = [g.spec().max_blocks_per_request(self.mnbt, self.mml) for g in self.groups]
        self.max_encoder_len = min((g.max_encoder_len for g in self.groups if g.kind == "cross"), default=0)
        # What each block holds, as the engine would have written it: block -> the hash of its
        # content (the prefix chain for KV, the prefix a Mamba state is the state after), or None
        # while it is incomplete. A block may only be cached under the hash of what it holds.
        self.contents: dict[int, bytes | None] = {}
        # Window retention's anchor group (the first cached full-attention group) and the junctions
        # it remembers (anchor hashes), and each sequence's planned Mamba checkpoints (position, rank).
        self.anchor = next((gi for gi, g in enumerate(self.groups) if g.kind == "full" and cfg.caching), None)
        self.junctions: set[bytes] = set()
        self.plans: dict[str, list[tuple[int, int]]] = {}
        # Sequences whose last step had draft slots and no release_lookahead: their next step first
        # frees the recurrent entries past the verified tokens.
        self.unreleased: set[str] = set()
        self.checkpoint_blocks = min((g.spec().checkpoint_blocks for g in self.groups  # type: ignore[attr-defined]
                                      if g.kind == "mamba_align"), default=0)

    # ------------------------------------------------------------------ helpers
    def _hashes(self, seq: Sequence) -> list[list[bytes]]:
        return [expected_hashes(seq.token_ids, seq.cache_salt, self.hash_unit, g.block_size) if g.cacheable
                else [] for g in self.groups]

    def _cached(self, gi: int, h: bytes) -> bool:
        return self.pool.get_cached_block(gi, h) is not None

    def _servable(self, gi: int, hashes: list[bytes], n: int) -> bool:
        """Can group ``gi`` serve a hit of ``n`` tokens from the cache (by its kind's rule)?"""
        g = self.groups[gi]
        if g.kind == "mamba_none":
            return False
        nb = n // g.block_size
        return all(self._cached(gi, hashes[i]) for i in range(g.hit_first_block(n), nb))

    def _expected_hit(self, seq: Sequence, hashes: list[list[bytes]]) -> tuple[int, int, int]:
        """(hit, full-attention-only hit, max hit) by brute force over aligned lengths."""
        max_hit = (seq.num_tokens - 1) // self.align * self.align
        constraining = [gi for gi, g in enumerate(self.groups) if g.constrains_hits]
        full = [gi for gi in constraining if self.groups[gi].kind == "full"]
        full_hit = next((n for n in range(max_hit, 0, -self.align)
                         if all(self._servable(gi, hashes[gi], n) for gi in full)), 0)
        hit = next((n for n in range(full_hit, 0, -self.align)
                    if all(self._servable(gi, hashes[gi], n) for gi in constraining)), 0)
        return hit, full_hit, max_hit

    def _check_hit(self, seq: Sequence, hit: CacheHit, hashes: list[list[bytes]]) -> None:
        n = hit.num_tokens
        assert hit.seq_id == seq.seq_id
        assert 0 <= n < seq.num_tokens, f"hit of {n} tokens for a sequence of {seq.num_tokens}"
        assert len(hit.block_ids) == len(self.groups)
        for g in self.groups:
            if g.constrains_hits:
                assert n % g.block_size == 0, f"hit {n} is not a multiple of block size {g.block_size}"
        if not self.cfg.caching:
            assert n == 0 and all(ids == () for ids in hit.block_ids)
            return
        expected, full_hit, max_hit = self._expected_hit(seq, hashes)
        assert n == expected, f"hit of {n} tokens, the longest every group can serve is {expected}"
        assert hit.full_hit_tokens == full_hit, f"full_hit_tokens {hit.full_hit_tokens} != {full_hit}"
        assert hit.max_hit_tokens == max_hit
        for gi, (g, ids) in enumerate(zip(self.groups, hit.block_ids)):
            if n == 0 or not g.constrains_hits:
                assert ids == (), f"group {gi}: hit of {n} tokens carries blocks {ids}"
                continue
            assert len(ids) == n // g.block_size, f"group {gi}: {len(ids)} hit blocks for {n} tokens"
            first = g.hit_first_block(n)
            for i, b in enumerate(ids):
                if i < first:
                    assert b == NULL, f"group {gi}: hit block {b} at {i} is outside the window (from {first})"
                    continue
                assert b != NULL, f"group {gi}: the hit lacks block {i} the next token reads"
                assert self.pool.block_hash[b] == hashes[gi][i], f"group {gi}: hit block {b} holds another prefix"
                assert b == self.pool.get_cached_block(gi, hashes[gi][i]), f"group {gi}: hit block {b} not cached"
            if g.kind == "full":  # exactly the cached chain for this prefix
                want = tuple(self.pool.get_cached_block(gi, h) for h in hashes[gi][: n // g.block_size])
                assert ids == want, f"full group {gi}: hit {ids} but the cached chain is {want}"

    def _chosen(self, plan: list[tuple[int, int]], start: int, end: int) -> list[int]:
        """The planned Mamba checkpoints a step over ``[start, end)`` writes: strictly inside, at most
        ``checkpoint_blocks``, junctions (rank 0) before the prompt's end (rank 1), latest first."""
        inside = sorted((rank, -p) for p, rank in plan if start < p < end)[: self.checkpoint_blocks]
        return sorted(-q for _, q in inside)

    def _mamba_plan(self, seq: Sequence, hit: CacheHit, hashes: list[list[bytes]], start: int) -> list[tuple[int, int]]:
        """Checkpoints an admitted sequence plans: junctions (the lookup's, remembered ones) and its
        checkpoint hints (rounded down to the alignment), then the prompt's last aligned boundary, in
        ``(start, prompt end]``."""
        if not self.cfg.caching or not any(g.kind == "mamba_align" for g in self.groups):
            return []
        end = (seq.num_prompt_tokens - 1) // self.align * self.align
        if end <= start:
            return []
        ranks = {end: 1}
        if self.anchor is not None and self.cfg.retention == "window":
            bs = self.groups[self.anchor].block_size
            h = hashes[self.anchor]
            for i in range(start // bs, min(end // bs, len(h))):
                if h[i] in self.junctions and (i + 1) * bs % self.align == 0:
                    ranks[(i + 1) * bs] = 0
        for p in {h // self.align * self.align for h in seq.checkpoint_hints}:
            if start < p <= end:
                ranks[p] = 0
        if start < hit.full_hit_tokens <= end:
            ranks[hit.full_hit_tokens] = 0
        return sorted(ranks.items())

    def _new_count(self, gi: int, length: int, computed: int, total: int, first_alloc: bool, enc: int,
                   external_end: int = 0, known: int = 0, plan: list[tuple[int, int]] = ()) -> int:  # type: ignore[assignment]
        """Fresh blocks group ``gi`` needs to hold ``total`` slots (table of ``length`` entries).

        ``external_end`` (> 0 when external tokens are loaded) is where the external tokens end:
        a Mamba "align" group then needs a state for it as well as one for the step's end (the
        lookahead slots' end: the accepted drafts may end there) and one per planned checkpoint.
        """
        g = self.groups[gi]
        bs = g.block_size
        if g.kind == "cross":
            return cdiv(enc, bs) if first_alloc else 0
        if g.kind == "mamba_none":
            return 1 if length == 0 else 0
        if g.kind == "mamba_align":
            out: list[int] = []
            if external_end:
                out.append(cdiv(external_end, bs) - 1)
                length = max(length, cdiv(external_end, bs))
            out += [p // bs - 1 for p in self._chosen(plan, computed, total) if p // bs > length]
            end = cdiv(total, bs)
            if end > length and (not out or out[-1] < end - 1):
                out.append(end - 1)
            return len(out)
        return max(0, cdiv(total, bs) - max(length, g.skip_blocks(computed)))

    def _whole_blocks(self, gi: int, num_tokens: int) -> int:
        """The admission bound: the spec's own per-request peak, as pool sizing counts it."""
        return self.groups[gi].spec().blocks_for_tokens(num_tokens, self.mnbt, self.mml)

    def _length(self, gi: int, length: int, total: int, actual: int, known: int) -> int:
        """Table length once ``total`` slots (``known`` tokens) are allocated (cross / no-cache Mamba:
        checked by shape; a Mamba state with checkpoints has an entry for every end the drafts allow)."""
        g = self.groups[gi]
        if g.kind in ("cross", "mamba_none"):
            return actual
        return max(length, cdiv(total, g.block_size))

    def _check_table(self, gi: int, table: tuple[int, ...], computed: int, length: int, enc: int) -> None:
        """Shape of group ``gi``'s table once ``computed`` tokens are in and ``length`` entries exist."""
        g = self.groups[gi]
        assert len(table) == length, f"group {gi}: table of {len(table)} entries, expected {length}"
        held = sum(1 for b in table if b != NULL)
        assert held <= self.bounds[gi], f"group {gi}: {held} blocks held, the per-request bound is {self.bounds[gi]}"
        if g.kind == "cross":
            assert len(table) == cdiv(enc, g.block_size) and NULL not in table
            return
        if g.kind == "mamba_none":
            assert len(table) == 1 and table[0] != NULL
            return
        skip = g.skip_blocks(computed)
        if g.kind == "mamba_align":
            assert all(b == NULL for b in table[:skip]), f"group {gi}: superseded states kept in {table}"
            assert table[-1] != NULL, f"group {gi}: no running state in {table}"
            return
        for i, b in enumerate(table):
            # sliding / chunked: null exactly before the window; full attention: never null.
            assert (b == NULL) == (i < skip), (
                f"group {gi} ({g.kind}): entry {i} is {b} with {computed} computed tokens "
                f"(null expected exactly below {skip}): {table}"
            )

    def _record_contents(self, seq: Sequence, tables: tuple[tuple[int, ...], ...], result: tuple[list[int], ...],
                         known: int, external_end: int, checkpoints: list[int] = ()) -> None:  # type: ignore[assignment]
        """What the step wrote: KV of the first ``known`` tokens, Mamba states at the phase ends."""
        for b in (b for got in result for b in got):
            self.contents.pop(b, None)  # reused: its old content is gone
        if not self.cfg.caching:
            return
        hashes = self._hashes(seq)
        for gi, (g, table) in enumerate(zip(self.groups, tables)):
            bs = g.block_size
            if g.kind in ("full", "sliding", "chunked"):
                for i, b in enumerate(table):
                    if b != NULL:
                        self.contents[b] = hashes[gi][i] if (i + 1) * bs <= known else None
            elif g.kind == "mamba_align":
                # A state is the checkpoint of a boundary only if it is the state after exactly it.
                for end in ([external_end] if external_end else []) + list(checkpoints) + [known]:
                    self.contents[table[cdiv(end, bs) - 1]] = hashes[gi][end // bs - 1] if end % bs == 0 else None
            else:
                self.contents.update((b, None) for b in table if b != NULL)

    def _tables(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        assert self.mgr is not None
        return {sid: self.mgr.block_table(sid) for sid in self.running}

    def _check_stats(self) -> None:
        assert self.mgr is not None
        st_ = self.mgr.stats
        got = {k: getattr(st_, k) for k in self.expected_stats}
        assert got == self.expected_stats, f"stats {got} != {self.expected_stats}"

    def _new_sequence(self, data: st.DataObject) -> Sequence:
        if self.history and data.draw(st.integers(0, 3), label="repeat a prompt") == 0:
            tokens, salt = data.draw(st.sampled_from(self.history), label="repeated prompt")
            tokens = list(tokens)
        else:
            prefix = data.draw(st.sampled_from(self.prefixes), label="prefix")
            suffix = data.draw(st.lists(st.integers(0, VOCAB - 1), max_size=32), label="suffix")
            tokens = (prefix + suffix)[: self.mml] or [0]
            salt = data.draw(st.sampled_from((None, None, None, "tenant-b")), label="salt")
            self.history.append((tokens, salt))
        enc = data.draw(st.integers(0, self.max_encoder_len), label="encoder tokens") if self.max_encoder_len else 0
        hints = data.draw(st.lists(st.integers(1, len(tokens)), max_size=2), label="checkpoint hints")
        self.next_id += 1
        return Sequence(f"seq-{self.next_id}", tokens, cache_salt=salt, num_encoder_tokens=enc,
                        checkpoint_hints=hints)

    # ------------------------------------------------------------------ rules
    def admit(self, data: st.DataObject) -> None:
        """lookup + allocate for a new or preempted sequence (optionally external tokens, whole fit)."""
        mgr = self.mgr
        assert mgr is not None
        if self.waiting and data.draw(st.booleans(), label="re-admit a waiting sequence"):
            seq = self.waiting.pop(data.draw(st.sampled_from(sorted(self.waiting)), label="waiting"))
        else:
            seq = self._new_sequence(data)
        assert seq.num_computed_tokens == 0
        sid = seq.seq_id
        before = pool_state(self.pool)
        hit = mgr.lookup(seq)
        assert pool_state(self.pool) == before, "lookup changed the pool"
        hashes = self._hashes(seq)
        self._check_hit(seq, hit, hashes)

        n_hit = hit.num_tokens
        remaining = seq.num_tokens - n_hit
        ext = 0
        if remaining >= 2 and data.draw(st.booleans(), label="external"):
            ext = data.draw(st.integers(1, remaining - 1), label="external tokens")
        new = self._chunk(data, remaining - ext)
        whole = data.draw(st.booleans(), label="whole_sequence_must_fit")
        computed, total = n_hit + ext, n_hit + ext + new
        enc = seq.num_encoder_tokens

        # The model: what adoption keeps, what the step needs, what it may cost.
        plan = self._mamba_plan(seq, hit, hashes, computed)
        adopted: list[tuple[int, ...]] = []
        for g, ids in zip(self.groups, hit.block_ids):
            skip = min(g.skip_blocks(computed), len(ids))
            adopted.append((NULL,) * skip + tuple(ids[skip:]))
        ref_before = before[0]
        counts = [self._new_count(gi, len(adopted[gi]), computed, total, True, enc, computed if ext else 0,
                                  n_hit + ext + new, plan) for gi in range(len(self.groups))]
        need = 0
        for gi, ids in enumerate(adopted):
            step = counts[gi]
            if whole:
                held = sum(1 for b in ids if b != NULL)
                step = max(step, self._whole_blocks(gi, seq.num_tokens) - held)
            need += step
        free_hits = {b for ids in adopted for b in ids if b != NULL and ref_before[b] == 0}
        tables_before = self._tables()
        free_before = mgr.num_free_blocks
        # Kept blocks whose anchor is held are reserved (not admissible); adopting a free hit costs
        # one admissible block, unless it is reserved already, and a free anchor that becomes held
        # turns its kept blocks that are not among the hits into reserved ones.
        kept_before, by_anchor = dict(before[7]), {a: set(w) for a, w in before[8]}
        reserved = sum(1 for a in kept_before.values() if ref_before[a] > 0)
        assert mgr.num_admissible_blocks == free_before - reserved, "admissible blocks"
        cost = sum(1 for b in free_hits if kept_before.get(b) is None or ref_before[kept_before[b]] == 0)
        cost += sum(1 for b in free_hits for w in by_anchor.get(b, ()) if w not in free_hits)

        result = mgr.allocate(seq, new, hit=hit, num_external_tokens=ext, whole_sequence_must_fit=whole)

        # When the blocks kept under the hit's anchors would leave too little, they yield (go to
        # ``low``): then only the hit blocks themselves count.
        fits = need + min(cost, len(free_hits)) <= free_before - reserved
        assert (result is not None) == fits, (
            f"allocate returned {result} with {need} blocks needed + {cost} for the hit, "
            f"{free_before} free of which {reserved} reserved"
        )
        assert self._tables() == tables_before, "admission changed a running sequence's blocks"
        if whole and not self.running and mgr.blocks_needed_when_empty(seq.num_tokens) <= self.pool.num_blocks - 1:
            assert result is not None, "a sequence that fits the idle pool was refused: it would wait for ever"
        if result is None:
            self.expected_stats["allocation_failures"] += 1
            assert pool_state(self.pool) == before, "a failed admission changed the pool"
            with pytest.raises(UnknownSequenceError):
                mgr.block_table(sid)
            assert mgr.lookup(seq) == hit, "a failed admission changed the hit"
            for g in mgr.groups:  # nothing noted for a sequence that holds no blocks
                assert sid not in getattr(g, "plans", {}) and sid not in getattr(g, "encoder_tokens", {})
            self.waiting[sid] = seq
            self._check_stats()
            return

        self.running[sid] = seq
        tables = mgr.block_table(sid)
        assert len(result) == len(self.groups)
        for gi, (table, ids, got) in enumerate(zip(tables, adopted, result)):
            assert table[: len(ids)] == ids, f"group {gi}: table {table} does not start with the hit {ids}"
            length = self._length(gi, len(ids), total, len(table), n_hit + ext + new)
            self._check_table(gi, table, computed, length, enc)
            fresh = [b for b in table[len(ids):] if b != NULL]
            assert got == fresh, f"group {gi}: allocate returned {got}, the table gained {fresh}"
            assert len(got) == counts[gi], f"group {gi}: {len(got)} new blocks, expected {counts[gi]}"
        new_blocks = [b for got in result for b in got]
        assert len(new_blocks) == len(set(new_blocks)), f"a block was handed out twice: {result}"
        for b in new_blocks:
            assert ref_before[b] == 0, f"block {b} was held (ref {ref_before[b]}) when allocated"
            assert self.pool.ref_cnt[b] == 1
        assert mgr.num_free_blocks == free_before - len(new_blocks) - len(free_hits), "free-block accounting"
        if (self.cfg.retention == "window" and self.anchor is not None
                and 0 < hit.full_hit_tokens < hit.max_hit_tokens):
            a = self.groups[self.anchor]
            self.junctions.add(hashes[self.anchor][hit.full_hit_tokens // a.block_size - 1])
        if data.draw(st.integers(0, 7), label="abort before the step runs") == 0:
            # A client gone, a preemption: freed between allocation and compute. The caller either
            # never advanced the count (0) or advanced it over the loaded external tokens.
            loaded = data.draw(st.booleans(), label="external tokens loaded") and ext > 0
            if loaded:
                self._record_contents(seq, tables, result, computed, computed, [])
            else:
                for b in new_blocks:
                    self.contents.pop(b, None)
            seq.num_computed_tokens = computed if loaded else 0
            self._count_admission(seq, n_hit, ext)
            self.running[sid] = seq
            self._release(sid, by_id=False, preempted=data.draw(st.booleans(), label="freed as preempted"))
            seq.num_computed_tokens = 0
            self.waiting[sid] = seq
            if not ext:  # (external tokens move a window past hit blocks it then need not adopt)
                assert mgr.lookup(seq).num_tokens >= n_hit, "an aborted admission took its hit out of the cache"
            return
        self._record_contents(seq, tables, result, n_hit + ext + new, computed if ext else 0,
                              self._chosen(plan, computed, n_hit + ext + new))
        self.plans[sid] = [(p, r) for p, r in plan if p > n_hit + ext + new]
        seq.num_computed_tokens = total
        self._count_admission(seq, n_hit, ext)

    def _count_admission(self, seq: Sequence, n_hit: int, ext: int) -> None:
        counts = [("admissions", 1), ("queried_tokens", seq.num_tokens), ("hit_tokens", n_hit),
                  ("external_tokens", ext)]
        if seq.seq_id in self.marked:  # a re-admission after a preemption counts in both
            self.marked.discard(seq.seq_id)
            counts += [("readmissions", 1), ("readmitted_queried_tokens", seq.num_tokens),
                       ("readmitted_hit_tokens", n_hit), ("readmitted_external_tokens", ext)]
        for key, value in counts:
            self.expected_stats[key] += value
        self._check_stats()
        assert self.mgr is not None
        st_ = self.mgr.stats
        first = st_.queried_tokens - st_.readmitted_queried_tokens
        expected = (st_.hit_tokens - st_.readmitted_hit_tokens) / first if first else 0.0
        assert st_.first_admission_hit_rate == expected

    def _step(self, seq: Sequence, n: int, lookahead: int, abort: bool = False) -> None:
        """allocate(seq, n) for a running sequence and check it against the model; with ``abort``,
        free it before the step runs (its computed count not advanced) and send it to waiting."""
        mgr = self.mgr
        assert mgr is not None
        sid = seq.seq_id
        computed = seq.num_computed_tokens
        known = computed + n
        total = known + lookahead
        before = pool_state(self.pool)
        ref_before = before[0]
        tables_before = self._tables()
        own = tables_before[sid]
        free_before = mgr.num_free_blocks
        dropped: set[int] = set()
        if sid in self.unreleased:  # the recurrent entries past the verified tokens are freed first
            self.unreleased.discard(sid)
            own = tuple(t[:cdiv(computed, g.block_size)] if g.kind == "mamba_align" else t
                        for g, t in zip(self.groups, own))
            for table, kept in zip(tables_before[sid], own):
                dropped.update(b for b in table[len(kept):] if b != NULL)
            for b in dropped:
                self.contents.pop(b, None)
        # Window drops: entries wholly before the window become null, in place.
        after_drop = []
        for g, table in zip(self.groups, own):
            skip = min(g.skip_blocks(computed), len(table))
            dropped.update(b for b in table[:skip] if b != NULL)
            after_drop.append((NULL,) * skip + table[skip:])
        freed = sum(1 for b in dropped if ref_before[b] == 1)
        plan = self.plans.get(sid, [])
        counts = [self._new_count(gi, len(own[gi]), computed, total, False, seq.num_encoder_tokens, 0, known, plan)
                  for gi in range(len(self.groups))]
        need = sum(counts)

        result = mgr.allocate(seq, n, num_lookahead_tokens=lookahead)

        tables = mgr.block_table(sid)
        for gi, (table, kept) in enumerate(zip(tables, after_drop)):
            assert table[: len(kept)] == kept, (
                f"group {gi}: table {own[gi]} became {table}; expected {kept} + appended blocks"
            )
        others = {k: v for k, v in self._tables().items() if k != sid}
        assert others == {k: v for k, v in tables_before.items() if k != sid}, "another sequence's table changed"
        if result is None:
            self.expected_stats["allocation_failures"] += 1
            assert tables == tuple(after_drop), "a failed allocate appended blocks"
            assert mgr.num_free_blocks == free_before + freed, "a failed allocate lost or took blocks"
            assert need > mgr.num_free_blocks, (
                f"allocate of a running sequence failed with {need} blocks needed and {mgr.num_free_blocks} free"
            )
            self._check_stats()
            return
        assert need <= free_before + freed
        for gi, (table, kept, got) in enumerate(zip(tables, after_drop, result)):
            length = self._length(gi, len(kept), total, len(table), known)
            self._check_table(gi, table, computed, length, seq.num_encoder_tokens)
            fresh = [b for b in table[len(kept):] if b != NULL]
            assert got == fresh, f"group {gi}: allocate returned {got}, the table gained {fresh}"
            assert len(got) == counts[gi], f"group {gi}: {len(got)} new blocks, expected {counts[gi]}"
        new_blocks = [b for got in result for b in got]
        assert len(new_blocks) == len(set(new_blocks)), f"a block was handed out twice: {result}"
        for b in new_blocks:
            assert ref_before[b] == 0 or (b in dropped and ref_before[b] == 1), f"block {b} was held when allocated"
        assert mgr.num_free_blocks == free_before + freed - len(new_blocks), "free-block accounting"
        if abort:
            for b in new_blocks:
                self.contents.pop(b, None)
            self._release(sid, by_id=True)
            seq.num_computed_tokens = 0
            self.waiting[sid] = seq
            return
        self._record_contents(seq, tables, result, known, 0, self._chosen(plan, computed, known))
        self.plans[sid] = [(p, r) for p, r in plan if p > known]
        if lookahead:
            self.unreleased.add(sid)
        seq.num_computed_tokens = known
        self._check_stats()

    def _chunk(self, data: st.DataObject, remaining: int) -> int:
        """Tokens to schedule: often all that is left (up to the batch limit), else a random part."""
        most = min(remaining, self.mnbt)
        return data.draw(st.one_of(st.just(most), st.integers(1, most)), label="tokens")

    def _lookahead(self, data: st.DataObject, seq: Sequence, n: int) -> int:
        assert self.mgr is not None
        room = min(self.mnbt - n, self.mml - seq.num_computed_tokens - n, 3, self.mgr.max_draft_tokens(n))
        if room <= 0:
            return 0
        return data.draw(st.integers(0, room), label="lookahead")

    def _prefilling(self) -> list[str]:
        return sorted(sid for sid, s in self.running.items() if s.num_computed_tokens < s.num_tokens)

    def _decodable(self) -> list[str]:
        return sorted(sid for sid, s in self.running.items()
                      if s.num_computed_tokens == s.num_tokens < self.mml)

    def continue_prefill(self, data: st.DataObject) -> None:
        """The next chunk of a running prefill (or of a decode step that did not fit)."""
        seq = self.running[data.draw(st.sampled_from(self._prefilling()), label="sequence")]
        remaining = seq.num_tokens - seq.num_computed_tokens
        n = self._chunk(data, remaining)
        abort = data.draw(st.integers(0, 7), label="abort before the step runs") == 0
        self._step(seq, n, self._lookahead(data, seq, n), abort)

    def decode(self, data: st.DataObject) -> None:
        """Append one token, then allocate(seq, 1)."""
        seq = self.running[data.draw(st.sampled_from(self._decodable()), label="sequence")]
        seq.append_token_ids([data.draw(st.integers(0, VOCAB - 1), label="token")])
        self._step(seq, 1, self._lookahead(data, seq, 1))

    def speculate(self, data: st.DataObject) -> None:
        """A speculative decode step: append the step's token, allocate it with 0..8 draft slots (within
        one block of a recurrent state with checkpoints), accept a random number of the drafts (their
        tokens appended, the count advanced over them) and release the rejected ones' slots. A
        recurrent state holds the state at the boundaries the accepted drafts crossed and at their end
        (as the engine writes them); the manager may register those only."""
        mgr = self.mgr
        assert mgr is not None
        seq = self.running[data.draw(st.sampled_from(self._decodable()), label="sequence")]
        sid = seq.seq_id
        seq.append_token_ids([data.draw(st.integers(0, VOCAB - 1), label="token")])
        room = min(8, self.mnbt - 1, self.mml - seq.num_tokens)
        if mgr.max_draft_tokens(1) < room:  # a recurrent state's block is the limit
            room = mgr.max_draft_tokens(1)
            before = pool_state(self.pool)
            tables = self._tables()
            with pytest.raises(InvalidInputError, match="recurrent state"):
                mgr.allocate(seq, 1, num_lookahead_tokens=room + 1)  # past one block of the state
            assert pool_state(self.pool) == before and self._tables() == tables, "a refused draft step changed things"
        k = data.draw(st.integers(0, max(0, room)), label="drafts")
        failures = self.expected_stats["allocation_failures"]
        self._step(seq, 1, k)  # checks the allocation against the model, advances the count over the step's token
        if self.expected_stats["allocation_failures"] > failures:
            return  # did not fit: the sequence stays as it was (the scheduler retries without drafts)
        known = seq.num_computed_tokens
        accepted = data.draw(st.integers(0, k), label="accepted")
        seq.append_token_ids(data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=accepted, max_size=accepted),
                                       label="accepted tokens"))
        seq.num_computed_tokens += accepted
        if data.draw(st.integers(0, 5), label="keep the draft slots") == 0:
            # A caller may keep the slots (the next steps write them again): nothing is freed.
            self._record_contents(seq, mgr.block_table(sid), (), seq.num_computed_tokens, 0,
                                  list(range(known + 1, seq.num_computed_tokens)))
            return
        own = mgr.block_table(sid)
        others = {k_: v for k_, v in self._tables().items() if k_ != sid}
        ref_before = list(self.pool.ref_cnt)
        free_before = mgr.num_free_blocks
        freed = mgr.release_lookahead(seq)
        self.unreleased.discard(sid)
        tables = mgr.block_table(sid)
        expected = []
        for g, table in zip(self.groups, own):
            keep = cdiv(seq.num_computed_tokens, g.block_size) if g.kind != "cross" else len(table)
            expected.append(table[:keep])
        assert tables == tuple(expected), f"release_lookahead left {tables}, expected {tuple(expected)}"
        gone = [b for table, kept in zip(own, tables) for b in table[len(kept):] if b != NULL]
        assert freed == len(gone), f"release_lookahead reported {freed} blocks, freed {gone}"
        for b in gone:
            assert ref_before[b] == 1 and self.pool.ref_cnt[b] == 0, f"draft block {b} shared or not released"
            assert self.pool.block_hash[b] is None, f"draft block {b} was cached"
            self.contents.pop(b, None)
        assert mgr.num_free_blocks == free_before + freed, "free-block accounting"
        assert {k_: v for k_, v in self._tables().items() if k_ != sid} == others, "another sequence's table changed"
        self._record_contents(seq, tables, (), seq.num_computed_tokens, 0,
                              list(range(known + 1, seq.num_computed_tokens)))

    def _release(self, sid: str, by_id: bool, preempted: bool = False) -> Sequence:
        mgr = self.mgr
        assert mgr is not None
        seq = self.running.pop(sid)
        self.plans.pop(sid, None)
        self.unreleased.discard(sid)
        ref_before = list(self.pool.ref_cnt)
        own = mgr.block_table(sid)
        others = self._tables()
        free_before = mgr.num_free_blocks
        mgr.free(sid if by_id else seq, preempted=preempted)
        (self.marked.add if preempted else self.marked.discard)(sid)
        with pytest.raises(UnknownSequenceError):
            mgr.block_table(sid)
        assert self._tables() == others, "freeing a sequence changed another one's table"
        blocks = [b for table in own for b in table if b != NULL]
        for b in blocks:
            assert self.pool.ref_cnt[b] == ref_before[b] - 1, f"block {b} not released"
        assert mgr.num_free_blocks == free_before + sum(1 for b in blocks if ref_before[b] == 1)
        state = pool_state(self.pool)
        mgr.free(seq, preempted=preempted)  # idempotent (the latest free says whether it comes back)
        assert pool_state(self.pool) == state, "a second free changed the pool"
        return seq

    def finish(self, data: st.DataObject) -> None:
        """The sequence finished: free all its blocks."""
        sid = data.draw(st.sampled_from(sorted(self.running)), label="sequence")
        self._release(sid, data.draw(st.booleans(), label="free by id"))

    def preempt(self, data: st.DataObject) -> None:
        """Free the sequence and reset its progress; it is re-admitted later with a fresh lookup."""
        sid = data.draw(st.sampled_from(sorted(self.running)), label="sequence")
        seq = self._release(sid, by_id=False, preempted=data.draw(st.booleans(), label="freed as preempted"))
        seq.num_computed_tokens = 0
        self.waiting[sid] = seq

    def drop_waiting(self, data: st.DataObject) -> None:
        """A waiting sequence is dropped (aborted, rejected): freed again, so it is not re-admitted."""
        sid = data.draw(st.sampled_from(sorted(self.waiting)), label="waiting")
        state = pool_state(self.pool)
        assert self.mgr is not None
        self.mgr.free(self.waiting.pop(sid))
        self.marked.discard(sid)
        assert pool_state(self.pool) == state, "freeing a sequence that holds no blocks changed the pool"

    def reset_prefix_cache(self, data: st.DataObject) -> None:
        mgr = self.mgr
        assert mgr is not None
        before = pool_state(self.pool)
        done = mgr.reset_prefix_cache()
        assert done == (not self.running), f"reset_prefix_cache returned {done} with {len(self.running)} running"
        if done:
            self.junctions.clear()
            assert self.pool.num_cached_blocks == 0
            assert mgr.num_free_blocks == self.cfg.num_blocks - 1
        else:
            assert pool_state(self.pool) == before, "a refused reset changed the pool"

    # ------------------------------------------------------------------ the step
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One scheduler action, drawn among those possible now (weighted by repetition)."""
        actions = ["reset_prefix_cache"]
        if len(self.running) < MAX_RUNNING:
            actions += ["admit"] * 4
        if self._prefilling():
            actions += ["continue_prefill"] * 4
        if self._decodable():
            actions += ["decode"] * 4 + ["speculate"] * 3
        if self.running:
            actions += ["finish", "preempt"]
        if self.waiting:
            actions.append("drop_waiting")
        getattr(self, data.draw(st.sampled_from(actions), label="action"))(data)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def invariants_hold(self) -> None:
        assert self.mgr is not None
        self.mgr.check_invariants()
        assert self.mgr.num_sequences == len(self.running)

    @invariant()
    def cached_blocks_hold_what_their_hash_says(self) -> None:
        for b, h in enumerate(self.pool.block_hash):
            if h is not None:
                assert b in self.contents, f"block {b} is cached but no step wrote it"
                assert self.contents[b] == h, (
                    f"block {b} is cached under a hash that is not its content "
                    f"({'incomplete block or state' if self.contents[b] is None else 'another prefix'})"
                )

    def teardown(self) -> None:
        if self.mgr is None or sys.exc_info()[0] is not None:
            return  # a failing step is already being reported
        for sid in sorted(self.running):
            self.mgr.free(self.running.pop(sid))
        self.mgr.check_invariants()
        assert self.mgr.num_free_blocks == self.cfg.num_blocks - 1, "blocks leaked"
        assert self.mgr.num_sequences == 0
        assert self.mgr.reset_prefix_cache()
        self.mgr.check_invariants()


TestKVCacheManagerStateMachine = KVCacheManagerMachine.TestCase


# ---------------------------------------------------------------------------------- block pool machine
ANCHOR_GROUP, WINDOW_GROUP = 0, 1
HASHES = tuple(bytes([i]) * 4 for i in range(6))  # few hashes: several blocks share one


class BlockPoolMachine(RuleBasedStateMachine):
    """``BlockPool`` against a full model of its tiers, ref counts, hash index and events, with
    window retention's kept queue (``KeptBlocks``) as its last free queue.

    As in the manager, anchors are cached blocks of group 0 and only group-1 (window) blocks are kept.
    """

    @initialize(num_blocks=st.integers(2, 16))
    def build(self, num_blocks: int) -> None:
        self.n = num_blocks
        self.pool = BlockPool(num_blocks, 2, enable_events=True, kept_queue=KeptBlocks)
        self.ref = [0] * num_blocks
        self.hash: list[bytes | None] = [None] * num_blocks
        self.group = [0] * num_blocks
        self.uncached: list[int] = []  # last freed is reused first
        self.next_fresh = 1
        self.low: OrderedDict[int, None] = OrderedDict()
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.kept: OrderedDict[int, int] = OrderedDict()  # window -> anchor
        self.index: dict[tuple[int, bytes], list[int]] = {}
        self.events: list[Any] = []

    # ------------------------------------------------------------------ model helpers
    def held(self) -> list[int]:
        return [b for b in range(1, self.n) if self.ref[b] > 0]

    def num_free(self) -> int:
        return self.n - 1 - len(self.held())

    def num_reserved(self) -> int:
        return sum(1 for a in self.kept.values() if self.ref[a] > 0)

    def anchors(self) -> list[int]:
        return [b for b in range(1, self.n) if self.hash[b] is not None and self.group[b] == ANCHOR_GROUP]

    def _evict(self, b: int) -> None:
        h = self.hash[b]
        if h is None:
            return
        key = (self.group[b], h)
        self.index[key].remove(b)  # another block with the hash (if any) serves it from now on
        if not self.index[key]:
            del self.index[key]
        self.hash[b] = None
        self.events.append(BlockRemoved(self.group[b], (h,)))
        for w in [w for w, a in self.kept.items() if a == b]:
            del self.kept[w]
            self.low[w] = None

    def _release(self, b: int, cached_tier: str, anchor: int = NULL) -> None:
        self.ref[b] -= 1
        if self.ref[b]:
            return
        if self.hash[b] is None:
            self.uncached.append(b)
        elif cached_tier == "low":
            self.low[b] = None
        elif cached_tier == "kept" and self._admits(b, anchor):
            self.kept[b] = anchor
        else:
            self.lru[b] = None

    # ------------------------------------------------------------------ rules
    def allocate(self, data: st.DataObject) -> None:
        allow_reserved = data.draw(st.booleans(), label="allow_reserved")
        limit = self.num_free() if allow_reserved else self.num_free() - self.num_reserved()
        assert self.pool.num_free_blocks == self.num_free()
        assert self.pool.num_admissible_blocks == self.num_free() - self.num_reserved()
        k = data.draw(st.integers(0, min(limit, 6)), label="blocks")
        expected: list[int] = []
        while len(expected) < k:
            if self.uncached:
                b = self.uncached.pop()
            elif self.next_fresh < self.n:
                b = self.next_fresh
                self.next_fresh += 1
            elif self.low:
                b = self.low.popitem(last=False)[0]
                self._evict(b)
            elif self.lru:
                b = self.lru.popitem(last=False)[0]
                self._evict(b)
            else:
                assert allow_reserved and self.kept, "the model ran out of blocks"
                b = next(iter(self.kept))
                del self.kept[b]
                self._evict(b)
            self.ref[b] = 1
            expected.append(b)
        got = self.pool.allocate(k, allow_reserved=allow_reserved)
        assert got == expected, f"allocate({k}, allow_reserved={allow_reserved}) gave {got}, expected {expected}"

    def windows(self) -> list[int]:
        """Held blocks that may be kept: never anchors (as in the manager, only group 1 is kept)."""
        return [b for b in self.held() if self.hash[b] is None or self.group[b] == WINDOW_GROUP]

    def _admits(self, b: int, anchor: int) -> bool:
        """Retention is one level deep: an anchor is never kept, a kept block anchors nothing."""
        return anchor not in self.kept and b not in self.kept and b not in self.kept.values()

    def _admit(self, anchor: int) -> Any:
        kept = self.pool.kept
        assert isinstance(kept, KeptBlocks)
        return lambda b: kept.admits(b, anchor)

    def free(self, data: st.DataObject) -> None:
        blocks = data.draw(st.lists(st.sampled_from(self.held()), min_size=1, max_size=4, unique=True))
        for b in blocks:
            self._release(b, "lru")
        self.pool.free(blocks)

    def free_low(self, data: st.DataObject) -> None:
        blocks = data.draw(st.lists(st.sampled_from(self.held()), min_size=1, max_size=4, unique=True))
        for b in blocks:
            self._release(b, "low")
        self.pool.free_low(blocks)

    def free_kept(self, data: st.DataObject) -> None:
        anchors = [a for a in self.anchors() if a not in self.kept]
        if not anchors:
            return
        candidates = self.windows()
        blocks = data.draw(st.lists(st.sampled_from(candidates), min_size=1, max_size=4, unique=True))
        anchor = data.draw(st.sampled_from(anchors), label="anchor")
        for b in blocks:
            self._release(b, "kept", anchor)
        self.pool.free_kept(blocks, self._admit(anchor))

    def keep_free(self, data: st.DataObject) -> None:
        free_windows = [b for b in [*self.low, *self.lru] if self.group[b] == WINDOW_GROUP]
        anchors = self.anchors()
        if not free_windows or not anchors:
            return
        # Blocks that are not in the low or lru tier (held, kept) must be left alone.
        blocks = data.draw(st.lists(st.sampled_from([*free_windows, *self.kept, *self.held()]),
                                    min_size=1, max_size=4, unique=True))
        anchor = data.draw(st.sampled_from(anchors), label="anchor")
        moved = 0
        for b in blocks:
            if (b in self.low or b in self.lru) and self._admits(b, anchor):
                self.low.pop(b, None)
                self.lru.pop(b, None)
                self.kept[b] = anchor
                moved += 1
        assert self.pool.keep_free(blocks, self._admit(anchor)) == moved

    def touch(self, data: st.DataObject) -> None:
        # Blocks of both groups (an anchor with its windows) and a block listed twice are allowed.
        cached = [b for b in range(1, self.n) if self.hash[b] is not None]
        blocks = data.draw(st.lists(st.sampled_from(cached), min_size=1, max_size=5))
        for b in blocks:
            if self.ref[b] == 0:
                self.low.pop(b, None)
                self.lru.pop(b, None)
                self.kept.pop(b, None)
            self.ref[b] += 1
        self.pool.touch(blocks)

    def cache_blocks(self, data: st.DataObject) -> None:
        group = data.draw(st.sampled_from((ANCHOR_GROUP, WINDOW_GROUP)), label="group")
        uncached_held = [b for b in range(1, self.n) if self.ref[b] > 0 and self.hash[b] is None]
        blocks = data.draw(st.lists(st.sampled_from(uncached_held), min_size=1, max_size=3, unique=True))
        hashes = data.draw(st.lists(st.sampled_from(HASHES), min_size=len(blocks), max_size=len(blocks)))
        for b, h in zip(blocks, hashes):
            self.hash[b] = h
            self.group[b] = group
            self.index.setdefault((group, h), []).append(b)
        self.events.append(BlockStored(group, tuple(hashes), tuple(blocks)))
        self.pool.cache_blocks(group, blocks, hashes)

    def reset_prefix_cache(self, data: st.DataObject) -> None:
        ok = not self.held()
        if ok:
            self.uncached.extend(self.kept)  # the kept queue empties first, then low and lru
            self.kept.clear()
            for tier in (self.low, self.lru):
                self.uncached.extend(tier)
                tier.clear()
            self.index.clear()
            self.hash = [None] * self.n
            self.events.append(AllBlocksCleared())
        assert self.pool.reset_prefix_cache() == ok

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One pool operation, drawn among those possible now (weighted by repetition)."""
        actions = ["allocate"] * 3 + ["reset_prefix_cache"]
        if self.held():
            actions += ["free", "free", "free_low"]
        if self.windows():
            actions += ["free_kept"] * 2
        if self.low or self.lru:
            actions += ["keep_free"]
        if any(h is not None for h in self.hash):
            actions += ["touch"] * 2
        if any(self.ref[b] > 0 and self.hash[b] is None for b in range(1, self.n)):
            actions += ["cache_blocks"] * 3
        getattr(self, data.draw(st.sampled_from(actions), label="action"))(data)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def pool_matches_model(self) -> None:
        pool = self.pool
        pool.check_invariants()
        assert pool.ref_cnt == self.ref
        assert pool.num_free_blocks == self.n - 1 - len(self.held())
        assert pool.num_admissible_blocks == pool.num_free_blocks - self.num_reserved()
        assert pool.num_kept_blocks == len(self.kept)
        assert pool.block_hash == self.hash, "a cached block lost its hash before being reused"
        for (group, h), ids in self.index.items():
            assert pool.get_cached_block(group, h) in ids, f"hash {h!r} of group {group} not found"
        for group in (ANCHOR_GROUP, WINDOW_GROUP):
            for h in HASHES:
                if (group, h) not in self.index:
                    assert pool.get_cached_block(group, h) is None
        assert _one_per_block(pool.take_events()) == _one_per_block(self.events)
        self.events = []


def _one_per_block(events: list[Any]) -> list[Any]:
    """Events with each removal of several blocks split into one per block, in order (the pool may
    report a run of evictions from one group as one event)."""
    out: list[Any] = []
    for e in events:
        if isinstance(e, BlockRemoved):
            out += [BlockRemoved(e.group, (h,)) for h in e.block_hashes]
        else:
            out.append(e)
    return out


TestBlockPoolStateMachine = BlockPoolMachine.TestCase


# ---------------------------------------------------------------------------------- cache salts
def _run_and_free(mgr: KVCacheManager, seq: Sequence) -> None:
    hit = mgr.lookup(seq)
    assert mgr.allocate(seq, seq.num_tokens - hit.num_tokens, hit=hit) is not None
    seq.num_computed_tokens = seq.num_tokens
    mgr.free(seq)


attention_layouts = st.tuples(
    group_cfgs(kinds=("full",)), st.lists(group_cfgs(kinds=("full", "sliding", "chunked")), max_size=2)
).map(lambda t: (t[0], *t[1]))
salts = st.one_of(st.none(), st.text(max_size=4))


@given(groups=attention_layouts, tokens=st.lists(st.integers(0, VOCAB - 1), min_size=17, max_size=64),
       salt_pair=st.tuples(salts, salts).filter(lambda p: p[0] != p[1]))
def test_different_cache_salts_never_share_a_hit(
    groups: tuple[GroupCfg, ...], tokens: list[int], salt_pair: tuple[str | None, str | None]
) -> None:
    cfg = ManagerCfg(groups, num_blocks=512, max_model_len=64, max_num_batched_tokens=64, retention="none",
                     caching=True)
    mgr = cfg.build()
    _run_and_free(mgr, Sequence("first", tokens, cache_salt=salt_pair[0]))
    hit = mgr.lookup(Sequence("second", tokens, cache_salt=salt_pair[1]))
    assert hit.num_tokens == 0 and hit.num_blocks == 0, f"salts {salt_pair} shared {hit}"


@given(groups=attention_layouts, tokens=st.lists(st.integers(0, VOCAB - 1), min_size=17, max_size=64),
       salt=salts)
def test_same_cache_salt_hits_the_whole_prefix(
    groups: tuple[GroupCfg, ...], tokens: list[int], salt: str | None
) -> None:
    cfg = ManagerCfg(groups, num_blocks=512, max_model_len=64, max_num_batched_tokens=64, retention="none",
                     caching=True)
    mgr = cfg.build()
    _run_and_free(mgr, Sequence("first", tokens, cache_salt=salt))
    hit = mgr.lookup(Sequence("second", tokens, cache_salt=salt))
    align = math.lcm(*[g.block_size for g in groups])
    assert hit.num_tokens == (len(tokens) - 1) // align * align > 0


# ---------------------------------------------------------------------------------- regressions
# Bugs the state machines found; each test is the minimal reproduction. Open ones are marked
# strict xfail: they fail the suite once the library is fixed, so that the mark gets removed.
FULL16 = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8)
MAMBA16 = MambaSpec(block_size=16, state_bytes=64, mode="align")


def _two_groups(num_blocks: int, second: KVCacheSpec) -> KVCacheLayout:
    return KVCacheLayout(num_blocks=num_blocks, groups=(KVCacheGroup(FULL16, ("full",)), KVCacheGroup(second, ("x",))))


def _keep(pool: BlockPool, blocks: list[int], anchor: int) -> None:
    kept = pool.kept
    assert isinstance(kept, KeptBlocks)
    pool.free_kept(blocks, lambda b: kept.admits(b, anchor))


def test_free_low_of_an_anchor_releases_its_reservation() -> None:
    pool = BlockPool(4, 2, kept_queue=KeptBlocks)
    anchor, window = pool.allocate(2, allow_reserved=False)
    pool.cache_blocks(0, [anchor], [b"anchor"])
    pool.cache_blocks(1, [window], [b"window"])
    _keep(pool, [window], anchor)  # kept under a held anchor: reserved
    assert pool.num_admissible_blocks == pool.num_free_blocks - 1
    pool.free_low([anchor])  # nothing is held any more: nothing is reserved
    assert pool.num_admissible_blocks == pool.num_free_blocks == 3
    pool.check_invariants()


def test_mamba_none_with_a_small_block_size_does_not_crash_lookup() -> None:
    mgr = KVCacheManager(_two_groups(64, MambaSpec(block_size=1, state_bytes=64, mode="none")), max_model_len=128)
    a = Sequence("a", list(range(40)))
    assert mgr.allocate(a, 40) is not None
    a.num_computed_tokens = 40
    mgr.free(a)
    hit = mgr.lookup(Sequence("b", list(range(40))))  # was: ValueError: slice step cannot be zero
    assert hit.num_tokens == 0  # a Mamba state without checkpoints can serve no hit


def test_mamba_align_external_tokens_need_a_state_block_of_their_own() -> None:
    # 16 external + 16 new tokens: full attention needs 2 blocks, Mamba a state after the external
    # tokens and one after the step: 4 blocks, and only 3 are usable.
    mgr = KVCacheManager(_two_groups(4, MAMBA16), max_model_len=64)
    seq = Sequence("s", list(range(40)))
    assert mgr.allocate(seq, 16, hit=mgr.lookup(seq), num_external_tokens=16) is None  # was: AssertionError
    mgr.check_invariants()
    with pytest.raises(UnknownSequenceError):
        mgr.block_table("s")
    assert mgr.num_free_blocks == 3


def test_mamba_align_checkpoints_only_where_a_step_ended() -> None:
    mgr = KVCacheManager(_two_groups(64, MAMBA16), max_model_len=128)
    tokens = list(range(50))
    a = Sequence("a", tokens)
    assert mgr.allocate(a, 17) is not None  # step 1 ends at token 17: state@17 in table entry 1
    a.num_computed_tokens = 17
    assert mgr.allocate(a, 20) is not None  # step 2 reads state@17, ends at 37: state@37 in entry 2
    a.num_computed_tokens = 37
    # No step ended at a block boundary (16 or 32): there is no checkpoint to resume from.
    hit = mgr.lookup(Sequence("b", tokens[:40]))
    assert hit.num_tokens == 0, f"hit resumes from a state that is not the state after {hit.num_tokens} tokens: {hit}"


def test_touch_of_an_anchor_and_its_window_at_once() -> None:
    pool = BlockPool(4, 2, kept_queue=KeptBlocks)
    anchor, window = pool.allocate(2, allow_reserved=False)
    pool.cache_blocks(0, [anchor], [b"anchor"])
    pool.cache_blocks(1, [window], [b"window"])
    pool.free([anchor])
    _keep(pool, [window], anchor)  # kept under a free anchor: not reserved
    pool.touch([anchor, window])  # both held again: nothing retained, nothing reserved
    assert pool.num_admissible_blocks == pool.num_free_blocks == 1
    pool.check_invariants()


def test_touch_takes_one_reference_per_listed_block() -> None:
    pool = BlockPool(3, 1)
    (b,) = pool.allocate(1, allow_reserved=False)
    pool.cache_blocks(0, [b], [b"h"])
    pool.free([b])
    pool.touch([b, b])
    assert pool.ref_cnt[b] == 2
    pool.check_invariants()


def test_free_drops_one_reference_per_listed_block() -> None:
    pool = BlockPool(3, 1)
    (b,) = pool.allocate(1, allow_reserved=False)
    pool.touch([b])  # ref 2
    pool.free([b, b])
    assert pool.ref_cnt[b] == 0 and pool.num_free_blocks == 2
    pool.check_invariants()
    assert pool.allocate(2, allow_reserved=False) != [b, b]


def test_admissible_blocks_stay_reachable_when_an_anchor_is_retained() -> None:
    pool = BlockPool(5, 2, kept_queue=KeptBlocks)
    a, b, w = pool.allocate(3, allow_reserved=False)
    pool.cache_blocks(0, [a], [b"a"])
    pool.cache_blocks(1, [b, w], [b"b", b"w"])
    _keep(pool, [w], a)  # w kept under a
    _keep(pool, [a], b)  # a anchors w: it is never kept itself (it joins the LRU)
    pool.check_invariants()
    admissible = pool.num_admissible_blocks  # a is not kept (one level deep): a, w and block 4
    assert admissible == 3
    assert len(pool.allocate(admissible, allow_reserved=False)) == admissible  # every one is reachable
    pool.check_invariants()

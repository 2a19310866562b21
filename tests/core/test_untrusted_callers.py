"""Nothing a caller passes corrupts the manager or the scheduler.

Wrong, stale and forged arguments (hits from another manager, hand-built hits, reused sequence
ids, floats, None, strings, outputs applied twice) end in a ``HybridKVError`` that changes
nothing, and ``check_invariants()`` holds after every call. Scheduler operations are atomic:
everything is validated before anything is applied, so a refused call can be retried.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from hybridkv import (
    CacheHit,
    HybridKVError,
    InvalidInputError,
    KVCacheManager,
    Scheduler,
    SchedulerConfig,
    Sequence,
)

from helpers import chunked, full, mamba, manager, swa, tokens

# ---------------------------------------------------------------------- the scheduler, atomically


def _one_step(sched: Scheduler) -> Any:
    out = sched.schedule()
    assert out.num_scheduled_tokens
    return out


def test_a_refused_update_changes_nothing_and_can_be_retried() -> None:
    sched = Scheduler(manager(200, full(), max_model_len=512, batch=256), SchedulerConfig(max_num_batched_tokens=256))
    sched.add(Sequence("a", tokens(0, 40)), max_new_tokens=1)
    out = _one_step(sched)
    for bad in ({"a": [-1]}, {"a": ["x"]}, {"a": []}, {}, {"a": 5}, ["a"]):
        with pytest.raises(InvalidInputError):
            sched.update(out, bad)  # type: ignore[arg-type]
        assert sched.requests["a"].seq.num_computed_tokens == 0 and sched.has_unfinished
    finished = sched.update(out, {"a": [7]})
    assert [r.seq_id for r in finished] == ["a"] and not sched.has_unfinished
    with pytest.raises(InvalidInputError, match="latest schedule"):
        sched.update(out, {"a": [7]})  # applied already
    sched.manager.check_invariants()


def test_a_refused_add_leaves_no_ghost() -> None:
    sched = Scheduler(manager(200, full(), max_model_len=512, batch=256), SchedulerConfig(max_num_batched_tokens=256))
    seq = Sequence("a", tokens(0, 40))
    for kwargs in ({"priority": "high"}, {"max_new_tokens": 0}, {"max_new_tokens": 2.0},
                   {"stop_token_ids": [1, -2]}, {"stop_token_ids": "eos"}):
        args: dict[str, Any] = {"max_new_tokens": 4, **kwargs}
        with pytest.raises(InvalidInputError):
            sched.add(seq, **args)
        assert "a" not in sched.requests and not sched.has_unfinished
    sched.add(seq, max_new_tokens=4, stop_token_ids=None)  # None: no stop tokens
    assert sched.requests["a"].stop_token_ids == frozenset()


def test_finished_requests_are_forgotten_unless_kept() -> None:
    for keep in (False, True):
        mgr = manager(20, full(), max_model_len=512, batch=256)  # 19 usable blocks: 304 tokens
        sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=256, keep_finished=keep))
        sched.add(Sequence("a", tokens(0, 40)), max_new_tokens=1)
        sched.add(Sequence("big", tokens(0, 500)), max_new_tokens=500)  # can never fit: rejected
        sched.add(Sequence("gone", tokens(0, 40)), max_new_tokens=1)
        sched.abort("gone")
        out = sched.schedule()
        assert [sid for sid, _ in out.rejected] == ["big"]
        sched.update(out, {"a": [1]})
        assert (set(sched.requests) == {"a", "big", "gone"}) is keep
        assert not sched.requests or keep


# ---------------------------------------------------------------------- a fuzz of the public API
def _tolerated(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(...)``, or None when it raises a ``HybridKVError`` (a clear, specific error: fine; the
    machines' invariants say whether anything changed badly)."""
    try:
        return fn(*args, **kwargs)
    except HybridKVError:
        return None


JUNK = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.integers(-5, -1),
                 st.lists(st.integers(-2, 5), max_size=3))
COUNTS = st.one_of(st.integers(0, 64), JUNK)


class UntrustedCallerMachine(RuleBasedStateMachine):
    """Random calls with arbitrary arguments on a hybrid manager and on a scheduler over another one."""

    @initialize(kinds=st.sampled_from(["swa", "mamba", "both"]))
    def build(self, kinds: str) -> None:
        specs = [full(8)] + ([swa(20, 8)] if kinds in ("swa", "both") else []) + (
            [mamba(8, state_bytes=32768)] if kinds in ("mamba", "both") else [])
        self.mgr = manager(60, *specs, max_model_len=96, batch=64)
        self.other = manager(60, *specs, max_model_len=96, batch=64)
        self.sched = Scheduler(manager(60, *specs, max_model_len=96, batch=64),
                               SchedulerConfig(max_num_batched_tokens=64))
        self.seqs: list[Sequence] = []
        self.hits: list[CacheHit] = []
        self.outs: list[Any] = []
        self.sched_ids: list[str] = []
        self.next = 0

    _call = staticmethod(_tolerated)

    def _new_seq(self, data: st.DataObject) -> Sequence:
        self.next += 1
        reuse = self.seqs and data.draw(st.booleans(), label="reuse an id")
        sid = data.draw(st.sampled_from(self.seqs), label="id of").seq_id if reuse else f"s{self.next}"
        prefix = data.draw(st.sampled_from([tokens(0, 32), tokens(100, 40), []]), label="prefix")
        seq = Sequence(sid, (prefix + data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=40)))[:96])
        self.seqs.append(seq)
        return seq

    def _seq(self, data: st.DataObject) -> Any:
        if not self.seqs or data.draw(st.integers(0, 3), label="new?") == 0:
            return self._new_seq(data)
        return data.draw(st.one_of(st.sampled_from(self.seqs), JUNK), label="sequence")

    def _hit(self, data: st.DataObject, seq: Any) -> Any:
        choice = data.draw(st.integers(0, 5), label="hit kind")
        if choice == 0 or not isinstance(seq, Sequence):
            return None
        if choice == 1:
            return self._call(self.mgr.lookup, seq)
        if choice == 2:
            return self._call(self.other.lookup, seq)  # another manager's hit
        if choice == 3 and self.hits:
            return data.draw(st.sampled_from(self.hits), label="stale hit")
        n = data.draw(st.integers(0, 48), label="hand-built tokens")
        ids = tuple(tuple(data.draw(st.lists(st.integers(-1, 70), max_size=6), label="ids"))
                    for _ in self.mgr.groups)
        return CacheHit(seq.seq_id, n, ids)

    @rule(data=st.data())
    def lookup(self, data: st.DataObject) -> None:
        hit = self._call(self.mgr.lookup, self._seq(data))
        if hit is not None:
            self.hits.append(hit)

    @rule(data=st.data())
    def allocate(self, data: st.DataObject) -> None:
        seq = self._seq(data)
        hit = self._hit(data, seq)
        n = data.draw(COUNTS, label="new tokens")
        ext = data.draw(st.one_of(st.just(0), COUNTS), label="external")
        look = data.draw(st.one_of(st.just(0), COUNTS), label="lookahead")
        whole = data.draw(st.booleans(), label="whole")
        if self._call(self.mgr.allocate, seq, n, hit=hit, num_external_tokens=ext, num_lookahead_tokens=look,
                      whole_sequence_must_fit=whole) is not None and isinstance(seq, Sequence):
            seq.num_computed_tokens = min(seq.num_tokens, seq.num_computed_tokens + n if type(n) is int else 0)

    @rule(data=st.data())
    def meddle(self, data: st.DataObject) -> None:
        """A caller sets progress or appends tokens wrongly."""
        if not self.seqs:
            return
        seq = data.draw(st.sampled_from(self.seqs), label="sequence")
        if data.draw(st.booleans(), label="computed or append"):
            seq.num_computed_tokens = data.draw(st.one_of(st.integers(-3, 100), JUNK), label="computed")
        else:
            self._call(seq.append_token_ids, data.draw(st.lists(st.one_of(st.integers(0, 3), JUNK), max_size=3)))

    @rule(data=st.data())
    def free_or_query(self, data: st.DataObject) -> None:
        target = data.draw(st.one_of(st.sampled_from(self.seqs or [None]), st.sampled_from(["s1", "nobody"]), JUNK))
        if data.draw(st.booleans(), label="free"):
            self._call(self.mgr.free, target)
        else:
            self._call(self.mgr.block_table, target)
            self._call(self.mgr.reset_prefix_cache)

    @rule(data=st.data())
    def scheduler(self, data: st.DataObject) -> None:
        action = data.draw(st.sampled_from(["add", "add", "schedule", "update", "abort", "preempt"]), label="op")
        sched = self.sched
        if action == "add":
            seq = self._new_seq(data)
            self.seqs.remove(seq)  # the scheduler owns its sequences' progress: no meddling with them
            self.sched_ids.append(seq.seq_id)
            self._call(sched.add, seq, data.draw(st.one_of(st.integers(1, 8), JUNK), label="max_new"),
                       priority=data.draw(st.one_of(st.integers(0, 2), JUNK), label="priority"),
                       stop_token_ids=data.draw(st.one_of(st.just(()), st.none(), JUNK), label="stops"))
        elif action == "schedule":
            out = self._call(sched.schedule)
            if out is not None:
                self.outs.append(out)
        elif action == "update" and self.outs:
            out = data.draw(st.sampled_from(self.outs), label="output")
            sampled = {sid: data.draw(st.one_of(st.just([1]), st.lists(st.integers(-1, 3), max_size=2), JUNK),
                                      label="sampled") for sid in out.num_scheduled_tokens}
            self._call(sched.update, out, sampled)
        elif action in ("abort", "preempt"):
            sid = data.draw(st.sampled_from(self.sched_ids or ["x"]), label="id")
            self._call(getattr(sched, action), sid)

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "mgr"):
            self.mgr.check_invariants()
            self.sched.manager.check_invariants()
            sched = self.sched
            for req in sched.running:
                assert sched.manager.block_table(req.seq_id) is not None


TestUntrustedCallers = UntrustedCallerMachine.TestCase


def test_the_manager_rejects_junk_arguments_with_its_own_errors() -> None:
    mgr = KVCacheManager(manager(40, full()).layout, 64)
    for bad in (None, "seq", 1, object()):
        with pytest.raises(InvalidInputError):
            mgr.lookup(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidInputError):
            mgr.allocate(bad, 1)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- counts a caller gets wrong
LAYOUTS = {
    "window first": (swa(20, 8), full(8)),
    "chunked first": (chunked(16, 8), full(8)),
    "mamba first": (mamba(8, state_bytes=32768), full(8), swa(12, 8)),
    "all": (swa(12, 8), chunked(16, 8), full(8), mamba(8, state_bytes=32768)),
}


class CountMisuseMachine(RuleBasedStateMachine):
    """Plausible caller mistakes on hybrid layouts: computed counts rewound, advanced past the slots
    or never advanced; hits of another manager, of another sequence, stale ones; steps larger than
    the batch. Each call works or raises a ``HybridKVError``; ``check_invariants()`` after each."""

    @initialize(name=st.sampled_from(sorted(LAYOUTS)), retention=st.sampled_from(["none", "window"]))
    def build(self, name: str, retention: str) -> None:
        specs = LAYOUTS[name]
        self.mgr = manager(48, *specs, max_model_len=96, batch=24, retention=retention)
        self.other = manager(48, *specs, max_model_len=96, batch=24, retention=retention)
        self.seqs: list[Sequence] = []
        self.hits: list[CacheHit] = []
        self.next = 0

    _call = staticmethod(_tolerated)

    @rule(data=st.data(), prefix=st.sampled_from([0, 1]), extra=st.integers(1, 40), twin=st.booleans())
    def admit(self, data: st.DataObject, prefix: int, extra: int, twin: bool) -> None:
        self.next += 1
        seq = Sequence(f"s{self.next}", (tokens(100 * prefix, 40) + tokens(1000 + self.next, extra))[:96])
        source = data.draw(st.sampled_from(["mine", "other", "stale", "none"]), label="hit from")
        if source == "stale" and self.hits:
            hit = data.draw(st.sampled_from(self.hits), label="stale")
            hit = CacheHit(seq.seq_id, hit.num_tokens, hit.block_ids, hit.full_hit_tokens, hit.max_hit_tokens,
                           hit.epoch, hit.owner, hit.content)
        elif source in ("mine", "other"):
            hit = (self.mgr if source == "mine" else self.other).lookup(seq)
            self.hits.append(hit)
        else:
            hit = None
        n = data.draw(st.integers(0, 30), label="new tokens")
        ext = data.draw(st.sampled_from([0, 0, 8]), label="external")
        if self._call(self.mgr.allocate, seq, n, hit=hit, num_external_tokens=ext) is not None:
            self.seqs.append(seq)
            # the scheduler's convention (count the hit at once) or the caller's (after the step)
            if data.draw(st.booleans(), label="count the hit now"):
                seq.num_computed_tokens = (hit.num_tokens if hit else 0) + ext
        if twin:  # the same prompt in the other manager, so its hits are for cached content there
            twin_seq = Sequence(seq.seq_id, seq.token_ids)
            h = self.other.lookup(twin_seq)
            if self.other.allocate(twin_seq, twin_seq.num_tokens - h.num_tokens if
                                   twin_seq.num_tokens - h.num_tokens <= 24 else 24, hit=h) is not None:
                twin_seq.num_computed_tokens = min(twin_seq.num_tokens, h.num_tokens + 24)
                self.other.free(twin_seq)

    @rule(data=st.data())
    def set_count(self, data: st.DataObject) -> None:
        if self.seqs:
            seq = data.draw(st.sampled_from(self.seqs), label="sequence")
            how = data.draw(st.sampled_from(["advance", "rewind", "past", "zero"]), label="how")
            c = seq.num_computed_tokens
            seq.num_computed_tokens = {"advance": min(seq.num_tokens, c + data.draw(st.integers(0, 24))),
                                       "rewind": max(0, c - data.draw(st.integers(1, 40))),
                                       "past": min(seq.num_tokens, c + data.draw(st.integers(1, 80))),
                                       "zero": 0}[how]

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        if self.seqs:
            seq = data.draw(st.sampled_from(self.seqs), label="sequence")
            if seq.num_computed_tokens == seq.num_tokens < 96 and data.draw(st.booleans(), label="decode"):
                seq.append_token_ids([7])
            n = data.draw(st.integers(0, 30), label="tokens")
            look = data.draw(st.sampled_from([0, 0, 2]), label="lookahead")
            whole = data.draw(st.booleans(), label="whole")
            self._call(self.mgr.allocate, seq, n, num_lookahead_tokens=look, whole_sequence_must_fit=whole)

    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        if self.seqs:
            seq = data.draw(st.sampled_from(self.seqs), label="sequence")
            self.mgr.free(seq)
            self.seqs.remove(seq)
            seq.num_computed_tokens = 0

    @rule()
    def reset(self) -> None:
        self.mgr.reset_prefix_cache()

    @invariant()
    def consistent(self) -> None:
        if hasattr(self, "mgr"):
            self.mgr.check_invariants()
            self.other.check_invariants()


TestCountMisuse = CountMisuseMachine.TestCase

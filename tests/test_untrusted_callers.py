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

from helpers import full, mamba, manager, swa, tokens

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
JUNK = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=3), st.integers(-5, -1),
                 st.lists(st.integers(-2, 5), max_size=3))
COUNTS = st.one_of(st.integers(0, 64), JUNK)


class UntrustedCallerMachine(RuleBasedStateMachine):
    """Random calls with arbitrary arguments on a hybrid manager and on a scheduler over another one."""

    @initialize(kinds=st.sampled_from(["swa", "mamba", "both"]))
    def build(self, kinds: str) -> None:
        specs = [full(8)] + ([swa(20, 8)] if kinds in ("swa", "both") else []) + (
            [mamba(8)] if kinds in ("mamba", "both") else [])
        self.mgr = manager(60, *specs, max_model_len=96, batch=64)
        self.other = manager(60, *specs, max_model_len=96, batch=64)
        self.sched = Scheduler(manager(60, *specs, max_model_len=96, batch=64),
                               SchedulerConfig(max_num_batched_tokens=64))
        self.seqs: list[Sequence] = []
        self.hits: list[CacheHit] = []
        self.outs: list[Any] = []
        self.sched_ids: list[str] = []
        self.next = 0

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HybridKVError:
            return None  # a clear, specific error: fine; the invariants below say nothing changed badly

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
            self.outs.append(sched.schedule())
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

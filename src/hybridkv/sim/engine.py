"""One simulated engine and the queue of requests that reach it, shared by both simulators.

``SimEngine.step`` runs the cycle of a serving engine once: propose drafts, schedule, time the
step with the cost model (and its tier loads), sample, write through to the tiers, update. The
single-engine simulator (``sim.simulator``) runs one; the cluster (``sim.cluster``) one per
replica. ``ArrivalQueue`` releases a workload's requests (arrivals, conversation turns, closed
loop); ``RequestRecords`` holds what each request met. ``docs/SIMULATOR.md`` has the method.
"""

from __future__ import annotations

import heapq
import math
import random
from array import array
from typing import TYPE_CHECKING

from hybridkv.core import KVCacheManager, Sequence
from hybridkv.errors import SequenceTooLongError
from hybridkv.planning.planner import draft_token_limit
from hybridkv.scheduling.scheduler import ScheduledSequence, Scheduler, SchedulerConfig, SchedulerOutput
from hybridkv.sim.cost_model import CostModel, SeqWork
from hybridkv.sim.synthetic import SyntheticSequence
from hybridkv.sim.tiers import SimTiers
from hybridkv.sim.workloads import SimRequest, Workload, release_time

if TYPE_CHECKING:
    from hybridkv.sim.simulator import SimConfig


def percentile(sorted_values: list[float] | array[float], q: float) -> float:
    """The ``q`` quantile (nearest rank) of ``sorted_values``; 0.0 when empty."""
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))
    return float(sorted_values[k])


def make_sequence(req: SimRequest) -> ScheduledSequence:
    """The sequence an engine runs for ``req``: its token ids when it has them, else its content runs."""
    if req.token_ids is not None:
        return Sequence(req.request_id, req.token_ids, req.cache_salt, checkpoint_hints=req.checkpoint_hints)
    return SyntheticSequence(req.request_id, req.segments, req.cache_salt, req.checkpoint_hints)


class RequestRecords:
    """What each request met in one simulation (every engine of it writes here): arrival, first and
    last token, finish, hit / tier / lost-hit tokens at its first admission, and the counts."""

    __slots__ = ("arrival", "hits", "tier_tokens", "lost", "first_token", "last_token", "finish", "itl",
                 "output_tokens", "rejected", "too_long")

    def __init__(self) -> None:
        self.arrival: dict[str, float] = {}
        self.hits: dict[str, int] = {}
        self.tier_tokens: dict[str, int] = {}
        self.lost: dict[str, int] = {}
        self.first_token: dict[str, float] = {}
        self.last_token: dict[str, float] = {}
        self.finish: dict[str, float] = {}
        self.itl = array("d")
        """Seconds between a request's steps that emit tokens (every request's, in step order)."""
        self.output_tokens = 0
        self.rejected = 0
        self.too_long = 0

    def ttfts(self) -> list[float]:
        """Time to first token of every request that had one, sorted."""
        arrival = self.arrival
        return sorted(t - arrival[sid] for sid, t in self.first_token.items())

    def timing(self, rid: str) -> dict[str, float]:
        """``arrival_s``, ``ttft_s`` (nan without a token), ``latency_s`` and ``finish_s`` of ``rid``."""
        at, finish = self.arrival[rid], self.finish[rid]
        first = self.first_token.get(rid)
        return {"arrival_s": at, "ttft_s": first - at if first is not None else math.nan,
                "latency_s": finish - at, "finish_s": finish}

    def latency_summary(self) -> dict[str, float]:
        """The summary's TTFT and ITL keys."""
        ttfts, itl = self.ttfts(), sorted(self.itl)
        return {"ttft_p50_s": percentile(ttfts, 0.5), "ttft_p90_s": percentile(ttfts, 0.9),
                "ttft_p99_s": percentile(ttfts, 0.99), "ttft_mean_s": sum(ttfts) / len(ttfts) if ttfts else 0.0,
                "itl_p50_s": percentile(itl, 0.5), "itl_p90_s": percentile(itl, 0.9),
                "itl_p99_s": percentile(itl, 0.99)}


class ArrivalQueue:
    """A workload's requests as they become due: at their arrival time, a conversation's turn not
    before its previous turn finished plus the think time, and (closed loop) while fewer than the
    workload's ``concurrency`` are in flight."""

    __slots__ = ("by_id", "order", "blocked_by", "ready", "concurrency", "think_time_s", "in_flight", "done",
                 "total")

    def __init__(self, workload: Workload) -> None:
        requests = workload.requests
        self.by_id = {r.request_id: r for r in requests}
        self.order = {r.request_id: i for i, r in enumerate(requests)}
        self.blocked_by: dict[str, str] = {}
        """Per request: the next turn of its conversation, released when it ends."""
        last_of_conv: dict[str, str] = {}
        for r in sorted(requests, key=lambda r: (r.conversation_id or "", r.turn)):
            if r.conversation_id is not None:
                if r.conversation_id in last_of_conv:
                    self.blocked_by[last_of_conv[r.conversation_id]] = r.request_id
                last_of_conv[r.conversation_id] = r.request_id
        waits = set(self.blocked_by.values())
        self.ready = [(r.arrival_time, self.order[r.request_id], r.request_id) for r in requests
                      if r.request_id not in waits]
        heapq.heapify(self.ready)
        self.concurrency = workload.concurrency
        self.think_time_s = workload.think_time_s
        self.in_flight = 0
        self.done = 0
        self.total = len(requests)

    def may_arrive(self) -> bool:
        """A request is released and the closed loop has room for it."""
        return bool(self.ready) and (self.concurrency is None or self.in_flight < self.concurrency)

    def next_time(self) -> float:
        """The release time of the next request (``ready`` must not be empty)."""
        return self.ready[0][0]

    def pop(self, now: float) -> tuple[SimRequest, float]:
        """The next request and its arrival time (a closed loop's request arrives when it is let in)."""
        _, _, rid = heapq.heappop(self.ready)
        req = self.by_id[rid]
        return req, max(now, req.arrival_time) if self.concurrency else req.arrival_time

    def ended(self, rid: str, now: float, *, started: bool = True) -> None:
        """``rid`` finished or was rejected at ``now`` (``started``: it was in flight): its conversation's
        next turn is released."""
        self.done += 1
        if started:
            self.in_flight -= 1
        nxt = self.blocked_by.get(rid)
        if nxt is not None:
            heapq.heappush(self.ready, (release_time(self.by_id[nxt], now, self.think_time_s), self.order[nxt], nxt))


def step_work(sched: Scheduler, out: SchedulerOutput, hits: dict[str, int], tier_tokens: dict[str, int],
              tiers: SimTiers | None, lost: dict[str, int] | None = None) -> tuple[list[SeqWork], float]:
    """Record the hit, tier (and, into ``lost``, lost-hit) tokens of ``out``'s admissions and start
    their tier loads; the step's work per sequence and the seconds its blocking loads take."""
    for sid in out.admitted:
        req = sched.requests[sid]
        hits.setdefault(sid, req.num_hit_tokens)
        if lost is not None and req.lost_hit_tokens:
            lost.setdefault(sid, sum(req.lost_hit_tokens.values()))
    load_s = 0.0
    if tiers is not None:
        for sid in out.admitted:
            tier_tokens.setdefault(sid, sched.requests[sid].num_external_tokens)
        if out.external:
            load_s = tiers.admit(out.external)
    work = []
    drafts = out.draft_tokens
    for sid, n in out.num_scheduled_tokens.items():
        seq = sched.requests[sid].seq
        c = seq.num_computed_tokens
        d = len(drafts[sid]) if drafts and sid in drafts else 0
        work.append(SeqWork(n + d, c, sampled=c + n == seq.num_tokens, num_draft_tokens=d))
    return work, load_s


def _prompt_tokens(sched: Scheduler, out: SchedulerOutput) -> int:
    """The prompt tokens ``out`` schedules (before the step's update)."""
    n = 0
    requests = sched.requests
    for sid, scheduled in out.num_scheduled_tokens.items():
        seq = requests[sid].seq
        rest = seq.num_prompt_tokens - seq.num_computed_tokens
        if rest > 0:
            n += scheduled if scheduled < rest else rest
    return n


class Speculation:
    """Speculative decoding in the loop: K drafts for every decoding sequence, each accepted with
    probability A until the first rejection (one seeded stream per request), and the counts."""

    __slots__ = ("k", "rate", "seed", "drafts", "rngs", "drafted", "accepted", "decode_steps", "decode_tokens")

    def __init__(self, k: int, rate: float, seed: int) -> None:
        self.k = k
        self.rate = rate
        self.seed = seed
        self.drafts = [0] * k
        self.rngs: dict[str, random.Random] = {}
        self.drafted = self.accepted = self.decode_steps = self.decode_tokens = 0

    def propose(self, sched: Scheduler) -> None:
        """Drafts for the next step of every running sequence that decodes."""
        if not self.k:
            return
        for req in sched.running:
            seq = req.seq
            if seq.num_computed_tokens + 1 == seq.num_tokens and seq.num_output_tokens:
                sched.set_draft_tokens(req.seq_id, self.drafts)

    def sample(self, sid: str, drafts: list[int] | None) -> tuple[int, ...]:
        """What a step that reached the end of ``sid``'s tokens samples: the accepted drafts and one token."""
        if not drafts:
            return (1,)
        rng = self.rngs.get(sid)
        if rng is None:
            rng = self.rngs[sid] = random.Random(f"{self.seed}/{sid}")
        n = 0
        while n < len(drafts) and rng.random() < self.rate:
            n += 1
        self.drafted += len(drafts)
        self.accepted += n
        return (*drafts[:n], 1)

    def count(self, emitted: int) -> None:
        """A decode step of one sequence emitted ``emitted`` tokens."""
        self.decode_steps += 1
        self.decode_tokens += emitted

    def summary(self) -> dict[str, float]:
        return {"num_speculative_tokens": self.k, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "tokens_per_step": self.decode_tokens / self.decode_steps if self.decode_steps else 0.0}


def pooled_speculation(specs: list[Speculation]) -> Speculation:
    """The counts of several engines' speculation as one (their K, A and seed are the first's)."""
    first = specs[0]
    total = Speculation(first.k, first.rate, first.seed)
    for s in specs:
        total.drafted += s.drafted
        total.accepted += s.accepted
        total.decode_steps += s.decode_steps
        total.decode_tokens += s.decode_tokens
    return total


class SimEngine:
    """One simulated engine: the real scheduler over a manager (and tiers), timed by a cost model,
    with speculation, its clock and its counters. ``step`` runs one engine step at ``now``."""

    def __init__(self, cfg: SimConfig, mgr: KVCacheManager, cost: CostModel, records: RequestRecords, *,
                 tiers: SimTiers | None = None, sample_every: int = 0) -> None:
        """``records``: where the engine writes what its requests meet (shared by a cluster's engines);
        ``sample_every``: a ``timeline`` point every this many steps (0: none)."""
        self.mgr = mgr
        self.cost = cost
        self.tiers = tiers
        self.records = records
        draft_token_limit(mgr, cfg.speculative_tokens, cfg.model, "speculative_tokens")
        self.sched = Scheduler(mgr, SchedulerConfig(
            max_num_batched_tokens=mgr.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold, policy=cfg.policy,
            admission=cfg.admission, num_speculative_tokens=cfg.speculative_tokens),
            connector=tiers.connector if tiers is not None else None)
        self.spec = Speculation(cfg.speculative_tokens, cfg.acceptance_rate, cfg.speculative_seed)
        self.now = 0.0
        """When the next step starts."""
        self.step_prompt_tokens = 0
        """The prompt tokens the last step computed (a step is computed at its start and ends at ``now``)."""
        self.steps = 0
        self.peak_running = 0
        self.usage_sum = 0.0
        self.usage_max = 0.0
        self.sample_every = sample_every
        self.timeline: list[tuple[float, float, float]] = []
        """(time s, KV usage, cumulative prefix-hit rate) every ``sample_every`` steps."""

    def add(self, seq: ScheduledSequence, max_new_tokens: int, now: float) -> bool:
        """Queue ``seq``; False when it is longer than ``max_model_len`` (rejected at ``now``, as an
        engine does; a rejection at admission is reported by a later ``step``)."""
        try:
            self.sched.add(seq, max_new_tokens)
        except SequenceTooLongError:
            records = self.records
            records.rejected += 1
            records.too_long += 1
            records.finish[seq.seq_id] = now
            return False
        return True

    def next_load(self) -> float | None:
        """When the first tier load still running after ``now`` finishes (None: none is)."""
        later = [r.load.ready_at for r in self.sched.waiting
                 if r.load is not None and not r.load.done() and r.load.ready_at > self.now]
        return min(later) if later else None

    def sample(self) -> None:
        """A ``timeline`` point now."""
        mgr = self.mgr
        self.timeline.append((self.now, mgr.usage, mgr.stats.hit_rate))

    def step(self) -> list[str] | None:
        """One engine step at ``now``: the requests it ended (finished or rejected), or None when none
        could run (every waiting request waits for its tier load; ``now`` is left as it was)."""
        sched, tiers, records = self.sched, self.tiers, self.records
        if tiers is not None:
            tiers.clock.now = self.now
        self.spec.propose(sched)
        out = sched.schedule()
        work, load_s = step_work(sched, out, records.hits, records.tier_tokens, tiers, records.lost)
        self.step_prompt_tokens = _prompt_tokens(sched, out)
        if not work and not load_s and not out.rejected:
            return None
        self.now = now = self.now + (self.cost.step_time(work, load_s) if work else load_s)
        self.steps += 1
        running = len(sched.running)
        if running > self.peak_running:
            self.peak_running = running
        sampled, emitting, stores = self._sample(out, now)
        later = self._store_finishing(stores, sampled) if stores else None
        finished = sched.update(out, sampled)
        spec = self.spec
        for seq, before, decode in emitting:
            emitted = seq.num_output_tokens - before
            records.output_tokens += emitted
            if decode:
                spec.count(emitted)
        if later:
            for seq, start in later:
                # Through the accepted drafts: ``update`` verified them, registering the blocks they
                # filled and the recurrent checkpoints they crossed (the next step drops those).
                tiers.store(seq, start, seq.num_computed_tokens - start)  # type: ignore[union-attr]
        ended = [r.seq_id for r in finished]
        if out.rejected:
            records.rejected += len(out.rejected)
            ended += [sid for sid, _ in out.rejected]
        finish = records.finish
        for sid in ended:
            finish[sid] = now
        usage = self.mgr.usage
        self.usage_sum += usage
        if usage > self.usage_max:
            self.usage_max = usage
        if self.sample_every and self.steps % self.sample_every == 0:
            self.sample()
        return ended

    def _sample(self, out: SchedulerOutput, now: float) -> tuple[dict[str, tuple[int, ...]],
                                                                 list[tuple[ScheduledSequence, int, bool]],
                                                                 list[tuple[str, ScheduledSequence, int, int]]]:
        """What the step samples per sequence, the sequences that emit (with their output tokens before
        and whether they decode), and the write-through of what it computed (with tiers)."""
        sched, spec, records, tiered = self.sched, self.spec, self.records, self.tiers is not None
        first_token, last_token, itl = records.first_token, records.last_token, records.itl
        drafts = out.draft_tokens
        sampled = {}
        emitting: list[tuple[ScheduledSequence, int, bool]] = []
        stores: list[tuple[str, ScheduledSequence, int, int]] = []
        for sid, n in out.num_scheduled_tokens.items():
            seq = sched.requests[sid].seq
            c = seq.num_computed_tokens
            if tiered:
                stores.append((sid, seq, c, n))
            if c + n == seq.num_tokens:
                sampled[sid] = spec.sample(sid, drafts.get(sid))
                decode = sid in first_token
                emitting.append((seq, seq.num_output_tokens, decode))
                if decode:
                    itl.append(now - last_token[sid])
                else:
                    first_token[sid] = now
                last_token[sid] = now
        return sampled, emitting, stores

    def _store_finishing(self, stores: list[tuple[str, ScheduledSequence, int, int]],
                         sampled: dict[str, tuple[int, ...]]) -> list[tuple[ScheduledSequence, int]]:
        """Write through now what the sequences this step finishes computed (``update`` frees them);
        the others' stores, returned as (sequence, first token), go after ``update`` (a recurrent state
        enters the cache then)."""
        sched, tiers, max_len = self.sched, self.tiers, self.mgr.max_model_len
        assert tiers is not None
        later = []
        for sid, seq, start, n in stores:
            emits = len(sampled[sid]) if sid in sampled else 0  # may finish it
            if emits and (seq.num_output_tokens + emits >= sched.requests[sid].max_new_tokens
                          or seq.num_tokens + emits >= max_len):
                tiers.store(seq, start, n)
            else:
                later.append((seq, start))
        return later

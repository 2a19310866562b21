"""A cluster in the simulator: N replicas of one engine behind a KV-aware router, on one clock.

What it models, in full: ``docs/SIMULATOR.md``, "The cluster simulation".
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from hybridkv.cluster.events import (
    BlockRemovedEvent,
    BlockStoredEvent,
    WireEvent,
    from_core_events,
    group_metadata,
    make_batch,
)
from hybridkv.cluster.hashes import HashScheme, HybridkvHashes
from hybridkv.cluster.index import ClusterIndex
from hybridkv.cluster.inflight import InFlightPrefixes
from hybridkv.cluster.replica import RequestKeys
from hybridkv.cluster.routing import (
    BALANCE,
    HOME_TOKENS,
    JUNCTION_WEIGHT,
    MISS_WEIGHT,
    POLICIES,
    SLACK,
    BackendState,
    Policy,
    estimate_hits,
)
from hybridkv.cluster.scrape import BackendLoad
from hybridkv.core import BlockHasher, KVCacheManager, KVSequence, Sequence, capacity_report
from hybridkv.core.hits import LOSS_CAUSES
from hybridkv.errors import InvalidInputError
from hybridkv.sim.cost_model import CostModel
from hybridkv.sim.engine import ArrivalQueue, RequestRecords, SimEngine, make_sequence, pooled_speculation
from hybridkv.sim.sim_tier import SimTier
from hybridkv.sim.simulator import (
    SimConfig,
    SimResult,
    build_manager,
    calibrated_cost_model,
    collector_paused,
    readmission_keys,
    sim_tiers,
    tier_keys,
)
from hybridkv.sim.synthetic import SyntheticSequence
from hybridkv.sim.tiers import SimConnector, SimTiers
from hybridkv.sim.workloads import SimRequest, Workload

ROUTERS = POLICIES
"""The routing policies: ``hybrid_exact``, ``prefix``, ``least_loaded``, ``round_robin``."""

SHARED_TIER_KINDS = ("net",)
"""Tier kinds one store serves to every replica (the others are per replica)."""


@dataclass(frozen=True)
class ClusterConfig:
    """The cluster around the simulated engine: how many replicas, and how requests are routed."""

    instances: int = 2
    router: str = "hybrid_exact"
    load_weight: float = 0.25
    """Prompt tokens one queued request weighs in the cost (``routing.Policy``)."""
    kv_weight: float = 0.0
    """Prompt tokens a full KV cache weighs in the cost."""
    balance: float = BALANCE
    slack: int = SLACK
    home_tokens: int = HOME_TOKENS
    miss_weight: float = MISS_WEIGHT
    junction_weight: float = JUNCTION_WEIGHT
    """``hybrid_exact``'s load bound, ring key, miss and junction weights (``routing.Policy``)."""
    index_tiers: bool = True
    """Feed the index the tiers' events too (False: device events only)."""
    explain: bool = False
    """Join each routing decision with what every replica held (``routing_breakdown``; costs a lookup
    per replica per request)."""

    def __post_init__(self) -> None:
        if type(self.instances) is not int or self.instances < 1:
            raise InvalidInputError(f"instances must be a positive integer, got {self.instances!r}")
        self.policy()  # validates

    def policy(self) -> Policy:
        """The router's policy."""
        return Policy(self.router, load_weight=self.load_weight, kv_weight=self.kv_weight, balance=self.balance,
                      slack=self.slack, home_tokens=self.home_tokens, miss_weight=self.miss_weight,
                      junction_weight=self.junction_weight)


CLUSTER_OPTIONS = ("router", "instances", "load_weight", "kv_weight", "balance", "slack", "home_tokens",
                   "miss_weight", "junction_weight")
"""The ``--compare`` options that vary the cluster rather than the simulated system."""


def cluster_variants(base: ClusterConfig, compare: str) -> list[tuple[str, ClusterConfig]]:
    """One cluster per value of ``OPTION=V1,V2`` (an option of ``CLUSTER_OPTIONS``)."""
    key, _, values = compare.partition("=")
    name = key.strip().replace("-", "_")
    if name not in CLUSTER_OPTIONS:
        raise InvalidInputError(f"--compare: {key!r} is not a cluster option ({', '.join(CLUSTER_OPTIONS)})")
    out = []
    for raw in (v.strip() for v in values.split(",")):
        value: object = raw
        try:
            if name in ("instances", "slack", "home_tokens"):
                value = int(raw)
            elif name != "router":
                value = float(raw)
        except ValueError:
            raise InvalidInputError(f"--compare {key}: {raw!r} is not a number") from None
        if name == "router" and raw not in ROUTERS:
            raise InvalidInputError(f"--compare router: unknown router {raw!r}; choose from {', '.join(ROUTERS)}")
        out.append((f"{name}={raw}", replace(base, **{name: value})))  # type: ignore[arg-type]
    return out


class SequenceKeys(RequestKeys):
    """A request's keys for the index taken from the sequence the replica will run: the same block
    hashes its manager computes (a simulated sequence has no token ids to hash again)."""

    __slots__ = ("hasher",)

    def __init__(self, seq: KVSequence, hasher: BlockHasher) -> None:  # the base would hash token ids
        self.sequence = seq
        self.token_ids = []
        self.cache_salt = None  # in the sequence's hashes already
        self.hasher = hasher
        self._chains = {}
        self._groups = {}

    def home_key(self, policy: Policy) -> bytes | None:
        """The ring key of the request: of its token ids when it has them (``Policy.home_key``), else a
        sha256 of the content runs that make its first ``home_tokens`` tokens (and its salt), the same
        in every process (its block hashes are Python ``hash()`` values, which are not: a ring keyed
        by them would place prefixes differently from one run to the next)."""
        seq = self.sequence
        if isinstance(seq, Sequence):
            return policy.home_key(seq.token_ids, seq.cache_salt)
        assert isinstance(seq, SyntheticSequence)
        runs = seq.segments
        salt = seq.cache_salt or b""
        digest = hashlib.sha256((salt.encode() if isinstance(salt, str) else salt) + b"\0")
        covered = 0
        for key, n in runs:
            take = min(n, policy.home_tokens - covered)
            digest.update(f"{key}:{take};".encode())
            covered += take
            if covered >= policy.home_tokens:
                break
        return digest.digest()

    def _chain(self, scheme: HashScheme, hash_block_size: int) -> list[bytes]:
        """The sequence's own block hashes (the scheme is the manager's: hybridkv's chain)."""
        key = ("sequence", hash_block_size)
        base = self._chains.get(key)
        if base is None:
            base = self._chains[key] = list(self.sequence.block_hashes(self.hasher, hash_block_size))
        return base


class ReplicaSim:
    """One replica of the cluster: a simulated engine (``SimEngine``) that publishes its KV events
    (and its tiers') to the router's index."""

    def __init__(self, name: str, cfg: SimConfig, workload: Workload, cost: CostModel, records: RequestRecords,
                 shared_tiers: dict[int, SimTier], *, publish: bool = True, index_tiers: bool = True) -> None:
        """``publish``: send the replica's KV events to the router's index (a router that ranks by
        hits needs them; the others do not, and the simulation is faster without); ``index_tiers``:
        its tiers' too."""
        planned, self.plan = build_manager(cfg)
        self.mgr = KVCacheManager(planned.layout, planned.max_model_len, planned.max_num_batched_tokens,
                                  cfg.enable_prefix_caching, retention=cfg.retention, enable_events=publish)
        self.name = name
        self.tiers = _replica_tiers(cfg, workload, self.mgr, shared_tiers) if cfg.tiers else None
        self.engine = SimEngine(cfg, self.mgr, cost, records, tiers=self.tiers)
        self.sched = self.engine.sched
        self.metadata = group_metadata(self.mgr.layout)
        self.published_tiers: list[SimTier] = []
        """The tiers whose changes go to the index with this replica's events (a shared one with
        every replica's: whichever steps first drains its log)."""
        if publish and index_tiers and self.tiers is not None:
            self.published_tiers = list(self.tiers.tiers)
            for tier in self.published_tiers:
                tier.record_changes(True)
        self.batches = 0

    @property
    def now(self) -> float:
        """When this replica's next step starts."""
        return self.engine.now

    def step(self, index: ClusterIndex) -> list[str]:
        """Run one engine step at ``now`` (or wait for a tier load); returns the requests that
        ended (finished or rejected). The step's KV events go to ``index``."""
        engine = self.engine
        ended = engine.step()
        if ended is None:  # every waiting request waits for its tier load
            ready = engine.next_load()
            if ready is None:
                raise RuntimeError(f"simulation stalled: {self.name}'s waiting requests can neither load nor "
                                   f"be admitted")
            engine.now = ready
            return []
        events = self.mgr.take_events()
        wire = from_core_events(events, self.metadata) if events else []
        for tier in self.published_tiers:
            changes = tier.take_changes()
            if changes:
                wire += self._tier_events(tier, changes)
        if wire:
            index.deliver(self.name, self.batches, make_batch(wire))
            self.batches += 1
        return ended

    def _tier_events(self, tier: SimTier, changes: list[tuple[bool, bytes]]) -> list[WireEvent]:
        """``tier``'s changes as wire events of its medium: one per run of one group's stores or removals."""
        assert self.tiers is not None and tier.medium is not None
        parse = self.tiers.connector.parse_key
        medium, metadata = tier.medium, self.metadata
        sizes = [self.mgr.group_block_size(g) for g in range(len(self.mgr.layout.groups))]
        out: list[WireEvent] = []
        run: list[bytes] = []
        at = (False, -1)

        def flush() -> None:
            entered, group = at
            if not run:
                return
            if entered:
                kind, window = metadata[group]
                out.append(BlockStoredEvent(tuple(run), None, (), sizes[group], medium, group, kind, window))
            else:
                out.append(BlockRemovedEvent(tuple(run), medium, group))
            run.clear()

        for entered, key in changes:
            group, block_hash = parse(key)
            if (entered, group) != at:
                flush()
                at = (entered, group)
            run.append(block_hash)
        flush()
        return out

    def backend(self, clock: float) -> BackendState:
        """This replica as the router sees it at ``clock``: requests running and waiting, KV usage, and
        the prompt tokens still to prefill. A step is computed at its start, but until it ends (``now``)
        the prompt tokens it computes are still to prefill, as a replica's ``/metrics`` (rendered after
        each step) reports them."""
        sched = self.sched
        running, waiting = len(sched.running), len(sched.waiting)
        pending = sched.prefill_tokens_pending
        if clock < self.engine.now:
            pending += self.engine.step_prompt_tokens
        return BackendState(self.name, "", inflight=running + waiting,
                            load=BackendLoad(running, waiting, self.mgr.usage, pending))


def _replica_tiers(cfg: SimConfig, workload: Workload, mgr: KVCacheManager,
                   shared: dict[int, SimTier]) -> SimTiers:
    """A replica's tiers: its own host and disk tiers, the cluster's one store for each ``net`` tier."""
    tiers = sim_tiers(cfg, workload, mgr)
    for i, spec in enumerate(cfg.tiers):
        if spec.kind in SHARED_TIER_KINDS:
            tiers.tiers[i] = shared.setdefault(i, tiers.tiers[i])
    old = tiers.connector
    tiers.connector = SimConnector(tiers.tiers, mgr, clock=tiers.clock, block_bytes=tiers.block_bytes,
                                   async_loads=old.async_loads, load_timeout_s=old.load_timeout_s,
                                   namespace=f"sim/{cfg.model}/{cfg.kv_dtype}",
                                   payload_bytes=dict.fromkeys(tiers.block_bytes, 1), storage=old.storage)
    return tiers


OUTCOMES = ("nothing to reuse", "went where its prefix was", "went to its prefix in a tier",
            "the router did not see it", "load sent it elsewhere", "a wrong prediction sent it elsewhere")
"""How a routed request met its reusable tokens (``ClusterRun.explain``): none anywhere; sent to the
replica holding the most (on its device, or only in its tiers); sent elsewhere because the index did
not show where they were (every holder predicted below what it held), because load outweighed a
predicted hit, or because a prediction elsewhere was wrong."""


class ClusterRun:
    """What one cluster simulation records besides the engines' ``RequestRecords``: where each request
    was routed, the hit predicted there and what decided."""

    def __init__(self) -> None:
        self.records = RequestRecords()
        """What each request met (arrival, tokens, finish, hits), written by the replicas' engines."""
        self.replica: dict[str, str] = {}
        self.predicted: dict[str, int] = {}
        self.chain_over_requests = 0
        self.chain_over_tokens = 0
        self.disagreements = 0
        self.decisions: Counter[str] = Counter()
        self.breakdown: dict[str, list[int]] = {o: [0, 0, 0] for o in OUTCOMES}
        """Per outcome (``explain``): requests, tokens they could have reused at the best replica,
        tokens the chosen replica held."""

    def decided(self, sid: str, replica: str, reason: str) -> None:
        """``sid`` was routed to ``replica``; ``reason``: what decided (``Decision.reason``)."""
        self.replica[sid] = replica
        self.decisions[reason] += 1

    def explain(self, sid: str, chosen: str, reason: str, held: Mapping[str, tuple[int, int]],
                predicted: Mapping[str, int]) -> None:
        """Join the decision for ``sid`` with what each replica held (``held``: device and tier
        tokens) and what the router predicted there; counted under its outcome (``OUTCOMES``)."""
        total = {n: d + t for n, (d, t) in held.items()}
        best = max(total.values())
        mine = total[chosen]
        if not best:
            outcome = "nothing to reuse"
        elif mine == best:
            outcome = "went where its prefix was" if held[chosen][0] or not held[chosen][1] else \
                "went to its prefix in a tier"
        else:
            holders = [n for n, v in total.items() if v == best]
            if all(predicted.get(n, 0) < total[n] for n in holders) and reason != "load":
                outcome = "the router did not see it"
            elif reason == "load":
                outcome = "load sent it elsewhere"
            else:
                outcome = "a wrong prediction sent it elsewhere"
        row = self.breakdown[outcome]
        row[0] += 1
        row[1] += best
        row[2] += mine


class Router:
    """The cluster's router: an index fed by the replicas' events and a routing policy."""

    def __init__(self, cluster: ClusterConfig, replicas: list[ReplicaSim], shared_media: tuple[str, ...] = ()) -> None:
        mgr = replicas[0].mgr
        self.index = ClusterIndex(max_model_len=mgr.max_model_len, shared_media=shared_media)
        for r in replicas:
            self.index.add_replica(r.name, scheme=HybridkvHashes(), layout=r.mgr.layout)
        self.policy = cluster.policy()
        self.replicas = {r.name: r for r in replicas}
        self.names = list(self.replicas)
        self.hasher = mgr.hasher
        self.inflight = InFlightPrefixes()
        self.explain = cluster.explain
        self._tickets: dict[str, int] = {}

    def ended(self, seq_id: str) -> None:
        """``seq_id`` finished or was rejected: its prompt no longer counts as coming to its replica."""
        ticket = self._tickets.pop(seq_id, None)
        if ticket is not None:
            self.inflight.remove(ticket)

    def route(self, seq: KVSequence, run: ClusterRun, clock: float) -> ReplicaSim:
        """The replica ``seq``, arriving at ``clock``, goes to; records the prediction for it and what decided."""
        backends = [r.backend(clock) for r in self.replicas.values()]
        if not self.policy.uses_hits:
            decision = self.policy.rank(backends, {}, seq.num_tokens)
            chosen = self.replicas[decision.order[0]]
            run.decided(seq.seq_id, chosen.name, decision.reason)
            if self.explain:
                run.explain(seq.seq_id, chosen.name, decision.reason, self._held(seq), {})
            return chosen
        keys = SequenceKeys(seq, self.hasher)
        hits = estimate_hits(self.policy, self.index, keys, self.names, self.inflight, seq.num_tokens)
        decision = self.policy.rank(backends, hits.predicted, seq.num_tokens, credited=hits.credited,
                                    home=hits.home, junctions=hits.junctions)
        chosen = self.replicas[decision.order[0]]
        found = hits.chains.get(chosen.name)
        if found is not None:
            self._tickets[seq.seq_id] = self.inflight.add(chosen.name, found[0])
        run.decided(seq.seq_id, chosen.name, decision.reason)
        run.predicted[seq.seq_id] = hits.predicted[chosen.name]
        if self.explain:
            run.explain(seq.seq_id, chosen.name, decision.reason, self._held(seq), hits.predicted)
        # How a chain-only index would have judged the replicas (device and tiers alike).
        exact = {n: p.tokens for n, p in self.index.lookup_keys(keys).items()} \
            if self.policy.name == "prefix" else {n: p.tokens for n, p in hits.found.items()}
        missing = [n for n in self.names if n not in hits.chain_found]
        found_chain = {**self.index.lookup_keys(keys, missing, chain_only=True), **hits.chain_found} \
            if missing else hits.chain_found
        chain = {n: p.tokens for n, p in found_chain.items()}
        over = chain[chosen.name] - exact[chosen.name]
        if over > 0:
            run.chain_over_requests += 1
            run.chain_over_tokens += over
        # Would the replica a chain-only index likes best serve less than the best replica does?
        top = max(chain.values())
        if max(exact[n] for n, t in chain.items() if t == top) < max(exact.values()):
            run.disagreements += 1
        return chosen

    def _held(self, seq: KVSequence) -> dict[str, tuple[int, int]]:
        """Per replica, the prompt tokens it could serve ``seq`` now: from its device cache, and from
        its tiers past that (the connector's probe; its lookup counters are left as they were)."""
        out = dict.fromkeys(self.replicas, (0, 0))
        if seq.num_tokens > self.index.max_model_len:
            return out  # rejected by every replica
        for name, r in self.replicas.items():
            device = r.mgr.lookup(seq).num_tokens
            tier = 0
            if r.tiers is not None:
                connector = r.tiers.connector
                before = replace(connector.stats)
                tier = connector.num_external_tokens(seq, device)
                connector.stats = before
            out[name] = (device, tier)
        return out


def simulate_cluster(workload: Workload, cfg: SimConfig, cluster: ClusterConfig, *,
                     progress: Callable[[int, int], None] | None = None) -> SimResult:
    """Run ``workload`` on ``cluster.instances`` replicas of the system ``cfg`` behind ``cluster.router``."""
    with collector_paused():
        return _simulate_cluster(workload, cfg, cluster, progress)


def _simulate_cluster(workload: Workload, cfg: SimConfig, cluster: ClusterConfig,
                      progress: Callable[[int, int], None] | None) -> SimResult:
    cost = calibrated_cost_model(cfg)
    shared: dict[int, SimTier] = {}
    publish = cluster.policy().uses_hits
    run = ClusterRun()
    replicas = [ReplicaSim(f"replica-{i}", cfg, workload, cost, run.records, shared, publish=publish,
                           index_tiers=cluster.index_tiers) for i in range(cluster.instances)]
    shared_media = tuple(dict.fromkeys(t.spec.medium for t in shared.values())) if cluster.index_tiers else ()
    router = Router(cluster, replicas, shared_media)
    _run_cluster(replicas, router, run, ArrivalQueue(workload), progress)
    return SimResult(cfg, workload.name, _summary(workload, cfg, cluster, replicas, run), [],
                     run.records.ttfts(), _per_request(workload.requests, run))


def _run_cluster(replicas: list[ReplicaSim], router: Router, run: ClusterRun, queue: ArrivalQueue,
                 progress: Callable[[int, int], None] | None) -> None:
    """The cluster's clock: the earliest of the next arrival (routed first on a tie) and the replicas'
    next steps, until every request ended."""
    clock = 0.0
    while queue.done < queue.total:
        busy = [r for r in replicas if r.sched.has_unfinished]
        t_step = min((r.now for r in busy), default=math.inf)
        if queue.may_arrive() and max(clock, queue.next_time()) <= t_step:
            clock = max(clock, queue.next_time())
            _arrive(queue, router, run, clock)
            continue
        if not busy:
            raise RuntimeError("simulation stalled: requests remain but none can arrive")
        replica = min(busy, key=lambda r: r.now)
        clock = max(clock, replica.now)
        ended = replica.step(router.index)
        for rid in ended:
            router.ended(rid)
            queue.ended(rid, replica.now)
        if progress and ended:
            progress(queue.done, queue.total)


def _arrive(queue: ArrivalQueue, router: Router, run: ClusterRun, clock: float) -> None:
    """The next request of ``queue`` arrives at ``clock``: routed, and added to its replica."""
    req, at = queue.pop(clock)
    rid = req.request_id
    run.records.arrival[rid] = at
    seq = make_sequence(req)
    target = router.route(seq, run, clock)
    was_idle = not target.sched.has_unfinished
    if not target.engine.add(seq, req.max_new_tokens, clock):  # longer than max_model_len
        router.ended(rid)
        queue.ended(rid, clock, started=False)
        return
    queue.in_flight += 1
    if was_idle:
        target.engine.now = max(target.now, clock)


def _per_request(requests: list[SimRequest], run: ClusterRun) -> dict[str, dict[str, float]]:
    """``SimResult.requests``, with the replica each request went to (its number) and the hit predicted there."""
    records = run.records
    out: dict[str, dict[str, float]] = {}
    for r in requests:
        rid = r.request_id
        if rid in records.arrival:
            replica = int(run.replica[rid].rsplit("-", 1)[1]) if rid in run.replica else -1
            out[rid] = {"replica": replica, "hit_tokens": records.hits.get(rid, 0),
                        "tier_tokens": records.tier_tokens.get(rid, 0),
                        "predicted_hit_tokens": run.predicted.get(rid, 0), **records.timing(rid)}
    return out


def _predictions(run: ClusterRun) -> tuple[int, int, int]:
    """Requests whose hit at first admission (device and tiers) equalled, fell short of, exceeded the
    router's prediction."""
    records = run.records
    equal = over = under = 0
    for rid, p in run.predicted.items():
        found = records.hits.get(rid)
        if found is None:
            continue
        found += records.tier_tokens.get(rid, 0)  # the index predicts the device's hit and the tiers' past it
        equal += found == p
        over += found < p
        under += found > p
    return equal, over, under


def _capacity(cfg: SimConfig, replicas: list[ReplicaSim]) -> dict[str, Any]:
    """The plan's capacity figures of one replica (of its pool when ``kv_cache_tokens`` sized it)."""
    if cfg.kv_cache_tokens is None:
        return replicas[0].plan
    mgr = replicas[0].mgr
    rep = capacity_report(mgr.layout, max_model_len=mgr.max_model_len,
                          max_num_batched_tokens=mgr.max_num_batched_tokens)
    return {"kv_capacity_tokens": rep.token_capacity, "max_concurrency": rep.max_concurrency}


def _engine_keys(workload: Workload, cfg: SimConfig, replicas: list[ReplicaSim], records: RequestRecords
                 ) -> dict[str, Any]:
    """The single-engine summary keys, pooled over ``replicas``."""
    engines = [r.engine for r in replicas]
    now = max(e.now for e in engines)
    hit = sum(r.mgr.stats.hit_tokens for r in replicas)
    queried = sum(r.mgr.stats.queried_tokens for r in replicas)
    external = sum(r.mgr.stats.external_tokens for r in replicas)
    finished = sum(r.sched.stats.finished for r in replicas)
    steps = sum(e.steps for e in engines)
    tiers = [r.tiers for r in replicas if r.tiers is not None]
    distinct: dict[int, SimTier] = {id(t): t for ts in tiers for t in ts.tiers}
    plan = _capacity(cfg, replicas)
    return {
        "workload": workload.name, "model": cfg.model, "gpu": cfg.gpu, "retention": replicas[0].mgr.retention.name,
        "cost_model": engines[0].cost.efficiency_source,
        "admission": cfg.admission, "requests": len(workload.requests), "finished": finished,
        "rejected": records.rejected, "rejected_too_long": records.too_long,
        "preemptions": sum(r.sched.stats.preemptions for r in replicas), "steps": steps, "duration_s": now,
        "output_tokens": records.output_tokens,
        "throughput_tokens_per_s": records.output_tokens / now if now else 0.0,
        "throughput_requests_per_s": finished / now if now else 0.0,
        "prefix_hit_rate": hit / queried if queried else 0.0, "hit_tokens": hit, "queried_tokens": queried,
        "lost_hit_tokens": {c: sum(r.mgr.stats.lost_hit_tokens[c] for r in replicas) for c in LOSS_CAUSES},
        **records.latency_summary(),
        "kv_capacity_tokens": plan.get("kv_capacity_tokens"), "num_blocks": replicas[0].mgr.layout.num_blocks,
        "max_concurrency": plan.get("max_concurrency"), "peak_running": max(e.peak_running for e in engines),
        "kv_usage_mean": sum(e.usage_sum for e in engines) / steps if steps else 0.0,
        "kv_usage_max": max(e.usage_max for e in engines),
        **tier_keys(cfg, tiers, sum(sum(t.load_s) for t in tiers),
                    sum(t.stats.bytes_written for t in distinct.values()), hit, external, queried),
        **readmission_keys(r.mgr.stats for r in replicas),
        "tier_stats": {},
    }


def _summary(workload: Workload, cfg: SimConfig, cluster: ClusterConfig, replicas: list[ReplicaSim],
             run: ClusterRun) -> dict[str, Any]:
    """The single-engine summary keys, pooled over replicas, and the cluster's own."""
    equal, over, under = _predictions(run)
    routed = {r.name: 0 for r in replicas}
    for name in run.replica.values():
        routed[name] += 1
    summary = _engine_keys(workload, cfg, replicas, run.records)
    if cfg.speculative_tokens:
        summary["spec_decode"] = pooled_speculation([r.engine.spec for r in replicas]).summary()
    return {
        **summary,
        "instances": cluster.instances, "router": cluster.router, "routed": routed,
        "replica_hit_rates": {r.name: r.mgr.stats.hit_rate for r in replicas},
        "predicted_hit_tokens": sum(run.predicted.values()),
        "prediction_equal": equal, "prediction_over": over, "prediction_under": under,
        "chain_over_requests": run.chain_over_requests, "chain_over_tokens": run.chain_over_tokens,
        "hit_policy_disagreements": run.disagreements,
        "decisions": dict(run.decisions),
        "routing_breakdown": {o: {"requests": n, "reusable_tokens": best, "chosen_held_tokens": mine}
                              for o, (n, best, mine) in run.breakdown.items()} if cluster.explain else None,
    }

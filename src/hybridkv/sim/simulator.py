"""The simulation loop: a workload through the real scheduler and manager, timed by a cost model.

What it models, in full: ``docs/SIMULATOR.md``, "The simulation loop and its summary keys".
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from hybridkv.connectors.storage import StoragePolicy, StoreAll, StoreHitSpans, StoreSpansSpill
from hybridkv.core import (
    KVCacheLayout,
    KVCacheManager,
    KVCacheStats,
    RecurrentPages,
    RetentionPolicy,
    capacity_report,
    plan_layout,
)
from hybridkv.errors import InvalidInputError
from hybridkv.planning.hardware import get_hardware
from hybridkv.planning.hf_config import layer_specs, parse_config
from hybridkv.planning.planner import DTYPE_BYTES, PlanInput, load_model, make_plan
from hybridkv.scheduling.scheduler import MAX_DRAFT_TOKENS, Admission, Policy
from hybridkv.sim.cost_model import CostModel, Efficiency, LMHead, calibrate
from hybridkv.sim.engine import ArrivalQueue, RequestRecords, SimEngine, make_sequence
from hybridkv.sim.tiers import SimTiers, TierSpec
from hybridkv.sim.workloads import Workload


@dataclass(frozen=True)
class SimConfig:
    """The system being simulated."""

    model: str = "gemma-3-27b"
    """A preset id, or the path of a Hugging Face ``config.json`` (then ``num_params`` is needed)."""
    gpu: str = "h100-80gb"
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0
    retention: str = "window"
    admission: Admission = "max_utilization"
    policy: Policy = "fcfs"
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    gpu_memory_bytes: int | None = None
    kv_cache_tokens: int | None = None
    """Size the pool to hold this many tokens of the growing groups, instead of the GPU memory."""
    kv_cache_memory: int | None = None
    """Size the pool for this KV budget in bytes with ``plan_layout`` (as the reference engine does)."""
    weights_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    block_size: int = 16
    recurrent_pages: RecurrentPages = "split"
    """How a recurrent state shares the pool's pages (``hybridkv.core.layout.RecurrentPages``)."""
    samples: int = 400
    """Points of the KV-usage / hit-rate time series."""
    calibration: Efficiency | str | None = None
    """Efficiencies, or a calibration file path (``cost_model.calibrate``: the step-shaped fit when its
    steps carry a ``mode``); None: the GPU's default (its built-in profile, else the data sheet)."""
    lm_head: LMHead | None = None
    """How the cost model charges the output projection (``docs/SIMULATOR.md``, "The cost model"); None:
    per sampled sequence under a calibrated (step-shaped) profile when the vocabulary is known, else
    per token."""
    tiers: tuple[TierSpec, ...] = ()
    """External KV tiers, queried in order (``sim.tiers``); empty: none."""
    tier_storage: str = "spans+spill"
    """What the tiers keep (``connectors.storage``): ``spans+spill`` (every block, those a hit cannot use
    at low priority, evicted first), ``hit-spans`` (per group what a hit can use) or ``all`` (every layer
    of every block)."""
    tier_checkpoint_interval: int = 0
    """With ``hit-spans`` / ``spans+spill``: also keep window checkpoints every this many tokens (0: none)."""
    tier_end_align: int | None = None
    """With ``hit-spans`` / ``spans+spill``: the prompt-end checkpoint at the prompt's length rounded down to a
    multiple of this; None: the workload's content block size (a Mooncake trace: 512), else the hit alignment."""
    tier_loads: str = "async"
    """``async``: a request waits for its tier load while the others run; ``blocking``: the load's time is
    added to the step that admits it."""
    tier_load_timeout_s: float | None = None
    """A tier load longer than this is a miss (the request computes its prompt after waiting this long)."""
    num_params: int | None = None
    """Parameter count (all experts) of a ``config.json`` model; a preset knows its own."""
    speculative_tokens: int = 0
    """Draft tokens each decode step verifies (speculative decoding); 0: none."""
    acceptance_rate: float = 0.0
    """With ``speculative_tokens``: the probability that a draft is accepted (given the drafts before it were)."""
    speculative_seed: int = 0
    """Seed of the acceptance draws (one stream per request)."""

    def __post_init__(self) -> None:
        k, a = self.speculative_tokens, self.acceptance_rate
        if type(k) is not int or not 0 <= k <= MAX_DRAFT_TOKENS:
            raise InvalidInputError(f"speculative_tokens must be an integer in 0..{MAX_DRAFT_TOKENS}, got {k!r}")
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 <= a <= 1.0:
            raise InvalidInputError(f"acceptance_rate must be a probability in [0, 1], got {a!r}")


@dataclass
class SimResult:
    """Figures of one simulation (``summary`` holds the documented JSON keys)."""

    config: SimConfig
    workload: str
    summary: dict[str, Any]
    timeline: list[tuple[float, float, float]] = field(default_factory=list)
    """(time s, KV usage, cumulative prefix-hit rate)."""
    ttfts: list[float] = field(default_factory=list)
    requests: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per request id: ``hit_tokens``, ``tier_tokens`` and ``lost_hit_tokens`` (tokens its full-attention
    prefix held that the hit did not serve; at its first admission), ``ttft_s``, ``latency_s``, ``finish_s``."""


def layout_for_memory(cfg: SimConfig) -> tuple[KVCacheLayout, int]:
    """``(layout, max_model_len)`` for a KV budget of ``cfg.kv_cache_memory`` bytes: the model's layer specs
    through ``plan_layout``, as the reference engine plans its pool."""
    memory = cfg.kv_cache_memory
    if not isinstance(memory, int) or isinstance(memory, bool) or memory <= 0:
        raise InvalidInputError(f"kv_cache_memory must be a positive number of bytes, got {memory!r}")
    source = load_model(cfg.model)
    max_model_len = cfg.max_model_len or source.max_model_len
    if not max_model_len:
        raise InvalidInputError(f"{source.name}: no default context length; pass max_model_len (--max-model-len)")
    kv_bytes = DTYPE_BYTES.get(cfg.kv_dtype)
    if kv_bytes is None or kv_bytes < 1:
        raise InvalidInputError(f"unknown KV dtype {cfg.kv_dtype!r}; choose one of fp32, bf16, fp16, fp8")
    specs = layer_specs(parse_config(source.config, tensor_parallel_size=cfg.tensor_parallel_size),
                        block_size=cfg.block_size, kv_dtype_bytes=int(kv_bytes))
    layout = plan_layout(specs, memory, max_model_len=max_model_len,
                         max_num_batched_tokens=min(cfg.max_num_batched_tokens, max_model_len),
                         recurrent_pages=cfg.recurrent_pages)
    return layout, max_model_len


def build_manager(cfg: SimConfig) -> tuple[KVCacheManager, dict[str, Any]]:
    """The manager the simulated engine runs on, and the plan report it came from (capacity figures only
    when ``kv_cache_memory`` sizes the pool)."""
    if cfg.kv_cache_memory is not None:
        if cfg.kv_cache_tokens is not None:
            raise InvalidInputError("give kv_cache_memory or kv_cache_tokens, not both")
        layout, max_model_len = layout_for_memory(cfg)
        batch = min(cfg.max_num_batched_tokens, max_model_len)
        rep = capacity_report(layout, max_model_len=max_model_len, max_num_batched_tokens=batch)
        mgr = KVCacheManager(layout, max_model_len, batch, cfg.enable_prefix_caching, retention=cfg.retention)
        return mgr, {"kv_capacity_tokens": rep.token_capacity, "max_concurrency": rep.max_concurrency,
                     "num_blocks": layout.num_blocks, "kv_memory_bytes": layout.memory_bytes}
    inp = PlanInput(model=cfg.model, gpu=cfg.gpu, gpu_memory_bytes=cfg.gpu_memory_bytes,
                    max_model_len=cfg.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens,
                    tensor_parallel_size=cfg.tensor_parallel_size, weights_dtype=cfg.weights_dtype,
                    kv_dtype=cfg.kv_dtype, gpu_memory_utilization=cfg.gpu_memory_utilization,
                    block_size=cfg.block_size, num_params=cfg.num_params, recurrent_pages=cfg.recurrent_pages)
    plan = make_plan(inp)
    if not plan.fits or plan.layout is None:
        raise InvalidInputError(f"{cfg.model}: {plan.report.get('error')}")
    layout = plan.layout
    if cfg.kv_cache_tokens:
        growing = [g for g in layout.groups if g.spec.grows_with_sequence] or list(layout.groups)
        blocks = sum(-(-cfg.kv_cache_tokens // g.spec.block_size) for g in growing) + 1
        layout = replace(layout, num_blocks=blocks)
    retention: str | RetentionPolicy = cfg.retention
    mgr = KVCacheManager(layout, plan.max_model_len, min(cfg.max_num_batched_tokens, plan.max_model_len),
                         cfg.enable_prefix_caching, retention=retention)
    return mgr, plan.report


def cost_model(cfg: SimConfig) -> CostModel:
    """The cost model of ``cfg``'s model (a preset, or a ``config.json`` with ``num_params``) on its GPU."""
    source = load_model(cfg.model)
    if source.is_preset:
        return CostModel.from_preset(cfg.model, cfg.gpu, tensor_parallel_size=cfg.tensor_parallel_size,
                                     weights_dtype=cfg.weights_dtype, kv_dtype=cfg.kv_dtype, lm_head=cfg.lm_head)
    if not cfg.num_params:
        raise InvalidInputError(f"{source.name}: a config.json does not say how many parameters the model has; "
                                f"pass num_params (--num-params, e.g. 27e9)")
    return CostModel.from_config(source.config, cfg.num_params, get_hardware(cfg.gpu),
                                 tensor_parallel_size=cfg.tensor_parallel_size, weights_dtype=cfg.weights_dtype,
                                 kv_dtype=cfg.kv_dtype, name=source.name, lm_head=cfg.lm_head)


def tier_storage(cfg: SimConfig, workload: Workload | None = None) -> StoragePolicy:
    """The storage policy of ``cfg``'s tiers (``SimConfig.tier_storage`` and its settings)."""
    if cfg.tier_storage == "all":
        return StoreAll()
    if cfg.tier_storage not in ("hit-spans", "spans+spill"):
        raise InvalidInputError(f"tier_storage must be 'spans+spill', 'hit-spans' or 'all', got {cfg.tier_storage!r}")
    align = cfg.tier_end_align
    if align is None:
        align = workload.content_block_size if workload is not None and workload.content_block_size else 0
    policy = StoreSpansSpill if cfg.tier_storage == "spans+spill" else StoreHitSpans
    # A trace that knows content only as prompt blocks (Mooncake) never holds the simulator's own
    # answers in a later prompt: storing the answer's boundaries would only take the tier's room.
    answers_reused = workload is None or workload.content_block_size is None
    return policy(interval=cfg.tier_checkpoint_interval, end_align=align, answer_ends=answers_reused)


def simulate(workload: Workload, cfg: SimConfig, *,
             progress: Callable[[int, int], None] | None = None) -> SimResult:
    """Run ``workload`` on the system ``cfg``; ``progress(done, total)`` is called as requests finish."""
    with collector_paused():
        return _simulate(workload, cfg, progress)


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was after). A run with a tier holds
    tens of millions of live references (the tier's and the pool's tables) that every full
    collection walks, and its offers come in lists of tuples that trigger them: the collector took
    14% of a trace-scale run (8 of 63 s) and found nothing, as a step leaves no reference cycle
    behind (memory is freed by reference counts; tests/sim/test_sim_tiers.py and test_sim_cluster.py
    check that)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()



def sim_tiers(cfg: SimConfig, workload: Workload, mgr: KVCacheManager) -> SimTiers:
    """The tiers of ``cfg`` behind ``mgr``'s engine."""
    if cfg.tier_loads not in ("async", "blocking"):
        raise InvalidInputError(f"tier_loads must be 'async' or 'blocking', got {cfg.tier_loads!r}")
    return SimTiers(cfg.tiers, mgr, namespace=f"sim/{cfg.model}/{cfg.kv_dtype}",
                    storage=tier_storage(cfg, workload), async_loads=cfg.tier_loads == "async",
                    load_timeout_s=cfg.tier_load_timeout_s)


def calibrated_cost_model(cfg: SimConfig) -> CostModel:
    """``cost_model(cfg)`` with ``cfg.calibration``'s efficiencies when it has one."""
    cost = cost_model(cfg)
    return calibrate(cost, cfg.calibration) if cfg.calibration is not None else cost


def _simulate(workload: Workload, cfg: SimConfig, progress: Callable[[int, int], None] | None) -> SimResult:
    mgr, plan = build_manager(cfg)
    tiers = sim_tiers(cfg, workload, mgr) if cfg.tiers else None
    batch = mgr.max_num_batched_tokens
    requests = workload.requests
    sample_every = max(1, sum(r.prompt_len + r.max_new_tokens for r in requests) // max(1, batch * cfg.samples))
    records = RequestRecords()
    engine = SimEngine(cfg, mgr, calibrated_cost_model(cfg), records, tiers=tiers, sample_every=sample_every)
    _run(engine, ArrivalQueue(workload), progress)
    engine.sample()
    per_request: dict[str, dict[str, float]] = {}
    for r in requests:
        rid = r.request_id
        if rid in records.arrival:
            per_request[rid] = {"hit_tokens": records.hits.get(rid, 0), "tier_tokens": records.tier_tokens.get(rid, 0),
                                "lost_hit_tokens": records.lost.get(rid, 0), **records.timing(rid)}
    return SimResult(cfg, workload.name, _summary(workload, cfg, engine, plan), engine.timeline, records.ttfts(),
                     per_request)


def _run(engine: SimEngine, queue: ArrivalQueue, progress: Callable[[int, int], None] | None) -> None:
    """Step ``engine`` until every request of ``queue`` ended; the requests due are added before each step."""
    records = engine.records
    while queue.done < queue.total:
        now = engine.now
        while queue.may_arrive() and queue.next_time() <= now:
            req, records.arrival[req.request_id] = queue.pop(now)
            if engine.add(make_sequence(req), req.max_new_tokens, now):
                queue.in_flight += 1
            else:
                queue.ended(req.request_id, now, started=False)
        if not engine.sched.has_unfinished:
            if queue.done >= queue.total:
                break
            if not queue.ready:
                raise RuntimeError("simulation stalled: requests remain but none can arrive")
            engine.now = max(now, queue.next_time())
            continue
        ended = engine.step()
        if ended is None:  # every waiting request waits for its tier load
            engine.now = _next_event(engine, queue)
            continue
        for sid in ended:
            queue.ended(sid, engine.now)
        if progress and ended:
            progress(queue.done, queue.total)


def _next_event(engine: SimEngine, queue: ArrivalQueue) -> float:
    """When something can happen after a step that scheduled nothing: a tier load finishes, or a
    request arrives."""
    times = [t for t in (engine.next_load(),) if t is not None]
    if queue.may_arrive() and queue.next_time() > engine.now:
        times.append(queue.next_time())
    if not times:
        raise RuntimeError("simulation stalled: waiting requests can neither load nor be admitted")
    return min(times)


def readmission_keys(stats: Iterable[KVCacheStats]) -> dict[str, Any]:
    """The summary's re-admission keys over managers' ``stats``: what re-admissions after a preemption
    found again (counted in ``hit_tokens`` / ``tier_hit_tokens`` too) and the hit rates without them."""
    queried = hit = external = r_queried = r_hit = r_external = readmissions = 0
    for st in stats:
        queried += st.queried_tokens
        hit += st.hit_tokens
        external += st.external_tokens
        readmissions += st.readmissions
        r_queried += st.readmitted_queried_tokens
        r_hit += st.readmitted_hit_tokens
        r_external += st.readmitted_external_tokens
    first = queried - r_queried
    return {
        "readmissions": readmissions, "readmitted_queried_tokens": r_queried,
        "readmitted_hit_tokens": r_hit, "readmitted_tier_hit_tokens": r_external,
        "first_admission_hit_rate": (hit - r_hit) / first if first else 0.0,
        "first_admission_tier_hit_rate": (external - r_external) / first if first else 0.0,
        "first_admission_total_hit_rate": (hit + external - r_hit - r_external) / first if first else 0.0,
    }


def tier_keys(cfg: SimConfig, tiers: list[SimTiers], load_s: float, stored_bytes: int, hit: int, external: int,
              queried: int) -> dict[str, Any]:
    """The summary's tier keys (``tiers`` to ``tier_lookup_probes``) of engines with ``tiers``."""
    return {
        "tiers": [t.label for t in cfg.tiers],
        "tier_hit_tokens": external,
        "tier_hit_rate": external / queried if queried else 0.0,
        "total_hit_rate": (hit + external) / queried if queried else 0.0,
        "tier_load_s": load_s,
        "tier_loads": cfg.tier_loads if tiers else None,
        "tier_storage": tiers[0].connector.storage.name if tiers else None,
        "tier_stored_bytes": stored_bytes,
        "tier_lookup_probes": sum(t.connector.stats.probes for t in tiers),
    }


def _summary(workload: Workload, cfg: SimConfig, engine: SimEngine, plan: dict[str, Any]) -> dict[str, Any]:
    """``SimResult.summary`` of a single-engine run."""
    mgr, sched, records, cost, tiers = engine.mgr, engine.sched, engine.records, engine.cost, engine.tiers
    now, st, timeline = engine.now, mgr.stats, engine.timeline
    output_tokens = records.output_tokens
    summary: dict[str, Any] = {
        "workload": workload.name, "model": cfg.model, "gpu": cfg.gpu, "retention": mgr.retention.name,
        "admission": cfg.admission, "requests": len(workload.requests), "finished": sched.stats.finished,
        "rejected": records.rejected, "preemptions": sched.stats.preemptions, "steps": engine.steps,
        "duration_s": now, "output_tokens": output_tokens,
        "throughput_tokens_per_s": output_tokens / now if now else 0.0,
        "throughput_requests_per_s": sched.stats.finished / now if now else 0.0,
        "prefix_hit_rate": st.hit_rate, "hit_tokens": st.hit_tokens, "queried_tokens": st.queried_tokens,
        "lost_hit_tokens": dict(st.lost_hit_tokens),
        **records.latency_summary(),
        "kv_capacity_tokens": plan["kv_capacity_tokens"] if cfg.kv_cache_tokens is None else None,
        "efficiency": asdict(cost.efficiency), "cost_model": cost.efficiency_source,
        "lm_head": "per_sample" if cost.lm_head_params else "per_token",
        "num_blocks": mgr.layout.num_blocks, "max_concurrency": plan["max_concurrency"],
        "peak_running": engine.peak_running,
        "kv_usage_mean": sum(u for _, u, _ in timeline) / len(timeline),
        "kv_usage_max": max(u for _, u, _ in timeline),
        **tier_keys(cfg, [tiers] if tiers is not None else [], sum(tiers.load_s) if tiers is not None else 0.0,
                    sum(t.stats.bytes_written for t in tiers.tiers) if tiers is not None else 0,
                    st.hit_tokens, st.external_tokens, st.queried_tokens),
        **readmission_keys([st]),
        "rejected_too_long": records.too_long,
        "tier_stats": tiers.summary() if tiers is not None else {},
        "spec_decode": engine.spec.summary(),
    }
    if cfg.kv_cache_tokens is not None:
        rep = capacity_report(mgr.layout, max_model_len=mgr.max_model_len,
                              max_num_batched_tokens=mgr.max_num_batched_tokens)
        summary["kv_capacity_tokens"] = rep.token_capacity
        summary["max_concurrency"] = rep.max_concurrency
    return summary

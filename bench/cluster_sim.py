"""Routers compared on a simulated cluster, side by side in one run, against one replica 8x as big.

    python bench/cluster_sim.py [--trace ../shared/traces/mooncake_synthetic_trace.jsonl] [--requests 3000|all]
        [--workloads trace,conversations] [--tiers none,host:256GiB] [--instances 8] [--concurrency 64]
        [--routers hybrid_exact,prefix,least_loaded,round_robin] [--jobs N] [--explain] [--json FILE [--per-request]]

``--instances`` simulated replicas of ``--model`` on ``--gpu`` (each its own scheduler, device pool and,
with a host tier, its own tier; ``hybridkv.sim.cluster``) behind each router, a closed loop of
``--concurrency`` requests in flight:

* ``hybrid_exact``: the request goes to the replica holding most of its prompt (device and tiers, the
  hybrid rule, from the replicas' KV events) unless that replica is overloaded (``--balance``,
  ``--slack``); a new prefix to its home on a consistent-hash ring;
* ``prefix``: hit of the full-attention chain against queue length (what deployed routers do);
* ``least_loaded``; ``round_robin``;
* ``one big replica``: the upper bound, one replica with ``--instances`` times the device pool and
  ``--instances`` times each tier (the same requests; its TTFT is one GPU's and not comparable);
* ``one pooled replica``: the cluster's hardware as one replica: ``--instances`` times the pool and the
  tiers (capacity and bandwidth), tensor parallel over ``--instances`` GPUs and ``--instances`` times
  the step's token budget, so it serves the requests in about the cluster's time. The big replica
  has one GPU's compute and takes about six times as long; the pooled one shows what one pool gains
  at the cluster's speed (docs/CLUSTER.md, "The two upper bounds"). ``--no-big`` skips both.

Workloads: ``trace``, the first ``--requests`` requests of a Mooncake trace in file order (``--requests
all``: the whole trace; ``trace@N``: the ``--requests`` after its first N, another window of the same trace;
``--workloads trace,trace@500,trace@993`` compares the routers on three);
``conversations``, ``--conversations`` chats of ``--turns`` turns (each turn's prompt is the previous
turn's prompt, its answer and a new user message, after a system prompt of ``--system-prompt-len``
tokens, each chat's own unless ``--shared-system-prompt``), turns of one chat in order.

Prints per workload and tier setting: device and total (device + tier) prefix-hit rates of first
admissions (re-admissions after a preemption left out, as vLLM counts them), TTFT p50 / mean / p99,
requests per replica, preemptions and what their re-admissions found again, what decided the
routing, wall time; and the routing targets:
``hybrid_exact``'s total hit rate >= 1.5x ``round_robin``'s and >= every other router's, its TTFT p50
<= every other router's, and >= 80% of the big replica's total hit rate (and where 1.5x round robin
lies above the big replica's, that it is out of reach), and, for reference, its share of the pooled
replica's; for a trace, the share of its prompt tokens an
unbounded cache could serve from earlier prompts. ``--explain`` adds, per router,
where each request's reusable tokens were and what sent it elsewhere.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridkv.core import capacity_report
from hybridkv.errors import InvalidInputError
from hybridkv.sim.cluster import OUTCOMES, ROUTERS, ClusterConfig, simulate_cluster
from hybridkv.sim.mooncake import read_mooncake
from hybridkv.sim.simulator import SimConfig, build_manager
from hybridkv.sim.tiers import TierSpec, parse_tiers
from hybridkv.sim.workloads import ClosedLoop, LengthDist, Workload, multi_turn_chat

BIG = "one big replica"
POOLED = "one pooled replica"
BOUNDS = (BIG, POOLED)
TOTAL = "first_admission_total_hit_rate"
"""The hit rate the routing targets compare: device + tier hits of first admissions, as vLLM's
``prefix_cache_hits`` counts them (a preempted request finding its own blocks again is not reuse
between requests, and would favour the routers whose replicas preempt more)."""
DEFAULT_TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def workload(args: argparse.Namespace, name: str) -> Workload:
    skip = trace_skip(name)
    if skip is not None:
        return read_mooncake(args.trace, limit=args.requests, skip=skip, concurrency=args.concurrency,
                             mark_last_block=args.mark_last_block)
    return multi_turn_chat(args.conversations, args.turns, system_prompt_len=args.system_prompt_len,
                           user_len=LengthDist(median=args.user_len, sigma=0.5, min_len=16),
                           max_new_tokens=LengthDist(median=args.output_len, sigma=0.5, min_len=8),
                           arrivals=ClosedLoop(args.concurrency), shared_system_prompt=args.shared_system_prompt,
                           seed=args.seed)


def request_count(text: str) -> int | None:
    """``--requests``: a positive number of trace requests, or ``all`` (None: the whole trace)."""
    if text == "all":
        return None
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of requests or 'all'")
    return int(text)


def trace_skip(name: str) -> int | None:
    """The trace requests a workload name skips (``trace``: 0, ``trace@N``: N); None for another workload."""
    if name == "trace":
        return 0
    head, at, tail = name.partition("@")
    if head == "trace" and at and tail.isdigit():
        return int(tail)
    return None


def earlier_shares(w: Workload) -> list[tuple[int | None, int]]:
    """Per request of ``w``: the latest earlier request that shares the longest run of its leading
    prompt segments, and how many tokens that run holds ((None, 0) when none does; a trie over the
    segments' content keys, so answers a later prompt repeats are not seen)."""
    trie: dict[str, Any] = {}
    out: list[tuple[int | None, int]] = []
    for i, r in enumerate(w.requests):
        node, matching, shared, last = trie, True, 0, None
        for key, n in r.segments:
            child = node.get(key)
            if matching and child is not None:
                shared += min(n, child["tokens"])
                last = child["last"]
                matching = child["tokens"] >= n
            else:
                matching = False
            if child is None:
                child = node[key] = {"tokens": n, "next": {}}
            child["tokens"] = max(child["tokens"], n)
            child["last"] = i
            node = child["next"]
        out.append((last, shared))
    return out


def reuse_ceiling(w: Workload) -> float:
    """The share of ``w``'s prompt tokens an unbounded cache could serve from earlier prompts."""
    total = sum(r.prompt_len for r in w.requests)
    return sum(n for _, n in earlier_shares(w)) / total if total else 0.0


def system(args: argparse.Namespace, tiers: str, scale: int = 1, *, pooled: bool = False) -> SimConfig:
    """The simulated replica; ``scale`` times its device pool and tiers for the big one, and with
    ``pooled`` ``scale`` times its compute (tensor parallel), step token budget and tier bandwidth too."""
    specs = parse_tiers(tiers)
    cfg = SimConfig(model=args.model, gpu=args.gpu, tiers=specs)
    if scale == 1:
        return cfg
    planned, _ = build_manager(cfg)
    layout = planned.layout
    tokens = capacity_report(layout, max_model_len=planned.max_model_len,
                             max_num_batched_tokens=planned.max_num_batched_tokens).token_capacity
    link = scale if pooled else 1
    big = tuple(TierSpec(s.kind, s.capacity_bytes * scale, s.bandwidth * link, s.latency_s) for s in specs)
    cfg = replace(cfg, kv_cache_tokens=tokens * scale, tiers=big)
    if pooled:
        cfg = replace(cfg, tensor_parallel_size=cfg.tensor_parallel_size * scale,
                      max_num_batched_tokens=cfg.max_num_batched_tokens * scale, max_num_seqs=cfg.max_num_seqs * scale)
    return cfg


def one(args: argparse.Namespace, task: tuple[str, str, str]) -> dict[str, Any]:
    name, tiers, router = task
    w = workload(args, name)
    bound = router in BOUNDS
    cfg = system(args, tiers, args.instances if bound else 1, pooled=router == POOLED)
    cluster = ClusterConfig(instances=1 if bound else args.instances, router="round_robin" if bound else router,
                            balance=args.balance, slack=args.slack, miss_weight=args.miss_weight,
                            junction_weight=args.junction_weight,
                            explain=args.explain and not bound)
    t = time.perf_counter()
    result = simulate_cluster(w, cfg, cluster)
    s = result.summary
    s["wall_s"] = time.perf_counter() - t
    if args.per_request:
        s["per_request"] = result.requests  # replica, hit, predicted hit, arrival, TTFT, finish
    s["prompt_tokens"] = sum(r.prompt_len for r in w.requests)
    return s


def check(label: str, ok: bool) -> str:
    return f"{label}: {'met' if ok else 'NOT met'}"


def report(rows: dict[str, dict[str, Any]], title: str, explain: bool) -> list[str]:
    print(f"\n{title}")
    print(f"{'router':18s} {'device hit':>10s} {'total hit':>9s} {'TTFT p50':>8s} {'mean':>7s} {'p99':>7s} "
          f"{'per replica':>11s} {'preempted (re-hit)':>18s} {'wall':>6s}  decided by")
    for router, s in rows.items():
        routed = list(s["routed"].values())
        decided = ", ".join(f"{k} {v}" for k, v in sorted(s["decisions"].items())) if router not in BOUNDS else "-"
        again = s["readmitted_hit_tokens"] + s["readmitted_tier_hit_tokens"]
        preempted = f"{s['preemptions']} ({again / 1e6:.2f}M)"
        print(f"{router:18s} {s['first_admission_hit_rate']:10.2%} {s[TOTAL]:9.2%} {s['ttft_p50_s']:7.2f}s "
              f"{s['ttft_mean_s']:6.2f}s {s['ttft_p99_s']:6.2f}s {min(routed):>5d}-{max(routed):<5d} "
              f"{preempted:>18s} {s['wall_s']:5.0f}s  {decided}")
    if explain:
        print("where each request's reusable tokens were (requests, reusable tokens):")
        for router, s in rows.items():
            b = s.get("routing_breakdown")
            if b:
                print(f"  {router:16s} " + "; ".join(f"{o} {b[o]['requests']} ({b[o]['reusable_tokens'] / 1e6:.2f}M)"
                                                     for o in OUTCOMES))
    verdicts = []
    he = rows.get("hybrid_exact")
    if he is not None:
        others = {r: s for r, s in rows.items() if r != "hybrid_exact" and r not in BOUNDS}
        total = he[TOTAL]
        if "round_robin" in rows:
            rr = rows["round_robin"][TOTAL]
            ratio = total / rr if rr else math.inf
            label = f"hybrid_exact / round_robin total hit rate {ratio:.2f}x (>= 1.5x)"
            bound = rows[BIG][TOTAL] if BIG in rows else None
            if ratio < 1.5 and bound is not None and 1.5 * rr > bound:  # not even all the memory in one replica
                label += f"; out of reach: 1.5x is {1.5 * rr:.2%}, above the big replica's {bound:.2%}"
            verdicts.append(check(label, ratio >= 1.5))
        if others:
            best = max(others, key=lambda r: others[r][TOTAL])
            verdicts.append(check(f"hybrid_exact {total:.2%} >= every other router (best: {best} "
                                  f"{others[best][TOTAL]:.2%})", total >= others[best][TOTAL]))
            fastest = min(others, key=lambda r: others[r]["ttft_p50_s"])
            verdicts.append(check(f"hybrid_exact TTFT p50 {he['ttft_p50_s']:.2f}s <= every other router (best: "
                                  f"{fastest} {others[fastest]['ttft_p50_s']:.2f}s)",
                                  he["ttft_p50_s"] <= others[fastest]["ttft_p50_s"]))
        if BIG in rows:
            bound = rows[BIG][TOTAL]
            share = total / bound if bound else math.inf
            verdicts.append(check(f"hybrid_exact at {share:.0%} of the big replica's {bound:.2%} (>= 80%)",
                                  share >= 0.8))
        if POOLED in rows:
            pooled = rows[POOLED][TOTAL]
            part = f"{total / pooled:.0%}" if pooled else "all"
            verdicts.append(f"for reference: hybrid_exact at {part} of the pooled replica's {pooled:.2%} "
                            f"(one pool at the cluster's speed)")
    for v in verdicts:
        print("  " + v)
    return [f"{title}: {v}" for v in verdicts]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE), help="a Mooncake trace (JSON Lines)")
    ap.add_argument("--requests", type=request_count, default=3000,
                    help="the trace's first N requests, or 'all' for the whole trace")
    ap.add_argument("--workloads", default="trace,conversations")
    ap.add_argument("--conversations", type=int, default=128)
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--system-prompt-len", type=int, default=2000)
    ap.add_argument("--shared-system-prompt", action="store_true",
                    help="one system prompt for every conversation (default: each its own, so reuse comes only "
                         "from a conversation's history, as in a production conversation trace)")
    ap.add_argument("--user-len", type=int, default=600, help="median user message (tokens)")
    ap.add_argument("--output-len", type=int, default=250, help="median answer (tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tiers", default="none,host:256GiB", help="tier settings to compare, comma-separated")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--model", default="gemma-3-27b")
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--no-big", action="store_true", help="skip the big and the pooled replica")
    ap.add_argument("--balance", type=float, default=ClusterConfig.balance)
    ap.add_argument("--slack", type=int, default=ClusterConfig.slack)
    ap.add_argument("--miss-weight", type=float, default=ClusterConfig.miss_weight)
    ap.add_argument("--junction-weight", type=float, default=ClusterConfig.junction_weight)
    ap.add_argument("--mark-last-block", action="store_true",
                    help="a trace prompt's partial last block starts at a checkpoint hint, where the next turn "
                         "parts from it (docs/SIMULATOR.md, \"Mooncake traces\")")
    ap.add_argument("--explain", action="store_true", help="where reusable tokens were, per router")
    ap.add_argument("--jobs", type=int, default=None,
                    help="simulations run in parallel processes (default: one more than the CPUs, at most one "
                         "per simulation: the simulations differ in length, and a spare process keeps every CPU "
                         "busy until the last ends)")
    ap.add_argument("--json", default=None, help="write the summaries to this file")
    ap.add_argument("--per-request", action="store_true",
                    help="with --json: each request's replica, hit, predicted hit, arrival, TTFT and finish")
    args = ap.parse_args()
    if args.per_request and not args.json:
        print("--per-request needs --json FILE to write the records to", file=sys.stderr)
        raise SystemExit(2)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = [w for w in names if w != "conversations" and trace_skip(w) is None]
    if unknown:
        print(f"--workloads: unknown workload {unknown[0]!r}; choose trace, trace@N (the trace after its "
              f"first N requests) or conversations", file=sys.stderr)
        raise SystemExit(2)
    if any(trace_skip(w) is not None for w in names) and not Path(args.trace).is_file():
        print(f"--trace {args.trace}: no such file", file=sys.stderr)
        raise SystemExit(2)
    routers = [r.strip() for r in args.routers.split(",")] + ([] if args.no_big else [BIG])
    if not args.no_big:
        try:
            build_manager(system(args, "none", args.instances, pooled=True))
            routers.append(POOLED)
        except InvalidInputError as e:  # e.g. the model's heads do not split over --instances GPUs
            print(f"no pooled replica: {e}", file=sys.stderr)
    tier_settings = [t.strip() for t in args.tiers.split(",")]
    tasks = [(w, t, r) for w in names for t in tier_settings for r in routers]
    t0 = time.perf_counter()
    jobs = args.jobs if args.jobs is not None else min(len(tasks), (os.cpu_count() or 1) + 1)
    with ProcessPoolExecutor(max_workers=max(1, jobs)) as pool:
        results = list(pool.map(one, [args] * len(tasks), tasks))
    wall = time.perf_counter() - t0
    by_task = dict(zip(tasks, results, strict=True))
    verdicts = []
    for w in names:
        # A chat's later prompts repeat its answers, which its segments do not show: traces only.
        ceiling = reuse_ceiling(workload(args, w)) if trace_skip(w) is not None else None
        for t in tier_settings:
            rows = {r: by_task[(w, t, r)] for r in routers}
            s0 = next(iter(rows.values()))
            title = (f"{w} ({s0['workload']}): {s0['requests']} requests, {s0['prompt_tokens'] / 1e6:.1f}M prompt "
                     f"tokens, {args.instances} x {args.model} / {args.gpu} "
                     f"({rows[routers[0]]['kv_capacity_tokens']:,} KV tokens each), closed loop {args.concurrency}, "
                     f"tiers {t}")
            if ceiling is not None:
                title += f"; an unbounded cache could serve {ceiling:.1%} of the prompt tokens"
            verdicts += report(rows, title, args.explain)
    print(f"\n{len(tasks)} simulations in {wall:.0f} s ({jobs} process{'es' if jobs != 1 else ''})")
    if args.json:
        out = {f"{w} | {t} | {r}": s for (w, t, r), s in by_task.items()}
        Path(args.json).write_text(json.dumps({"results": out, "verdicts": verdicts}, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Routers compared on a simulated cluster: hit rate and TTFT per routing policy on a Mooncake trace.

    python bench/cluster_sim.py --trace mooncake_trace.jsonl [--requests 1500] [--instances 8]
        [--model gemma-3-27b] [--gpu h100-80gb] [--time-scale 1.0] [--tier net:1TiB] [--jobs 2]

``--instances`` simulated replicas of ``--model`` on ``--gpu`` (each its own scheduler and device
pool, ``hybridkv.sim.cluster``) behind each router: ``round_robin``, ``least_loaded``, ``prefix`` (an
index of the full-attention chain alone, what deployed KV-aware routers keep) and ``hybrid_exact``
(the hybrid rule: chain, window blocks at the hit point), the index fed by the replicas' own KV
events. The trace's first ``--requests`` requests at their logged arrivals (times ``--time-scale``).

Prints per router: the cluster's device prefix-hit rate (and total with a tier), TTFT mean / p50 /
p99, how requests spread over replicas, and how the router's prediction for the replica it chose
compared with the hit that replica's manager found at admission. For the hit-aware routers also:
requests where a chain-only index predicted more than the replica could serve (the window blocks
at the chain's hit point were gone) and requests where the chain-only favourite serves less than
the best replica. Targets: ``hybrid_exact`` >= 1.5x ``round_robin``'s hit rate, never below ``prefix``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from hybridkv.sim.cluster import ROUTERS, ClusterConfig, simulate_cluster
from hybridkv.sim.mooncake import read_mooncake
from hybridkv.sim.simulator import SimConfig
from hybridkv.sim.tiers import parse_tiers


def one(args: argparse.Namespace, router: str) -> dict[str, Any]:
    workload = read_mooncake(args.trace, limit=args.requests, time_scale=args.time_scale)
    cfg = SimConfig(model=args.model, gpu=args.gpu, tiers=parse_tiers(args.tier) if args.tier else ())
    t = time.perf_counter()
    res = simulate_cluster(workload, cfg, ClusterConfig(instances=args.instances, router=router))
    s = res.summary
    s["wall_s"] = time.perf_counter() - t
    s["prompt_tokens"] = sum(r.prompt_len for r in workload.requests)
    s["span_s"] = workload.requests[-1].arrival_time
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="a Mooncake trace (JSON Lines)")
    ap.add_argument("--requests", type=int, default=1500, help="the trace's first N requests")
    ap.add_argument("--instances", type=int, default=8)
    ap.add_argument("--model", default="gemma-3-27b")
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--tier", default=None, help="tiers as in --compare tier=..., e.g. net:1TiB (net is shared)")
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--jobs", type=int, default=2, help="routers simulated in parallel processes")
    ap.add_argument("--json", default=None, help="write the summaries to this file")
    args = ap.parse_args()
    if not Path(args.trace).is_file():
        print(f"--trace {args.trace}: no such file", file=sys.stderr)
        raise SystemExit(2)
    routers = [r.strip() for r in args.routers.split(",")]
    with ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = dict(zip(routers, pool.map(one, [args] * len(routers), routers), strict=True))
    s0 = next(iter(results.values()))
    print(f"{s0['workload']}: first {s0['requests']} requests ({s0['prompt_tokens']:,} prompt tokens over "
          f"{s0['span_s']:.0f} s, time scale {args.time_scale}) on {args.instances} x {args.model} / {args.gpu}, "
          f"{s0['kv_capacity_tokens']:,} KV tokens per replica" + (f", tiers {args.tier}" if args.tier else ""))
    head = (f"{'router':14s} {'hit rate':>8s} {'total':>7s} {'TTFT mean':>9s} {'p50':>7s} {'p99':>7s} "
            f"{'routed min-max':>14s} {'pred = / > / <':>16s} {'chain over':>16s} {'chain pick worse':>16s} "
            f"{'wall':>6s}")
    print(head)
    for router, s in results.items():
        routed = s["routed"].values()
        pred = (f"{s['prediction_equal']} / {s['prediction_over']} / {s['prediction_under']}"
                if router in ("prefix", "hybrid_exact") else "-")
        over = (f"{s['chain_over_requests']} ({s['chain_over_tokens'] / 1e3:,.0f}k tok)"
                if router in ("prefix", "hybrid_exact") else "-")
        worse = str(s["hit_policy_disagreements"]) if router in ("prefix", "hybrid_exact") else "-"
        print(f"{router:14s} {s['prefix_hit_rate']:8.1%} {s['total_hit_rate']:7.1%} {s['ttft_mean_s']:8.2f}s "
              f"{s['ttft_p50_s']:6.2f}s {s['ttft_p99_s']:6.2f}s {min(routed):>6d} - {max(routed):<5d} {pred:>16s} "
              f"{over:>16s} {worse:>16s} {s['wall_s']:5.0f}s")
    if "hybrid_exact" in results:
        he = results["hybrid_exact"]["prefix_hit_rate"]
        if "round_robin" in results:
            rr = results["round_robin"]["prefix_hit_rate"]
            ratio = he / rr if rr else float("inf")
            print(f"hybrid_exact / round_robin hit rate: {ratio:.2f}x (target >= 1.5x): "
                  f"{'met' if ratio >= 1.5 else 'NOT met'}")
        if "prefix" in results:
            px = results["prefix"]["prefix_hit_rate"]
            print(f"hybrid_exact - prefix hit rate: {100 * (he - px):+.2f} points (target >= 0): "
                  f"{'met' if he >= px else 'NOT met'}")
    print("pred = / > / <: requests whose hit at admission equalled / fell short of / exceeded the router's "
          "prediction for the replica it chose; chain over: requests where a full-attention-only index predicted "
          "more than that replica could serve; chain pick worse: requests where the replica a chain-only index "
          "likes best serves less than the best replica")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()

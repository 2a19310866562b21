"""The window-retention shared-prefix sweep with external KV tiers: hit rate and TTFT per tier set.

    python bench/tier_sweep.py [--quick] [--prefixes 15,20,30,40,60] [--requests 150]
                               [--tiers none,host:64GiB,host:64GiB+disk:1TiB] [--storage spans+spill]
                               [--jobs 2]
                               [--plot docs/tier_sweep.png] [--json FILE]

Gemma 3 27B (sliding window 1,024 on 52 of 62 layers) on an H100, a pool of 1.47M full-attention
tokens, 28,000-token shared prefixes + 200-token unique suffixes, 64 output tokens, closed loop
x16, window retention: the retention workload of bench/founding_scenarios.py, with fewer requests
(that scenario runs 600) to keep a run to a few minutes. From ~40 prefixes the prefixes outgrow the
device pool; the tiers (``hybridkv.sim.tiers``: capacity, bandwidth and latency per GPU, loads
through the real connector, write-through stores) serve what the pool evicted. One prefix
written through takes 28,000 tokens x 62 layers x 8 KiB = 13 GiB of a tier (every layer's
blocks, the sliding-window ones included), so host:64GiB holds about 4.8 prefixes and disk:1TiB
about 77.

``--storage`` (comma-separated: ``spans+spill``, ``hit-spans``, ``all``) picks what the tiers keep
(``SimConfig.tier_storage``; one row per tier set and storage). Columns: device = prefix-cache hit
rate, tier = tokens loaded from tiers, total = both (prompt tokens not computed), TTFT mean / p50,
load = seconds of tier loads in all steps, wall = seconds to simulate. ``--quick``: prefixes
15,30,60 and 60 requests.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from hybridkv.sim.simulator import SimConfig, simulate
from hybridkv.sim.tiers import parse_tiers
from hybridkv.sim.workloads import ClosedLoop, shared_prefix

PREFIX_LEN = 28_000


def one(prefixes: int, requests: int, tiers: str, storage: str = "spans+spill") -> dict[str, Any]:
    """One simulation of the sweep: its row."""
    w = shared_prefix(requests, prefixes, PREFIX_LEN, 200, max_new_tokens=64, arrivals=ClosedLoop(16), seed=3)
    cfg = SimConfig(model="gemma-3-27b", gpu="h100-80gb", max_model_len=32768, max_num_batched_tokens=8192,
                    kv_cache_tokens=1_470_000, retention="window", tiers=parse_tiers(tiers),
                    tier_storage=storage)
    t0 = time.perf_counter()
    s = simulate(w, cfg).summary
    return {"prefixes": prefixes, "tiers": tiers, "storage": storage if tiers != "none" else "-",
            "requests": requests,
            "prefix_hit_rate": s["first_admission_hit_rate"], "tier_hit_rate": s["first_admission_tier_hit_rate"],
            "total_hit_rate": s["first_admission_total_hit_rate"], "preemptions": s["preemptions"],
            "ttft_mean_s": s["ttft_mean_s"], "ttft_p50_s": s["ttft_p50_s"],
            "ttft_p90_s": s["ttft_p90_s"], "tier_load_s": s["tier_load_s"], "duration_s": s["duration_s"],
            "tier_stats": s["tier_stats"], "wall_s": time.perf_counter() - t0}


HEADER = (f"{'prefixes':>8} {'tiers':<22} {'storage':<12} {'device':>7} {'tier':>6} {'total':>6} {'TTFT mean':>10} "
          f"{'TTFT p50':>9} {'load':>7} {'preempt':>7} {'wall':>6}")


def fmt(r: dict[str, Any]) -> str:
    return (f"{r['prefixes']:>8} {r['tiers']:<22} {r['storage']:<12} {r['prefix_hit_rate']:>7.1%} "
            f"{r['tier_hit_rate']:>6.1%} {r['total_hit_rate']:>6.1%} {r['ttft_mean_s']:>9.3f}s "
            f"{r['ttft_p50_s']:>8.3f}s {r['tier_load_s']:>6.1f}s {r['preemptions']:>7} {r['wall_s']:>5.1f}s")


def plot(rows: list[dict[str, Any]], tier_sets: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    variants = list(dict.fromkeys((r["tiers"], r["storage"]) for r in rows))
    for (tiers, storage), marker in zip(variants, "osD^v<>xP*"):
        pts = sorted((r for r in rows if (r["tiers"], r["storage"]) == (tiers, storage)), key=lambda r: r["prefixes"])
        label = f"tiers: {tiers}" + (f" ({storage})" if storage != "-" else "")
        xs = [r["prefixes"] for r in pts]
        a.plot(xs, [r["total_hit_rate"] * 100 for r in pts], marker=marker, label=label)
        b.plot(xs, [r["ttft_mean_s"] * 1000 for r in pts], marker=marker, label=label)
    a.set(title="hit rate (device + tiers)", xlabel="shared prefixes of 28k tokens", ylabel="% of prompt tokens")
    b.set(title="mean TTFT", xlabel="shared prefixes of 28k tokens", ylabel="ms")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"window-retention sweep with KV tiers, gemma-3-27b on h100-80gb, {rows[0]['requests']} requests "
                 "(hybridkv simulate)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefixes", default="15,20,30,40,60")
    ap.add_argument("--requests", type=int, default=150)
    ap.add_argument("--tiers", default="none,host:64GiB,host:64GiB+disk:1TiB",
                    help="tier sets to compare, comma-separated; '+' joins the tiers of one set")
    ap.add_argument("--storage", default="spans+spill",
                    help="what the tiers keep, comma-separated: spans+spill, hit-spans, all")
    ap.add_argument("--quick", action="store_true", help="prefixes 15,30,60 and 60 requests")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="simulations run in parallel processes (default: 2, or 1 on one core)")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    prefixes = [15, 30, 60] if args.quick else [int(x) for x in args.prefixes.split(",")]
    requests = 60 if args.quick else args.requests
    tier_sets = [t.strip() for t in args.tiers.split(",")]
    for t in tier_sets:
        parse_tiers(t)  # a bad spec fails before any simulation
    print(f"gemma-3-27b on h100-80gb, pool of 1.47M full-attention tokens, window retention, {requests} requests, "
          f"{PREFIX_LEN:,}-token shared prefixes + 200-token suffixes, 64 output tokens, closed loop x16")
    print(HEADER, flush=True)
    storages = [s.strip() for s in args.storage.split(",")]
    for s in storages:
        if s not in ("spans+spill", "hit-spans", "all"):
            ap.error(f"--storage: expected spans+spill, hit-spans or all, got {s!r}")
    jobs = [(p, requests, t, s) for p in prefixes for t in tier_sets
            for s in (storages if t != "none" else storages[:1])]
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            for r in pool.map(one, *zip(*jobs)):
                rows.append(r)
                print(fmt(r), flush=True)
    else:
        for job in jobs:
            rows.append(one(*job))
            print(fmt(rows[-1]), flush=True)
    print(f"total wall time {time.perf_counter() - t0:.0f} s")
    if args.plot:
        plot(rows, tier_sets, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

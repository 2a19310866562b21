"""A Mooncake trace through ``hybridkv simulate`` with and without KV tiers, against LRU ceilings.

    python bench/tier_mooncake.py TRACE.jsonl [--requests 3000] [--concurrency 32] [--model gemma-3-27b]
        [--gpu h100-80gb] [--max-model-len 131072] [--tier host:1TiB] [--interval 16384]
        [--variants none,all,hit-spans,spans+spill,interval] [--jobs 2] [--plot docs/tier_mooncake.png] [--json FILE]

TRACE is a Mooncake FAST'25 trace (``timestamp`` ms, ``input_length``, ``output_length``, ``hash_ids``
of 512-token blocks), e.g. the synthetic trace of the release. Its first ``--requests`` requests run
as a closed loop of ``--concurrency`` through the real scheduler and manager (``hybridkv simulate
--workload trace --trace-format mooncake``), once per variant:

* ``none``: the device pool alone (window retention);
* ``all``: ``--tier``, every layer of every block stored (what tiers did before);
* ``hit-spans``: ``--tier``, per group what a hit can use (``StoreHitSpans``: growing layers every
  block, the window at junctions and at each prompt's last full 512-token block);
* ``spans+spill`` (the default storage): every block, those outside ``hit-spans``' spans at low
  priority (``StoreSpansSpill``: the tier evicts them first and never for them; one that serves a hit
  becomes normal);
* ``interval``: ``hit-spans`` plus a window checkpoint every ``--interval`` tokens;
* ``blocking``: ``hit-spans`` with loads added to the step that admits them (not asynchronous).

The ceilings (``hybridkv.sim.ceilings``) replay the same requests one at a time through an LRU of the
tier's capacity, at 512-token block granularity: ``growing`` stores only the growing layers (windows
for free: an upper bound), ``end-checkpoint`` adds one window checkpoint per request at its last full
block (the target's reference: the simulated total hit rate should reach >= 90% of it), ``junctions``
also checkpoints shared-prefix junctions, ``interval`` junctions plus every ``--interval`` tokens, and
``infinite`` holds everything. Prints one row per ceiling and per variant (device / tier / total hit
rate, TTFT, tier bytes, simulation wall and CPU seconds); ``--plot`` draws hit rates and TTFT CDFs.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridkv.sim.ceilings import lru_ceiling
from hybridkv.sim.mooncake import MOONCAKE_BLOCK_SIZE, read_mooncake
from hybridkv.sim.simulator import SimConfig, build_manager, simulate
from hybridkv.sim.tiers import group_block_bytes, parse_tiers

VARIANTS = {
    "none": {"tiers": "none"},
    "all": {"tier_storage": "all"},
    "hit-spans": {"tier_storage": "hit-spans"},
    "spans+spill": {"tier_storage": "spans+spill"},
    "interval": {"tier_storage": "hit-spans", "interval": True},
    "blocking": {"tier_storage": "hit-spans", "tier_loads": "blocking"},
}


def config(args: argparse.Namespace, variant: str) -> SimConfig:
    v = VARIANTS[variant]
    cfg = SimConfig(model=args.model, gpu=args.gpu, max_model_len=args.max_model_len,
                    tiers=parse_tiers(str(v.get("tiers", args.tier))))
    if "tier_storage" in v:
        cfg = replace(cfg, tier_storage=str(v["tier_storage"]))
    if v.get("interval"):
        cfg = replace(cfg, tier_checkpoint_interval=args.interval)
    if "tier_loads" in v:
        cfg = replace(cfg, tier_loads=str(v["tier_loads"]))
    return cfg


def run_variant(args: argparse.Namespace, variant: str) -> dict[str, Any]:
    w = read_mooncake(args.trace, concurrency=args.concurrency, limit=args.requests)
    t0, c0 = time.perf_counter(), time.process_time()
    res = simulate(w, config(args, variant))
    s = res.summary
    tier = next(iter(s["tier_stats"].values()), {})
    return {"variant": variant, "device": s["first_admission_hit_rate"], "tier": s["first_admission_tier_hit_rate"],
            "total": s["first_admission_total_hit_rate"], "preemptions": s["preemptions"],
            "ttft_mean_s": s["ttft_mean_s"], "ttft_p50_s": s["ttft_p50_s"], "ttft_p90_s": s["ttft_p90_s"],
            "stored_bytes": s["tier_stored_bytes"], "used_bytes": tier.get("used_bytes", 0),
            "loaded_bytes": tier.get("loaded_bytes", 0), "load_s": s["tier_load_s"],
            "finished": s["finished"], "rejected": s["rejected"], "duration_s": s["duration_s"],
            "wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "ttfts": res.ttfts}


def ceilings(args: argparse.Namespace) -> dict[str, float]:
    """The LRU ceilings of the tier's capacity on the same requests (module docstring)."""
    w = read_mooncake(args.trace, concurrency=args.concurrency, limit=args.requests)
    mgr, _ = build_manager(SimConfig(model=args.model, gpu=args.gpu, max_model_len=args.max_model_len))
    sizes = group_block_bytes(mgr)
    groups = mgr.layout.groups
    growing = [g for g in range(len(groups)) if groups[g].spec.grows_with_sequence]
    per_token = sum(sizes[g] / groups[g].spec.block_size for g in growing)

    def checkpoint(p: int) -> float:
        return float(sum(len(mgr.hit_span(g, p)) * sizes[g] for g in range(len(groups)) if g not in growing))

    capacity = sum(t.capacity_bytes for t in parse_tiers(args.tier))
    common = {"growing_bytes_per_token": per_token, "checkpoint_bytes": checkpoint,
              "block_size": MOONCAKE_BLOCK_SIZE, "alignment": mgr.hit_alignment,
              "max_prompt_tokens": mgr.max_model_len}
    out = {}
    for name, model, every in (("infinite", "infinite", 0), ("growing", "growing", 0),
                               ("end-checkpoint", "end-checkpoint", 0), ("junctions", "junctions", 0),
                               ("interval", "junctions", args.interval // MOONCAKE_BLOCK_SIZE)):
        out[name] = lru_ceiling(w.requests, capacity, model=model, interval_blocks=every, **common).hit_rate
    return out


HEADER = (f"{'variant':<11} {'device':>7} {'tier':>7} {'total':>7} {'/ceiling':>8} {'TTFT mean':>10} {'p50':>8} "
          f"{'p90':>8} {'written':>10} {'held':>9} {'loaded':>9} {'preempt':>7} {'wall':>7} {'cpu':>7}")


def fmt(r: dict[str, Any], reference: float) -> str:
    tib = 2**40
    return (f"{r['variant']:<11} {r['device']:>7.1%} {r['tier']:>7.1%} {r['total']:>7.1%} "
            f"{r['total'] / reference if reference else 0:>8.1%} {r['ttft_mean_s']:>9.2f}s {r['ttft_p50_s']:>7.2f}s "
            f"{r['ttft_p90_s']:>7.2f}s {r['stored_bytes'] / tib:>7.2f}TiB {r['used_bytes'] / tib:>6.2f}TiB "
            f"{r['loaded_bytes'] / tib:>6.2f}TiB {r['preemptions']:>7} {r['wall_s']:>6.1f}s {r['cpu_s']:>6.1f}s")


def plot(rows: list[dict[str, Any]], ceil: dict[str, float], args: argparse.Namespace, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = [r["variant"] for r in rows]
    a.bar(names, [r["device"] * 100 for r in rows], label="device pool", color="#4c72b0")
    a.bar(names, [r["tier"] * 100 for r in rows], bottom=[r["device"] * 100 for r in rows], label="tier",
          color="#dd8452")
    for (name, value), style in zip(ceil.items(), ("-", "--", "-.", ":", (0, (1, 3)))):
        a.axhline(value * 100, color="gray", linestyle=style, linewidth=1, label=f"LRU ceiling: {name}")
    a.set(title=f"hit rate (tokens), tier {args.tier}", ylabel="% of prompt tokens")
    a.legend(fontsize=7, loc="upper left")
    for r in rows:
        xs = sorted(r["ttfts"])
        b.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r["variant"])
    b.set(title="TTFT CDF", xlabel="seconds", ylabel="fraction of requests", xscale="log")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    fig.suptitle(f"{Path(args.trace).name}: first {args.requests} requests, closed loop x{args.concurrency}, "
                 f"{args.model} on {args.gpu} (hybridkv simulate)", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--model", default="gemma-3-27b")
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--max-model-len", type=int, default=131072)
    ap.add_argument("--tier", default="host:1TiB")
    ap.add_argument("--interval", type=int, default=16384, help="tokens between interval checkpoints")
    ap.add_argument("--variants", default="none,all,hit-spans,spans+spill,interval")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    w = read_mooncake(args.trace, concurrency=args.concurrency, limit=args.requests)
    tokens = sum(r.prompt_len for r in w.requests)
    print(f"{Path(args.trace).name}: {len(w.requests)} requests, {tokens / 1e6:.1f}M prompt tokens, closed loop "
          f"x{args.concurrency}; {args.model} on {args.gpu}, max-model-len {args.max_model_len}, tier {args.tier}")
    t0 = time.perf_counter()
    ceil = ceilings(args)
    print(f"LRU ceilings for the tier's bytes ({time.perf_counter() - t0:.1f} s): "
          + ", ".join(f"{k} {v:.1%}" for k, v in ceil.items()))
    reference = ceil["end-checkpoint"]
    print(HEADER, flush=True)
    rows: list[dict[str, Any]] = []
    if args.jobs > 1:
        with ProcessPoolExecutor(args.jobs) as pool:
            for r in pool.map(run_variant, [args] * len(variants), variants):
                rows.append(r)
                print(fmt(r, reference), flush=True)
    else:
        for v in variants:
            rows.append(run_variant(args, v))
            print(fmt(rows[-1], reference), flush=True)
    for r in rows:
        if r["variant"] in ("hit-spans", "spans+spill", "interval"):
            verdict = "meets" if r["total"] >= 0.9 * reference else "misses"
            print(f"{r['variant']}: total hit rate {r['total']:.1%} = {r['total'] / reference:.0%} of the "
                  f"end-checkpoint ceiling {reference:.1%} ({verdict} the >= 90% target; growing-only ceiling "
                  f"{ceil['growing']:.1%})")
    if args.plot:
        plot(rows, ceil, args, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({"ceilings": ceil, "rows": [{k: v for k, v in r.items() if k != "ttfts"}
                                                                           for r in rows]}, indent=1))


if __name__ == "__main__":
    main()

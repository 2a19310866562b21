"""The behaviours hybridkv was founded on, reproduced with the simulator.

    python bench/founding_scenarios.py [--only bound,capacity,retention] [--plot docs/retention_sweep.png]
        [--json FILE]

* bound -- the admission bound: a 16k-token request on Gemma 3 12B with a pool where counting
  every sliding-window block at admission never admits it (a scheduler deadlock): hybridkv admits
  and finishes all.
* capacity -- growing-groups capacity: the planner's max concurrency equals the concurrency the
  simulation reaches.
* retention -- window retention: 15/20/30/40/60 shared prefixes of 28k tokens on a Gemma-class
  hybrid with a pool of ~1.47M tokens: prefix-hit rate and TTFT with retention ``none`` vs ``window``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from hybridkv.sim.simulator import SimConfig, build_manager, simulate
from hybridkv.sim.workloads import ClosedLoop, SimRequest, Workload, shared_prefix


def admission_bound() -> dict[str, Any]:
    cfg = SimConfig(model="gemma-3-12b", gpu="h100-80gb", max_model_len=16384, max_num_batched_tokens=2048,
                    kv_cache_tokens=40_000)
    mgr, _ = build_manager(cfg)
    usable = mgr.layout.num_blocks - 1
    naive = sum(-(-16384 // g.spec.block_size) for g in mgr.layout.groups)
    bounded = mgr.blocks_needed_when_empty(16384)
    w = shared_prefix(8, 8, 16000, 200, max_new_tokens=64, arrivals=ClosedLoop(4), seed=1)
    s = simulate(w, cfg).summary
    print(f"admission bound: Gemma 3 12B, {len(mgr.layout.groups)} groups, pool of {usable} usable blocks; "
          f"a 16,384-token "
          f"request counts {naive} blocks if every group's blocks are counted (never admitted: deadlock), "
          f"{bounded} with the per-request bounds -> {s['finished']}/{s['requests']} 16k-token requests finished, "
          f"{s['rejected']} rejected, {s['preemptions']} preemptions")
    return {"usable_blocks": usable, "naive_blocks_per_request": naive, "bounded_blocks_per_request": bounded,
            "finished": s["finished"], "requests": s["requests"], "rejected": s["rejected"]}


def capacity() -> list[dict[str, Any]]:
    rows = []
    for model, gpu, tokens in (("gemma-3-27b", "h100-80gb", 200_000), ("gpt-oss-20b", "h100-80gb", 100_000),
                               ("llama-3.1-8b", "h100-80gb", 100_000)):
        cfg = SimConfig(model=model, gpu=gpu, max_model_len=8192, max_num_batched_tokens=2048,
                        kv_cache_tokens=tokens, admission="guaranteed_no_preemption", retention="none")
        # Unique prompts (no sharing), each growing to max_model_len: the planned per-request peak.
        w = Workload([SimRequest(f"r{i}", 0.0, ((f"unique-{i}", 2048),), 6144) for i in range(48)], 48, "unique")
        s = simulate(w, cfg).summary
        naive = s["num_blocks"] // max(1, len(build_manager(cfg)[0].layout.groups)) * 16
        print(f"capacity: {model}: planned max concurrency at 8,192 tokens {s['max_concurrency']}, reached "
              f"{s['peak_running']}; token capacity {s['kv_capacity_tokens']:,} (naive rule {naive:,})")
        rows.append({"model": model, "max_concurrency": s["max_concurrency"], "peak_running": s["peak_running"],
                     "kv_capacity_tokens": s["kv_capacity_tokens"], "naive_capacity_tokens": naive})
    return rows


def retention(prefix_counts: list[int], requests: int) -> list[dict[str, Any]]:
    rows = []
    print(f"window retention: gemma-3-27b (W=1024), pool of 1.47M full-attention tokens, {requests} requests, "
          "28,000-token shared prefixes + 200-token suffixes, 64 output tokens, closed loop x16")
    print(f"{'prefixes':>8} {'retention':>9} {'hit rate':>9} {'TTFT p50':>9} {'TTFT mean':>10} {'preempt':>7} "
          f"{'wall':>6}")
    for p in prefix_counts:
        w = shared_prefix(requests, p, 28_000, 200, max_new_tokens=64, arrivals=ClosedLoop(16), seed=3)
        for retention in ("none", "window"):
            cfg = SimConfig(model="gemma-3-27b", gpu="h100-80gb", max_model_len=32768, max_num_batched_tokens=8192,
                            kv_cache_tokens=1_470_000, retention=retention)
            t0 = time.perf_counter()
            s = simulate(w, cfg).summary
            print(f"{p:>8} {retention:>9} {s['first_admission_hit_rate']:>9.1%} {s['ttft_p50_s']:>8.3f}s "
                  f"{s['ttft_mean_s']:>9.3f}s {s['preemptions']:>7} {time.perf_counter() - t0:>5.1f}s", flush=True)
            rows.append({"prefixes": p, "retention": retention, "prefix_hit_rate": s["first_admission_hit_rate"],
                         "preemptions": s["preemptions"], "ttft_p50_s": s["ttft_p50_s"],
                         "ttft_mean_s": s["ttft_mean_s"]})
    return rows


def plot_retention(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for retention, marker in (("none", "o"), ("window", "s")):
        pts = [r for r in rows if r["retention"] == retention]
        xs = [r["prefixes"] for r in pts]
        a.plot(xs, [r["prefix_hit_rate"] * 100 for r in pts], marker=marker, label=f"retention={retention}")
        b.plot(xs, [r["ttft_mean_s"] * 1000 for r in pts], marker=marker, label=f"retention={retention}")
    a.set(title="prefix-hit rate", xlabel="shared prefixes of 28k tokens", ylabel="% of prompt tokens")
    b.set(title="mean TTFT", xlabel="shared prefixes of 28k tokens", ylabel="ms")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("window retention on gemma-3-27b, 1.47M-token pool (hybridkv simulate)")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="bound,capacity,retention")
    ap.add_argument("--prefixes", default="15,20,30,40,60")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out: dict[str, Any] = {}
    only = args.only.split(",")
    if "bound" in only:
        out["admission_bound"] = admission_bound()
    if "capacity" in only:
        out["capacity"] = capacity()
    if "retention" in only:
        out["retention"] = retention([int(x) for x in args.prefixes.split(",")], args.requests)
        if args.plot:
            plot_retention(out["retention"], args.plot)
            print(f"plot written to {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

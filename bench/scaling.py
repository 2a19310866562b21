"""Scaling curves: manager time per scheduler step, hybridkv next to the reference manager.

    python bench/scaling.py [--reference-venv PATH] [--quick] [--out docs/scaling.png] [--json FILE]

Four sweeps over the reference driver's workload (shared prefixes + unique suffixes, chunked
prefill, decodes, FCFS admission with preemption; ``reference_trace.py``), one panel each:

* running batch: 16 .. 1024 running sequences (full attention + one sliding window);
* prompt length: 1k .. 128k tokens (full attention, 16 running);
* number of KV-cache groups: 1 .. 6 (full attention + 0 .. 5 sliding windows of 128 .. 2048);
* pool size: 16k .. 1M blocks at a fixed workload (full attention): the manager's cost follows
  the blocks a step touches, not the size of the pool.

"Manager time per step" is the time spent in the manager's calls (lookup, allocate, free) divided
by the number of scheduler steps; block hashing is counted on neither side. With
``--reference-venv`` the reference runs the same points (``reference_side.py --sweep``) and its
curves are drawn dashed. Each side's figure is the best of two runs. The machine may be noisy:
compare the two curves of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from reference_trace import TraceConfig, build_workload, run_trace

ROOT = Path(__file__).resolve().parent.parent
REFERENCE_SIDE = Path(__file__).resolve().parent / "reference_side.py"


def sweeps(quick: bool) -> dict[str, tuple[str, list[dict[str, Any]]]]:
    """Per panel: its x-axis label and its points (TraceConfig overrides, a ``kind`` and ``x``)."""
    decode = 16 if quick else 32
    batches = [16, 64, 256, 1024] if quick else [16, 32, 64, 128, 256, 512, 1024]
    lengths = [1024, 8192, 131072] if quick else [1024, 4096, 16384, 65536, 131072]
    groups = [1, 2, 4, 6] if quick else [1, 2, 3, 4, 5, 6]
    pools = [16384, 131072, 1048576] if quick else [16384, 65536, 262144, 1048576]
    base = {"decode_steps": decode, "max_model_len": 8192}
    return {
        "batch": ("running sequences", [
            {**base, "kind": "hybrid", "x": b, "max_running": b, "requests": max(64, 2 * b),
             "token_budget": max(8192, 16 * b), "num_blocks": 48 * b + 16384}
            for b in batches]),
        "prompt": ("prompt tokens", [
            {**base, "kind": "full", "x": n, "max_running": 16, "requests": 32 if quick else 48, "prefixes": 4,
             "prefix_len": n - 256, "suffix_len": 256, "token_budget": 16384, "max_model_len": n + 256,
             "num_blocks": 20 * n // 16 + 4096}
            for n in lengths]),
        "groups": ("KV-cache groups", [
            {**base, "kind": f"groups-{k}", "x": k, "requests": 150 if quick else 300, "num_blocks": 16384 * k}
            for k in groups]),
        "pool": ("pool blocks", [
            {**base, "kind": "full", "x": nb, "requests": 150 if quick else 300, "num_blocks": nb}
            for nb in pools]),
    }


def trace_config(point: dict[str, Any]) -> TraceConfig:
    fields = {k: v for k, v in point.items() if k not in ("kind", "x")}
    return replace(TraceConfig(), **fields)


def run_ours(point: dict[str, Any]) -> float:
    """hybridkv's manager microseconds per scheduler step at ``point`` (best of two runs)."""
    cfg = trace_config(point)
    prompts = build_workload(cfg)
    best = min((run_trace(point["kind"], cfg, "none", prompts, hash_outside=True) for _ in range(2)),
               key=lambda r: r.manager_s / r.steps)
    return best.manager_s * 1e6 / best.steps


def run_reference(venv: Path, points: list[dict[str, Any]], workdir: Path) -> list[float]:
    """The reference's manager microseconds per scheduler step, one per point (best of two sweeps)."""
    sweep, out = workdir / "sweep.json", workdir / "out.json"
    sweep.write_text(json.dumps([{k: v for k, v in p.items() if k != "x"} for p in points]))
    runs = []
    for _ in range(2):
        subprocess.run([str(venv / "bin" / "python"), str(REFERENCE_SIDE), "--sweep", str(sweep), "--json", str(out)],
                       check=True, stdout=subprocess.DEVNULL)
        runs.append([r["manager_total_s"] * 1e6 / r["steps"] for r in json.loads(out.read_text())])
    return [min(values) for values in zip(*runs)]


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (name, panel) in zip(axes.flat, results.items()):
        xs = [p["x"] for p in panel["points"]]
        ax.plot(xs, [p["hybridkv_us"] for p in panel["points"]], "o-", color="tab:blue", label="hybridkv")
        if all(p.get("reference_us") for p in panel["points"]):
            ax.plot(xs, [p["reference_us"] for p in panel["points"]], "s--", color="tab:red", label="reference")
        ax.set_xscale("log" if name != "groups" else "linear")
        ax.set_yscale("log")
        ax.set_xlabel(panel["xlabel"])
        ax.set_ylabel("manager time per step (us)")
        ax.set_title({"batch": "running batch (full + sliding window)", "prompt": "prompt length (full attention)",
                      "groups": "KV-cache groups (64 running)", "pool": "pool size, fixed workload"}[name])
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("KV-cache manager time per scheduler step: hybridkv vs the reference manager")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference-venv", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="fewer points and shorter runs")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "scaling.png")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (xlabel, points) in sweeps(args.quick).items():
            ours = [run_ours(p) for p in points]
            ref = run_reference(args.reference_venv, points, Path(tmp)) if args.reference_venv else [None] * len(points)
            results[name] = {"xlabel": xlabel, "points": [
                {**p, "hybridkv_us": o, "reference_us": r} for p, o, r in zip(points, ours, ref)]}
            for p, o, r in zip(points, ours, ref):
                vs = f"  reference {r:9.1f} us  ratio {o / r:.2f}" if r else ""
                print(f"{name:>6} {xlabel} = {p['x']:>8}: hybridkv {o:9.1f} us per step{vs}", flush=True)
    plot(results, args.out)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

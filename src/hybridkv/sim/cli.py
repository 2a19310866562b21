"""``hybridkv simulate``: workloads through the real scheduler and manager, timed by a cost model.

``--tier KIND:SIZE[@BANDWIDTH][@LATENCY]`` (repeatable, queried in order) adds simulated external
KV tiers (``sim.tiers``), e.g. ``--tier host:64GiB --tier disk:1TiB@7GB/s``; ``--compare
tier=none,host:64GiB,host:64GiB+disk:1TiB`` runs one variant per tier set (``+`` joins tiers).
The summary then shows the tier and total hit rates, the tokens and bytes loaded per tier and the
load time; the JSON keys are documented in ``sim.simulator``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

from hybridkv.errors import InvalidInputError
from hybridkv.sim.simulator import SimConfig, SimResult, simulate
from hybridkv.sim.tiers import parse_tiers, tier_arg
from hybridkv.sim.workloads import (
    Arrivals,
    Bursty,
    ClosedLoop,
    LengthDist,
    Poisson,
    Workload,
    chat_lengths,
    multi_turn_chat,
    shared_prefix,
)
from hybridkv.sizes import size_arg

SUMMARY_ROWS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("requests finished / rejected", lambda s: f"{s['finished']} / {s['rejected']}"),
    ("simulated time", lambda s: f"{s['duration_s']:.1f} s"),
    ("throughput", lambda s: f"{s['throughput_tokens_per_s']:,.0f} tok/s, {s['throughput_requests_per_s']:.2f} req/s"),
    ("prefix-hit rate (tokens)", lambda s: f"{s['prefix_hit_rate']:.1%}"),
    ("TTFT p50 / p90 / p99", lambda s: f"{s['ttft_p50_s']:.3f} / {s['ttft_p90_s']:.3f} / {s['ttft_p99_s']:.3f} s"),
    ("ITL p50 / p90 / p99", lambda s: f"{s['itl_p50_s'] * 1e3:.1f} / {s['itl_p90_s'] * 1e3:.1f} / "
                                      f"{s['itl_p99_s'] * 1e3:.1f} ms"),
    ("preemptions", lambda s: str(s["preemptions"])),
    ("KV usage mean / max", lambda s: f"{s['kv_usage_mean']:.1%} / {s['kv_usage_max']:.1%}"),
    ("KV capacity", lambda s: f"{s['kv_capacity_tokens']:,} tokens, {s['num_blocks']:,} blocks"),
    ("max concurrency (plan) / peak running", lambda s: f"{s['max_concurrency']} / {s['peak_running']}"),
]

TIER_ROWS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("KV tiers", lambda s: " + ".join(s["tiers"]) or "none"),
    ("tier / total hit rate (tokens)", lambda s: f"{s['tier_hit_rate']:.1%} / {s['total_hit_rate']:.1%}"),
    ("tokens loaded from tiers", lambda s: f"{s['tier_hit_tokens']:,}"),
    ("loaded per tier (GB)", lambda s: ", ".join(f"{k.split(':', 1)[1]} {v['loaded_bytes'] / 1e9:,.1f}"
                                                 for k, v in s["tier_stats"].items()) or "-"),
    ("tier load time (all steps)", lambda s: f"{s['tier_load_s']:.2f} s"),
]
"""Rows added to the summary when any variant has tiers."""


def add_parser(sub: Any) -> None:
    """Register the ``simulate`` subcommand."""
    p = sub.add_parser("simulate", help="simulate a workload on a model + GPU with the real scheduler and manager")
    p.add_argument("--model", default="gemma-3-27b")
    p.add_argument("--gpu", default="h100-80gb")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--long-prefill-threshold", type=int, default=0)
    p.add_argument("--retention", choices=("none", "window"), default="window")
    p.add_argument("--admission", choices=("max_utilization", "guaranteed_no_preemption"), default="max_utilization")
    p.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="size the pool to this many tokens instead of from GPU memory")
    p.add_argument("--kv-cache-memory", type=size_arg, default=None, metavar="BYTES",
                   help="size the pool for this KV budget (e.g. 48MiB) as the reference engine plans it")
    p.add_argument("--weights-dtype", default="bf16", choices=("fp32", "bf16", "fp16", "fp8", "int4"))
    p.add_argument("--kv-dtype", default="bf16", choices=("fp32", "bf16", "fp16", "fp8"))
    p.add_argument("--calibration", default=None, metavar="PATH",
                   help="fit the cost model's efficiencies to measured steps in this JSON file")
    p.add_argument("--lm-head", choices=("per_token", "per_sample"), default="per_token",
                   help="charge the output projection per new token (generic) or per sampled sequence")
    p.add_argument("--workload", choices=("shared-prefix", "multi-turn", "chat", "trace"), default="shared-prefix")
    p.add_argument("--trace", default=None, help="JSONL trace (with --workload trace)")
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--prefixes", type=int, default=30)
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--suffix-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--popularity", choices=("uniform", "zipf"), default="uniform")
    p.add_argument("--conversations", type=int, default=100)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=1024)
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals (req/s); default: closed loop")
    p.add_argument("--burstiness", type=float, default=None, help="with --rate: bursty (gamma) arrivals")
    p.add_argument("--concurrency", type=int, default=64, help="closed-loop concurrency (without --rate)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tier", type=tier_arg, action="append", default=None, metavar="SPEC",
                   help="external KV tier, queried in the order given (repeatable): KIND:SIZE[@BANDWIDTH][@LATENCY] "
                        "with KIND host (default 25GB/s), disk (5GB/s, 100us) or net/redis (3GB/s, 1ms), "
                        "e.g. host:64GiB, disk:1TiB@7GB/s; per GPU")
    p.add_argument("--compare", default=None,
                   help="run variants: OPTION=V1,V2 (e.g. retention=none,window or tier=none,host:64GiB+disk:1TiB)")
    p.add_argument("--json", default=None, help="write the summary as JSON to PATH ('-' for stdout)")
    p.add_argument("--plot", default=None, help="write KV usage / hit rate over time and the TTFT CDF to a PNG")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)


def _arrivals(args: argparse.Namespace) -> Arrivals:
    if args.rate is None:
        return ClosedLoop(args.concurrency)
    if args.burstiness is not None:
        return Bursty(rate=args.rate, burstiness=args.burstiness)
    return Poisson(args.rate)


def build_workload(args: argparse.Namespace) -> Workload:
    """The workload the options describe."""
    if args.workload == "trace":
        if not args.trace:
            raise InvalidInputError("--workload trace needs --trace PATH")
        from hybridkv.sim.trace import read_trace

        return read_trace(args.trace)
    arrivals = _arrivals(args)
    if args.workload == "shared-prefix":
        return shared_prefix(args.requests, args.prefixes, args.prefix_len, args.suffix_len,
                             max_new_tokens=args.output_len, popularity=args.popularity, arrivals=arrivals,
                             seed=args.seed)
    if args.workload == "multi-turn":
        return multi_turn_chat(args.conversations, args.turns, system_prompt_len=args.system_prompt_len,
                               user_len=LengthDist(median=max(1, args.suffix_len), sigma=0.5, min_len=1),
                               max_new_tokens=args.output_len, arrivals=arrivals, seed=args.seed)
    return chat_lengths(args.requests, arrivals=arrivals, seed=args.seed)


def sim_config(args: argparse.Namespace) -> SimConfig:
    """The simulated system the options describe."""
    return SimConfig(model=args.model, gpu=args.gpu, tensor_parallel_size=args.tp, max_model_len=args.max_model_len,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                     long_prefill_token_threshold=args.long_prefill_threshold, retention=args.retention,
                     admission=args.admission, policy=args.policy, enable_prefix_caching=not args.no_prefix_caching,
                     kv_cache_tokens=args.kv_cache_tokens, kv_cache_memory=args.kv_cache_memory,
                     weights_dtype=args.weights_dtype, kv_dtype=args.kv_dtype, calibration=args.calibration,
                     lm_head=args.lm_head, tiers=tuple(args.tier or ()))


_OPTIONAL_INTS = ("max_model_len", "kv_cache_tokens", "kv_cache_memory", "gpu_memory_bytes")


def variants(base: SimConfig, compare: str | None) -> list[tuple[str, SimConfig]]:
    """``[(label, config)]``: the base alone, or one variant per value of ``OPTION=V1,V2``.

    ``tier`` (or ``tiers``) takes tier sets: ``none`` or specs joined by ``+`` (``sim.tiers``)."""
    if not compare:
        return [("", base)]
    if "=" not in compare:
        raise InvalidInputError(f"--compare expects OPTION=V1,V2, got {compare!r}")
    key, values = compare.split("=", 1)
    name = key.strip().replace("-", "_")
    if name in ("tier", "tiers"):
        return [(f"tier={raw.strip()}", replace(base, tiers=parse_tiers(raw))) for raw in values.split(",")]
    known = {f.name: f for f in fields(SimConfig)}
    if name not in known:
        raise InvalidInputError(f"--compare: unknown option {key!r}; known: {', '.join(known)}")
    current = getattr(base, name)
    out = []
    for raw in values.split(","):
        raw = raw.strip()
        value: Any = raw
        if isinstance(current, bool):
            value = raw.lower() in ("1", "true", "yes", "on")
        elif isinstance(current, int) or name in _OPTIONAL_INTS:
            value = int(raw)
        elif isinstance(current, float):
            value = float(raw)
        out.append((f"{name}={raw}", replace(base, **{name: value})))
    return out


def _progress(label: str, enabled: bool) -> Callable[[int, int], None] | None:
    if not enabled:
        return None
    state = {"t": 0.0}
    tty = sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        now = time.perf_counter()
        if not tty:  # a log file gets one line per variant, not a redrawn bar
            if done == total:
                sys.stderr.write(f"{label}: {done}/{total} requests simulated\n")
            return
        if done == total or now - state["t"] > 0.2:
            state["t"] = now
            width = 30
            filled = int(width * done / total)
            sys.stderr.write(f"\r{label:<24} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()

    return report


def run(args: argparse.Namespace) -> int:
    """Simulate, print the summary (side by side for ``--compare``), write JSON / plot."""
    workload = build_workload(args)
    results: list[tuple[str, SimResult]] = []
    show = not args.no_progress
    for label, cfg in variants(sim_config(args), args.compare):
        t0 = time.perf_counter()
        res = simulate(workload, cfg, progress=_progress(label or "simulating", show))
        res.summary["wall_s"] = time.perf_counter() - t0
        results.append((label, res))
    if args.json:
        doc: Any = results[0][1].summary if len(results) == 1 else {lbl: r.summary for lbl, r in results}
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    if args.json != "-":
        print_summary(workload, results)
    if args.plot:
        from hybridkv.sim.plot import plot_results

        plot_results(results, args.plot)
        if args.json != "-":
            print(f"plot written to {args.plot}")
    return 0


def print_summary(workload: Workload, results: list[tuple[str, SimResult]]) -> None:
    """A side-by-side table of the variants (rich when installed)."""
    s0 = results[0][1].summary
    title = (f"{workload.name}: {len(workload.requests)} requests on {s0['model']} / {s0['gpu']}"
             + (f", closed loop x{workload.concurrency}" if workload.concurrency else ""))
    labels = [lbl or "result" for lbl, _ in results]
    spec_rows = SUMMARY_ROWS + (TIER_ROWS if any(r.summary["tiers"] for _, r in results) else [])
    rows = [(name, [fmt(r.summary) for _, r in results]) for name, fmt in spec_rows]
    rows.append(("simulation wall time", [f"{r.summary['wall_s']:.1f} s" for _, r in results]))
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        width = max(len(n) for n, _ in rows)
        print(" " * width + "  " + "  ".join(f"{lbl:>28}" for lbl in labels))
        for name, vals in rows:
            print(f"{name:<{width}}  " + "  ".join(f"{v:>28}" for v in vals))
        return
    table = Table(title=title)
    table.add_column("")
    for lbl in labels:
        table.add_column(lbl, justify="right")
    for name, vals in rows:
        table.add_row(name, *vals)
    Console(width=max(110, Console().width)).print(table)

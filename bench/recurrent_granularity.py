"""Prefix hits on recurrent hybrids: a state spread over pages (split) against one page per state (unified).

    python bench/recurrent_granularity.py [--prefixes 100,400,1000,3000] [--suffix 200] [--requests 200]
        [--json FILE]

The reference engine's layout (``--recurrent-pages unified``) grows attention blocks until one page
holds a whole recurrent state (544 tokens on Qwen3-Next at TP 2), so a hit can only end at a multiple
of that block. The split layout (the default) keeps 16-token attention blocks and spreads a state
over as many pages as it needs, one KV-cache group per page. For each model and shared-prefix
length this runs the same closed-loop workload (8 prefixes, a 200-token unique suffix, 32 output
tokens, 16 in flight) through the simulator with each layout, side by side, and prints the
prefix-hit rate, the shared share of the prompt (the most any cache can hit), the ratio of the two
(target: >= 0.90) and max concurrency at 32k tokens (target: split within 3% of unified), with what
checkpoints cost in pages. Each request marks its prefix's end as a checkpoint hint (a chat server
marks the system prompt's end), so the first request of a prefix writes the state there and only it
misses: with 25 requests per prefix the ceiling is 24/25 of the share rounded down to the block (a
100-token prefix: 96 of 100 tokens). The column ``no hints`` runs the split layout with the hints
removed: the second request must then reveal the junction first (ceiling 23/25).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

from hybridkv.sim.simulator import SimConfig, build_manager, simulate
from hybridkv.sim.workloads import ClosedLoop, shared_prefix

MODELS = {
    "qwen3-next-80b-a3b": {"gpu": "h200-141gb", "tensor_parallel_size": 2},
    "nemotron-h-8b": {"gpu": "h100-80gb", "tensor_parallel_size": 1},
}


def run(model: str, pages: str, prefix: int, args: argparse.Namespace, hints: bool = True) -> dict[str, Any]:
    cfg = SimConfig(model=model, max_model_len=32768, recurrent_pages=pages, **MODELS[model])  # type: ignore[arg-type]
    work = shared_prefix(args.requests, 8, prefix, args.suffix, max_new_tokens=32, arrivals=ClosedLoop(16))
    if not hints:
        work = dataclasses.replace(work, requests=[dataclasses.replace(r, checkpoint_hints=()) for r in work.requests])
    start = time.perf_counter()
    result = simulate(work, cfg)
    return {"hit_rate": result.summary["prefix_hit_rate"], "wall_s": time.perf_counter() - start}


def capacity(model: str, pages: str) -> dict[str, Any]:
    cfg = SimConfig(model=model, max_model_len=32768, recurrent_pages=pages, **MODELS[model])  # type: ignore[arg-type]
    mgr, report = build_manager(cfg)
    states = mgr.layout.recurrent_states
    per_state = {g for st in states for g in st.groups}
    bound = sum(report["groups"][g]["blocks_per_request"] for g in per_state)
    return {"max_concurrency": report["max_concurrency"], "block_size": report["block_size"],
            "pages_per_state": len(states[0].groups), "state_pages_per_request": bound,
            "blocks_per_request": report["blocks_per_request"], "bytes_per_block": report["bytes_per_block"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefixes", default="100,400,1000,3000", help="shared-prefix lengths, comma-separated")
    ap.add_argument("--suffix", type=int, default=200, help="unique tokens after the prefix")
    ap.add_argument("--requests", type=int, default=200, help="requests per run")
    ap.add_argument("--models", default=",".join(MODELS), help="presets, comma-separated")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    out: dict[str, Any] = {}
    for model in args.models.split(","):
        caps = {pages: capacity(model, pages) for pages in ("split", "unified")}
        out[model] = {"capacity": caps, "runs": {}}
        print(f"\n{model} ({MODELS[model]['gpu']}, TP {MODELS[model]['tensor_parallel_size']}): attention blocks "
              f"{caps['split']['block_size']} (split) vs {caps['unified']['block_size']} (unified); a state spans "
              f"{caps['split']['pages_per_state']} pages")
        print(f"{'prefix':>7} {'share':>6} {'split':>7} {'unified':>8} {'split/share':>12} {'>=0.90':>7} "
              f"{'>=unified':>10} {'no hints':>9} {'wall split':>11} {'wall unified':>13}")
        for prefix in (int(p) for p in args.prefixes.split(",")):
            share = prefix / (prefix + args.suffix)
            split, unified = run(model, "split", prefix, args), run(model, "unified", prefix, args)
            bare = run(model, "split", prefix, args, hints=False)
            ratio = split["hit_rate"] / share
            out[model]["runs"][prefix] = {"share": share, "split": split, "unified": unified, "split_no_hints": bare}
            beats = "yes" if split["hit_rate"] >= unified["hit_rate"] else "NO"
            print(f"{prefix:>7} {share:>6.3f} {split['hit_rate']:>7.3f} {unified['hit_rate']:>8.3f} {ratio:>12.3f} "
                  f"{'yes' if ratio >= 0.9 else 'NO':>7} {beats:>10} {bare['hit_rate']:>9.3f} "
                  f"{split['wall_s']:>10.1f}s {unified['wall_s']:>12.1f}s")
        s, u = caps["split"], caps["unified"]
        print(f"max concurrency at 32768 tokens: split {s['max_concurrency']}, unified {u['max_concurrency']} "
              f"({s['max_concurrency'] / u['max_concurrency'] - 1:+.1%}); a request's states (the one read, one "
              f"checkpoint, the one written) take {s['state_pages_per_request']} of its {s['blocks_per_request']} "
              f"pages of {s['bytes_per_block']} bytes (split)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

"""Bytes a KV tier stores per cached token, every layer of every block against per group what a hit can use.

    python bench/tier_bytes.py TRACE.jsonl [--requests 400] [--models gemma-3-27b,gpt-oss-120b,llama-4-scout,
        qwen3-next-80b-a3b] [--interval 0] [--json FILE]

The first ``--requests`` requests of a Mooncake trace (closed loop of 32, max-model-len 131,072, one GPU
of each model's usual deployment: Gemma 3 27B and GPT-OSS 120B (int4 weights) on one H100, Llama 4
Scout and Qwen3-Next 80B at tensor parallelism 4) go through ``hybridkv simulate`` with a host tier too
large to evict anything, once storing every layer of every block (``all``) and once what a hit can
use (``hit-spans``). "Cached tokens" are the tokens of the growing (full-attention) blocks the tier
holds -- the prefix it can serve -- and bytes per cached token are the tier's bytes over them (per
GPU: one tensor-parallel rank's shard). Also printed: the bytes of every layer of one token, and the
total hit rate of each run (the tier never evicts, so the difference is the hit points lost by
keeping windows only at checkpoints).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from hybridkv.sim.mooncake import read_mooncake
from hybridkv.sim.simulator import SimConfig, build_manager, simulate
from hybridkv.sim.tiers import SimTiers, group_block_bytes, parse_tiers

MODELS: dict[str, dict[str, Any]] = {
    "gemma-3-27b": {},
    "gpt-oss-120b": {"weights_dtype": "int4"},
    "llama-4-scout": {"tensor_parallel_size": 4},
    "qwen3-next-80b-a3b": {"tensor_parallel_size": 4},
}


def measure(trace: str, requests: int, model: str, storage: str, interval: int) -> dict[str, Any]:
    w = read_mooncake(trace, concurrency=32, limit=requests)
    cfg = SimConfig(model=model, max_model_len=131072, tiers=parse_tiers("host:1024TiB"), tier_storage=storage,
                    tier_checkpoint_interval=interval, **MODELS[model])
    held: dict[str, Any] = {}
    original = SimTiers.summary

    def keep(self: SimTiers) -> dict[str, Any]:  # the tier's contents at the end of the run
        held["per_group"] = self.tiers[0].entries_per_group()
        held["used"] = self.tiers[0].used_bytes
        return original(self)

    SimTiers.summary = keep  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        s = simulate(w, cfg).summary
    finally:
        SimTiers.summary = original  # type: ignore[method-assign]
    mgr, _ = build_manager(cfg)
    groups = mgr.layout.groups
    growing = [g for g in range(len(groups)) if groups[g].spec.grows_with_sequence]
    cached = sum(held["per_group"].get(g, 0) * groups[g].spec.block_size for g in growing[:1])
    sizes = group_block_bytes(mgr)
    every_layer = sum(sizes[g] / groups[g].spec.block_size for g in range(len(groups)))
    return {"model": model, "storage": storage, "used_bytes": held["used"], "cached_tokens": cached,
            "bytes_per_cached_token": held["used"] / cached if cached else 0.0, "every_layer_per_token": every_layer,
            "total_hit_rate": s["total_hit_rate"], "wall_s": time.perf_counter() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--interval", type=int, default=0, help="hit-spans: a window checkpoint every N tokens too")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    print(f"{Path(args.trace).name}: first {args.requests} requests, closed loop x32, an unbounded host tier")
    print(f"{'model':<20} {'every layer/token':>17} {'all: B/token':>13} {'hit-spans: B/token':>19} {'ratio':>6} "
          f"{'hit rate all / spans':>21}")
    rows = []
    for model in args.models.split(","):
        pair = [measure(args.trace, args.requests, model, storage, args.interval) for storage in ("all", "hit-spans")]
        rows += pair
        a, h = pair
        ratio = h["bytes_per_cached_token"] / a["bytes_per_cached_token"]
        print(f"{model:<20} {a['every_layer_per_token'] / 1024:>13.1f} KiB "
              f"{a['bytes_per_cached_token'] / 1024:>9.1f} KiB {h['bytes_per_cached_token'] / 1024:>15.1f} KiB "
              f"{ratio:>6.2f} {a['total_hit_rate']:>10.1%} / {h['total_hit_rate']:.1%}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

"""How fast the simulator runs: 10,000 requests with 100k-token contexts.

    python bench/sim_speed.py [--requests 10000] [--prefixes 20] [--prefix-len 100000]

GPT-OSS 20B (sliding window 128 + full attention, MXFP4 ~ int4 weights) on an H100, 20 shared
prefixes of 100,000 tokens + 256-token unique suffixes, 32 output tokens, closed loop of 64.
Prints the wall time of the whole simulation (workload generation included) and its summary.
"""

from __future__ import annotations

import argparse
import time

from hybridkv.sim.simulator import SimConfig, simulate
from hybridkv.sim.workloads import ClosedLoop, shared_prefix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--prefixes", type=int, default=20)
    ap.add_argument("--prefix-len", type=int, default=100_000)
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args()
    t0 = time.perf_counter()
    w = shared_prefix(args.requests, args.prefixes, args.prefix_len, 256, max_new_tokens=args.output_len,
                      arrivals=ClosedLoop(64))
    cfg = SimConfig(model="gpt-oss-20b", gpu="h100-80gb", max_model_len=131072, weights_dtype="int4")
    s = simulate(w, cfg).summary
    wall = time.perf_counter() - t0
    print(f"{args.requests} requests x {args.prefix_len + 256:,}-token contexts: simulated in {wall:.1f} s wall "
          f"({wall / args.requests * 1e3:.2f} ms per request); {s['steps']} steps, hit rate "
          f"{s['prefix_hit_rate']:.1%}, {s['finished']} finished, simulated time {s['duration_s']:.0f} s")


if __name__ == "__main__":
    main()

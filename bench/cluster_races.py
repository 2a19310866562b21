"""Which requests hit under one router and not another, and whether the last earlier request of
their prefix was still running when they arrived (a race with its blocks' eviction).

    python bench/cluster_sim.py --workloads trace --tiers none --routers hybrid_exact,prefix --no-big \\
        --json runs.json --per-request
    python bench/cluster_races.py runs.json [--trace ../shared/traces/mooncake_synthetic_trace.jsonl] \\
        [--a hybrid_exact] [--b prefix] [--tiers none] [--workload trace] [--beyond TOKENS]

For each request with a device hit (of more than ``--beyond`` tokens: on a trace whose every prompt
starts with one system prompt, its length) under exactly one of the routers ``--a`` and ``--b``: the
earlier request sharing the most of its prompt's leading tokens (the latest of equals), and, under
the router that hit and the one that did not, whether that request was still running when this one
arrived, and how long before it had ended. Prints one line per request and the counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cluster_sim import DEFAULT_TRACE, earlier_shares, trace_skip
from hybridkv.sim.mooncake import read_mooncake


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", help="bench/cluster_sim.py --json FILE --per-request")
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--a", default="hybrid_exact")
    ap.add_argument("--b", default="prefix")
    ap.add_argument("--tiers", default="none")
    ap.add_argument("--workload", default="trace", help="trace or trace@N, as bench/cluster_sim.py ran it")
    ap.add_argument("--beyond", type=int, default=0, metavar="TOKENS",
                    help="a hit counts when it is longer than this (default 0: any hit)")
    args = ap.parse_args()
    if args.beyond < 0:
        print(f"--beyond {args.beyond}: must be 0 or more tokens", file=sys.stderr)
        raise SystemExit(2)
    skip = trace_skip(args.workload)
    if skip is None:
        print(f"--workload {args.workload!r}: races are read for a trace (trace or trace@N)", file=sys.stderr)
        raise SystemExit(2)
    try:
        results = json.loads(Path(args.runs).read_text())["results"]
        runs = {r: results[f"{args.workload} | {args.tiers} | {r}"]["per_request"] for r in (args.a, args.b)}
    except (OSError, ValueError, KeyError) as e:
        print(f"{args.runs}: no per-request records of {args.workload} | {args.tiers} | {args.a} and {args.b} "
              f"(run bench/cluster_sim.py with --json and --per-request): {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if not Path(args.trace).is_file():
        print(f"--trace {args.trace}: no such file", file=sys.stderr)
        raise SystemExit(2)
    ids = sorted(runs[args.a], key=lambda k: int(k.rsplit("-", 1)[1]))
    shared = earlier_shares(read_mooncake(args.trace, limit=len(ids), skip=skip))
    counts = {args.a: [0, 0], args.b: [0, 0]}
    for i, rid in enumerate(ids):
        hit = {r: runs[r][rid]["hit_tokens"] > args.beyond for r in runs}
        j, tokens = shared[i]
        if hit[args.a] == hit[args.b] or j is None:
            continue
        winner, loser = (args.a, args.b) if hit[args.a] else (args.b, args.a)
        prev = f"{rid.rsplit('-', 1)[0]}-{j}"
        running = {r: runs[r][prev]["finish_s"] > runs[r][rid]["arrival_s"] for r in runs}
        ended = runs[loser][rid]["arrival_s"] - runs[loser][prev]["finish_s"]
        counts[winner][0] += 1
        counts[winner][1] += running[winner]
        print(f"{rid}: hit only under {winner} ({runs[winner][rid]['hit_tokens']:,} tokens); shares {tokens:,} "
              f"leading tokens with {prev}, running at arrival under {winner}: {running[winner]}, under {loser}: "
              f"{running[loser]}" + ("" if running[loser] else f" (ended {ended:.1f} s before)"))
    for r, (n, running) in counts.items():
        print(f"hit only under {r}: {n} requests; the earlier request of the prefix still running in {running}")


if __name__ == "__main__":
    main()

"""Which requests hit under one router and not another, and whether the last earlier request of
their prefix was still running when they arrived (a race with its blocks' eviction).

    python bench/cluster_sim.py --workloads trace --tiers none --routers hybrid_exact,prefix --no-big \\
        --json runs.json --per-request
    python bench/cluster_races.py runs.json [--trace ../shared/traces/mooncake_synthetic_trace.jsonl] \\
        [--a hybrid_exact] [--b prefix] [--tiers none] [--workload trace] [--beyond TOKENS] [--by-sharer]

For each request with a device hit (of more than ``--beyond`` tokens: on a trace whose every prompt
starts with one system prompt, its length) under exactly one of the routers ``--a`` and ``--b``: the
earlier request sharing the most of its prompt's leading tokens (the latest of equals), and, under
the router that hit and the one that did not, whether that request was still running when this one
arrived, and how long before it had ended. Prints one line per request and the counts.

``--by-sharer`` prints instead, for ``--a`` and ``--b`` each, where the device hits of requests with an
earlier sharer were found and lost: the requests sorted by what their latest earlier sharer was doing
when they arrived (queued or in prefill, decoding, ended under 5 s, 5-30 s or 30 s or more before)
and by whether they went to its replica, with the tokens they shared with it and the tokens they hit
(as shares of the window's prompt tokens).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cluster_sim import DEFAULT_TRACE, earlier_shares, trace_skip
from hybridkv.sim.mooncake import read_mooncake

SHARER_STATES = ("queued or in prefill", "decoding", "ended < 5 s before", "ended 5-30 s before",
                 "ended >= 30 s before")
"""What a request's latest earlier sharer was doing when the request arrived (``--by-sharer``)."""


def sharer_state(sharer: dict[str, float], arrival: float) -> str:
    """``SHARER_STATES``: where ``sharer`` (a per-request record) was at ``arrival``."""
    if arrival < sharer["arrival_s"] + sharer["ttft_s"]:
        return SHARER_STATES[0]
    if arrival < sharer["finish_s"]:
        return SHARER_STATES[1]
    gap = arrival - sharer["finish_s"]
    return SHARER_STATES[2] if gap < 5 else SHARER_STATES[3] if gap < 30 else SHARER_STATES[4]


def by_sharer(router: str, run: dict[str, dict[str, float]], ids: list[str],
              shared: list[tuple[int | None, int]], prompt_tokens: int) -> None:
    """Print ``router``'s requests with an earlier sharer by the sharer's state and replica (``--by-sharer``)."""
    rows: dict[tuple[str, bool], list[int]] = {}
    prefix = ids[0].rsplit("-", 1)[0]
    for i, rid in enumerate(ids):
        j, tokens = shared[i]
        if j is None or not tokens:
            continue
        me, sharer = run[rid], run[f"{prefix}-{j}"]
        key = (sharer_state(sharer, me["arrival_s"]), sharer["replica"] == me["replica"])
        row = rows.setdefault(key, [0, 0, 0])
        row[0] += 1
        row[1] += tokens
        row[2] += int(me["hit_tokens"])
    print(f"{router}: requests with an earlier sharer, by what it was doing when they arrived")
    print(f"  {'sharer':22s} {'its replica':>11s} {'requests':>8s} {'shared':>7s} {'hit':>7s} {'hit/shared':>10s}")
    for state in SHARER_STATES:
        for same in (True, False):
            n, tokens, hit = rows.get((state, same), (0, 0, 0))
            if n:
                print(f"  {state:22s} {'yes' if same else 'no':>11s} {n:8d} {tokens / prompt_tokens:7.2%} "
                      f"{hit / prompt_tokens:7.2%} {hit / tokens:10.1%}")


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
    ap.add_argument("--by-sharer", action="store_true",
                    help="where each router's device hits were found and lost, by what the earlier sharer was doing")
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
    requests = read_mooncake(args.trace, limit=len(ids), skip=skip)
    shared = earlier_shares(requests)
    if args.by_sharer:
        prompt_tokens = sum(r.prompt_len for r in requests.requests)
        for router, run in runs.items():
            by_sharer(router, run, ids, shared, prompt_tokens)
        return
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

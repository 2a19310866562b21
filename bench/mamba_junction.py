"""Recurrent-state prefix caching at a shared-prefix junction, side by side with full attention.

    python bench/mamba_junction.py [--requests 300] [--num-blocks 3000,2000,1400,1000] [--json FILE]

The workload real chat traffic produces: one 4,096-token system prompt with a distinct 1,024-token
suffix per request (fan-out over one prefix), interleaved with unrelated 2,048-token prompts that
put the pool under pressure, replayed through the reference driver's scheduler loop
(``reference_trace.run_trace``: 64 running at most, an 8,192-token budget, 32 decode steps,
16-token blocks). For each pool size it prints the prefix-hit tokens of

* full attention only (the ceiling: every hit needs only the full-attention chain),
* full attention + one Mamba group in ``align`` mode, with retention ``none`` and ``window``,

and the ratio Mamba / full attention (target: >= 0.90). A Mamba hybrid can resume only from a
state checkpoint: the second request of the fan-out finds the junction (full attention matches
the system prompt, the recurrent group has no state there) and writes the state at the junction
inside its prefill; from the third request on, every request resumes there. Under pressure the
junction state lives as long as its full-attention anchor with ``window`` retention.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from reference_trace import TraceConfig, run_trace


def workload(requests: int, seed: int = 7) -> list[list[int]]:
    """Shared system prompt + distinct suffixes, every other request an unrelated prompt."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 32000) for _ in range(4096)]
    prompts = []
    for i in range(requests):
        if i % 2:
            prompts.append([rng.randrange(1, 32000) for _ in range(2048)])
        else:
            prompts.append(system + [rng.randrange(1, 32000) for _ in range(1024)])
    return prompts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--num-blocks", default="3000,2000,1400,1000")
    ap.add_argument("--json", default=None, help="write the rows as JSON to FILE")
    args = ap.parse_args()
    prompts = workload(args.requests)
    base = replace(TraceConfig(), requests=args.requests, decode_steps=32, max_running=64, token_budget=8192,
                   max_model_len=8192)
    rows = []
    print(f"{args.requests} requests: a 4,096-token system prompt + 1,024 distinct tokens, every other one an "
          f"unrelated 2,048-token prompt; hit tokens")
    print(f"{'blocks':>7} {'full only':>10} {'mamba/none':>11} {'mamba/window':>13} {'ratio none':>11} "
          f"{'ratio window':>13} {'seconds':>8}")
    for nb in (int(x) for x in args.num_blocks.split(",")):
        cfg = replace(base, num_blocks=nb)
        t0 = time.perf_counter()
        full = run_trace("full", cfg, "window", prompts)
        none = run_trace("mamba", cfg, "none", prompts)
        window = run_trace("mamba", cfg, "window", prompts)
        row = {"num_blocks": nb, "full_hit_tokens": full.tok_hit, "mamba_none_hit_tokens": none.tok_hit,
               "mamba_window_hit_tokens": window.tok_hit,
               "ratio_none": none.tok_hit / max(1, full.tok_hit),
               "ratio_window": window.tok_hit / max(1, full.tok_hit),
               "preemptions": [full.preemptions, none.preemptions, window.preemptions]}
        rows.append(row)
        print(f"{nb:>7} {full.tok_hit:>10,} {none.tok_hit:>11,} {window.tok_hit:>13,} {row['ratio_none']:>11.3f} "
              f"{row['ratio_window']:>13.3f} {time.perf_counter() - t0:>8.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

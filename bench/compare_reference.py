"""hybridkv and the reference engine's KV-cache manager, side by side on one trace.

    python bench/compare_reference.py --reference-venv /path/to/vllm-venv [--num-blocks 16384,4000]
                                      [--requests 2000] [--json FILE]

The reference side runs ``shared/reference/vllm/driver.py`` in its own virtual environment (build
it with ``shared/reference/vllm/install.sh /path/to/vllm-venv``: about a minute, 2.2 GB, outside
this tree). Both sides replay the same requests (the driver's ``build_workload`` with the same
seed) through the same scheduler loop. Block hashing is counted on neither side: the reference
hashes in ``Request()`` / ``append_output_token_ids`` outside its timed calls, and hybridkv's
replay hashes before each timed call (``hash_outside``).

For each configuration it prints manager microseconds per scheduled token and per call kind,
the prefix-hit rate, the hybridkv/reference ratio, and whether the two managers agreed on every
admission's hit tokens and every allocation's success (retention ``none``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from reference_trace import TraceConfig, build_workload, run_trace

DRIVER = Path(__file__).resolve().parent.parent.parent / "shared" / "reference" / "vllm" / "driver.py"
KINDS = ("full", "hybrid")
CALL_NAMES = {  # hybridkv call -> reference call
    "lookup": "get_computed_blocks",
    "allocate(admit)": "allocate_slots(admit)",
    "allocate(decode)": "allocate_slots(decode)",
    "allocate(prefill chunk)": "allocate_slots(prefill chunk)",
    "free": "free",
}


def run_reference(venv: Path, cfg: TraceConfig, workdir: Path) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """The driver's figures per kind and its event log per kind."""
    out = workdir / f"ref-{cfg.num_blocks}.json"
    prefix = workdir / f"ref-{cfg.num_blocks}"
    cmd = [str(venv / "bin" / "python"), str(DRIVER), "--skip-smoke", "--kinds", ",".join(KINDS),
           "--requests", str(cfg.requests), "--num-blocks", str(cfg.num_blocks), "--json", str(out),
           "--dump-trace", str(prefix)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    figures = {r["kind"]: r for r in json.loads(out.read_text())["results"]}
    logs: dict[str, list[Any]] = {}
    for kind in KINDS:
        events = []
        with open(f"{prefix}.{kind}.jsonl") as f:
            for line in f:
                e = json.loads(line)
                if e["op"] == "admit":
                    events.append(("admit", e["rid"], e["hit"], e["ok"]))
                elif e["op"] == "allocate_slots":
                    events.append(("allocate", e["rid"], e["num_new_tokens"], e["ok"]))
        logs[kind] = events
    return figures, logs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference-venv", required=True, type=Path)
    ap.add_argument("--num-blocks", default="16384,4000")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not (args.reference_venv / "bin" / "python").exists():
        print(f"no reference venv at {args.reference_venv}: build it with\n"
              f"    bash {DRIVER.parent / 'install.sh'} {args.reference_venv}", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for nb in (int(x) for x in args.num_blocks.split(",")):
            cfg = replace(TraceConfig(), num_blocks=nb, requests=args.requests)
            prompts = build_workload(cfg)
            ref, ref_logs = run_reference(args.reference_venv, cfg, Path(tmp))
            for kind in KINDS:
                events: list[tuple[str, str, int, bool]] = []
                ours = run_trace(kind, cfg, "none", prompts, hash_outside=True, events=events)
                mine = [e for e in events if e[0] in ("admit", "allocate")]
                agree = mine == ref_logs[kind]
                first_diff = next((i for i, (a, b) in enumerate(zip(mine, ref_logs[kind])) if a != b), None)
                r = ref[kind]
                tok_ref = r["tok_prefill"] + r["tok_decode"]
                us_ref = r["manager_total_s"] * 1e6 / tok_ref
                row = {
                    "config": f"{kind}-{nb}",
                    "us_per_token_hybridkv": ours.us_per_token,
                    "us_per_token_reference": us_ref,
                    "ratio": ours.us_per_token / us_ref,
                    "hit_rate_hybridkv": ours.hit_rate,
                    "hit_rate_reference": r["tok_hit"] / max(1, r["tok_hit"] + r["tok_prefill"]),
                    "agree": agree,
                    "first_disagreement": first_diff,
                    "calls_us": {
                        name: {"hybridkv": ours.call_s.get(name, 0) * 1e6 / max(1, ours.call_n.get(name, 0)),
                               "reference": r["calls"].get(ref_name, {}).get("us_per_call", 0.0)}
                        for name, ref_name in CALL_NAMES.items()
                    },
                }
                rows.append(row)
                calls = ", ".join(f"{k} {v['hybridkv']:.1f}/{v['reference']:.1f}" for k, v in row["calls_us"].items())
                print(f"{row['config']:>13}: {row['us_per_token_hybridkv']:.3f} vs {row['us_per_token_reference']:.3f}"
                      f" us/token (ratio {row['ratio']:.2f}); hit rate {row['hit_rate_hybridkv']:.4f} vs "
                      f"{row['hit_rate_reference']:.4f}; decisions agree: {agree}"
                      + (f" (first difference at event {first_diff})" if not agree else "")
                      + f"\n{'':>15}us per call hybridkv/reference: {calls}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

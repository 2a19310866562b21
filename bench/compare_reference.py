"""hybridkv and the reference engine's KV-cache manager, side by side on one trace.

    python bench/compare_reference.py --reference-venv /path/to/vllm-venv [--num-blocks 16384,4000]
        [--kinds full,hybrid,swa2,mamba] [--requests 2000] [--max-running 64] [--token-budget 8192]
        [--repeat 3] [--json FILE]

The reference side runs ``bench/reference_side.py`` (the shared ``shared/reference/vllm/driver.py``
with two more layouts) in its own virtual environment (build it with
``shared/reference/vllm/install.sh /path/to/vllm-venv``: about a minute, 2.2 GB, outside this
tree). Both sides replay the same requests (the driver's ``build_workload`` with the same seed)
through the same scheduler loop. Block hashing is counted on neither side: the reference hashes in
``Request()`` / ``append_output_token_ids`` outside its timed calls, and hybridkv's replay hashes
before each timed call (``hash_outside``).

Layouts (``--kinds``): ``full`` (full attention), ``hybrid`` (full + one sliding window),
``swa2`` (full + two sliding windows, 128 and 1024 tokens), ``mamba`` (full + Mamba in ``align``
mode). The machine may be shared and noisy: each side runs ``--repeat`` times, alternating, and
the fastest run of each side counts (per token and per call kind).

For each configuration it prints manager microseconds per scheduled token and per call kind, the
prefix-hit rate, the hybridkv/reference ratio, and whether the two managers agreed on every
admission's hit tokens and every allocation's success (retention ``none``). For ``mamba`` the two
managers checkpoint recurrent state at different positions (see ``MAMBA_NOTE``), so hit tokens are
not expected to agree there; the ratio per *served* token (prompt tokens, hit or computed, plus
decode tokens) is printed beside the ratio per scheduled token, which a higher hit rate inflates.
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

from reference_trace import KINDS, TraceConfig, TraceResult, build_workload, run_trace

REFERENCE_SIDE = Path(__file__).resolve().parent / "reference_side.py"
CALL_NAMES = {  # hybridkv call -> reference call
    "lookup": "get_computed_blocks",
    "allocate(admit)": "allocate_slots(admit)",
    "allocate(decode)": "allocate_slots(decode)",
    "allocate(prefill chunk)": "allocate_slots(prefill chunk)",
    "free": "free",
}
MAMBA_NOTE = (
    "hit tokens differ by design: hybridkv checkpoints recurrent state inside prefills at shared-prefix junctions "
    "and at the prompt's end (registered once computed); the reference checkpoints where its scheduler ends a "
    "chunk and at partial blocks (copy-on-write), and refuses a hit on a state cached in the same step"
)


def run_reference(venv: Path, cfg: TraceConfig, kinds: list[str], workdir: Path, dump: bool
                  ) -> tuple[dict[str, Any], dict[str, list[Any]], dict[str, str]]:
    """The reference's figures per kind, its event log per kind (if ``dump``), and kinds it cannot run."""
    out = workdir / f"ref-{cfg.num_blocks}.json"
    prefix = workdir / f"ref-{cfg.num_blocks}"
    cmd = [str(venv / "bin" / "python"), str(REFERENCE_SIDE), "--quiet", "--kinds", ",".join(kinds),
           "--requests", str(cfg.requests), "--num-blocks", str(cfg.num_blocks), "--max-running",
           str(cfg.max_running), "--token-budget", str(cfg.token_budget), "--json", str(out)]
    if dump:
        cmd += ["--dump-trace", str(prefix)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    data = json.loads(out.read_text())
    figures = {r["kind"]: r for r in data["results"]}
    logs: dict[str, list[Any]] = {}
    for kind in figures if dump else ():
        events = []
        with open(f"{prefix}.{kind}.jsonl") as f:
            for line in f:
                e = json.loads(line)
                if e["op"] == "admit":
                    events.append(("admit", e["rid"], e["hit"], e["ok"]))
                elif e["op"] == "allocate_slots":
                    events.append(("allocate", e["rid"], e["num_new_tokens"], e["ok"]))
        logs[kind] = events
    return figures, logs, data.get("errors", {})


def _best_reference(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest run, with each call kind's fastest per-call time."""
    best = dict(min(runs, key=lambda r: r["manager_total_s"]))
    best["calls"] = {k: {"us_per_call": min(r["calls"].get(k, {}).get("us_per_call", 0.0) for r in runs)}
                     for k in best["calls"]}
    return best


def _best_ours(runs: list[TraceResult]) -> tuple[TraceResult, dict[str, float]]:
    best = min(runs, key=lambda r: r.us_per_token)
    per_call = {k: min(r.call_s.get(k, 0.0) * 1e6 / max(1, r.call_n.get(k, 0)) for r in runs) for k in best.call_s}
    return best, per_call


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference-venv", required=True, type=Path)
    ap.add_argument("--num-blocks", default="16384,4000")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--max-running", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=3, help="runs per side; the fastest counts")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not (args.reference_venv / "bin" / "python").exists():
        print(f"no reference venv at {args.reference_venv}: build it with\n"
              f"    bash {REFERENCE_SIDE.parent.parent.parent / 'shared/reference/vllm/install.sh'} "
              f"{args.reference_venv}", file=sys.stderr)
        return 2
    kinds = args.kinds.split(",")
    print(f"{args.requests} requests, max_running={args.max_running}, token_budget={args.token_budget}, "
          f"best of {args.repeat} runs per side; block hashing counted on neither side", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for nb in (int(x) for x in args.num_blocks.split(",")):
            cfg = replace(TraceConfig(), num_blocks=nb, requests=args.requests, max_running=args.max_running,
                          token_budget=args.token_budget)
            prompts = build_workload(cfg)
            ref_runs: list[dict[str, Any]] = []
            our_runs: dict[str, list[TraceResult]] = {k: [] for k in kinds}
            events: dict[str, list[tuple[str, str, int, bool]]] = {k: [] for k in kinds}
            ref_logs: dict[str, list[Any]] = {}
            errors: dict[str, str] = {}
            for rep in range(args.repeat):
                figures, logs, errors = run_reference(args.reference_venv, cfg, kinds, Path(tmp), dump=rep == 0)
                ref_runs.append(figures)
                ref_logs.update(logs)
                for kind in kinds:
                    log = events[kind] if rep == 0 else None
                    our_runs[kind].append(run_trace(kind, cfg, "none", prompts, hash_outside=True, events=log))
            for kind in kinds:
                ours, our_calls = _best_ours(our_runs[kind])
                if kind in errors:
                    print(f"{kind}-{nb:>6}: {ours.us_per_token:.3f} us/token; reference cannot run it: {errors[kind]}")
                    continue
                r = _best_reference([f[kind] for f in ref_runs])
                mine = [e for e in events[kind] if e[0] in ("admit", "allocate")]
                agree = mine == ref_logs[kind]
                first_diff = next((i for i, (a, b) in enumerate(zip(mine, ref_logs[kind])) if a != b), None)
                tok_ref = r["tok_prefill"] + r["tok_decode"]
                us_ref = r["manager_total_s"] * 1e6 / tok_ref
                served_ours = ours.tok_prefill + ours.tok_hit + ours.tok_decode
                served_ref = tok_ref + r["tok_hit"]
                row = {
                    "config": f"{kind}-{nb}",
                    "ratio_per_served_token": (ours.manager_s / served_ours) / (r["manager_total_s"] / served_ref),
                    "max_running": args.max_running,
                    "us_per_token_hybridkv": ours.us_per_token,
                    "us_per_token_reference": us_ref,
                    "ratio": ours.us_per_token / us_ref,
                    "hit_rate_hybridkv": ours.hit_rate,
                    "hit_rate_reference": r["tok_hit"] / max(1, r["tok_hit"] + r["tok_prefill"]),
                    "agree": agree,
                    "first_disagreement": first_diff,
                    "calls_us": {
                        name: {"hybridkv": our_calls.get(name, 0.0),
                               "reference": r["calls"].get(ref_name, {}).get("us_per_call", 0.0)}
                        for name, ref_name in CALL_NAMES.items()
                    },
                }
                if kind == "mamba":
                    row["note"] = MAMBA_NOTE
                rows.append(row)
                calls = ", ".join(f"{k} {v['hybridkv']:.1f}/{v['reference']:.1f}" for k, v in row["calls_us"].items())
                print(f"{row['config']:>13}: {row['us_per_token_hybridkv']:.3f} vs {row['us_per_token_reference']:.3f}"
                      f" us/token (ratio {row['ratio']:.2f}, per served token "
                      f"{row['ratio_per_served_token']:.2f}); hit rate {row['hit_rate_hybridkv']:.4f} vs "
                      f"{row['hit_rate_reference']:.4f}; decisions agree: {agree}"
                      + (f" (first difference at event {first_diff})" if not agree else "")
                      + f"\n{'':>15}us per call hybridkv/reference: {calls}"
                      + (f"\n{'':>15}note: {MAMBA_NOTE}" if kind == "mamba" else ""), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Multi-turn conversations through ``hybridkv simulate``: the next turn's checkpoint, against LRU ceilings.

    python bench/multiturn.py [--model gemma-3-27b] [--tp 1] [--conversations 48] [--turns 5]
        [--concurrency 12] [--system 512] [--user 160] [--answer 240] [--think 1.0] [--kv-tokens 120000]
        [--tier host:4GiB] [--token-trace FILE] [--variants ...] [--json FILE]

A conversation's turn ``t + 1`` is turn ``t``'s prompt, turn ``t``'s answer (the tokens the simulator
generated) and a new user message (``sim.workloads.multi_turn_chat``), so its longest hit ends at the
previous turn's computed end, rounded down to the hit alignment. The workload runs as a closed loop
through the real scheduler and manager, once per variant:

* ``lru``: plain LRU (``retention="none"``);
* ``window-before``: window retention keeping junctions and each prompt's end only
  (``WindowRetention(keep_ends=False)``): the answer's end is not a checkpoint;
* ``window``: window retention with the next turn's checkpoint (``keep_ends``, the default);
* ``tier-before``: ``window-before`` plus ``--tier`` storing ``StoreHitSpans(answer_ends=False)`` (junctions
  and the prompt's end);
* ``tier``: ``window`` plus ``--tier`` storing ``StoreHitSpans()`` (also every boundary of the answer).

``--token-trace FILE`` also writes the workload as a token-level trace (explicit token ids; answers are the
simulator's, ``sim.workloads.with_token_ids``), reads it back (``sim.trace``) and runs the same variants on it.

The ceilings (``sim.ceilings.turn_ceiling``) replay the requests one at a time, in the order the ``window``
run started them, through an LRU cache of prompts and answers: for the device variants of the pool's
blocks (a window checkpoint costs its blocks in every non-growing group), for the tier variants of the
device's blocks plus the tier's, in bytes. ``growing`` resumes anywhere (windows free: an upper bound),
``prompt-end`` only at prompt ends and junctions, ``turn-end`` also at each request's computed end (the
reference; an LRU, not a bound: a device that keeps windows with their chains beats it when the windows
are large, as Gemma 3's are). Prints per variant the device / tier / total hit rate and its ratios to the
``turn-end`` and ``growing`` ceilings, the share of later turns whose hit reached the previous turn's end
("at end"), TTFT and the simulation's wall time.

The tier "before" variant swaps the simulator's storage-policy factory (``simulator.tier_storage``) for one
that returns ``StoreHitSpans(answer_ends=False)``: ``SimConfig`` has no field for it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hybridkv import WindowRetention
from hybridkv.connectors.storage import StoreHitSpans
from hybridkv.sim import simulator
from hybridkv.sim.ceilings import turn_ceiling
from hybridkv.sim.simulator import SimConfig, build_manager, simulate
from hybridkv.sim.tiers import group_block_bytes, parse_tiers
from hybridkv.sim.trace import read_trace, write_trace
from hybridkv.sim.workloads import ClosedLoop, Workload, multi_turn_chat, with_token_ids

VARIANTS: dict[str, dict[str, Any]] = {
    "lru": {"retention": "none"},
    "window-before": {"retention": WindowRetention(keep_ends=False)},
    "window": {"retention": WindowRetention()},
    "tier-before": {"retention": WindowRetention(keep_ends=False), "tier": True, "answer_ends": False},
    "tier": {"retention": WindowRetention(), "tier": True, "answer_ends": True},
}


def base_config(args: argparse.Namespace) -> SimConfig:
    return SimConfig(model=args.model, gpu=args.gpu, tensor_parallel_size=args.tp, max_model_len=args.max_model_len,
                     kv_cache_tokens=args.kv_tokens, max_num_batched_tokens=args.batch)


def run_variant(args: argparse.Namespace, w: Workload, variant: str) -> dict[str, Any]:
    v = VARIANTS[variant]
    cfg = replace(base_config(args), retention=v["retention"])
    if v.get("tier"):
        cfg = replace(cfg, tiers=parse_tiers(args.tier), tier_storage="hit-spans")
    factory = simulator.tier_storage
    if v.get("tier"):
        simulator.tier_storage = lambda _cfg, _w=None: StoreHitSpans(answer_ends=v["answer_ends"])  # type: ignore[assignment]
    t0 = time.perf_counter()
    try:
        res = simulate(w, cfg)
    finally:
        simulator.tier_storage = factory  # type: ignore[assignment]
    s = res.summary
    return {"variant": variant, "at_end": resumed_at_end(w, res.requests, args.alignment),
            "device": s["first_admission_hit_rate"], "tier": s["first_admission_tier_hit_rate"],
            "total": s["first_admission_total_hit_rate"],
            "ttft_mean_s": s["ttft_mean_s"], "ttft_p90_s": s["ttft_p90_s"], "preemptions": s["preemptions"],
            "finished": s["finished"], "stored_bytes": s["tier_stored_bytes"], "wall_s": time.perf_counter() - t0,
            "order": sorted(res.requests, key=lambda rid: res.requests[rid]["arrival_s"])}


def resumed_at_end(w: Workload, per_request: dict[str, dict[str, float]], align: int) -> float:
    """Fraction of the turns after the first whose hit (device and tier) reached the previous turn's computed
    end (its prompt and answer less the last sampled token, rounded down to ``align``)."""
    turns = {(r.conversation_id, r.turn): r for r in w.requests}
    later = at_end = 0
    for r in w.requests:
        prev = turns.get((r.conversation_id, r.turn - 1)) if r.turn else None
        if prev is None or r.request_id not in per_request:
            continue
        later += 1
        got = per_request[r.request_id]
        end = (prev.prompt_len + prev.max_new_tokens - 1) // align * align
        at_end += got["hit_tokens"] + got["tier_tokens"] >= end
    return at_end / later if later else 0.0


def ceilings(args: argparse.Namespace, w: Workload, order: list[str]) -> dict[str, dict[str, float]]:
    """``turn_ceiling`` per model for the device pool (blocks) and for the device plus the tier (bytes)."""
    mgr, _ = build_manager(base_config(args))
    groups = mgr.layout.groups
    growing = [g for g in range(len(groups)) if groups[g].spec.grows_with_sequence]
    align = mgr.hit_alignment
    by_id = {r.request_id: r for r in w.requests}
    requests = [by_id[rid] for rid in order if rid in by_id]
    sizes = group_block_bytes(mgr)

    others = [g for g in range(len(groups)) if g not in growing]
    assert all(groups[g].spec.block_size == align for g in range(len(groups))), "one block size (the alignment)"

    def blocks_at(p: int) -> list[tuple[int, int, float]]:
        return [(g, i, 1.0) for g in others for i in mgr.hit_span(g, p)]

    def bytes_at(p: int) -> list[tuple[int, int, float]]:
        return [(g, i, float(sizes[g])) for g in others for i in mgr.hit_span(g, p)]

    per_token_blocks = sum(1 / groups[g].spec.block_size for g in growing)
    per_token_bytes = sum(sizes[g] / groups[g].spec.block_size for g in growing)
    device_bytes = (mgr.layout.num_blocks - 1) * sum(sizes.values()) / len(sizes)
    tier_bytes = sum(t.capacity_bytes for t in parse_tiers(args.tier))
    out: dict[str, dict[str, float]] = {"device": {}, "device+tier": {}}
    for model in ("growing", "prompt-end", "turn-end", "infinite"):
        out["device"][model] = turn_ceiling(requests, mgr.layout.num_blocks - 1, model=model,
                                            growing_per_token=per_token_blocks, span=blocks_at,
                                            alignment=align, max_prompt_tokens=mgr.max_model_len).hit_rate
        out["device+tier"][model] = turn_ceiling(requests, device_bytes + tier_bytes, model=model,
                                                 growing_per_token=per_token_bytes, span=bytes_at,
                                                 alignment=align, max_prompt_tokens=mgr.max_model_len).hit_rate
    return out


HEADER = (f"{'variant':<14} {'device':>7} {'tier':>7} {'total':>7} {'/turn-end':>9} {'/growing':>8} {'at end':>7} "
          f"{'TTFT mean':>10} {'p90':>8} {'preempt':>7} {'wall':>7}")


def fmt(r: dict[str, Any], ceiling: dict[str, float]) -> str:
    turn_end, growing = ceiling["turn-end"], ceiling["growing"]
    return (f"{r['variant']:<14} {r['device']:>7.1%} {r['tier']:>7.1%} {r['total']:>7.1%} "
            f"{r['total'] / turn_end if turn_end else 0:>9.1%} {r['total'] / growing if growing else 0:>8.1%} "
            f"{r['at_end']:>7.1%} {r['ttft_mean_s']:>9.3f}s "
            f"{r['ttft_p90_s']:>7.3f}s {r['preemptions']:>7} {r['wall_s']:>6.1f}s")


def run_workload(args: argparse.Namespace, w: Workload, variants: list[str]) -> dict[str, Any]:
    tokens = sum(r.prompt_len for r in w.requests)
    print(f"\n{w.name}: {len(w.requests)} requests, {tokens / 1e6:.2f}M prompt tokens, closed loop x{w.concurrency}; "
          f"{args.model} (tp {args.tp}), pool of {args.kv_tokens} growing tokens, tier {args.tier}", flush=True)
    rows = [run_variant(args, w, v) for v in variants]
    reference = next((r for r in rows if r["variant"] == "window"), rows[0])
    ceil = ceilings(args, w, reference["order"])
    for scope, values in ceil.items():
        print(f"LRU ceilings ({scope}): " + ", ".join(f"{k} {v:.1%}" for k, v in values.items()))
    print(HEADER)
    for r in rows:
        print(fmt(r, ceil["device+tier" if VARIANTS[r["variant"]].get("tier") else "device"]))
    return {"workload": w.name, "ceilings": ceil,
            "rows": [{k: v for k, v in r.items() if k != "order"} for r in rows]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma-3-27b")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=12)
    ap.add_argument("--system", type=int, default=512, help="shared system prompt tokens")
    ap.add_argument("--user", type=int, default=160, help="tokens per user message")
    ap.add_argument("--answer", type=int, default=240, help="tokens per answer")
    ap.add_argument("--think", type=float, default=1.0, help="seconds between a turn's finish and the next turn")
    ap.add_argument("--kv-tokens", type=int, default=120_000, help="pool size in growing-group tokens")
    ap.add_argument("--tier", default="host:4GiB")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--token-trace", default=None, help="also run the workload as a token-level trace written here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.alignment = build_manager(base_config(args))[0].hit_alignment
    variants = [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    w = multi_turn_chat(args.conversations, args.turns, system_prompt_len=args.system, user_len=args.user,
                        max_new_tokens=args.answer, arrivals=ClosedLoop(args.concurrency), think_time_s=args.think,
                        seed=args.seed)
    results = [run_workload(args, w, variants)]
    if args.token_trace is not None:
        path = args.token_trace or str(Path(tempfile.mkdtemp()) / "multiturn_tokens.jsonl.gz")
        write_trace(path, with_token_ids(w))
        results.append(run_workload(args, read_trace(path), variants))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

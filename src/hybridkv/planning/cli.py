"""``hybridkv plan``: how many concurrent N-token requests fit for model M on GPU G?

The answer comes from the same layout and capacity code the manager runs on.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from hybridkv.sizes import parse_bytes, size_arg


def _gpu_ids() -> list[str]:
    from hybridkv.planning.hardware import HARDWARE

    return list(HARDWARE)


def plan(args: argparse.Namespace) -> int:
    """Print (or write as JSON) the layout and capacity of a model on a GPU."""
    from hybridkv.planning import PRESETS
    from hybridkv.planning.planner import PlanInput, make_plan

    if args.list_models:
        for p in PRESETS.values():
            print(f"{p.id:<22} {p.hf_name:<45} {p.num_params / 1e9:>7.1f}B params, max context {p.max_model_len}")
        return 0
    if not args.model:
        print("hybridkv plan: --model is required (see --list-models)", file=sys.stderr)
        return 2
    result = make_plan(PlanInput(
        model=args.model, gpu=args.gpu, gpu_memory_bytes=args.gpu_memory, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, request_lens=tuple(args.request_len or ()),
        tensor_parallel_size=args.tp, weights_dtype=args.weights_dtype, kv_dtype=args.kv_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization, reserve_bytes=args.reserve,
        block_size=args.block_size, num_params=args.num_params,
    ))
    doc = json.dumps(result.to_json(), indent=2)
    if args.json == "-":
        print(doc)
    else:
        if args.json:
            with open(args.json, "w") as f:
                f.write(doc + "\n")
        _print_plan(result)
    return 0 if result.fits else 1


def _print_plan(result: object) -> None:
    from hybridkv.planning.planner import Plan, render_text

    assert isinstance(result, Plan)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is an optional extra: plain text works everywhere
        print(render_text(result))
        return
    r = result.report
    console = Console()
    m = r["memory"]
    gib = float(1 << 30)
    console.print(f"[bold]{r['model']}[/] on {r['gpu'] or 'custom GPU'} (tensor parallel {r['tensor_parallel_size']}, "
                  f"figures per GPU), weights {r['weights_dtype']}, KV {r['kv_dtype']}, max_model_len "
                  f"{r['max_model_len']}, max_num_batched_tokens {r['max_num_batched_tokens']}")
    mem = Table(title="memory", show_header=True)
    for col in ("GPU", "utilisation", "weights", "reserve", "KV budget"):
        mem.add_column(col, justify="right")
    mem.add_row(f"{m['gpu_bytes'] / gib:.1f} GiB", f"{m['utilization']}", f"{m['weights_bytes'] / gib:.2f} GiB",
                f"{m['reserve_bytes'] / gib:.1f} GiB", f"{m['kv_budget_bytes'] / gib:.2f} GiB")
    console.print(mem)
    if not r["fits"]:
        console.print(f"[bold red]does not fit[/]: {r['error']}")
        return
    groups = Table(title="KV-cache groups (one block table per group per request)")
    for col in ("group", "kind", "layers", "block size", "page bytes", "grows", "blocks/request",
                "bound (seed 001)", "slot address space"):
        groups.add_column(col, justify="right")
    for i, g in enumerate(r["groups"]):
        layers = g["layers"]
        shown = ", ".join(x.rsplit(".", 1)[-1] for x in layers)
        groups.add_row(str(i), g["kind"], f"{g['num_layers']} ({shown})", str(g["block_size"]),
                       str(g["page_size_bytes"]), "yes" if g["grows_with_sequence"] else "no",
                       str(g["blocks_per_request"]), str(g["max_blocks_per_request"]), str(g["slot_address_space"]))
    console.print(groups)
    cap = Table(title="capacity", show_header=False)
    cap.add_column("what")
    cap.add_column("value", justify="right")
    cap.add_row("blocks x bytes per block", f"{r['num_blocks']} x {r['bytes_per_block']}")
    cap.add_row("KV memory", f"{r['kv_memory_bytes'] / gib:.2f} GiB")
    cap.add_row("padding waste", f"{r['padding_waste_bytes'] / gib:.3f} GiB")
    cap.add_row("token capacity (growing groups only)", f"{r['kv_capacity_tokens']:,}")
    cap.add_row("naive num_blocks // num_groups * block_size", f"{r['naive_capacity_tokens']:,}")
    cap.add_row(f"max concurrency at {r['max_model_len']} tokens", str(r["max_concurrency"]))
    for n, c in r["concurrency_at_request_len"].items():
        cap.add_row(f"max concurrency at {n} tokens", str(c))
    cap.add_row("blocks per max-length request", str(r["blocks_per_request"]))
    cap.add_row("share of them in bounded groups", f"{r['bounded_groups_share']:.1%}")
    console.print(cap)


def add_parser(sub: Any) -> None:
    """Register ``plan`` on the ``hybridkv`` sub-command parser."""
    p = sub.add_parser("plan", help="KV-cache layout and capacity of a model on a GPU")
    p.add_argument("--model", help="preset id (see --list-models) or path to a config.json")
    p.add_argument("--list-models", action="store_true", help="list the model presets and exit")
    p.add_argument("--gpu", default="h100-80gb", help="GPU preset: " + ", ".join(_gpu_ids()))
    p.add_argument("--gpu-memory", type=size_arg, default=None, help="GPU memory (e.g. 80GiB), instead of --gpu")
    p.add_argument("--max-model-len", type=int, default=None, help="default: the model's max context")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--request-len", type=int, action="append", help="also report concurrency at this length")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    p.add_argument("--weights-dtype", default="bf16", choices=("bf16", "fp16", "fp8", "int4"))
    p.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp16", "fp8"))
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--reserve", type=parse_bytes, default=2 << 30, help="activation/workspace reserve per GPU")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-params", type=int, default=None, help="parameter count (needed for a config.json)")
    p.add_argument("--json", default=None, help="write the report as JSON to PATH ('-' for stdout)")
    p.set_defaults(func=plan)

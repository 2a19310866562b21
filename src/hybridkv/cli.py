"""The ``hybridkv`` command line.

* ``hybridkv demo`` walks through the library on a Gemma-3-like layout (full attention plus a
  512-token sliding window): a shared-prefix hit, window drops, the admission bound and the
  capacity report.
* ``hybridkv plan`` answers "how many concurrent N-token requests fit for model M on GPU G?"
  from the same layout code the manager runs on.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence as SequenceABC

from hybridkv import (
    FullAttentionSpec,
    InvalidInputError,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheManager,
    Sequence,
    SlidingWindowSpec,
    __version__,
    capacity_report,
)
from hybridkv.sizes import parse_bytes, size_arg


def _table(ids: SequenceABC[int], limit: int = 24) -> str:
    """Compact block table: runs of null blocks folded as ``0 x n``."""
    parts: list[str] = []
    i = 0
    while i < len(ids):
        if ids[i] == 0:
            j = i
            while j < len(ids) and ids[j] == 0:
                j += 1
            parts.append(f"0 x{j - i}")
            i = j
        else:
            parts.append(str(ids[i]))
            i += 1
    text = " ".join(parts[:limit])
    return f"[{text}{' ...' if len(parts) > limit else ''}] ({len(ids)} entries)"


def demo(args: argparse.Namespace) -> int:
    """Print block tables, hits, window drops and capacity for a small hybrid layout."""
    bs, window = 16, args.window
    full = FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=256, dtype_bytes=2)
    swa = SlidingWindowSpec(block_size=bs, num_kv_heads=1, head_size=256, dtype_bytes=2, sliding_window=window)
    layout = KVCacheLayout(num_blocks=args.num_blocks, groups=(
        KVCacheGroup(full, ("layers.5", "layers.11", "layers.17")),
        KVCacheGroup(swa, ("layers.0", "layers.1", "layers.2")),
    ))
    mgr = KVCacheManager(layout, max_model_len=4096, max_num_batched_tokens=256, retention=args.retention)
    print(f"hybridkv {__version__} demo: full attention + sliding window W={window}, {bs}-token blocks, "
          f"{args.num_blocks} blocks, retention={mgr.retention.name!r}")
    rep = capacity_report(layout, max_model_len=4096, max_num_batched_tokens=256)
    print(f"capacity: {rep.token_capacity} tokens (seed 003: only the full-attention group grows), "
          f"{rep.max_concurrency} concurrent 4096-token requests, blocks/request {rep.blocks_per_request}")

    system = list(range(1000, 1000 + 1200))  # a shared 1,200-token system prompt
    for name, suffix in (("alice", range(5000, 5300)), ("bob", range(7000, 7200))):
        seq = Sequence(name, system + list(suffix))
        hit = mgr.lookup(seq)
        print(f"\n{name}: {seq.num_tokens} prompt tokens, cache hit {hit.num_tokens} tokens")
        while seq.num_computed_tokens < seq.num_tokens:
            start = seq.num_computed_tokens or hit.num_tokens
            n = min(256, seq.num_tokens - start)
            first = seq.num_computed_tokens == 0
            new = mgr.allocate(seq, n, hit=hit if first else None, whole_sequence_must_fit=first)
            if new is None:
                print(f"  {name} does not fit: {mgr.num_free_blocks} free blocks")
                return 1
            seq.num_computed_tokens = start + n
            print(f"  step +{n:4d} tokens -> computed {seq.num_computed_tokens:5d}; new blocks per group "
                  f"{[len(b) for b in new]}; free {mgr.num_free_blocks}")
        full_ids, swa_ids = mgr.block_table(name)
        print(f"  full-attention table: {_table(full_ids)}")
        print(f"  sliding-window table: {_table(swa_ids)}  <- blocks behind the window are null")
        mgr.free(seq)
    st = mgr.stats
    print(f"\nprefix cache: {st.hit_tokens} of {st.queried_tokens} prompt tokens served from cache "
          f"({st.hit_rate:.1%}); free blocks {mgr.num_free_blocks} of {args.num_blocks - 1}")
    mgr.check_invariants()
    print("check_invariants(): ok")
    return 0


def _gpu_ids() -> list[str]:
    from hybridkv.hardware import HARDWARE

    return list(HARDWARE)


def plan(args: argparse.Namespace) -> int:
    """Print (or write as JSON) the layout and capacity of a model on a GPU."""
    from hybridkv.models import PRESETS
    from hybridkv.planner import PlanInput, make_plan

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
    from hybridkv.planner import Plan, render_text

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


def main(argv: SequenceABC[str] | None = None) -> int:
    """Entry point of the ``hybridkv`` command."""
    parser = argparse.ArgumentParser(prog="hybridkv", description="Paged KV-cache manager for hybrid models")
    parser.add_argument("--version", action="version", version=f"hybridkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="walk through the library on a small hybrid layout")
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--retention", choices=("none", "window"), default="window")
    p.set_defaults(func=demo)

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

    from hybridkv.engine.cli import add_parser as add_generate
    from hybridkv.engine.demo import add_parser as add_engine_demo
    from hybridkv.server.cli import add_parser as add_serve
    from hybridkv.sim.cli import add_parser as add_simulate

    add_simulate(sub)
    add_generate(sub)
    add_engine_demo(sub)
    add_serve(sub)

    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
    except InvalidInputError as exc:
        print(f"hybridkv {args.command}: {exc}", file=sys.stderr)
        return 2
    return result


if __name__ == "__main__":
    sys.exit(main())

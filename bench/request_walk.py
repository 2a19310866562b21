"""The walk of one request through the manager: which files and functions each call runs.

    python bench/request_walk.py [--layout full+swa|full+mamba|full]

A request is looked up, admitted with its hit (a shared prefix another request computed),
decoded for 40 tokens and freed; a tracer records every function of the ``hybridkv`` package each
call enters. Use it to see how much code a newcomer must follow to understand one request.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from hybridkv import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheManager,
    MambaSpec,
    Sequence,
    SlidingWindowSpec,
)

PACKAGE = str(Path(sys.modules["hybridkv"].__file__ or "").parent)


def layout(kind: str) -> KVCacheLayout:
    attn: dict[str, Any] = {"block_size": 16, "num_kv_heads": 8, "head_size": 128}
    specs: list[Any] = [FullAttentionSpec(**attn)]
    if kind == "full+swa":
        specs.append(SlidingWindowSpec(**attn, sliding_window=128))
    elif kind == "full+mamba":
        specs.append(MambaSpec(block_size=16, state_bytes=4096, mode="align"))
    return KVCacheLayout(num_blocks=4096, groups=tuple(KVCacheGroup(s, (f"l{i}",)) for i, s in enumerate(specs)))


def traced(fn: Callable[[], Any]) -> set[tuple[str, str]]:
    """(file, function) pairs of the package that ``fn()`` enters (comprehensions and lambdas not counted)."""
    seen: set[tuple[str, str]] = set()

    def tracer(frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call" and code.co_filename.startswith(PACKAGE) and "<" not in code.co_qualname:
            seen.add((frame.f_code.co_filename.removeprefix(PACKAGE + "/"), frame.f_code.co_qualname))

    sys.setprofile(tracer)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="full+swa", choices=("full", "full+swa", "full+mamba"))
    ap.add_argument("-v", "--verbose", action="store_true", help="list the functions")
    args = ap.parse_args()
    mgr = KVCacheManager(layout(args.layout), 8192, 2048)
    prefix = list(range(1, 1025))
    first = Sequence("first", prefix + list(range(5000, 5100)))
    assert mgr.allocate(first, first.num_tokens) is not None
    first.num_computed_tokens = first.num_tokens
    mgr.free(first)
    seq = Sequence("req", prefix + list(range(7000, 7300)))
    hasher = mgr.hasher
    unit = mgr.hash_block_size
    seq.block_hashes(hasher, unit)  # hashing is the caller's (as in the reference)
    hit_box: list[Any] = []

    def admit() -> None:
        hit_box.append(mgr.lookup(seq))
        assert mgr.allocate(seq, seq.num_tokens - hit_box[0].num_tokens, hit=hit_box[0]) is not None
        seq.num_computed_tokens = seq.num_tokens

    def decode() -> None:
        for t in range(40):
            seq.append_token_ids([t])
            assert mgr.allocate(seq, 1) is not None
            seq.num_computed_tokens += 1

    total: set[tuple[str, str]] = set()
    for name, fn in (("lookup + admission", admit), ("40 decode steps", decode), ("free", lambda: mgr.free(seq))):
        seen = traced(fn)
        total |= seen
        files = sorted({f for f, _ in seen})
        print(f"{name:>20}: {len(files)} files, {len(seen)} functions")
        if args.verbose:
            for f, q in sorted(seen):
                print(f"{'':>22}{f}: {q}")
    print(f"{'the whole request':>20}: {len({f for f, _ in total})} files, {len(total)} functions")
    return 0


if __name__ == "__main__":
    sys.exit(main())

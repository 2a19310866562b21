"""Scale figures: pool start-up and memory, long-prompt lookup, hashing speed.

    python bench/scale.py [--reference-venv PATH]

* a pool of 1,000,000 blocks: build time and Python memory per block (tracemalloc);
* a 128k-token prompt (8,000 block hashes of 16 tokens) looked up against a cache holding it;
* sha256 block hashing, nanoseconds per token; with ``--reference-venv`` also the reference's
  ``Request()`` construction with its sha256 block hasher on the same 128k-token prompt, next to
  hybridkv's ``Sequence()`` construction plus hashing.
"""

from __future__ import annotations

import argparse
import subprocess
import time
import tracemalloc
from pathlib import Path

from hybridkv import BlockHasher, FullAttentionSpec, KVCacheGroup, KVCacheLayout, KVCacheManager, Sequence
from hybridkv.core.block_pool import BlockPool


def best(fn: object, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        times.append(time.perf_counter() - t0)
    return min(times)


REFERENCE_SNIPPET = """
import os, sys, time
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, sys.argv[1])
import driver
tokens = list(range(1, 128_001))
best = min(
    (lambda t: (driver.make_request("r", tokens, 1, 16), time.perf_counter() - t)[1])(time.perf_counter())
    for _ in range(5)
)
print(best * 1e9 / len(tokens))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference-venv", type=Path, default=None)
    args = ap.parse_args()
    n = 1_000_000
    tracemalloc.start()
    t0 = time.perf_counter()
    pool = BlockPool(n)
    build = time.perf_counter() - t0
    size, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"BlockPool({n:,}): built in {build * 1e3:.1f} ms, {size / n:.1f} bytes per block (tracemalloc)")
    del pool

    spec = FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128)
    t0 = time.perf_counter()
    mgr = KVCacheManager(KVCacheLayout(num_blocks=n, groups=(KVCacheGroup(spec, ("l0",)),)), 131072)
    print(f"KVCacheManager on {n:,} blocks: built in {(time.perf_counter() - t0) * 1e3:.1f} ms")

    tokens = list(range(1, 128_001))
    hasher = BlockHasher()
    seqs = [Sequence(f"h{i}", tokens) for i in range(5)]  # built (and validated) outside the timing
    hashing = min(best(lambda s=s: s.block_hashes(hasher, 16), repeat=1) for s in seqs)
    print(f"sha256 block hashing: {hashing * 1e9 / len(tokens):.1f} ns per token (128,000 tokens, 16-token blocks; "
          f"the reference's sha256 path measured ~77 ns per token)")

    both = best(lambda: Sequence("c", tokens).block_hashes(hasher, 16))
    print(f"Sequence() + hashing: {both * 1e9 / len(tokens):.1f} ns per token")
    if args.reference_venv:
        driver_dir = Path(__file__).resolve().parent.parent.parent / "shared" / "reference" / "vllm"
        out = subprocess.run([str(args.reference_venv / "bin" / "python"), "-c", REFERENCE_SNIPPET, str(driver_dir)],
                             check=True, capture_output=True, text=True).stdout.split()[-1]
        print(f"reference Request() with its sha256 block hasher: {float(out):.1f} ns per token (same prompt)")

    seq = Sequence("a", tokens)
    assert mgr.allocate(seq, len(tokens)) is not None
    mgr.free(seq)
    probe = Sequence("b", tokens + [7])
    probe.block_hashes(hasher, 16)  # hashed outside, as an engine does when the request arrives
    hit = mgr.lookup(probe)
    lookup = best(lambda: mgr.lookup(probe), repeat=20)
    print(f"lookup of a {len(tokens) + 1:,}-token prompt ({len(probe.block_hashes(hasher, 16)):,} block hashes, "
          f"hit {hit.num_tokens:,} tokens): {lookup * 1e3:.3f} ms")


if __name__ == "__main__":
    main()

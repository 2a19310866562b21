"""The global index: exactness against vLLM's own manager, lookup cost and memory per indexed block.

    python bench/cluster_index.py [--reference-python VENV/bin/python] [--replicas 8] [--blocks 100000]

1. With ``--reference-python`` (a venv with vLLM 0.33): vLLM's ``KVCacheManager`` with events on
   publishes through vLLM's ``ZmqEventPublisher``; the index follows it over ZMQ and predicts every
   next request's hit, compared with what ``get_computed_blocks`` then finds (full + sliding
   window, full + Mamba, full + both). Also counts how often an index of the full-attention chain
   alone (what deployed routers keep) predicts a hit vLLM does not find.
2. Cost: ``--replicas`` replicas of a Gemma-3-like layout (full attention + a 512-token sliding
   window, 16-token blocks), each with ``--blocks`` indexed hashes (half per group: full chains of
   shared-prefix requests, windows of their last 512 tokens), filled through the event path. A
   1,000-token request that shares a prefix with every replica is looked up: the time to hash it
   once (per hash scheme) and the time to predict every replica's hit from the hashes, best of
   ``--repeat`` (and, beside it, each replica predicted by its own view, without the index's masks).
   The index shares each replica's prediction per hit point between lookups (a router's requests
   keep landing on the same hit points); the lookup is also timed with those dropped first, as
   for the first request that puts the replicas at these hit points.
   Memory per indexed block: traced allocations of the filled index / hashes held.
   Run for vLLM's default 64-bit event hashes and for full 32-byte digests.
3. Settling: the same, with windows kept only at the end of each replica's prefix, so the replicas
   whose prefix runs past the request hold no window where their chain ends and must be moved
   down to the next point their window group accepts (here: none, a hit of 0).

Target: <= 20 us per 1,000-token lookup against 8 replicas x 100,000 indexed blocks (the index
lookup; hashing the request is reported beside it: it is done once per request, whatever the
number of replicas).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from hybridkv import FullAttentionSpec, KVCacheGroup, KVCacheLayout, SlidingWindowSpec
from hybridkv.cluster import BlockStoredEvent, ClusterIndex, RequestKeys, VllmHashes, make_batch
from hybridkv.cluster.events import ExternalHash

from cluster_reference import compare_with_reference

BLOCK = 16
WINDOW = 512


def gemma_like_layout() -> KVCacheLayout:
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=256)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=256, sliding_window=WINDOW)
    return KVCacheLayout(2, (KVCacheGroup(full), KVCacheGroup(swa)))


def fill(index: ClusterIndex, scheme: VllmHashes, replicas: int, blocks: int, shared: list[int],
         other: list[int], int_hashes: bool, seed: int, junctions: bool = True) -> None:
    """Give every replica ``blocks`` indexed hashes. Replica ``r`` holds the shared prefix to a depth
    of its own with the windows at every 256th token of it (junctions earlier requests left; with
    ``junctions`` off, at the end of its prefix only), then 2,000-token requests that continue the
    prefix with tokens of their own: their own full-chain blocks in group 0, the blocks of their
    last ``WINDOW`` tokens in group 1."""
    rng = random.Random(seed)
    window_blocks = WINDOW // BLOCK

    def ext(hashes: list[bytes]) -> tuple[ExternalHash, ...]:
        return tuple(int.from_bytes(h[-8:], "big") for h in hashes) if int_hashes else tuple(hashes)

    def stored(hashes: list[bytes], group: int) -> BlockStoredEvent:
        kind, window = ("full_attention", None) if group == 0 else ("sliding_window", WINDOW)
        return BlockStoredEvent(ext(hashes), None, (), BLOCK, "GPU", group, kind, window)

    for r in range(replicas):
        name = f"replica-{r}"
        index.add_replica(name, scheme=scheme, layout=gemma_like_layout())
        depth = len(shared) * (r + 1) // replicas // BLOCK * BLOCK
        h = scheme.chain(shared[:depth], BLOCK, None)
        ends = sorted({*range(256 // BLOCK, len(h) + 1, 256 // BLOCK), len(h)}) if junctions else [len(h)]
        windows = sorted({i for end in ends for i in range(max(0, end - window_blocks), end)})
        index.deliver(name, 0, make_batch([stored(h, 0), stored([h[i] for i in windows], 1)]))
        seq = 1
        if r < 2:  # a second prefix only two replicas hold, with its window at 992 tokens
            h = scheme.chain(other, BLOCK, None)[:62]
            index.deliver(name, seq, make_batch([stored(h, 0), stored(h[-window_blocks:], 1)]))
            seq += 1
        while index.views[name].num_blocks() < blocks:
            # The request's own blocks: random digests stand in for hashing 2,000 - depth own tokens.
            own = [rng.randbytes(32) for _ in range((2000 - depth) // BLOCK)]
            room = blocks - index.views[name].num_blocks()
            if 2 * len(own) > room:
                own = own[: max(1, room // 2)]
            index.deliver(name, seq, make_batch([stored(own, 0), stored(own[-window_blocks:], 1)]))
            seq += 1


def _unshare(index: ClusterIndex) -> None:
    """Drop the predictions the index shares between lookups (one per replica and hit point), so the
    next lookup builds them, as the first request that puts a replica at a new hit point does."""
    assert index._plan is not None  # the bench reaches in: no caller needs this
    for group in index._plan.together:
        for hits in group.hits.values():
            hits.clear()


def _time(index: ClusterIndex, scheme: VllmHashes, request: list[int], int_hashes: bool, repeat: int
          ) -> tuple[list[float], list[float], list[float], list[float], list[int]]:
    hashing, lookup, each, first = [], [], [], []
    found = {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        keys = RequestKeys(request)
        keys.hashes(scheme, BLOCK, BLOCK, int_hashes)
        t1 = time.perf_counter()
        found = index.lookup_keys(keys)
        t2 = time.perf_counter()
        alone = index.lookup_each(keys)
        t3 = time.perf_counter()
        assert alone == found
        _unshare(index)
        t4 = time.perf_counter()
        assert index.lookup_keys(keys) == found
        t5 = time.perf_counter()
        hashing.append(t1 - t0)
        lookup.append(t2 - t1)
        each.append(t3 - t2)
        first.append(t5 - t4)
    return hashing, lookup, each, first, [p.tokens for p in found.values()]


def cost(replicas: int, blocks: int, repeat: int, int_hashes: bool) -> None:
    scheme = VllmHashes()
    rng = random.Random(1)
    shared = [rng.randrange(1, 250_000) for _ in range(1500)]
    other = [rng.randrange(1, 250_000) for _ in range(1000)]
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = ClusterIndex()
    t = time.perf_counter()
    fill(index, scheme, replicas, blocks, shared, other, int_hashes, seed=2)
    fill_s = time.perf_counter() - t
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    held = sum(index.num_blocks().values())
    label = "64-bit event hashes (vLLM's default)" if int_hashes else "32-byte digests"
    print(f"\n{label}: {replicas} replicas x {held // replicas:,} indexed blocks ({held:,} in all), "
          f"filled through the event path in {fill_s:.1f} s")
    print(f"  memory: {used / held:.0f} bytes per indexed block (traced allocations, {used / 2**20:.1f} MiB)")
    for what, request in (("every replica holds a prefix of it", shared[:1000]),
                          ("2 replicas hold its prefix", other)):
        hashing, lookup, each, first, hits = _time(index, scheme, request, int_hashes, repeat)
        print(f"  1,000-token request, {what}: predicted hits {hits}")
        print(f"    hash it once (vLLM sha256 mirror, token check included): {min(hashing) * 1e6:.1f} us; "
              f"index lookup, all {replicas} replicas: {min(lookup) * 1e6:.1f} us "
              f"(best of {repeat}; median {sorted(lookup)[len(lookup) // 2] * 1e6:.1f} us)")
        print(f"    the same, the first time these hit points are predicted (predictions not yet shared): "
              f"{min(first) * 1e6:.1f} us")
        print(f"    the same, each replica by its own view (no masks; equal predictions): {min(each) * 1e6:.1f} us")


def settling(replicas: int, blocks: int, repeat: int) -> None:
    """The lookup when replicas must settle below their chains: windows kept only at the end of
    each replica's prefix, so the replicas whose prefix runs past the request's end hold no window
    at their chain's end and are walked down to the next point their window group accepts."""
    scheme = VllmHashes()
    rng = random.Random(1)
    shared = [rng.randrange(1, 250_000) for _ in range(1500)]
    other = [rng.randrange(1, 250_000) for _ in range(1000)]
    index = ClusterIndex()
    fill(index, scheme, replicas, blocks, shared, other, True, seed=2, junctions=False)
    _, lookup, each, first, hits = _time(index, scheme, shared[:1000], True, repeat)
    print(f"\nwindows only at each replica's prefix end (64-bit hashes), 1,000-token request: predicted hits {hits}")
    print(f"    index lookup, all {replicas} replicas: {min(lookup) * 1e6:.1f} us (best of {repeat}; median "
          f"{sorted(lookup)[len(lookup) // 2] * 1e6:.1f} us); first time at these hit points: "
          f"{min(first) * 1e6:.1f} us; each replica by its own view: {min(each) * 1e6:.1f} us")


def exactness(python: str, requests: int) -> None:
    print(f"exactness against vLLM's KVCacheManager + ZmqEventPublisher ({requests} requests per layout, "
          f"80-block pool):")
    for layout, int_hashes in (("full_swa", True), ("full_mamba", True), ("full_swa_mamba", False)):
        t = time.perf_counter()
        c = compare_with_reference(python, layout, num_blocks=80, requests=requests, seed=3, int_hashes=int_hashes)
        print(f"  {layout:15s} {c['requests']} requests, every prediction equal to vLLM's hit; {c['hits']} hits, "
              f"{c['hit_tokens']} hit tokens, {c['batches']} event batches, resyncs {c['resyncs']}; "
              f"a full-attention-only index over-predicts {c['full_only_over']} requests "
              f"(+{c['full_only_over_tokens']} tokens)  [{time.perf_counter() - t:.1f} s]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference-python", help="python of a venv with vLLM 0.33 (skips the exactness part if absent)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    if args.reference_python:
        if not Path(args.reference_python).is_file():
            print(f"--reference-python {args.reference_python}: no such file", file=sys.stderr)
            raise SystemExit(2)
        exactness(args.reference_python, args.requests)
    else:
        print("exactness against vLLM: skipped (pass --reference-python VENV/bin/python)")
    for int_hashes in (True, False):
        cost(args.replicas, args.blocks, args.repeat, int_hashes)
    settling(args.replicas, args.blocks, args.repeat)


if __name__ == "__main__":
    main()

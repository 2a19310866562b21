"""A long-running scheduler holds nothing of finished requests: memory stays flat.

    python bench/scheduler_memory.py [--sequences 1000000] [--keep-finished]

Runs SEQUENCES short requests (48-token prompts over 8 shared 32-token prefixes, 4 output tokens
each, 64 in flight) through ``Scheduler`` on a full + sliding-window ``KVCacheManager`` and prints
the process's resident memory and the Python heap (tracemalloc is off: it would slow the run;
``sys.getallocatedblocks``) every tenth of the run. With ``--keep-finished`` the scheduler keeps
every ended request (the behaviour before forgetting became the default), for comparison.
"""

from __future__ import annotations

import argparse
import random
import resource
import sys
import time

from hybridkv import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheManager,
    Scheduler,
    SchedulerConfig,
    Sequence,
    SlidingWindowSpec,
)


def rss_mib() -> float:
    """Current resident set size in MiB (from /proc; peak from getrusage where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=1_000_000)
    ap.add_argument("--keep-finished", action="store_true")
    args = ap.parse_args()
    attn = {"block_size": 16, "num_kv_heads": 8, "head_size": 128}
    layout = KVCacheLayout(num_blocks=4096, groups=(KVCacheGroup(FullAttentionSpec(**attn), ("l0",)),
                                                    KVCacheGroup(SlidingWindowSpec(**attn, sliding_window=32),
                                                                 ("l1",))))
    mgr = KVCacheManager(layout, 1024, 512)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=64,
                                           keep_finished=args.keep_finished))
    rng = random.Random(1)
    prefixes = [[rng.randrange(1, 30000) for _ in range(32)] for _ in range(8)]
    added = finished = 0
    report_every = max(1, args.sequences // 10)
    t0 = time.perf_counter()
    print(f"{'sequences':>10} {'RSS MiB':>8} {'heap blocks':>12} {'requests kept':>14} {'seconds':>8}")
    print(f"{0:>10,} {rss_mib():>8.1f} {sys.getallocatedblocks():>12,} {len(sched.requests):>14,} {0:>8.1f}")
    while finished < args.sequences:
        while added < args.sequences and len(sched.waiting) + len(sched.running) < 64:
            prompt = prefixes[added % 8] + [rng.randrange(1, 30000) for _ in range(16)]
            sched.add(Sequence(f"r{added}", prompt), max_new_tokens=4)
            added += 1
        out = sched.schedule()
        sampled = {sid: [rng.randrange(1, 30000)] for sid, n in out.num_scheduled_tokens.items()
                   if sched.requests[sid].seq.num_computed_tokens + n == sched.requests[sid].seq.num_tokens}
        before = finished
        finished += len(sched.update(out, sampled)) + len(out.rejected)
        if finished // report_every > before // report_every:
            print(f"{finished:>10,} {rss_mib():>8.1f} {sys.getallocatedblocks():>12,} {len(sched.requests):>14,} "
                  f"{time.perf_counter() - t0:>8.1f}", flush=True)
    mgr.check_invariants()
    assert mgr.num_sequences == 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Admission cost of a tier lookup and load on 28,000-token prompts (Gemma 3 27B: 6 window groups + 1 full).

    python bench/tier_admission.py [--prefix 28000] [--repeat 20]

A producer computes a 28,000-token shared prefix plus a unique tail and writes it through to the
tier; a second request with the same prefix and another tail computes it too (its lookup finds the
shared-prefix junction at 28,000); then each measured admission -- one more request with the same
prefix -- asks the tier how many tokens past its (empty) local hit it can supply and reads them:
``num_external_tokens`` + ``fetch``, the work the scheduler does to admit a request. Two tiers: the
real connector on a ``HostTier`` (frames built and checked; 64-byte payloads, so memory copies do not
hide the lookup), and the simulator's ``SimTiers`` (keys and sizes only). Prints the median and best
milliseconds per admission over ``--repeat`` admissions, the external tokens found and the tier calls
(existence checks, reads) one admission makes. Block hashes are computed before timing (the device
lookup computes them anyway).

The script uses only what older versions offer too, so running it against another checkout
(``PYTHONPATH=<checkout>/src python bench/tier_admission.py``) measures that version's admissions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence as Seq
from typing import Any

import hybridkv
from hybridkv import Sequence
from hybridkv.connectors import HostTier, KVConnector
from hybridkv.sim.simulator import SimConfig, build_manager
from hybridkv.sim.tiers import SimTiers, parse_tiers


class Counting(HostTier):
    def __init__(self) -> None:
        super().__init__(1 << 40)
        self.calls = {"exists": 0, "get": 0}

    def exists_many(self, keys: Seq[bytes]) -> list[bool]:
        self.calls["exists"] += 1
        return super().exists_many(keys)

    def get_many(self, keys: Seq[bytes]) -> list[bytes | None]:
        self.calls["get"] += 1
        return super().get_many(keys)


def manager() -> Any:
    mgr, _ = build_manager(SimConfig(model="gemma-3-27b", max_model_len=131072))
    return mgr


def compute(conn: Any, mgr: Any, seq: Sequence) -> None:
    """Prefill ``seq`` in 8,192-token steps, writing each step through, then free it."""
    hit = mgr.lookup(seq)
    conn.num_external_tokens(seq, hit.num_tokens)  # a junction found here is remembered (where supported)
    seq.num_computed_tokens = hit.num_tokens
    while seq.num_computed_tokens < seq.num_tokens:
        c = seq.num_computed_tokens
        n = min(8192, seq.num_tokens - c)
        assert mgr.allocate(seq, n, hit=hit if hit is not None else None) is not None
        hit = None
        seq.num_computed_tokens = c + n
        conn.store(seq, c + n, lambda g, b: b"k" * 64, c)
    mgr.free(seq)


def admissions(conn: Any, mgr: Any, prefix: list[int], repeat: int, tier: Counting | None) -> dict[str, Any]:
    times, found = [], 0
    for i in range(repeat):
        seq = Sequence(f"c{i}", prefix + [900_000 + i] * 200)
        for g in range(len(mgr.layout.groups)):
            mgr.block_hashes(seq, g)
        if tier is not None:
            tier.calls = {"exists": 0, "get": 0}
        t0 = time.perf_counter()
        k = conn.num_external_tokens(seq, 0)
        got = conn.fetch(seq, 0, k)
        times.append(time.perf_counter() - t0)
        found = got.num_tokens
    return {"median_ms": statistics.median(times) * 1e3, "best_ms": min(times) * 1e3, "tokens": found,
            "calls": dict(tier.calls) if tier is not None else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefix", type=int, default=28000)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    prefix = list(range(1000, 1000 + args.prefix))
    print(f"hybridkv {hybridkv.__file__}")
    mgr = manager()
    tier = Counting()
    sizes = dict.fromkeys(range(len(mgr.layout.groups)), 64)
    conn = KVConnector([tier], mgr, namespace="bench", payload_bytes=sizes)
    for j in range(2):
        compute(conn, mgr, Sequence(f"p{j}", prefix + [800_000 + j] * 200))
        mgr.reset_prefix_cache()
    host = admissions(conn, mgr, prefix, args.repeat, tier)
    smgr = manager()
    sim = SimTiers(parse_tiers("host:1TiB"), smgr, namespace="bench")
    from hybridkv.sim.synthetic import SyntheticSequence

    def synthetic(sid: str, tail: int) -> Any:
        return SyntheticSequence(sid, (("prefix", args.prefix), (f"tail-{tail}", 200)))

    for j in range(2):
        compute(sim.connector, smgr, synthetic(f"p{j}", j))
        smgr.reset_prefix_cache()
    times, found = [], 0
    for i in range(args.repeat):
        seq = synthetic(f"c{i}", 100 + i)
        for g in range(len(smgr.layout.groups)):
            smgr.block_hashes(seq, g)
        t0 = time.perf_counter()
        k = sim.connector.num_external_tokens(seq, 0)
        got = sim.connector.fetch(seq, 0, k)
        times.append(time.perf_counter() - t0)
        found = got.num_tokens
    print(f"{args.prefix:,}-token shared prefix, gemma-3-27b layout ({len(mgr.layout.groups)} groups), "
          f"{args.repeat} admissions each")
    print(f"  connector + HostTier: median {host['median_ms']:.2f} ms, best {host['best_ms']:.2f} ms per admission, "
          f"{host['tokens']:,} tokens from the tier, tier calls per admission {host['calls']}")
    print(f"  simulator (SimTiers): median {statistics.median(times) * 1e3:.2f} ms, best {min(times) * 1e3:.2f} ms "
          f"per admission, {found:,} tokens from the tier")


if __name__ == "__main__":
    main()

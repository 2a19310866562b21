"""The global index predicts exactly the hit a replica's manager then finds.

* Fed by a hybridkv manager's own events (converted to vLLM's wire model), the index's prediction
  for every next request equals ``KVCacheManager.lookup``: full attention, sliding windows with
  different block sizes, Mamba checkpoints, window retention, evictions under a small pool; with a
  configured layout and with one learned from the store events; with 32-byte and 64-bit hashes.
* What the index holds per group is exactly what the pool indexes.
* Per medium: a CPU tier extends the device hit from where it stops; a shared medium serves every
  replica.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv import KVCacheManager, Sequence
from hybridkv.cluster import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockRemovedEvent,
    BlockStoredEvent,
    ClusterIndex,
    HybridkvHashes,
    RequestKeys,
    from_core_events,
    group_metadata,
    make_batch,
)

from helpers import full, layout, mamba, manager, split_state, swa, tokens

LAYOUTS = {
    "full": (full(16),),
    "full+swa": (full(16), swa(40, 16)),
    "full+swa32": (full(16), swa(70, 32)),
    "full+mamba": (full(16), mamba(16)),
    "full+swa+mamba": (full(16), swa(33, 16), mamba(32)),
    "full+split-state": (full(16), *split_state(3)),
    "full+swa+split-state": (full(16), swa(33, 16), *split_state(2)),
}


class Replica:
    """A manager that serves prompts (chunked prefill, a few decode steps, up to ``max_running`` at
    once, the oldest freed when the pool is full) and publishes its events into an index."""

    def __init__(self, mgr: KVCacheManager, index: ClusterIndex, name: str, *, int_hashes: bool = False) -> None:
        self.mgr, self.index, self.name, self.int_hashes = mgr, index, name, int_hashes
        self.meta = group_metadata(mgr.layout)
        self.running: deque[Sequence] = deque()
        self.seq = 0

    def publish(self) -> None:
        events = from_core_events(self.mgr.take_events(), self.meta, int_hashes=self.int_hashes)
        if events:
            self.index.deliver(self.name, self.seq, make_batch(events))
            self.seq += 1

    def _allocate(self, seq: Sequence, n: int, **kw: object) -> None:
        while self.mgr.allocate(seq, n, **kw) is None:  # type: ignore[arg-type]
            victim = next(s for s in self.running if s is not seq)
            self.running.remove(victim)
            self.mgr.free(victim)
        self.publish()

    def serve(self, seq: Sequence, chunk: int, decode: int, max_running: int) -> None:
        hit = self.mgr.lookup(seq)
        self.running.append(seq)
        start = hit.num_tokens
        n = min(chunk, seq.num_tokens - start)
        self._allocate(seq, n, hit=hit)
        seq.num_computed_tokens = start + n
        while seq.num_computed_tokens < seq.num_tokens:
            n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
            self._allocate(seq, n)
            seq.num_computed_tokens += n
        for t in range(decode):
            seq.append_token_ids([7000 + t])
            self._allocate(seq, 1)
            seq.num_computed_tokens += 1
        while len(self.running) > max_running:
            self.mgr.free(self.running.popleft())
            self.publish()


def _prompts(rng: random.Random, n: int, prefixes: int, max_len: int) -> list[list[int]]:
    heads = [tokens(10_000 * (p + 1), rng.randint(20, max_len)) for p in range(prefixes)]
    out = []
    for i in range(n):
        head = rng.choice(heads)
        out.append(head[: rng.randint(1, len(head))] + tokens(100_000 + 1000 * i, rng.randint(1, 60)))
    return out


def _check_workload(specs: tuple[object, ...], *, num_blocks: int, retention: str, learned: bool, seed: int,
                    int_hashes: bool = False) -> int:
    mgr = manager(num_blocks, *specs, max_model_len=1024, batch=256, retention=retention, enable_events=True)
    index = ClusterIndex()
    index.add_replica("r", scheme=HybridkvHashes(), layout=None if learned else mgr.layout,
                      expected_groups=len(specs) if learned else None)
    replica = Replica(mgr, index, "r", int_hashes=int_hashes)
    rng = random.Random(seed)
    hits = 0
    for i, prompt in enumerate(_prompts(rng, 30, 3, 300)):
        seq = Sequence(f"s{i}", prompt)
        predicted = index.lookup(prompt)["r"]
        actual = mgr.lookup(seq).num_tokens
        assert predicted.tokens == actual, f"request {i}: index {predicted}, manager {actual}"
        hits += actual > 0
        replica.serve(seq, chunk=rng.choice([16, 64, 256]), decode=rng.randint(0, 20), max_running=3)
    mgr.check_invariants()
    return hits


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("retention", ["none", "window"])
def test_the_index_predicts_the_managers_hit_for_every_next_request(name: str, retention: str) -> None:
    hits = _check_workload(LAYOUTS[name], num_blocks=64, retention=retention, learned=False, seed=1)
    assert hits >= 5  # the workload shares prefixes: most requests hit something


@given(name=st.sampled_from(sorted(LAYOUTS)), seed=st.integers(0, 10_000), num_blocks=st.integers(60, 400),
       retention=st.sampled_from(["none", "window"]), int_hashes=st.booleans())
def test_a_learned_layout_predicts_like_a_configured_one(name: str, seed: int, num_blocks: int, retention: str,
                                                        int_hashes: bool) -> None:
    _check_workload(LAYOUTS[name], num_blocks=num_blocks, retention=retention, learned=True, seed=seed,
                    int_hashes=int_hashes)


def test_the_index_holds_per_group_exactly_what_the_pool_indexes() -> None:
    mgr = manager(90, full(16), swa(40, 16), mamba(16), max_model_len=1024, batch=256, enable_events=True)
    index = ClusterIndex()
    index.add_replica("r", scheme=HybridkvHashes(), layout=mgr.layout)
    replica = Replica(mgr, index, "r")
    for i, prompt in enumerate(_prompts(random.Random(5), 25, 2, 250)):
        replica.serve(Sequence(f"s{i}", prompt), chunk=64, decode=3, max_running=2)
        held = index.views["r"].media.get(MEDIUM_GPU, {})
        for g in range(3):
            assert set(held.get(g, {})) == set(mgr.pool.index[g]), f"group {g} after request {i}"


def test_an_incomplete_learned_layout_predicts_no_hit_and_says_why() -> None:
    mgr = manager(200, full(16), mamba(16), max_model_len=1024, batch=256, enable_events=True)
    index = ClusterIndex()
    index.add_replica("r", scheme=HybridkvHashes(), expected_groups=2)
    replica = Replica(mgr, index, "r")
    # 15 tokens: no full block, nothing stored, nothing learned.
    replica.serve(Sequence("a", tokens(0, 15)), chunk=64, decode=0, max_running=0)
    assert index.lookup(tokens(0, 40))["r"].problem == "no store event seen yet"
    # A store of group 0 alone leaves group 1 unknown: the replica is predicted no hit.
    index.apply_events("r", make_batch([BlockStoredEvent((b"x" * 32,), None, tuple(range(16)), 16, MEDIUM_GPU, 0,
                                                         "full_attention")]))
    prediction = index.lookup(tokens(0, 40))["r"]
    assert (prediction.tokens, prediction.problem) == (0, "groups [1] not seen in any store event yet")


def _stored(hashes: list[bytes], group: int, medium: str, kind: str = "full_attention",
            window: int | None = None) -> BlockStoredEvent:
    return BlockStoredEvent(tuple(hashes), None, (), 16, medium, group, kind, window)


def test_a_cpu_tier_extends_the_device_hit_from_where_it_stops() -> None:
    scheme = HybridkvHashes()
    prompt = tokens(0, 200)
    h = scheme.chain(prompt, 16, None)  # 12 full blocks
    index = ClusterIndex()
    index.add_replica("r", scheme=scheme, layout=layout(10, full(16), swa(40, 16)))
    # A hit at L needs the full chain to L and the 3 window blocks before L (cdiv(40 - 1, 16)).
    # GPU: full blocks 0-3 and window blocks 1-3; CPU: full blocks 4-9 and window blocks 6-9.
    index.apply_events("r", make_batch([_stored(h[:4], 0, MEDIUM_GPU), _stored(h[1:4], 1, MEDIUM_GPU),
                                        _stored(h[4:10], 0, MEDIUM_CPU), _stored(h[6:10], 1, MEDIUM_CPU)]))
    p = index.lookup(prompt)["r"]
    assert (p.tokens, p.medium_tokens(MEDIUM_GPU), p.medium_tokens(MEDIUM_CPU)) == (160, 64, 96)
    # Window block 9 leaves the CPU: the longest whole window now ends at block 8 (blocks 6-8).
    index.apply_events("r", make_batch([BlockRemovedEvent((h[9],), MEDIUM_CPU, 1)]))
    p = index.lookup(prompt)["r"]
    assert (p.tokens, p.by_medium) == (144, ((MEDIUM_GPU, 64), (MEDIUM_CPU, 80)))


def test_a_block_stored_twice_stays_until_removed_twice() -> None:
    # Two copies of one hash (two sequences computed one prefix at once): the replica holds it until
    # both are removed, in one event or two; a removal of a copy it never held is counted, not applied.
    scheme = HybridkvHashes()
    prompt = tokens(0, 64)
    h = scheme.chain(prompt, 16, None)  # 4 full blocks
    query = prompt + [7]  # all 4 can hit
    index = ClusterIndex()
    for name in ("a", "b"):
        index.add_replica(name, scheme=scheme, layout=layout(10, full(16)))
    index.apply_events("a", make_batch([_stored(h[:4], 0, MEDIUM_GPU), _stored(h[:2], 0, MEDIUM_GPU)]))
    index.apply_events("b", make_batch([_stored(h[:4], 0, MEDIUM_GPU)]))
    index.apply_events("a", make_batch([BlockRemovedEvent((h[0], h[3]), MEDIUM_GPU, 0)]))
    assert {n: p.tokens for n, p in index.lookup(query).items()} == {"a": 48, "b": 64}
    index.apply_events("a", make_batch([BlockRemovedEvent((h[1], h[1], h[0]), MEDIUM_GPU, 0)]))
    assert {n: p.tokens for n, p in index.lookup(query).items()} == {"a": 0, "b": 64}
    assert index.views["a"].unknown_removals == 0
    index.apply_events("b", make_batch([BlockRemovedEvent((h[2], h[2]), MEDIUM_GPU, 0)]))
    assert {n: p.tokens for n, p in index.lookup(query).items()} == {"a": 0, "b": 32}
    assert index.views["b"].unknown_removals == 1
    assert index.lookup_keys(RequestKeys(query)) == index.lookup_each(RequestKeys(query))


def test_a_shared_medium_serves_every_replica() -> None:
    scheme = HybridkvHashes()
    prompt = tokens(0, 100)
    h = scheme.chain(prompt, 16, None)
    index = ClusterIndex(shared_media=["REDIS"])
    for name in ("a", "b"):
        index.add_replica(name, scheme=scheme, layout=layout(10, full(16)))
    index.apply_events("a", make_batch([_stored(h[:2], 0, MEDIUM_GPU), _stored(h[:5], 0, "REDIS")]))
    found = index.lookup(prompt)
    assert (found["a"].tokens, found["a"].by_medium) == (80, ((MEDIUM_GPU, 32), ("REDIS", 48)))
    assert (found["b"].tokens, found["b"].by_medium) == (80, (("REDIS", 80),))
    assert index.num_blocks() == {"a": 2, "b": 0, "shared:REDIS": 5}


def test_a_cache_salt_separates_tenants() -> None:
    mgr = manager(200, full(16), max_model_len=1024, batch=256, enable_events=True)
    index = ClusterIndex()
    index.add_replica("r", scheme=HybridkvHashes(), layout=mgr.layout)
    replica = Replica(mgr, index, "r")
    replica.serve(Sequence("a", tokens(0, 100), cache_salt="tenant-a"), chunk=128, decode=0, max_running=1)
    assert index.lookup(tokens(0, 100), cache_salt="tenant-a")["r"].tokens == 96
    assert index.lookup(tokens(0, 100), cache_salt="tenant-b")["r"].tokens == 0
    assert index.lookup(tokens(0, 100))["r"].tokens == 0


def test_an_index_of_the_chain_alone_predicts_hits_the_replica_cannot_serve() -> None:
    scheme = HybridkvHashes()
    prompt = tokens(0, 200)
    h = scheme.chain(prompt, 16, None)
    index = ClusterIndex()
    index.add_replica("r", scheme=scheme, layout=layout(10, full(16), swa(40, 16)))
    # The full chain to block 7; the window (3 blocks) only before block 4: the rest was evicted.
    index.apply_events("r", make_batch([_stored(h[:8], 0, MEDIUM_GPU), _stored(h[1:4], 1, MEDIUM_GPU)]))
    assert index.lookup(prompt)["r"].tokens == 64
    assert index.lookup(prompt, chain_only=True)["r"].tokens == 128


def test_the_index_imports_without_the_cluster_extra() -> None:
    import subprocess
    import sys
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('msgpack', 'zmq', 'fastapi', 'httpx', 'uvicorn'):\n"
        "            raise ImportError(name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from hybridkv.cluster import ClusterIndex, HybridkvHashes\n"
        "index = ClusterIndex()\n"
        "index.add_replica('r', scheme=HybridkvHashes(), expected_groups=1)\n"
        "print(index.lookup(list(range(40)))['r'].problem)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no store event seen yet"

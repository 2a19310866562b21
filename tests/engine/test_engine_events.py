"""The engine publishes its KV-cache events (vLLM's wire format over ZMQ): its device pool's and its
host and disk tiers', and the cluster index fed from them predicts exactly what the engine then
serves from each."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from hybridkv.cluster import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, ClusterIndex, HybridkvHashes
from hybridkv.cluster.subscriber import KVEventSubscriber

import gemma

gemma.require_model()

from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.engine.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.model  # loads the embedded Gemma 3 270M

SHARED = ("The harbour board met on Tuesday to review the spring dredging schedule, the lighting "
          "contract and the new ferry pier. ") * 12


def _poll_until(sub: KVEventSubscriber, engine: LLMEngine, timeout: float = 10.0) -> None:
    """Poll until the index has applied every batch the engine published."""
    deadline = time.monotonic() + timeout
    while (sub.index.streams["engine"].next_seq or 0) != engine.events.num_published:
        assert time.monotonic() < deadline, "the index did not catch up with the engine's events"
        sub.poll(0.05)


def test_the_index_predicts_the_engines_next_prefix_hits_from_its_events() -> None:
    engine = LLMEngine(gemma.weights(), gemma.tokenizer(), EngineConfig(
        dtype="float32", kv_cache_memory=64 << 20, max_model_len=1024, max_num_batched_tokens=256,
        kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0"))
    index = ClusterIndex()
    index.add_replica("engine", scheme=HybridkvHashes(), layout=engine.layout)
    sub = KVEventSubscriber(index)
    try:
        sub.connect("engine", engine.events.endpoint, engine.events.replay_endpoint)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            sub.poll(0.02)
        tok = gemma.tokenizer()
        predicted, served = [], []
        first = "Who chaired the meeting, and what did the members decide about the lighting contract and its cost?"
        for tail in [first, "What did the pier cost?", "When does the dredging start?", first]:
            prompt = tok.encode(SHARED + tail)
            _poll_until(sub, engine)
            predicted.append(index.lookup(prompt)["engine"].tokens)
            outs = engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True))
            served.append(outs[0].num_cached_tokens)
        assert predicted == served
        # The shared prefix (266 tokens: 256 cached), then the whole repeated prompt.
        assert served[0] == 0 and served[1] == 256 and served[3] > 256
    finally:
        sub.close()
        engine.close()


BLOCK_BYTES = 3 * 2 * 16 * 256 * 4
"""One float32 block of one group (3 layers) of Gemma 3 270M."""


def test_the_index_predicts_what_the_engine_serves_from_its_device_host_and_disk_tiers(tmp_path: Path) -> None:
    # 99 device blocks (16 full blocks per group at most: a 96-token prompt holds 6 x 6), a 16 MiB
    # host tier (170 blocks) over a 64 MiB disk tier, both written through.
    engine = LLMEngine(gemma.weights(), gemma.tokenizer(), EngineConfig(
        dtype="float32", kv_cache_memory=100 * BLOCK_BYTES, max_model_len=256, max_num_batched_tokens=256,
        kv_tiers=("host:16MiB", f"disk:{tmp_path / 'kv'}:64MiB"),
        kv_events_endpoint="tcp://127.0.0.1:0", kv_events_replay_endpoint="tcp://127.0.0.1:0"))
    assert engine.connector is not None
    host, disk = engine.connector.tiers
    index = ClusterIndex()
    index.add_replica("engine", scheme=HybridkvHashes(), layout=engine.layout)
    sub = KVEventSubscriber(index)
    tok = gemma.tokenizer()
    shared = tok.encode(SHARED[:440])  # 80 tokens: five blocks
    prompts = {name: shared + tok.encode(f" {tail}", add_bos=False) for name, tail in
               (("p0", "Who chaired it?"), ("p1", "What did the pier cost?"), ("p2", "When does dredging start?"))}
    for i, words in enumerate((48, 60, 60)):  # 187, 235 and 235 tokens
        prompts[f"f{i}"] = tok.encode(f"Filler {i}: " + " ".join(f"w{i}{j}" for j in range(words)))
    groups = len(engine.layout.groups)
    try:
        sub.connect("engine", engine.events.endpoint, engine.events.replay_endpoint)
        seen: dict[str, tuple[tuple[tuple[str, int], ...], int, int]] = {}
        for name in ("p0", "f0", "p1", "f1", "f2", "p2"):
            _poll_until(sub, engine)
            predicted = index.lookup(prompts[name])["engine"]
            reads = host.stats.hits, disk.stats.hits
            (out,) = engine.generate([prompts[name]], SamplingParams(max_tokens=2, ignore_eos=True))
            cpu, storage = predicted.medium_tokens(MEDIUM_CPU), predicted.medium_tokens(MEDIUM_STORAGE)
            host_reads, disk_reads = host.stats.hits - reads[0], disk.stats.hits - reads[1]
            assert predicted.medium_tokens(MEDIUM_GPU) == out.num_cached_tokens, name
            assert cpu + storage == out.num_external_tokens, name
            # The prompts lie inside the 512-token window: a load reads every block of every group. The
            # host serves at least the blocks of the tokens the index credits to it (it may also serve
            # stray blocks past them, which the index credits to the disk: the host alone cannot resume
            # there), and the two tiers together exactly the blocks of the external tokens.
            assert host_reads + disk_reads == (cpu + storage) // 16 * groups, name
            assert host_reads >= cpu // 16 * groups, name
            seen[name] = (predicted.by_medium, host_reads, disk_reads)
        # f0 evicted the tail of the shared prefix from the device: p1 found its head there and the
        # rest in the host tier, which served every block of it. f1 and f2 then evicted the prefix from
        # the host tier: p2 found it on disk.
        (gpu, cpu), host_reads, disk_reads = seen["p1"]
        assert gpu[0] == MEDIUM_GPU and cpu[0] == MEDIUM_CPU and (host_reads, disk_reads) == (cpu[1] // 16 * groups, 0)
        assert [m for m, _ in seen["p2"][0]] == [MEDIUM_STORAGE] and host.stats.evictions > 0
        _poll_until(sub, engine)
        view = index.views["engine"]
        assert sum(len(g) for g in view.media[MEDIUM_CPU].values()) == len(host)
        assert sum(len(g) for g in view.media[MEDIUM_STORAGE].values()) == len(disk)
    finally:
        sub.close()
        engine.close()

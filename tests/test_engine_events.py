"""The engine publishes its KV-cache events (vLLM's wire format over ZMQ), and the cluster index
fed from them predicts exactly what the engine's own prefix cache then serves."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from hybridkv.cluster import ClusterIndex, HybridkvHashes
from hybridkv.cluster.subscriber import KVEventSubscriber

import gemma

gemma.require_model()

from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.engine.sampling import SamplingParams  # noqa: E402

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

"""Our side of the comparison with vLLM's own KV-cache manager (``cluster_reference_side.py``).

``compare_with_reference`` starts the reference side in the vLLM venv (vLLM's ``KVCacheManager``
with events on, publishing through vLLM's ``ZmqEventPublisher``), follows it with a
``ClusterIndex`` over ZMQ, and for every request of a shared-prefix workload asserts that the
index's prediction equals the hit ``get_computed_blocks`` then finds. Used by
``tests/cluster/test_cluster_vllm.py`` and ``bench/cluster_index.py``.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from hybridkv import FullAttentionSpec, KVCacheGroup, KVCacheLayout
from hybridkv.cluster import ClusterIndex, VllmHashes
from hybridkv.cluster.subscriber import KVEventSubscriber

REFERENCE_SIDE = Path(__file__).resolve().parent / "cluster_reference_side.py"
LAYOUT_GROUPS = {"full": 1, "full_swa": 2, "full_mamba": 2, "full_swa_mamba": 3}


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment for vLLM's side: no PYTHONHASHSEED (vLLM's fixed sha256 seed applies)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    env.update(VLLM_LOGGING_LEVEL="WARNING", **extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ReferenceReplica:
    """``cluster_reference_side.py`` running in the vLLM venv: vLLM's manager and publisher."""

    def __init__(self, python: str, layout: str, num_blocks: int, *, int_hashes: bool = True, chunk: int = 64) -> None:
        self.port, self.replay_port = _free_port(), _free_port()
        self.proc = subprocess.Popen(
            [python, str(REFERENCE_SIDE), "--layout", layout, "--num-blocks", str(num_blocks),
             "--chunk", str(chunk), "--endpoint", f"tcp://*:{self.port}",
             "--replay-endpoint", f"tcp://*:{self.replay_port}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=vllm_env(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1" if int_hashes else "0"))
        ready = self._read()
        if ready != {"ready": True}:
            raise RuntimeError(f"reference side did not start: {ready}")

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            assert self.proc.stderr is not None
            raise RuntimeError("reference side exited: " + self.proc.stderr.read()[-3000:])
        return dict(json.loads(line))

    def run(self, rid: str, tokens: list[int], decode: int, keep: int) -> dict[str, Any]:
        """Serve one request; returns its hit at admission and the batches published so far."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "run", "id": rid, "tokens": tokens, "decode": decode,
                                          "keep": keep}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
            self.proc.stdin.flush()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def workload(seed: int, n: int) -> list[list[int]]:
    """Prompts cut from 4 shared prefixes of 40-320 tokens at random points, plus 1-50 own tokens."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 30_000) for _ in range(rng.randint(40, 320))] for _ in range(4)]
    out = []
    for _ in range(n):
        head = rng.choice(heads)
        out.append(head[: rng.randint(1, len(head))] + [rng.randrange(1, 30_000) for _ in range(rng.randint(1, 50))])
    return out


def _wait_for(sub: KVEventSubscriber, name: str, published: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (sub.index.streams[name].next_seq or 0) < published:
        if time.monotonic() > deadline:
            raise AssertionError(f"index at batch {sub.index.streams[name].next_seq}, replica published {published}")
        sub.poll(0.05)


def compare_with_reference(python: str, layout: str, *, num_blocks: int, requests: int, seed: int,
                           int_hashes: bool = True) -> dict[str, Any]:
    """Drive the reference replica with ``workload(seed, requests)``; raise ``AssertionError`` at the
    first request whose predicted hit differs from vLLM's. Returns counts: requests, hits, hit
    tokens, removals of hashes never stored (0 unless events were lost), and how many requests an
    index of the full-attention chain alone (fed the same events) over-predicts."""
    index = ClusterIndex()
    index.add_replica("vllm", scheme=VllmHashes(), expected_groups=LAYOUT_GROUPS[layout])
    full = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=1)
    index.add_replica("full-only", scheme=VllmHashes(), layout=KVCacheLayout(2, (KVCacheGroup(full),)))
    sub = KVEventSubscriber(index)
    ref = ReferenceReplica(python, layout, num_blocks, int_hashes=int_hashes)
    rng = random.Random(seed)
    counts: dict[str, Any] = {"requests": 0, "hits": 0, "hit_tokens": 0, "unknown_removals": 0,
                              "full_only_over": 0, "full_only_over_tokens": 0}
    try:
        for name in ("vllm", "full-only"):
            sub.connect(name, f"tcp://127.0.0.1:{ref.port}", f"tcp://127.0.0.1:{ref.replay_port}")
        published = 0
        for i, prompt in enumerate(workload(seed, requests)):
            _wait_for(sub, "vllm", published)
            _wait_for(sub, "full-only", published)
            found = index.lookup(prompt)
            predicted, full_only = found["vllm"], found["full-only"]
            answer = ref.run(f"r{i}", prompt, decode=rng.randint(0, 24), keep=rng.randint(1, 3))
            if predicted.tokens != answer["hit"]:
                raise AssertionError(f"{layout}, request {i} ({len(prompt)} tokens): index predicted "
                                     f"{predicted}, vLLM found {answer['hit']}")
            published = answer["published"]
            counts["requests"] += 1
            counts["hits"] += answer["hit"] > 0
            counts["hit_tokens"] += answer["hit"]
            counts["full_only_over"] += full_only.tokens > answer["hit"]
            counts["full_only_over_tokens"] += max(0, full_only.tokens - answer["hit"])
        view = index.views["vllm"]
        if not view.verified or view.hash_problem:
            raise AssertionError(f"the mirror of vLLM's hashes was not confirmed: {view.hash_problem or 'unchecked'}")
        counts["unknown_removals"] = view.unknown_removals
        counts["resyncs"] = index.streams["vllm"].resyncs
        counts["batches"] = index.streams["vllm"].batches
        return counts
    finally:
        sub.close()
        ref.close()

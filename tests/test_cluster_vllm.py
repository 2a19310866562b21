"""Against vLLM itself: its wire classes and its own KV-cache manager and ZMQ publisher.

These tests run vLLM's code in a subprocess with the python of a venv where vLLM 0.33 is
installed (scheduler-side code on the CPU; no GPU needed): set ``HYBRIDKV_VLLM_PYTHON`` to it.

* Batches we publish decode with vLLM's msgspec ``KVEventBatch``; batches vLLM encodes decode with
  ours.
* The index, fed by vLLM's ``ZmqEventPublisher`` from vLLM's ``KVCacheManager`` (events enabled),
  predicts for every next request exactly the hit ``get_computed_blocks`` then finds: full +
  sliding window, full + Mamba (align mode, junction checkpoints), full + both; with vLLM's default
  64-bit event hashes and with full digests; a small pool so blocks are evicted.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hybridkv import FullAttentionSpec, KVCacheGroup, KVCacheLayout
from hybridkv.cluster import (
    AllClearedEvent,
    BlockRemovedEvent,
    BlockStoredEvent,
    ClusterIndex,
    VllmHashes,
    make_batch,
)
from hybridkv.cluster.subscriber import KVEventSubscriber
from hybridkv.cluster.wire import decode_batch, encode_batch

VLLM_PYTHON = os.environ.get("HYBRIDKV_VLLM_PYTHON", "")
REFERENCE_SIDE = Path(__file__).resolve().parent.parent / "bench" / "cluster_reference_side.py"

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON or not Path(VLLM_PYTHON).is_file(),
    reason="needs vLLM 0.33: set HYBRIDKV_VLLM_PYTHON to the python of a venv where it is installed",
)


def _vllm_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}  # vLLM's fixed sha256 seed
    env.update(VLLM_LOGGING_LEVEL="WARNING", **extra)
    return env


def _run_vllm(code: str, stdin: bytes = b"") -> bytes:
    done = subprocess.run([VLLM_PYTHON, "-c", code], input=stdin, capture_output=True, env=_vllm_env(), timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return done.stdout


def test_batches_we_encode_decode_with_vllms_own_classes() -> None:
    batch = make_batch([
        BlockStoredEvent((b"\x01" * 32, 2**64 - 1), None, tuple(range(32)), 16, "GPU", 1, "sliding_window", 48),
        BlockRemovedEvent((b"\x01" * 32,), "CPU", 0),
        AllClearedEvent(),
    ], ts=3.25, data_parallel_rank=2)
    code = (
        "import sys, msgspec\n"
        "from vllm.distributed.kv_events import KVEventBatch\n"
        "b = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=KVEventBatch)\n"
        "print(repr(b))\n"
    )
    text = _run_vllm(code, encode_batch(batch)).decode()
    assert text.startswith("KVEventBatch(ts=3.25, events=[BlockStored(block_hashes=[b'\\x01")
    for part in ("18446744073709551615]", "parent_block_hash=None", "block_size=16", "medium='GPU'",
                 "group_idx=1", "kv_cache_spec_kind='sliding_window'", "kv_cache_spec_sliding_window=48",
                 "BlockRemoved(block_hashes=[b'\\x01", "medium='CPU', group_idx=0", "AllBlocksCleared()",
                 "data_parallel_rank=2"):
        assert part in text, part


def test_batches_vllm_encodes_decode_with_ours() -> None:
    code = (
        "import sys, msgspec\n"
        "from vllm.distributed.kv_events import *\n"
        "b = KVEventBatch(ts=7.5, events=[BlockStored(block_hashes=[11, 12], parent_block_hash=10,"
        " token_ids=[1, 2, 3, 4], block_size=2, lora_id=None, medium='GPU', lora_name=None,"
        " extra_keys=[('salt',), None], group_idx=2, kv_cache_spec_kind='mamba'),"
        " BlockRemoved(block_hashes=[11], medium='GPU', group_idx=2), AllBlocksCleared()])\n"
        "sys.stdout.buffer.write(msgspec.msgpack.encode(b))\n"
    )
    batch = decode_batch(_run_vllm(code))
    assert batch.ts == 7.5
    assert batch.events == (
        BlockStoredEvent((11, 12), 10, (1, 2, 3, 4), 2, "GPU", 2, "mamba", None, extra_keys=(["salt"], None)),
        BlockRemovedEvent((11,), "GPU", 2),
        AllClearedEvent(),
    )


# ---------------------------------------------------------------------- the reference manager
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ReferenceReplica:
    """``bench/cluster_reference_side.py`` in the vLLM venv: vLLM's manager and publisher."""

    def __init__(self, layout: str, num_blocks: int, *, int_hashes: bool = True, chunk: int = 64) -> None:
        self.port, self.replay_port = _free_port(), _free_port()
        self.proc = subprocess.Popen(
            [VLLM_PYTHON, str(REFERENCE_SIDE), "--layout", layout, "--num-blocks", str(num_blocks),
             "--chunk", str(chunk), "--endpoint", f"tcp://*:{self.port}",
             "--replay-endpoint", f"tcp://*:{self.replay_port}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=_vllm_env(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1" if int_hashes else "0"))
        assert self._read() == {"ready": True}

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            assert self.proc.stderr is not None
            raise AssertionError("reference side exited: " + self.proc.stderr.read()[-3000:])
        return dict(json.loads(line))

    def run(self, rid: str, tokens: list[int], decode: int, keep: int) -> dict[str, Any]:
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


def _workload(seed: int, n: int) -> list[list[int]]:
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


def compare_with_reference(layout: str, groups: int, *, num_blocks: int, requests: int, seed: int,
                           int_hashes: bool = True) -> dict[str, int]:
    """Drive the reference replica with a shared-prefix workload; assert the index's prediction equals
    the reference's hit for every request. Returns counts for the caller to check the run mattered."""
    index = ClusterIndex()
    index.add_replica("vllm", scheme=VllmHashes(), expected_groups=groups)
    # What deployed routers index: the full-attention chain alone, fed the same events.
    index.add_replica("full-only", scheme=VllmHashes(),
                      layout=KVCacheLayout(2, (KVCacheGroup(FullAttentionSpec(block_size=16, num_kv_heads=1,
                                                                              head_size=1)),)))
    sub = KVEventSubscriber(index)
    ref = ReferenceReplica(layout, num_blocks, int_hashes=int_hashes)
    rng = random.Random(seed)
    counts = {"requests": 0, "hits": 0, "hit_tokens": 0, "unknown_removals": 0, "full_only_over": 0}
    try:
        for name in ("vllm", "full-only"):
            sub.connect(name, f"tcp://127.0.0.1:{ref.port}", f"tcp://127.0.0.1:{ref.replay_port}")
        published = 0
        for i, prompt in enumerate(_workload(seed, requests)):
            _wait_for(sub, "vllm", published)
            _wait_for(sub, "full-only", published)
            predicted, full_only = index.lookup(prompt).values()
            answer = ref.run(f"r{i}", prompt, decode=rng.randint(0, 24), keep=rng.randint(1, 3))
            assert predicted.tokens == answer["hit"], (
                f"request {i} ({len(prompt)} tokens): index predicted {predicted}, vLLM found {answer['hit']}")
            published = answer["published"]
            counts["requests"] += 1
            counts["hits"] += answer["hit"] > 0
            counts["hit_tokens"] += answer["hit"]
            counts["full_only_over"] += full_only.tokens > answer["hit"]
        view = index.views["vllm"]
        assert view.verified and not view.hash_problem  # our mirror of vLLM's hashes was checked
        counts["unknown_removals"] = view.unknown_removals  # of hashes never stored: must stay 0
        assert index.streams["vllm"].resyncs == 0
        return counts
    finally:
        sub.close()
        ref.close()


@pytest.mark.parametrize(("layout", "groups", "int_hashes"), [
    ("full_swa", 2, True),
    ("full_mamba", 2, True),
    ("full_swa_mamba", 3, False),
])
def test_the_index_predicts_the_reference_managers_hit_for_every_next_request(
        layout: str, groups: int, int_hashes: bool) -> None:
    counts = compare_with_reference(layout, groups, num_blocks=80, requests=60, seed=3, int_hashes=int_hashes)
    assert counts["hits"] >= 15 and counts["unknown_removals"] == 0, counts
    # The workload tells the hybrid rule from the chain alone: a full-attention-only index, fed the
    # same events, predicts hits vLLM does not find (a window partly evicted, no checkpoint there).
    assert counts["full_only_over"] >= 5, counts


if __name__ == "__main__":  # pragma: no cover - a quick manual run
    print(compare_with_reference(sys.argv[1], int(sys.argv[2]), num_blocks=80, requests=60, seed=3))

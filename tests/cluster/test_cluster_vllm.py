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

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridkv.cluster import AllClearedEvent, BlockRemovedEvent, BlockStoredEvent, make_batch
from hybridkv.cluster.wire import decode_batch, encode_batch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from cluster_reference import compare_with_reference, vllm_env

VLLM_PYTHON = os.environ.get("HYBRIDKV_VLLM_PYTHON", "")

pytestmark = pytest.mark.skipif(
    not VLLM_PYTHON or not Path(VLLM_PYTHON).is_file(),
    reason="needs vLLM 0.33: set HYBRIDKV_VLLM_PYTHON to the python of a venv where it is installed",
)


def _run_vllm(code: str, stdin: bytes = b"") -> bytes:
    done = subprocess.run([VLLM_PYTHON, "-c", code], input=stdin, capture_output=True, env=vllm_env(), timeout=300)
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
@pytest.mark.parametrize(("layout", "int_hashes"), [("full_swa", True), ("full_mamba", True),
                                                    ("full_swa_mamba", False)])
def test_the_index_predicts_the_reference_managers_hit_for_every_next_request(layout: str, int_hashes: bool) -> None:
    counts = compare_with_reference(VLLM_PYTHON, layout, num_blocks=80, requests=60, seed=3, int_hashes=int_hashes)
    assert counts["hits"] >= 15 and counts["unknown_removals"] == 0, counts
    # The workload tells the hybrid rule from the chain alone: a full-attention-only index, fed the
    # same events, predicts hits vLLM does not find (a window partly evicted, no checkpoint there).
    assert counts["full_only_over"] >= 5, counts

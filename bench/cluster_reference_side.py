"""The reference engine's KV-cache manager publishing its own KV events (run with the vLLM venv's python).

Drives vLLM's scheduler-side ``KVCacheManager`` with ``enable_kv_cache_events`` on the CPU and
publishes every step's events through vLLM's own ``ZmqEventPublisher``, the way its scheduler
does (``KVEventBatch(ts, events)`` after each step). A controller (``tests/cluster/test_cluster_vllm.py``,
``bench/cluster_index.py``) feeds it requests as JSON lines on stdin and reads one JSON line per
request on stdout::

    {"op": "run", "id": "r1", "tokens": [...], "decode": 4, "keep": 2}
      -> {"hit": 96, "published": 17}     # the manager's prefix hit at admission, batches so far
    {"op": "quit"}

A request is admitted with the hit ``get_computed_blocks`` finds, prefilled in chunks of at most
``--chunk`` tokens (for a Mamba group in ``align`` mode, split as vLLM's scheduler splits: at the
shared-prefix junction and at the last block boundary), decoded ``decode`` tokens, and kept
running; the oldest running requests are freed beyond ``keep``, and freed early when the pool
runs out (preemption). Layouts (``--layout``): ``full``, ``full_swa`` (full + sliding window),
``full_mamba`` (full + Mamba, align mode), ``full_swa_mamba``.

    VENV/bin/python bench/cluster_reference_side.py --layout full_swa --endpoint tcp://*:5557 \\
        --replay-endpoint tcp://*:5558
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import deque

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch
from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request, RequestStatus


def specs_for(layout: str, block_size: int, window: int) -> list[object]:
    attn = {"block_size": block_size, "num_kv_heads": 8, "head_size": 128, "dtype": torch.bfloat16}
    full = FullAttentionSpec(**attn)
    swa = SlidingWindowSpec(**attn, sliding_window=window)
    mamba = MambaSpec(block_size=block_size, shapes=((64,),), dtypes=(torch.float32,),
                      page_size_padded=full.page_size_bytes, mamba_cache_mode="align")
    return {"full": [full], "full_swa": [full, swa], "full_mamba": [full, mamba],
            "full_swa_mamba": [full, swa, mamba]}[layout]


class Replica:
    def __init__(self, args: argparse.Namespace) -> None:
        specs = specs_for(args.layout, args.block_size, args.window)
        groups = [KVCacheGroupSpec(layer_names=[f"layers.{g}"], kv_cache_spec=s) for g, s in enumerate(specs)]
        config = KVCacheConfig(num_blocks=args.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        self.mamba = "mamba" in args.layout
        self.mgr = KVCacheManager(kv_cache_config=config, max_model_len=args.max_model_len,
                                  scheduler_block_size=args.block_size, hash_block_size=args.block_size,
                                  enable_caching=True, enable_kv_cache_events=True,
                                  enable_mamba_shared_prefix_checkpoint=self.mamba)
        hash_fn = get_hash_fn_by_name(args.hash)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(args.block_size, hash_fn)
        self.block_size = args.block_size
        self.chunk = args.chunk
        self.publisher = ZmqEventPublisher(0, endpoint=args.endpoint, replay_endpoint=args.replay_endpoint,
                                           buffer_steps=args.buffer_steps)
        self.published = 0
        self.running: deque[Request] = deque()
        self.manager_seconds = 0.0

    def step_done(self) -> None:
        """The end of a scheduler step: publish what the manager collected (as vLLM's scheduler does)."""
        events = self.mgr.take_events()
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))
            self.published += 1

    def allocate(self, req: Request, n: int, **kw: object) -> None:
        while True:
            t = time.perf_counter()
            out = self.mgr.allocate_slots(req, n, **kw)
            self.manager_seconds += time.perf_counter() - t
            if out is not None:
                return
            victims = [r for r in self.running if r is not req]
            if not victims:
                raise RuntimeError(f"request {req.request_id} does not fit in the pool")
            self.free(victims[0])

    def free(self, req: Request) -> None:
        self.running.remove(req)
        req.status = RequestStatus.FINISHED_STOPPED
        self.mgr.free(req)

    def stops(self, req: Request, start: int, junction: int) -> list[int]:
        """Where the prefill's chunks end."""
        n = req.num_tokens
        ends = set(range(start + self.chunk, n, self.chunk))
        if self.mamba:  # align mode: chunk ends that are not block boundaries cache no state
            bs = self.block_size
            ends = {e // bs * bs for e in ends}
            ends |= {(n - 1) // bs * bs}
            if start < junction:
                ends.add(junction // bs * bs)
        return sorted({e for e in ends if start < e < n} | {n})

    def run(self, rid: str, tokens: list[int], decode: int, keep: int) -> int:
        req = Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(max_tokens=decode + 1),
                      pooling_params=None, block_hasher=self.hasher)
        self.mgr.new_step_starts()
        t = time.perf_counter()
        computed, hit, junction = self.mgr.get_computed_blocks(req)
        self.manager_seconds += time.perf_counter() - t
        req.shared_prefix_boundary = junction
        self.running.append(req)
        start = hit
        for i, end in enumerate(self.stops(req, hit, junction)):
            if i:
                self.mgr.new_step_starts()
                self.allocate(req, end - start)
            else:
                self.allocate(req, end - start, num_new_computed_tokens=hit, new_computed_blocks=computed)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = end
            start = end
            self.step_done()
        for k in range(decode):
            self.mgr.new_step_starts()
            req.append_output_token_ids(50_000 + k)
            self.allocate(req, 1)
            req.num_computed_tokens += 1
            self.step_done()
        while len(self.running) > keep:
            self.free(self.running[0])
        self.step_done()
        return hit


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layout", default="full_swa", choices=["full", "full_swa", "full_mamba", "full_swa_mamba"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--window", type=int, default=40)
    ap.add_argument("--num-blocks", type=int, default=96)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--hash", default="sha256")
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--replay-endpoint")
    args = ap.parse_args()
    replica = Replica(args)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "quit":
            break
        hit = replica.run(cmd["id"], cmd["tokens"], cmd.get("decode", 0), cmd.get("keep", 1))
        print(json.dumps({"hit": hit, "published": replica.published,
                          "manager_seconds": replica.manager_seconds}), flush=True)
    replica.publisher.shutdown()


if __name__ == "__main__":
    main()

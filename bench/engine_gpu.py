"""The engine's decode speed on a GPU, eager against CUDA graphs, on Gemma 3 270M's shapes.

    python bench/engine_gpu.py [--device cuda] [--dtypes bfloat16,float32] [--batches 1,8,32] [--json FILE]

Random weights of the real shapes (``gemma-3-270m-random``: the GGUF need not be on the GPU
machine; speed does not depend on the values). For each dtype and mode (``eager``:
``EngineConfig(enforce_eager=True)``, the engine before decode graphs; ``graphs``: the default on a
GPU), one engine serves ``--batches`` sequences of ``--prompt-len``-token prompts, each generating
``--decode-tokens`` greedy tokens; decode tokens/s = tokens after each sequence's first over the
time from the last first token to the end. Each measurement runs ``--repeat`` times, the modes
alternating, and the best is kept; a warm-up run first (graph capture, allocator, cuBLAS).

Also printed: the share of a graphs decode step spent outside the graph replay (scheduler,
manager, packing, sampling, detokenization: what is left to speed up on the host), and whether the
greedy tokens of the two modes agree (``same``: every sequence's tokens; else how many positions
agree up to the first difference).

``--small`` runs a toy Gemma 3 (a smoke test of this script on a CPU).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from hybridkv.engine import model, quant
from hybridkv.engine.config import EngineConfig, parse_dtype
from hybridkv.engine.engine import LLMEngine
from hybridkv.engine.graphs import DecodeGraphs
from hybridkv.engine.hybrid import ByteTokenizer
from hybridkv.engine.sampling import SamplingParams
from hybridkv.engine.weights import GEMMA3_270M, Gemma3Config, Gemma3Weights

SMALL = Gemma3Config(num_layers=6, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=1, head_dim=32,
                     vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6, sliding_window=48,
                     rope_theta_global=1e6)


class Timed:
    """Wraps ``DecodeGraphs.replay`` to add up the seconds spent in it (a replay ends in a sync)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = 0.0
        self.calls = 0
        graphs = engine.graphs
        if graphs is None:
            return
        inner = graphs.replay

        def replay(*args: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return inner(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1

        graphs.replay = replay  # type: ignore[method-assign]


def decode(engine: LLMEngine, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]], float]:
    """(decode tokens/s, each sequence's tokens, seconds per decode step spent outside the replay)."""
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    timed = Timed(engine)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", p, params)
    first: float | None = None
    waiting = len(prompts)
    out: dict[str, list[int]] = {}
    steps_after = 0
    replay_before = 0.0
    while engine.has_unfinished:
        for o in engine.step():
            waiting -= len(o.token_ids) == 1
            out[o.request_id] = o.token_ids
        if first is None and waiting == 0:
            first = time.perf_counter()
            replay_before = timed.seconds
        elif first is not None:
            steps_after += 1
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    end = time.perf_counter()
    assert first is not None
    seconds = end - first
    outside = (seconds - (timed.seconds - replay_before)) / max(1, steps_after) if timed.calls else float("nan")
    return len(prompts) * (tokens - 1) / seconds, [out[k] for k in sorted(out)], outside


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    if a == b:
        return "same"
    agree = 0
    for x, y in zip(a, b):
        agree += next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), len(x))
    return f"{agree}/{sum(len(x) for x in a)}"


MODES = {
    # name: (enforce_eager, DenseLinear's F.linear on a GPU, decode_attention on a GPU)
    "eager-before": (True, False, False),
    "graphs-only": (False, False, False),
    "graphs+linear": (False, True, False),  # graphs with one change of two
    "graphs": (False, True, True),
    "eager": (True, True, True),
}
"""``eager-before``: the engine before this change (the baseline the speed-ups are against);
``graphs``: the default now; the others take one change at a time."""


def use(mode: str) -> None:
    _, linear, sdpa = MODES[mode]
    quant.CUDA_LINEAR, model.CUDA_DECODE_ATTENTION = linear, sdpa


def profile(engine: LLMEngine, mode: str, prompts: list[list[int]], out: str | None) -> None:
    """Kernels per decode step and the costliest kernels, from the profiler over 16 steps."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    use(mode)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"p{i}-{time.monotonic_ns()}", p, params)
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(16):
            engine.step()
        torch.cuda.synchronize()
    while engine.has_unfinished:
        engine.step()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = len(events) / 16
    busy = sum(e.device_time for e in events) / 16 / 1e3
    print(f"profile {mode}, {len(prompts)} rows: {kernels:.0f} kernels per step, {busy:.3f} ms of kernel time per step")
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    print(table)
    if out:
        with open(out, "a") as f:
            f.write(f"## {mode}, {len(prompts)} rows\n{table}\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--modes", default=",".join(MODES), help="of " + ", ".join(MODES))
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--small", action="store_true", help="a toy Gemma 3 (smoke test on a CPU)")
    ap.add_argument("--profile", default=None, metavar="MODES", help="profile these modes' decode steps (GPU)")
    ap.add_argument("--profile-out", default=None, metavar="FILE")
    ap.add_argument("--json", default=None, metavar="FILE")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    modes = args.modes.split(",")
    config = SMALL if args.small else GEMMA3_270M
    gen = torch.Generator().manual_seed(0)
    device_name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    rows: list[dict[str, Any]] = []
    for dtype in args.dtypes.split(","):
        weights = Gemma3Weights.generate(config, parse_dtype(dtype), device=args.device)
        engines = {}
        for mode in modes:
            cfg = EngineConfig(device=args.device, dtype=dtype, weights="dense", enforce_eager=MODES[mode][0],
                               max_num_seqs=max(batches), max_model_len=2048, kv_cache_memory=1 << 30,
                               max_num_batched_tokens=max(2048, args.prompt_len * max(batches)),
                               enable_prefix_caching=False)
            e = engines[mode] = LLMEngine(weights, ByteTokenizer(), cfg)
            if not MODES[mode][0] and e.graphs is None:  # a CPU: the padded inputs, run eagerly
                e.graphs = DecodeGraphs(e.model, e.block_size, e.group_windows, cfg.max_num_seqs, cfg.max_model_len,
                                        e.device, capture=False)
        for batch in batches:
            prompts = [[256] + torch.randint(0, 256, (args.prompt_len - 1,), generator=gen).tolist()
                       for _ in range(batch)]
            best: dict[str, tuple[float, list[list[int]], float]] = {}
            for mode, engine in engines.items():
                use(mode)
                decode(engine, prompts, 4)  # warm-up: this batch's graphs captured
            for _ in range(args.repeat):
                for mode, engine in engines.items():
                    use(mode)
                    result = decode(engine, prompts, args.decode_tokens)
                    if mode not in best or result[0] > best[mode][0]:
                        best[mode] = result
            base = modes[0]
            for mode in modes:
                row = {"device": device_name, "dtype": dtype, "batch": batch, "mode": mode,
                       "tokens_per_s": round(best[mode][0], 1), "vs_" + base: round(best[mode][0] / best[base][0], 2),
                       "host_ms_per_step_outside_replay": round(best[mode][2] * 1e3, 3),
                       "greedy_agreement_with_" + base: agreement(best[mode][1], best[base][1])}
                rows.append(row)
                print(json.dumps(row), flush=True)
        if args.profile and args.device.startswith("cuda"):
            for mode in args.profile.split(","):
                for count in (1, 8):
                    if mode in engines:
                        profile(engines[mode], mode, [[256] + list(range(100 + i)) for i in range(count)],
                                args.profile_out)
        del engines, weights
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    use("graphs")
    print(f"\n{'dtype':<9} {'batch':>5} {'mode':<14} {'tok/s':>9} {'x':>6} {'host ms/step':>13} agree")
    for r in rows:
        ratio, agree = (v for k, v in r.items() if k.startswith("vs_") or k.startswith("greedy_"))
        print(f"{r['dtype']:<9} {r['batch']:>5} {r['mode']:<14} {r['tokens_per_s']:>9} {ratio:>6} "
              f"{r['host_ms_per_step_outside_replay']:>13} {agree}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

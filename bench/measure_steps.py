"""Measure whole-model step times of any preset's shapes on a CUDA GPU (random weights).

    python bench/measure_steps.py --model gemma-3-4b --gpu h100-80gb OUT.json
    python bench/measure_steps.py --model gemma-3-1b --smoke OUT.json     # a CPU dry run, tiny shapes

Writes a calibration profile (``hybridkv.sim.cost_model.load_profile``; fit it with ``hybridkv
calibrate OUT.json --model MODEL --gpu GPU``, or check the built-in H100 profile against it with
``--check``). NOT RUN by its author: written without a GPU; the arguments and shapes are tested
(``tests/sim/test_sim_measure_steps.py``) and ``--smoke`` runs the whole script on the CPU.

What runs: a decoder with the preset's layer kinds (full, sliding-window, chunked-local
attention), hidden size, query/KV heads and head size, a gated MLP (``intermediate_size`` from the
config, ``KNOWN_INTERMEDIATE`` or ``--intermediate-size``; an MoE is run as a dense MLP as wide as
its active parameters), RMS norms and the LM head for the sampled rows only; random weights in
``--dtype`` (bf16); attention through PyTorch SDPA with lower-right causal masks over contiguous
per-layer KV buffers. A sliding (chunked) layer attends to its last ``window - 1`` cached keys (the
keys since its chunk began) plus the whole new chunk under the causal mask: the profile says
``"window_kernel": "masked"``. Recurrent (Mamba, Gated DeltaNet) and MLA layers are refused.
Not measured: rotary embeddings, QK norms, sampling, scheduling, paged KV, fused kernels. Each
step is timed with CUDA events (median of ``--reps``, after warm-ups); decode batches run eagerly
and as a captured CUDA graph (``decode-eager``, ``decode-graph``); a prefill chunk of one
sequence is ``prefill-eager``; a chunk with a decode batch is ``mixed-eager``. The file is
rewritten after every step, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridkv.errors import InvalidInputError
from hybridkv.planning import get_preset, parse_config
from hybridkv.planning.hf_config import text_config
from hybridkv.sim.cost_model import ACTIVE_PARAMS

KNOWN_INTERMEDIATE: dict[str, int] = {
    # intermediate_size of the published config.json files (the presets keep only KV-cache fields).
    "gemma-3-270m": 2048, "gemma-3-1b": 6912, "gemma-3-4b": 10240, "gemma-3-12b": 15360, "gemma-3-27b": 21504,
    "gemma-2-9b": 14336, "gemma-2-27b": 36864, "mistral-7b-v0.1": 14336, "llama-3.1-8b": 14336,
    "llama-3.1-70b": 28672, "phi-3-mini": 8192,
}

DEFAULT_PREFILL_CHUNKS = (128, 512, 2048, 8192)
DEFAULT_PREFILL_CONTEXTS = (0, 8192, 32768)
DEFAULT_DECODE = ((1, 1024), (1, 8192), (1, 32768), (8, 1024), (8, 8192), (32, 1024), (32, 4096), (64, 1024),
                  (64, 2048))
DEFAULT_MIXED = ((2048, 0, 32, 4096), (512, 16384, 32, 4096), (2048, 8192, 8, 8192))


@dataclass(frozen=True)
class Shape:
    """The decoder a run builds."""

    model: str
    kinds: tuple[str, ...]
    """Per layer: ``full``, ``sliding`` or ``chunked``."""
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    window: int
    """Sliding window (or attention chunk) in tokens; 0 without one."""

    def keys(self, layer: int, context: int, new: int) -> int:
        """Keys a chunk of ``new`` tokens after ``context`` cached ones attends to in ``layer``."""
        kind = self.kinds[layer]
        if kind == "sliding":
            return min(context, self.window - 1) + new
        if kind == "chunked":
            return context % self.window + new
        return context + new


def model_shape(model: str, intermediate_size: int | None = None) -> Shape:
    """The ``Shape`` of a model preset; ``InvalidInputError`` for a layer kind this script cannot run."""
    preset = get_preset(model)
    cfg = text_config(preset.config)
    kv = parse_config(preset.config)
    unsupported = sorted({k for k in kv.layer_kinds if k not in ("full", "sliding", "chunked")})
    if unsupported:
        raise InvalidInputError(f"{model}: measure_steps.py runs full, sliding-window and chunked attention "
                                f"layers only, not {', '.join(unsupported)}")
    hidden, heads, vocab = int(cfg["hidden_size"]), int(cfg["num_attention_heads"]), int(cfg["vocab_size"])
    inter = intermediate_size or cfg.get("intermediate_size") or KNOWN_INTERMEDIATE.get(preset.id)
    if not inter:
        # An MoE (or an unknown dense model): a gated MLP as wide as the active parameters leave.
        tied = bool(cfg.get("tie_word_embeddings", True))
        active = ACTIVE_PARAMS.get(preset.id, preset.num_params)
        body = active - vocab * hidden * (1 if tied else 2)
        attn = hidden * kv.head_size * (2 * heads + 2 * kv.num_kv_heads)
        inter = max(1, int((body / kv.num_layers - attn) / (3 * hidden)))
    window = kv.sliding_window or kv.attention_chunk_size or 0
    return Shape(preset.id, tuple(kv.layer_kinds), hidden, heads, kv.num_kv_heads, kv.head_size, int(inter), vocab,
                 window)


def smoke_shape(shape: Shape) -> Shape:
    """A tiny decoder with the same layer pattern (the first 12 layers), for a CPU dry run."""
    return Shape(shape.model, shape.kinds[:12], 64, 4, 2, 16, 128, 512, min(shape.window, 16) if shape.window else 0)


def _pairs(text: str, n: int) -> tuple[tuple[int, ...], ...]:
    out = []
    for item in text.split(","):
        parts = item.strip().split(":")
        if len(parts) != n or not all(p.isdigit() for p in parts):
            raise argparse.ArgumentTypeError(f"expected {n} integers separated by ':' per item, got {item!r}")
        out.append(tuple(int(p) for p in parts))
    return tuple(out)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by ',', got {text!r}") from None
    if any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 0, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="profile to write (JSON)")
    ap.add_argument("--model", required=True, help="model preset whose shapes to run")
    ap.add_argument("--gpu", default="h100-80gb", help="GPU preset id written into the profile's meta")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: known or derived)")
    ap.add_argument("--prefill-chunks", type=_ints, default=DEFAULT_PREFILL_CHUNKS, metavar="N,N,...")
    ap.add_argument("--prefill-contexts", type=_ints, default=DEFAULT_PREFILL_CONTEXTS, metavar="C,C,...")
    ap.add_argument("--decode", type=lambda s: _pairs(s, 2), default=DEFAULT_DECODE, metavar="B:C,...",
                    help="decode batches: B sequences at C tokens of context")
    ap.add_argument("--mixed", type=lambda s: _pairs(s, 4), default=DEFAULT_MIXED, metavar="T:C:B:D,...",
                    help="mixed steps: a T-token chunk after C cached tokens with B decodes at D context")
    ap.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph decode steps")
    ap.add_argument("--reps", type=int, default=7, help="timed runs per step (the median is kept)")
    ap.add_argument("--local-buffers", type=int, default=13,
                    help="KV buffers cycled over the sliding/chunked layers (each larger than L2)")
    ap.add_argument("--budget-s", type=float, default=600.0, help="stop starting new steps after this long")
    ap.add_argument("--smoke", action="store_true", help="a CPU dry run with tiny shapes")
    return ap


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def plan_steps(args: argparse.Namespace) -> list[tuple[str, list[tuple[int, int, int]]]]:
    """(mode, parts) of every step to measure, in order; a part is (sequences, new tokens, context)."""
    steps: list[tuple[str, list[tuple[int, int, int]]]] = []
    for c in args.prefill_contexts:
        for t in args.prefill_chunks:
            steps.append(("prefill-eager", [(1, t, c)]))
    for b, c in args.decode:
        steps.append(("decode-eager", [(b, 1, c)]))
        if not args.no_graphs and not args.smoke:
            steps.append(("decode-graph", [(b, 1, c)]))
    for t, c, b, d in args.mixed:
        steps.append(("mixed-eager", [(1, t, c), (b, 1, d)]))
    return steps


def sample_of(mode: str, parts: list[tuple[int, int, int]], times: list[float]) -> dict[str, Any]:
    """One profile sample: every sequence samples (a decode, or a prefill chunk's last token)."""
    work = [[t, c, 0, 1] for b, t, c in parts for _ in range(b)]
    return {"work": work, "seconds": statistics.median(times), "best_s": min(times), "mode": mode,
            "parts": [list(p) for p in parts]}


def measure(args: argparse.Namespace) -> dict[str, Any]:  # pragma: no cover - needs torch (and a GPU)
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    shape = model_shape(args.model, args.intermediate_size)
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", getattr(torch, {"bf16": "bfloat16",
                                                                                       "fp16": "float16"}[args.dtype]))
    if args.smoke:
        shape = smoke_shape(shape)
    elif not torch.cuda.is_available():
        raise SystemExit("measure_steps.py: no CUDA device (use --smoke for a CPU dry run)")
    h, nh, nkv, hd, inter = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    gen = torch.Generator(device=device).manual_seed(0)

    def weight(*dims: int) -> Any:
        return torch.empty(*dims, device=device, dtype=dtype).normal_(0, 0.02, generator=gen)

    layers = [{"qkv": weight(h, (nh + 2 * nkv) * hd), "o": weight(nh * hd, h), "gu": weight(h, 2 * inter),
               "down": weight(inter, h), "n1": weight(h), "n2": weight(h)} for _ in shape.kinds]
    head = weight(h, shape.vocab)
    sync: Callable[[], None] = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    local = [i for i, k in enumerate(shape.kinds) if k != "full"]

    def rms(x: Any, w: Any) -> Any:
        return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype) * w

    class Caches:
        """Per part: a KV buffer per global layer, ``--local-buffers`` cycled over the local ones."""

        def __init__(self, b: int, t: int, c: int) -> None:
            self.buf: dict[int, Any] = {}
            shared: list[Any] = []
            for i, kind in enumerate(shape.kinds):
                n = shape.keys(i, c, t)
                if kind == "full":
                    self.buf[i] = torch.randn(2, b, nkv, n, hd, device=device, dtype=dtype)
                else:
                    j = local.index(i) % max(1, args.local_buffers)
                    if j == len(shared):
                        shared.append(torch.randn(2, b, nkv, n, hd, device=device, dtype=dtype))
                    self.buf[i] = shared[j]

    def forward(parts: list[tuple[int, int, int]], caches: list[Caches]) -> Any:
        x = torch.cat([torch.randn(b * t, h, device=device, dtype=dtype) for b, t, _ in parts])
        for i, ly in enumerate(layers):
            qkv = rms(x, ly["n1"]) @ ly["qkv"]
            outs, off = [], 0
            for (b, t, c), cache in zip(parts, caches):
                blk = qkv[off:off + b * t].view(b, t, nh + 2 * nkv, hd)
                q = blk[:, :, :nh].transpose(1, 2)
                n = shape.keys(i, c, t)
                kv = cache.buf[i]
                mask = causal_lower_right(t, n) if t > 1 else None
                a = F.scaled_dot_product_attention(q, kv[0, :, :, :n], kv[1, :, :, :n], attn_mask=mask,
                                                   enable_gqa=True)
                outs.append(a.transpose(1, 2).reshape(b * t, nh * hd))
                off += b * t
            x = x + torch.cat(outs) @ ly["o"]
            gu = rms(x, ly["n2"]) @ ly["gu"]
            x = x + (F.gelu(gu[:, :inter], approximate="tanh") * gu[:, inter:]) @ ly["down"]
        rows, off = [], 0
        for b, t, _ in parts:
            rows.append(x[off + t - 1:off + b * t:t])
            off += b * t
        return torch.cat(rows) @ head

    def timed(fn: Callable[[], Any], warm: int) -> list[float]:
        for _ in range(warm):
            fn()
        sync()
        times = []
        for _ in range(1 if args.smoke else args.reps):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return times

    meta: dict[str, Any] = {
        "model": shape.model, "gpu": args.gpu, "window_kernel": "masked", "script": "bench/measure_steps.py",
        "torch": torch.__version__, "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
        "dtype": args.dtype, "intermediate_size": shape.intermediate, "smoke": bool(args.smoke),
    }
    doc: dict[str, Any] = {"meta": meta, "samples": []}
    deadline = time.time() + args.budget_s
    for mode, parts in plan_steps(args):
        if time.time() > deadline:
            print("budget spent: stopping", flush=True)
            break
        if args.smoke:
            parts = [(b, max(1, min(t, 64)) if t > 1 else 1, min(c, 64)) for b, t, c in parts]
        caches: list[Caches] = []
        try:
            caches = [Caches(b, t, c) for b, t, c in parts]
            if mode == "decode-graph":
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    forward(parts, caches)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    forward(parts, caches)  # the outputs stay in the graph's pool
                times = timed(graph.replay, warm=2)
                del graph
            else:
                times = timed(lambda p=parts, cs=caches: forward(p, cs), warm=1 if mode == "prefill-eager" else 2)
        except RuntimeError as exc:  # e.g. out of memory: skip the step
            print(f"FAILED {mode} {parts}: {str(exc)[:200]}", flush=True)
            times = []
        del caches
        if device == "cuda":
            torch.cuda.empty_cache()
        if times:
            doc["samples"].append(sample_of(mode, parts, times))
            args.out.write_text(json.dumps(doc, indent=1))
            print(f"{mode} {parts}: {statistics.median(times) * 1e3:.2f} ms", flush=True)
    return doc


def main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - needs torch
    args = parse_args(argv)
    try:
        model_shape(args.model, args.intermediate_size)
    except InvalidInputError as exc:
        print(f"measure_steps.py: {exc}", file=sys.stderr)
        return 2
    doc = measure(args)
    print(f"{len(doc['samples'])} steps written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

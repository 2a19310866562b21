"""hybridkv's engine, llama.cpp and transformers on the same GGUF and machine, side by side in one run.

    pip install -e '.[bench]'    # llama-cpp-python, built from source (optional: --no-llama skips it)
    python bench/engine_speed.py [--hybridkv auto,float32] [--threads 2] [--repeat 3] [--json FILE]

Sides: hybridkv in each ``--hybridkv`` configuration (``auto``: the default, bfloat16 KV with the
GGUF's own codes; ``float32``: the exact dense path; ``WEIGHTS:DTYPE`` for any other), llama.cpp
(llama-cpp-python) and transformers (``generate``; it loads the same GGUF), all with ``--threads``
CPU threads. Measured for each side:

* prefill tokens/s: a 1,024-token prompt, time to the first token;
* decode tokens/s for 1 sequence and for a batch of 8: 128-token prompts, 64 greedy tokens, decode
  time = total minus the time to the last first token (llama-cpp-python runs one sequence at a time:
  no batch figure);
* TTFT of a 1,200-token prompt whose first 1,000 tokens were computed by the previous request
  (hybridkv: the prefix cache; llama.cpp: its reuse of the previous prompt's KV), against uncached.

Every measurement is repeated ``--repeat`` times, the sides alternating, and the best is kept (the
machine is shared: ratios measured in one run are what count).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hybridkv.engine.config import parse_dtype, weights_format
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.gguf_file import GGUFFile
from hybridkv.engine.sampling import SamplingParams
from hybridkv.engine.tokenizer import GemmaTokenizer
from hybridkv.engine.weights import Gemma3Weights, default_model_path

PROMPT_LEN, DECODE_TOKENS, PREFILL_LEN, SHARED_LEN, TTFT_LEN = 128, 64, 1024, 1000, 1200


def token_ids(rng: random.Random, n: int) -> list[int]:
    return [2] + [rng.randrange(300, 200_000) for _ in range(n - 1)]


class Side:
    """One system under test. ``generate`` returns (seconds to the last first token, seconds after it)."""

    name: str
    batches: bool = True

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        raise NotImplementedError

    def cached_ttft(self, warm: list[int], probe: list[int]) -> float | None:
        """TTFT of ``probe`` right after ``warm`` (sharing a prefix) ran; None if not measured."""
        return None


class Hybridkv(Side):
    def __init__(self, gguf: GGUFFile, tokenizer: GemmaTokenizer, spec: str) -> None:
        fmt, dtype = ("auto", "bfloat16") if spec == "auto" else (("auto", spec) if ":" not in spec
                                                                  else tuple(spec.split(":", 1)))
        self.config = EngineConfig(dtype=dtype, weights=fmt, max_model_len=4096, kv_cache_memory=512 << 20,
                                   max_num_batched_tokens=2048)
        resolved = weights_format(self.config)
        t0 = time.perf_counter()
        self.weights = Gemma3Weights.load(gguf, parse_dtype(dtype), resolved)
        self.load_seconds = time.perf_counter() - t0
        self.tokenizer = tokenizer
        self.name = f"hybridkv {resolved} {dtype}"

    def engine(self, caching: bool) -> LLMEngine:
        cfg = EngineConfig(**{**vars(self.config), "enable_prefix_caching": caching})
        return LLMEngine(self.weights, self.tokenizer, cfg)

    def generate(self, prompts: list[list[int]], max_tokens: int, eng: LLMEngine | None = None
                 ) -> tuple[float, float]:
        eng = eng or self.engine(caching=False)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}-{time.monotonic_ns()}", p, params)
        start = time.perf_counter()
        first = None
        waiting = len(prompts)
        while eng.has_unfinished:
            waiting -= sum(len(out.token_ids) == 1 for out in eng.step())
            if first is None and waiting == 0:
                first = time.perf_counter() - start
        assert first is not None
        return first, time.perf_counter() - start - first

    def cached_ttft(self, warm: list[int], probe: list[int]) -> float:
        eng = self.engine(caching=True)
        self.generate([warm], 1, eng)
        return self.generate([probe], 1, eng)[0]


class LlamaCpp(Side):
    batches = False

    def __init__(self, threads: int) -> None:
        from llama_cpp import Llama

        t0 = time.perf_counter()
        with quiet():
            self.llm = Llama(model_path=str(default_model_path()), n_ctx=4096, n_batch=2048, n_threads=threads,
                             n_threads_batch=threads, verbose=False)
        self.load_seconds = time.perf_counter() - t0
        import llama_cpp

        self.name = f"llama.cpp {llama_cpp.__version__}"

    def generate(self, prompts: list[list[int]], max_tokens: int, reuse: bool = False) -> tuple[float, float]:
        """``reuse``: keep the previous prompt's KV for the common prefix (llama-cpp-python's prefix reuse)."""
        (prompt,) = prompts
        if not reuse:
            self.llm.reset()
        start = time.perf_counter()
        first = 0.0
        for n, _token in enumerate(self.llm.generate(prompt, top_k=1, temp=0.0), start=1):
            if n == 1:
                first = time.perf_counter() - start
            if n == max_tokens:
                break
        return first, time.perf_counter() - start - first

    def cached_ttft(self, warm: list[int], probe: list[int]) -> float:
        self.generate([warm], 1)
        return self.generate([probe], 1, reuse=True)[0]


class Transformers(Side):
    def __init__(self, dtype: str) -> None:
        import transformers

        os.environ["HF_HUB_OFFLINE"] = "1"
        path = default_model_path()
        t0 = time.perf_counter()
        with quiet():
            self.model = transformers.AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name, dtype=parse_dtype(dtype))
        self.model.eval()
        self.load_seconds = time.perf_counter() - t0
        self.name = f"transformers {transformers.__version__} {dtype}"

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        ids = torch.tensor(prompts)
        kw: dict[str, Any] = {"do_sample": False, "pad_token_id": 0}
        start = time.perf_counter()
        self.model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        first = time.perf_counter() - start
        if max_tokens == 1:
            return first, 0.0
        start = time.perf_counter()
        self.model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        return first, time.perf_counter() - start - first


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Silence C-level stderr (llama.cpp's load log) while loading."""
    fd = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(fd, 2)
        os.close(fd)


def best(fn: Callable[[], float], results: dict[str, float], key: str) -> None:
    value = fn()
    results[key] = max(results.get(key, 0.0), value)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hybridkv", default="auto,float32",
                    help="comma-separated hybridkv configurations: auto, float32, bfloat16 or WEIGHTS:DTYPE "
                         "(WEIGHTS dense or gguf)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    ap.add_argument("--no-transformers", action="store_true", help="skip transformers")
    ap.add_argument("--transformers-dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = GGUFFile(default_model_path())
    tokenizer = GemmaTokenizer.from_gguf(gguf)
    sides: list[Side] = [Hybridkv(gguf, tokenizer, spec) for spec in args.hybridkv.split(",") if spec]
    if not args.no_llama:
        try:
            sides.append(LlamaCpp(args.threads))
        except ImportError:
            print("llama-cpp-python is not installed (pip install -e '.[bench]'): no llama.cpp side",
                  file=sys.stderr)
    if not args.no_transformers:
        sides.append(Transformers(args.transformers_dtype))
    for side in sides:
        print(f"{side.name}: loaded in {getattr(side, 'load_seconds', 0):.1f} s", file=sys.stderr)

    rng = random.Random(0)
    one = [token_ids(rng, PROMPT_LEN)]
    eight = [token_ids(rng, PROMPT_LEN) for _ in range(8)]
    long = [token_ids(rng, PREFILL_LEN)]
    shared = token_ids(rng, SHARED_LEN)
    warm, probe = (shared + token_ids(rng, TTFT_LEN - SHARED_LEN + 1)[1:] for _ in range(2))
    for side in sides:
        side.generate(one, 4)  # warm-up
    results: dict[str, dict[str, float]] = {side.name: {} for side in sides}
    for rep in range(args.repeat):
        for side in sides:
            r = results[side.name]
            best(lambda side=side: PREFILL_LEN / side.generate(long, 1)[0], r, "prefill tokens/s")
            best(lambda side=side: (DECODE_TOKENS - 1) / side.generate(one, DECODE_TOKENS)[1], r,
                 "decode tokens/s, 1 sequence")
            if side.batches:
                best(lambda side=side: 8 * (DECODE_TOKENS - 1) / side.generate(eight, DECODE_TOKENS)[1], r,
                     "decode tokens/s, batch of 8")
            best(lambda side=side: 1 / side.generate([probe], 1)[0], r, "uncached TTFT 1/s")
            cached = side.cached_ttft(warm, probe)
            if cached is not None:
                best(lambda cached=cached: 1 / cached, r, "cached TTFT 1/s")
        if rep + 1 < args.repeat:  # the best so far: a slow shared machine may not wait for the end
            print(f"after round {rep + 1} of {args.repeat}:\n{report(results)}", file=sys.stderr, flush=True)
    print(report(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "repeat": args.repeat, "results": results}, f, indent=2)
    return 0


def report(results: dict[str, dict[str, float]]) -> str:
    """A markdown table: one row per side; TTFTs in ms (best); batch-8 also as a multiple of single."""
    cols = ["prefill tok/s (1,024)", "decode tok/s (1 seq)", "decode tok/s (8 seqs)", "8 seqs / 1 seq",
            "TTFT 1,200 uncached ms", "TTFT 1,200 with 1,000 cached ms"]
    lines = ["| side | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, r in results.items():
        single, batch = r.get("decode tokens/s, 1 sequence"), r.get("decode tokens/s, batch of 8")
        cells = [r.get("prefill tokens/s"), single, batch, batch / single if batch and single else None,
                 1000 / r["uncached TTFT 1/s"] if "uncached TTFT 1/s" in r else None,
                 1000 / r["cached TTFT 1/s"] if "cached TTFT 1/s" in r else None]
        lines.append(f"| {name} | " + " | ".join("n/a" if c is None else f"{c:,.1f}" for c in cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

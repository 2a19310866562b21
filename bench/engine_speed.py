"""The reference engine against transformers on the same model and machine, side by side in one run.

    python bench/engine_speed.py [--dtype float32|bfloat16] [--device cpu|cuda] [--repeat 2] [--json FILE]

Measures, for hybridkv's engine and for transformers' ``generate`` on the same Gemma 3 270M
(transformers loads the same GGUF):

* decode tokens/s for 1 sequence and for a batch of 8 (128-token prompts, 64 greedy tokens;
  decode time = total minus the time to the first token);
* prefill tokens/s on a 1,024-token prompt (time to the first token);
* hybridkv's TTFT on a 1,200-token prompt whose first 1,000 tokens are in the prefix cache,
  against the same prompt uncached.

Each measurement is repeated ``--repeat`` times, alternating the two sides, and the best is kept
(the machine is shared; ratios measured in one run are what count).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.gguf_file import GGUFFile
from hybridkv.engine.sampling import SamplingParams
from hybridkv.engine.tokenizer import GemmaTokenizer
from hybridkv.engine.weights import Gemma3Weights, default_model_path, parse_dtype


def token_ids(rng: random.Random, n: int) -> list[int]:
    return [2] + [rng.randrange(300, 200_000) for _ in range(n - 1)]


def best(fn: Callable[[], float], repeat: int) -> float:
    return min(fn() for _ in range(repeat))


class Ours:
    def __init__(self, weights: Gemma3Weights, tokenizer: GemmaTokenizer, args: argparse.Namespace) -> None:
        self.weights, self.tokenizer, self.args = weights, tokenizer, args

    def engine(self, caching: bool = True) -> LLMEngine:
        return LLMEngine(self.weights, self.tokenizer, EngineConfig(
            dtype=self.args.dtype, device=self.args.device, max_model_len=4096, kv_cache_memory=512 << 20,
            max_num_batched_tokens=2048, enable_prefix_caching=caching))

    def run(self, prompts: list[list[int]], max_tokens: int, eng: LLMEngine | None = None) -> tuple[float, float]:
        """(seconds to the last first token, seconds for the rest): prompts start together."""
        eng = eng or self.engine(caching=False)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}-{time.monotonic_ns()}", p, params)
        start = time.perf_counter()
        first = None
        waiting_first = len(prompts)
        while eng.has_unfinished:
            for out in eng.step():
                if len(out.token_ids) == 1:
                    waiting_first -= 1
            if first is None and waiting_first == 0:
                first = time.perf_counter() - start
        total = time.perf_counter() - start
        assert first is not None
        return first, total - first


class Theirs:
    def __init__(self, args: argparse.Namespace) -> None:
        import transformers

        os.environ["HF_HUB_OFFLINE"] = "1"
        path = default_model_path()
        t0 = time.perf_counter()
        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=parse_dtype(args.dtype)).to(args.device)
        self.model.eval()
        self.load_seconds = time.perf_counter() - t0
        self.device = args.device

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, float]:
        ids = torch.tensor(prompts, device=self.device)
        kw: dict[str, Any] = {"do_sample": False, "pad_token_id": 0}
        start = time.perf_counter()
        self.model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        first = time.perf_counter() - start
        start = time.perf_counter()
        self.model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, **kw)
        return first, time.perf_counter() - start - first


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "fp32", "bf16"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--no-transformers", action="store_true", help="measure hybridkv only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = random.Random(0)
    t0 = time.perf_counter()
    gguf = GGUFFile(default_model_path())
    weights = Gemma3Weights.load(gguf, parse_dtype(args.dtype))
    if args.device != "cpu":
        weights = weights.to(torch.device(args.device))
    tokenizer = GemmaTokenizer.from_gguf(gguf)
    ours = Ours(weights, tokenizer, args)
    print(f"hybridkv engine loaded in {time.perf_counter() - t0:.1f} s ({args.dtype}, {args.device}, "
          f"{torch.get_num_threads()} threads)", file=sys.stderr)
    theirs = None if args.no_transformers else Theirs(args)
    if theirs:
        print(f"transformers loaded in {theirs.load_seconds:.1f} s", file=sys.stderr)

    n = args.decode_tokens
    one = [token_ids(rng, 128)]
    eight = [token_ids(rng, 128) for _ in range(8)]
    long = [token_ids(rng, 1024)]
    results: dict[str, Any] = {"dtype": args.dtype, "device": args.device, "threads": torch.get_num_threads()}
    sides: list[tuple[str, Any]] = [("hybridkv", ours)] + ([("transformers", theirs)] if theirs else [])
    for _name, side in sides:
        side.run(one, 4)  # warm-up
    for label, prompts, tokens, what in (("decode_1", one, n, "decode"), ("decode_8", eight, n, "decode"),
                                        ("prefill_1024", long, 1, "prefill")):
        for name, side in sides:
            if what == "decode":
                secs = best(lambda side=side, prompts=prompts, tokens=tokens: side.run(prompts, tokens)[1],
                            args.repeat)
                rate = len(prompts) * (tokens - 1) / secs
            else:
                secs = best(lambda side=side, prompts=prompts: side.run(prompts, 1)[0], args.repeat)
                rate = len(prompts[0]) / secs
            results[f"{label}_tokens_per_s_{name}"] = round(rate, 2)
            print(f"{label:>14} {name:>12}: {rate:8.1f} tokens/s", file=sys.stderr)

    # TTFT: a 1,200-token prompt with its first 1,000 tokens cached, against uncached.
    shared = token_ids(rng, 1000)
    warm, probe = shared + token_ids(rng, 201)[1:], shared + token_ids(rng, 201)[1:]

    def cached() -> float:
        eng = ours.engine(caching=True)
        ours.run([warm], 1, eng)
        return ours.run([probe], 1, eng)[0]

    results["ttft_cached_1200_s"] = round(best(cached, args.repeat), 4)
    results["ttft_uncached_1200_s"] = round(best(lambda: ours.run([probe], 1)[0], args.repeat), 4)
    results["ttft_speedup"] = round(results["ttft_uncached_1200_s"] / results["ttft_cached_1200_s"], 2)
    results["batch8_over_single"] = round(results["decode_8_tokens_per_s_hybridkv"]
                                          / results["decode_1_tokens_per_s_hybridkv"], 2)
    if theirs:
        results["decode_1_ratio_vs_transformers"] = round(results["decode_1_tokens_per_s_hybridkv"]
                                                          / results["decode_1_tokens_per_s_transformers"], 2)
    print(f"TTFT 1,200 tokens: cached prefix of 1,000 {1000 * results['ttft_cached_1200_s']:.0f} ms, "
          f"uncached {1000 * results['ttft_uncached_1200_s']:.0f} ms ({results['ttft_speedup']}x)", file=sys.stderr)
    print(json.dumps(results, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

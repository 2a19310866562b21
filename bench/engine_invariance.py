"""Speed and batch invariance of hybridkv's engine on its default path (bfloat16 KV, GGUF weights).

    PYTHONPATH=src python bench/engine_invariance.py [--threads 1] [--repeat 3] [--dtype bfloat16]

Measured in one process, each figure the best of ``--repeat`` runs (the machine is shared):

* prefill tokens/s: one 1,024-token prompt, time to its first token;
* decode tokens/s for 1 sequence and for a batch of 8: 128-token prompts, 32 greedy tokens, decode
  time = total minus the time to the last first token;
* batch invariance: the greedy tokens (and the log-probability of each) of 8 different prompts
  decoded together, mixed with a long prompt's chunked prefill, against each decoded alone.

To compare two versions of the code, run this script on each in turn, on the same machine.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from hybridkv.engine.config import parse_dtype, weights_format
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.gguf_file import GGUFFile
from hybridkv.engine.sampling import SamplingParams
from hybridkv.engine.tokenizer import GemmaTokenizer
from hybridkv.engine.weights import Gemma3Weights, default_model_path

PREFILL_LEN, PROMPT_LEN, DECODE_TOKENS = 1024, 128, 32


def token_ids(rng: random.Random, n: int) -> list[int]:
    return [2] + [rng.randrange(300, 200_000) for _ in range(n - 1)]


def generate(eng: LLMEngine, prompts: list[list[int]], max_tokens: int
             ) -> tuple[float, float, list[list[tuple[int, float]]]]:
    """(seconds to the last first token, seconds after it, each prompt's (token, logprob) pairs)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    start = time.perf_counter()
    first: float | None = None
    outputs: dict[str, list[tuple[int, float]]] = {}
    while eng.has_unfinished:
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = [(lp.token_id, lp.logprob) for lp in out.logprobs or []]
        if first is None and all(eng._tracked[r].seq.num_output_tokens for r in ids if r in eng._tracked):
            first = time.perf_counter() - start
    assert first is not None
    return first, time.perf_counter() - start - first, [outputs[r] for r in ids]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prefill-len", type=int, default=PREFILL_LEN)
    ap.add_argument("--no-invariance", action="store_true", help="measure speed only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = GGUFFile(default_model_path())
    tokenizer = GemmaTokenizer.from_gguf(gguf)
    config = EngineConfig(dtype=args.dtype, max_model_len=2048, kv_cache_memory=256 << 20,
                          max_num_batched_tokens=1024, enable_prefix_caching=False)
    weights = Gemma3Weights.load(gguf, parse_dtype(args.dtype), weights_format(config))
    rng = random.Random(0)
    long, one = [token_ids(rng, args.prefill_len)], [token_ids(rng, PROMPT_LEN)]
    eight = [token_ids(rng, PROMPT_LEN + 8 * i) for i in range(8)]
    generate(LLMEngine(weights, tokenizer, config), one, 2)  # warm-up
    r: dict[str, float] = {}
    for _ in range(args.repeat):
        eng = LLMEngine(weights, tokenizer, config)
        r["prefill"] = max(r.get("prefill", 0.0), args.prefill_len / generate(eng, long, 1)[0])
        r["decode1"] = max(r.get("decode1", 0.0), (DECODE_TOKENS - 1) / generate(eng, one, DECODE_TOKENS)[1])
        r["decode8"] = max(r.get("decode8", 0.0), 8 * (DECODE_TOKENS - 1) / generate(eng, eight, DECODE_TOKENS)[1])
    print(f"{weights.format} {args.dtype}, {args.threads} thread(s), best of {args.repeat}: prefill "
          f"{r['prefill']:.1f} tok/s ({args.prefill_len} tokens), decode {r['decode1']:.2f} tok/s (1 seq), "
          f"{r['decode8']:.2f} tok/s (8 seqs)", flush=True)
    if args.no_invariance:
        return 0

    eng = LLMEngine(weights, tokenizer, EngineConfig(**{**vars(config), "max_num_batched_tokens": 256}))
    alone = [generate(eng, [p], 16)[2][0] for p in eight]
    mixed = generate(eng, eight + long, 16)[2][:8]  # the long prompt's chunks share steps with the decodes
    same_tokens = sum([t for t, _ in a] == [t for t, _ in b] for a, b in zip(alone, mixed))
    same_bits = sum(a == b for a, b in zip(alone, mixed))
    print(f"batch invariance: {same_tokens}/8 sequences with identical greedy tokens, {same_bits}/8 with "
          f"bitwise-identical log-probabilities, alone vs in a batch of 8 + a chunked {args.prefill_len}-token prefill")
    return 0


if __name__ == "__main__":
    sys.exit(main())

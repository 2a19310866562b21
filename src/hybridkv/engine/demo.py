"""``hybridkv engine-demo``: a shared-prefix batch on the real model, without and with prefix caching.

Timed warm (an untimed request on each side first) and best of ``--runs`` (3) runs per side,
alternating the sides, each cached run starting from an empty prefix cache: a busy machine slows
single runs, and the best of several is what the machine can do.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridkv.engine.engine import LLMEngine, RequestOutput
    from hybridkv.engine.sampling import SamplingParams

DOCUMENT = (
    "Harbour Street Bakery opens at six every morning. The ovens are lit at four, the sourdough is shaped "
    "the evening before, and the first customers are the ferry crew, who buy rolls for the crossing. On "
    "Saturdays the queue reaches the fish market. The bakery was founded in 1952 by Ana Costa, whose "
    "granddaughter runs it today with two apprentices. "
)
QUESTIONS = [
    "Question: At what time are the ovens lit?\nAnswer:",
    "Question: Who founded the bakery?\nAnswer:",
    "Question: Who are the first customers each morning?\nAnswer:",
    "Question: How far does the Saturday queue reach?\nAnswer:",
    "Question: Who runs the bakery today?\nAnswer:",
    "Question: When is the sourdough shaped?\nAnswer:",
]


def add_parser(sub: Any) -> None:
    from hybridkv.engine.cli import add_engine_arguments

    p = sub.add_parser("engine-demo", help="the embedded model on a shared-prefix batch, without and with caching",
                       description="Run Gemma 3 270M on a batch of questions about one shared document, without "
                                   "and with prefix caching: the answers, TTFT, cached tokens and the speed-up.")
    p.add_argument("--requests", type=int, default=6, help=f"at most {len(QUESTIONS)}")
    p.add_argument("--repeat-document", type=int, default=8, help="copies of the shared document (~70 tokens)")
    p.add_argument("--max-tokens", type=int, default=12, help="most tokens generated per answer")
    p.add_argument("--runs", type=int, default=3, help="timed runs per side; the best counts (default: %(default)s)")
    add_engine_arguments(p)
    p.set_defaults(func=engine_demo)


def engine_demo(args: argparse.Namespace) -> int:
    import dataclasses

    from hybridkv.engine.engine import LLMEngine
    from hybridkv.engine.preflight import checked_engine_config
    from hybridkv.engine.sampling import SamplingParams
    from hybridkv.errors import InvalidInputError

    if not 1 <= args.requests <= len(QUESTIONS):
        raise InvalidInputError(f"--requests must be in 1..{len(QUESTIONS)}")
    if args.runs < 1:
        raise InvalidInputError("--runs must be at least 1")
    config = checked_engine_config(args)  # what the options alone reveal, before the model loads
    t0 = time.perf_counter()
    cached_engine = LLMEngine.from_package(config)
    print(f"Loaded {cached_engine.config.model} ({args.dtype}) in {time.perf_counter() - t0:.1f} s; KV pool "
          f"{cached_engine.pool_summary()}")
    plain_engine = LLMEngine(cached_engine.weights, cached_engine.tokenizer,
                             dataclasses.replace(cached_engine.config, enable_prefix_caching=False))
    document = DOCUMENT * args.repeat_document
    prompts = [document + "\n" + q for q in QUESTIONS[:args.requests]]
    params = SamplingParams(max_tokens=args.max_tokens, stop=("\n",))
    n_tokens = len(cached_engine.tokenizer.encode(prompts[0]))
    print(f"\n{len(prompts)} requests sharing a {n_tokens}-token document (window 512: the sliding-window "
          f"layers drop blocks behind it); greedy, up to {args.max_tokens} tokens each.")
    sides = {"without prefix caching": plain_engine, "with prefix caching": cached_engine}
    for engine in sides.values():  # warm-up, untimed: the first prefill and decodes of a process are slower
        engine.generate(prompts[:1], SamplingParams(max_tokens=2))
    print(f"Warm; {args.runs} timed runs of each side, alternating; the best counts.\n")
    best, times, same = _timed_runs(sides, prompts, params, args.runs)
    return _report(best, times, same, args.runs)


def _run_cold(engine: LLMEngine, prompts: list[str],
              params: SamplingParams) -> tuple[list[RequestOutput], float]:
    """One timed run from an empty prefix cache: the first request computes the document; the rest
    arrive as it finishes (they hit its prefix)."""
    if not engine.manager.reset_prefix_cache():
        raise RuntimeError("the engine still holds blocks between runs")
    start = time.perf_counter()
    outs = engine.generate(prompts[:1], params)
    outs += engine.generate(prompts[1:], params) if len(prompts) > 1 else []
    return outs, time.perf_counter() - start


def _timed_runs(sides: dict[str, LLMEngine], prompts: list[str], params: SamplingParams, runs: int
                ) -> tuple[dict[str, tuple[list[RequestOutput], float]], dict[str, list[float]], bool]:
    """``runs`` runs of each side, alternating: each side's best run (outputs, seconds), every run's
    seconds, and whether each side's runs gave the same tokens."""
    best: dict[str, tuple[list[RequestOutput], float]] = {}
    times: dict[str, list[float]] = {label: [] for label in sides}
    same = True
    for _ in range(runs):
        for label, engine in sides.items():
            outs, secs = _run_cold(engine, prompts, params)
            times[label].append(secs)
            same &= label not in best or [o.token_ids for o in outs] == [o.token_ids for o in best[label][0]]
            if label not in best or secs < best[label][1]:
                best[label] = (outs, secs)
    return best, times, same


def _report(best: dict[str, tuple[list[RequestOutput], float]], times: dict[str, list[float]], same: bool,
            runs: int) -> int:
    """Print each side's answers and the speed-up; 1 if the outputs differ between runs or sides."""
    for label, (outs, secs) in best.items():
        print(f"{label}: {secs:.2f} s (runs: {', '.join(f'{t:.2f}' for t in times[label])})")
        for q, o in zip(QUESTIONS, outs):
            question = q.split("\n")[0].removeprefix("Question: ")
            print(f"  {question:<45} ->{o.text!r:<32} TTFT {1000 * (o.ttft or 0):6.0f} ms, "
                  f"{o.num_cached_tokens:4d} prompt tokens from cache")
    (plain, t_plain), (cached, t_cached) = best.values()
    same &= [a.token_ids for a in plain] == [b.token_ids for b in cached]
    ttft_plain = sum(o.ttft or 0 for o in plain[1:]) / max(1, len(plain) - 1)
    ttft_cached = sum(o.ttft or 0 for o in cached[1:]) / max(1, len(cached) - 1)
    print(f"\nPrefix caching: {t_plain / t_cached:.1f}x faster end to end (best of {runs}, warm), mean TTFT "
          f"of the requests after the first {1000 * ttft_plain:.0f} -> {1000 * ttft_cached:.0f} ms "
          f"({ttft_plain / ttft_cached:.1f}x); hit tokens per run {sum(o.num_cached_tokens for o in cached)}; "
          f"outputs identical: {same}")
    if not same:
        print("outputs differ between runs or between the cached and uncached engines", file=sys.stderr)
        return 1
    return 0

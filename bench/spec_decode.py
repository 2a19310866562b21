"""Speculative decoding (n-gram prompt lookup): hybridkv and llama.cpp, with and without, side by side in one run.

    pip install -e '.[bench]'    # llama-cpp-python, built from source (optional: --no-llama skips it)
    python bench/spec_decode.py [--k 4] [--threads 2] [--repeat 3] [--max-tokens 128] [--json FILE]

Two workloads on the embedded Gemma 3 270M (the same GGUF and the same prompt token ids for every side):

* ``copy/edit``: a prompt quoting a ~1,000-token document (plain English prose written into this
  script), then "Repeat the document above exactly" and the document's first sentence as the start
  of the answer, so the greedy answer copies the document: prompt lookup finds most drafts;
* ``free``: a short prompt to continue freely (nothing in it to copy; the model's own text may still repeat).

Sides, all with ``--threads`` CPU threads:

* ``hybridkv``: the default engine path (``EngineConfig()``: bfloat16, weights ``auto``), one token
  per step;
* ``hybridkv ngram K``: the same with ``speculative="ngram", num_speculative_tokens=K``;
* ``llama.cpp``: llama-cpp-python's ``Llama.generate``, greedy;
* ``llama.cpp lookup K``: the same with ``draft_model=LlamaPromptLookupDecoding(num_pred_tokens=K)``.

Decode tokens/s = (generated tokens - 1) / seconds after the first token (the first token, i.e.
the prefill, is timed separately and reported as TTFT). For the hybridkv sides the table also gives
the acceptance rate (accepted / drafted tokens) and tokens per decode step (generated tokens after
the first / engine steps after the first token), and the run checks that speculation leaves the
greedy tokens unchanged. Every measurement is repeated ``--repeat`` times, the sides alternating,
and the best is kept (the machine is shared: ratios measured in one run are what count). The
issue's targets are printed as PASS/MISS at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field

import torch

from engine_speed import quiet  # the same silencing of llama.cpp's load log
from hybridkv.engine.config import parse_dtype, weights_format
from hybridkv.engine.engine import EngineConfig, LLMEngine
from hybridkv.engine.gguf_file import GGUFFile
from hybridkv.engine.sampling import SamplingParams
from hybridkv.engine.tokenizer import GemmaTokenizer
from hybridkv.engine.weights import Gemma3Weights, default_model_path

DOCUMENT = """\
The harbor town of Wendmere sits at the mouth of a narrow river, where the water turns from brown \
to green as it meets the sea. For most of its history the town lived on herring. Every autumn the \
shoals came close to the shore, and every family with a boat went out before dawn to set their nets. \
The women salted the catch in long wooden sheds along the quay, and the barrels were loaded onto \
ships bound for the cities in the south. A good season meant new roofs and new boots; a poor one \
meant a hungry winter and young men leaving to find work inland.

The lighthouse on the northern headland was built in the year the old stone pier collapsed during a \
storm. Before it stood there, ships found the harbor by a fire that the keeper of the customs house \
lit in an iron basket on the hill. The fire was often late, sometimes missing, and on one famous \
night it was lit on the wrong hill altogether, sending a grain ship onto the rocks below the church. \
After that the town council raised money for a proper tower, with a lamp that turned by clockwork \
and could be seen from twelve miles out on a clear night.

The first keeper of the new light was a widow named Agnes Farrow. She had learned the work from her \
father, who had tended a smaller light further up the coast, and she kept a careful log of every \
night she spent in the tower. Her entries recorded the weather, the ships that passed, the oil she \
burned and the repairs she made to the mechanism. Most of them are short and plain, but now and then \
she wrote a line about the sea itself: the colour of the water before a gale, or the way the fog \
came in from the east like a wall of wet wool. The log books survive in the town library, and \
visitors still ask to read them.

In the middle of the last century the herring moved away. Nobody in Wendmere agreed on the reason. \
Some blamed the large trawlers from abroad, some blamed warmer water, and some said the fish had \
simply grown tired of the place. Whatever the cause, the sheds on the quay fell quiet one by one. \
The younger families moved to the cities, the school lost half of its pupils, and the railway \
company closed the branch line that had carried salted fish to the junction at Harlow.

For a time it seemed that the town would empty completely. Then, slowly, other people began to \
arrive. Painters came first, drawn by the light on the water and the cheap rents of the empty \
cottages. They were followed by walkers who followed the cliff path from the lighthouse to the next \
bay, and by families who wanted a quiet beach for their summer holidays. The old salting sheds were \
turned into a gallery, a bakery and a small museum of the fishing trade, where children can try to \
mend a net and lift a barrel of sand the size of a herring barrel.

The lighthouse itself was automated many years ago, and no keeper has lived in the tower since the \
last one retired to a cottage by the church. The lamp is now an electric one that switches on by \
itself at dusk, and the clockwork that Agnes Farrow oiled every evening stands in a glass case in the \
museum. On the first Saturday of every September the town holds a festival in her name. Boats are \
decorated with lanterns, the bakery sells small loaves shaped like fish, and in the evening the \
oldest resident of the town reads aloud a page from one of her log books.

People who visit Wendmere today often say that it feels like a place at the end of something. The \
river still turns from brown to green, the gulls still gather on the roofs of the sheds, and the \
wind still comes in from the sea in the afternoon. But the town has found a second life that its \
founders could not have imagined. The harbor that once smelled of salt and fish now smells of coffee \
and fresh bread, and the boats that go out before dawn carry tourists who want to see the sun rise \
behind the lighthouse on the northern headland.

The town council has plans to repair the old stone pier, which has stood as a heap of broken rock \
since the storm that gave the lighthouse its reason to exist. The work will take three summers and \
cost more than the town has ever spent on anything, but most people in Wendmere believe it is worth \
it. When the pier is finished, they say, the larger boats will be able to tie up in the harbor \
again, and perhaps one day the herring will come back to see what has changed."""
"""The copy/edit workload's document: ~1,000 Gemma tokens of plain English prose (no downloads)."""

COPY_INSTRUCTION = "\n\nRepeat the document above exactly, word for word:\n\n"
FREE_PROMPT = ("The history of the bicycle begins in the early nineteenth century, when a German inventor named "
               "Karl Drais built a wooden machine with two wheels and no pedals.")
"""The free workload: a continuation with nothing to copy. Chosen among a few candidates as the one whose greedy
answer repeats itself least (Gemma 3 270M is a small base model: greedy text soon loops on most prompts, and a
loop is what prompt lookup drafts well)."""


def copy_prompt() -> str:
    """The document, the instruction, then the document's first sentence as the start of the answer."""
    first = DOCUMENT.split(". ", 1)[0] + "."
    return "Document:\n\n" + DOCUMENT + COPY_INSTRUCTION + first


@dataclass
class Run:
    """One generation: the tokens, the time to the first token, the time after it and what the engine counted."""

    tokens: list[int]
    first: float
    rest: float
    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def decode_tps(self) -> float:
        return (len(self.tokens) - 1) / self.rest


class Side:
    name: str
    load_seconds: float = 0.0

    def generate(self, prompt: list[int], max_tokens: int) -> Run:
        raise NotImplementedError


class Hybridkv(Side):
    """The default engine path, ``EngineConfig()`` (bfloat16, weights auto): one token per step, or n-gram drafts."""

    def __init__(self, weights: Gemma3Weights, tokenizer: GemmaTokenizer, k: int, load_seconds: float) -> None:
        self.weights, self.tokenizer, self.k = weights, tokenizer, k
        self.config = EngineConfig(speculative="ngram", num_speculative_tokens=k) if k else EngineConfig()
        self.name = f"hybridkv ngram K={k}" if k else "hybridkv"
        self.load_seconds = load_seconds

    def generate(self, prompt: list[int], max_tokens: int) -> Run:
        eng = LLMEngine(self.weights, self.tokenizer, self.config)  # fresh: no prefix cache across repeats
        eng.add_request(f"r{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        start = time.perf_counter()
        first = None
        tokens: list[int] = []
        decode_steps = 0
        while eng.has_unfinished:
            outs = eng.step()
            if first is None:
                if outs and outs[0].token_ids:
                    first = time.perf_counter() - start
                    base = (eng.metrics.spec_draft_tokens, eng.metrics.spec_accepted_tokens)
            else:
                decode_steps += 1
            for out in outs:
                tokens = out.token_ids
        assert first is not None
        rest = time.perf_counter() - start - first
        m = eng.metrics
        return Run(list(tokens), first, rest, decode_steps, m.spec_draft_tokens - base[0],
                   m.spec_accepted_tokens - base[1])


class LlamaCpp(Side):
    """llama-cpp-python on the same GGUF; ``k``: with ``LlamaPromptLookupDecoding(num_pred_tokens=k)``."""

    def __init__(self, threads: int, k: int) -> None:
        import llama_cpp
        from llama_cpp import Llama

        draft = None
        if k:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=k)
        t0 = time.perf_counter()
        with quiet():
            self.llm = Llama(model_path=str(default_model_path()), n_ctx=4096, n_batch=2048, n_threads=threads,
                             n_threads_batch=threads, draft_model=draft, verbose=False)
        self.load_seconds = time.perf_counter() - t0
        self.name = f"llama.cpp {llama_cpp.__version__}" + (f" lookup K={k}" if k else "")

    def generate(self, prompt: list[int], max_tokens: int) -> Run:
        self.llm.reset()  # no reuse of the previous repeat's KV
        start = time.perf_counter()
        first = 0.0
        tokens: list[int] = []
        for token in self.llm.generate(prompt, top_k=1, temp=0.0):
            tokens.append(token)
            if len(tokens) == 1:
                first = time.perf_counter() - start
            if len(tokens) == max_tokens:
                break
        return Run(tokens, first, time.perf_counter() - start - first)


@dataclass
class Best:
    """The best decode tokens/s of a side on a workload over the repeats, and that run."""

    run: Run | None = None
    runs: list[Run] = field(default_factory=list)

    def add(self, run: Run) -> None:
        self.runs.append(run)
        if self.run is None or run.decode_tps > self.run.decode_tps:
            self.run = run

    def figures(self) -> dict[str, float | None]:
        r = self.run
        assert r is not None
        spec = r.steps > 0 and r.drafted > 0
        return {
            "decode tokens/s": r.decode_tps,
            "TTFT ms": 1000 * min(x.first for x in self.runs),
            "generated": len(r.tokens),
            "decode steps": r.steps or None,
            "tokens/step": (len(r.tokens) - 1) / r.steps if r.steps else None,
            "drafted": r.drafted if spec else None,
            "accepted": r.accepted if spec else None,
            "acceptance": r.accepted / r.drafted if spec else None,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step (both engines)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128, help="greedy tokens generated per workload")
    ap.add_argument("--workloads", default="copy/edit,free")
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    gguf = GGUFFile(default_model_path())
    tokenizer = GemmaTokenizer.from_gguf(gguf)
    config = EngineConfig()
    t0 = time.perf_counter()
    weights = Gemma3Weights.load(gguf, parse_dtype(config.dtype), weights_format(config))
    load = time.perf_counter() - t0
    sides: list[Side] = [Hybridkv(weights, tokenizer, 0, load), Hybridkv(weights, tokenizer, args.k, load)]
    if not args.no_llama:
        try:
            sides += [LlamaCpp(args.threads, 0), LlamaCpp(args.threads, args.k)]
        except ImportError:
            print("llama-cpp-python is not installed (pip install -e '.[bench]'): no llama.cpp sides",
                  file=sys.stderr)
    for side in sides:
        print(f"{side.name}: loaded in {side.load_seconds:.1f} s", file=sys.stderr)

    all_prompts = {"copy/edit": tokenizer.encode(copy_prompt()), "free": tokenizer.encode(FREE_PROMPT)}
    prompts = {w: all_prompts[w] for w in args.workloads.split(",") if w}
    for w, p in prompts.items():
        print(f"{w}: prompt {len(p)} tokens", file=sys.stderr)
    for side in sides:
        side.generate(prompts[next(iter(prompts))][:64], 4)  # warm-up
    results: dict[str, dict[str, Best]] = {w: {s.name: Best() for s in sides} for w in prompts}
    for rep in range(args.repeat):
        order = sides if rep % 2 == 0 else sides[::-1]  # alternate which side runs first
        for w, prompt in prompts.items():
            for side in order:
                results[w][side.name].add(side.generate(prompt, args.max_tokens))
        if rep + 1 < args.repeat:
            print(f"after round {rep + 1} of {args.repeat}:\n{report(results)}", file=sys.stderr, flush=True)

    print(f"Gemma 3 270M ({default_model_path().name}), {args.threads} threads, best of {args.repeat}, "
          f"{args.max_tokens} greedy tokens, K={args.k}; prompts: "
          + ", ".join(f"{w} {len(p)} tokens" for w, p in prompts.items()))
    print(report(results))
    print()
    checks = identity_checks(results, sides, tokenizer)
    for line in checks["lines"]:
        print(line)
    targets = check_targets(results, sides)
    print()
    for line in targets["lines"]:
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "repeat": args.repeat, "k": args.k, "max_tokens": args.max_tokens,
                       "prompt_tokens": {w: len(p) for w, p in prompts.items()},
                       "results": {w: {s: b.figures() for s, b in r.items()} for w, r in results.items()},
                       "identical": checks["identical"], "targets": targets["targets"]}, f, indent=2)
    return 0


def identity_checks(results: dict[str, dict[str, Best]], sides: list[Side], tokenizer: GemmaTokenizer
                    ) -> dict[str, object]:
    """Whether every hybridkv ngram run's greedy tokens equal the plain hybridkv run's (and llama.cpp's
    lookup run's equal its plain run's); the first tokens of the copy answer, decoded, to show it copies."""
    lines: list[str] = []
    identical: dict[str, bool] = {}
    pairs = [(sides[i].name, sides[i + 1].name) for i in range(0, len(sides) - 1, 2)]
    for w, r in results.items():
        for plain, spec in pairs:
            want = r[plain].runs[0].tokens
            same = all(x.tokens == want for x in r[plain].runs + r[spec].runs)
            identical[f"{w}: {spec}"] = same
            first_diff = "" if same else f" (first difference at token {first_difference(want, r[spec].runs)})"
            lines.append(f"{w}: {spec} greedy tokens identical to {plain}'s in every repeat: "
                         f"{'yes' if same else 'NO'}{first_diff}")
        text = tokenizer.decode(r[sides[0].name].runs[0].tokens)
        lines.append(f"{w}: hybridkv's answer begins {text[:160]!r}")
    return {"lines": lines, "identical": identical}


def first_difference(want: list[int], runs: list[Run]) -> int:
    return min(next((i for i, (a, b) in enumerate(zip(want, x.tokens)) if a != b), min(len(want), len(x.tokens)))
               for x in runs)


def check_targets(results: dict[str, dict[str, Best]], sides: list[Side]) -> dict[str, object]:
    """Issue 23's targets: hybridkv spec >= 1.5x plain on copy/edit, >= 0.95x on free, >= llama.cpp lookup on both."""
    names = [s.name for s in sides]
    lines: list[str] = []
    targets: dict[str, dict[str, object]] = {}

    def tps(w: str, name: str) -> float:
        run = results[w][name].run
        assert run is not None
        return run.decode_tps

    def target(label: str, value: float, want: float) -> None:
        ok = value >= want
        targets[label] = {"value": value, "target": want, "pass": ok}
        lines.append(f"{'PASS' if ok else 'MISS'}  {label}: {value:.2f}x (target >= {want}x)")

    plain, spec = names[0], names[1]
    for w, want in (("copy/edit", 1.5), ("free", 0.95)):
        if w in results:
            target(f"{w}: {spec} / {plain} decode tokens/s", tps(w, spec) / tps(w, plain), want)
    if len(names) >= 4:
        for w in results:
            target(f"{w}: {spec} / {names[3]} decode tokens/s", tps(w, spec) / tps(w, names[3]), 1.0)
    else:
        lines.append("(no llama.cpp sides: the llama.cpp targets are not measured)")
    return {"lines": lines, "targets": targets}


def report(results: dict[str, dict[str, Best]]) -> str:
    """A markdown table: one row per workload and side."""
    cols = ["decode tok/s", "x plain", "TTFT ms", "tokens", "decode steps", "tokens/step", "drafted",
            "accepted", "acceptance"]
    lines = ["| workload | side | " + " | ".join(cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for w, r in results.items():
        names = list(r)
        for i, (name, b) in enumerate(r.items()):
            if b.run is None:
                continue
            f = b.figures()
            base = r[names[i - i % 2]].run  # the plain side of the pair (hybridkv, llama.cpp)
            ratio = f["decode tokens/s"] / base.decode_tps if base is not None else None  # type: ignore[operator]
            cells = [f"{f['decode tokens/s']:,.1f}", f"{ratio:.2f}x" if ratio else "n/a", f"{f['TTFT ms']:,.0f}",
                     str(f["generated"]), fmt(f["decode steps"], "{:.0f}"), fmt(f["tokens/step"], "{:.2f}"),
                     fmt(f["drafted"], "{:.0f}"), fmt(f["accepted"], "{:.0f}"), fmt(f["acceptance"], "{:.0%}")]
            lines.append(f"| {w} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else spec.format(value)


if __name__ == "__main__":
    sys.exit(main())

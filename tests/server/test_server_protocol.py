"""The server as a drop-in for vLLM and OpenAI clients, and no request stalling the others, on a scripted
engine (no model: every test runs in well under a second): 400 with the OpenAI error body for
validation errors, ``Allow`` on 405, vLLM's metric names, ``text_offset`` with ``<bos>``, limits checked
before any tokenizing, and the event loop answering ``/health`` while a request is being prepared.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from hybridkv.engine.engine import EngineConfig, RequestOutput  # noqa: E402
from hybridkv.engine.metrics import EngineMetrics, Histogram, MetricNames  # noqa: E402
from hybridkv.engine.sampling import SamplingParams, TokenLogprob  # noqa: E402
from hybridkv.server.app import build_app  # noqa: E402
from hybridkv.server.async_engine import AsyncEngine  # noqa: E402

MODEL = "gemma-3-270m"
BOS = 2


class SpyTokenizer:
    """One token per character (ids are code points + 10); ``<bos>`` (id 2) is special. Counts encodes;
    ``gate``, when set, holds every encode until it is set."""

    bos_token_id, eos_token_id, vocab_size = BOS, 1, 0x110000 + 10

    def __init__(self) -> None:
        self.encodes = 0
        self.gate: threading.Event | None = None

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        self.encodes += 1
        if self.gate is not None:
            self.gate.wait(10)
        return [BOS] * add_bos + [ord(c) + 10 for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join("<bos>" if i == BOS else chr(i - 10) for i in ids
                       if not (skip_special_tokens and i == BOS))


class EchoEngine:
    """Stands in for ``LLMEngine``: a request ends at once with one token, "x"; prompt log-probabilities
    of -1.0 per token when asked for."""

    chat_template = None

    def __init__(self) -> None:
        self.tokenizer = SpyTokenizer()
        self.config = EngineConfig(max_model_len=256)
        self.metrics = EngineMetrics()
        self.manager = SimpleNamespace(usage=0.0, num_free_blocks=100)
        self.pending: list[tuple[str, list[int], SamplingParams]] = []
        self.hints: dict[str, tuple[int, ...]] = {}
        self.prompts: dict[str, list[int]] = {}

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, *,
                    cache_salt: str | None = None, priority: int = 0, checkpoint_hints: tuple[int, ...] = ()) -> None:
        self.pending.append((request_id, prompt, params))
        self.hints[request_id] = checkpoint_hints
        self.prompts[request_id] = prompt
        self.metrics.request_max_tokens.observe(params.max_tokens)

    def abort(self, request_id: str) -> None:
        pass

    @property
    def has_unfinished(self) -> bool:
        return bool(self.pending)

    num_running = num_waiting = 0

    def metrics_text(self, model_name: str = "", names: MetricNames = "hybridkv") -> str:
        gauges = {"kv_cache_usage_perc": (0.0, "KV-cache usage."), "num_requests_waiting": (0.0, "Waiting."),
                  "num_free_blocks": (100.0, "Free blocks.")}
        return self.metrics.render(gauges, names, model_name=model_name)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid, prompt, params in self.pending:
            plp: list[TokenLogprob | None] | None = None
            if params.prompt_logprobs is not None:
                plp = [None] + [TokenLogprob(t, -1.0) for t in prompt[1:]]
            outputs.append(RequestOutput(rid, prompt, [ord("x") + 10], "x", "x", True, "length", 0, 0, 0.0,
                                         prompt_logprobs=plp))
        self.pending = []
        return outputs

    def close(self) -> None:
        pass


@pytest.fixture
def engine() -> Iterator[EchoEngine]:
    yield EchoEngine()


def serve(engine: EchoEngine, names: MetricNames = "vllm") -> tuple[httpx.AsyncClient, AsyncEngine]:
    async_engine = AsyncEngine(engine, MODEL, metrics_names=names)  # type: ignore[arg-type]
    app = build_app(async_engine, MODEL)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30)
    return client, async_engine


def run(engine: EchoEngine, test: Any, names: MetricNames = "vllm") -> Any:
    async def main() -> Any:
        client, async_engine = serve(engine, names)
        try:
            async with client:
                return await test(client)
        finally:
            await asyncio.to_thread(async_engine.shutdown, False)

    return asyncio.run(main())


def assert_openai_error(resp: Any, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


# ---------------------------------------------------------------------- protocol
@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "frequency_penality": 1}, "frequency_penality"),
    ({"prompt": "hi", "max_tokens": "8"}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({}, "prompt"),
])
def test_validation_errors_are_400_with_the_openai_error_body(engine: EchoEngine, body: dict[str, Any],
                                                              param: str) -> None:
    async def test(client: Any) -> Any:
        return await client.post("/v1/completions", json={"model": MODEL, **body})

    error = assert_openai_error(run(engine, test), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_invalid_json_and_a_non_object_body_are_400(engine: EchoEngine) -> None:
    async def test(client: Any) -> Any:
        return [await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
                for body in (b'{"model": ', b"[1, 2]", b"\xff\xfe")]

    bad_json, not_object, not_utf8 = run(engine, test)
    assert "not valid JSON" in assert_openai_error(bad_json, 400)["message"]
    assert "JSON object" in assert_openai_error(not_object, 400)["message"]
    assert "not valid JSON" in assert_openai_error(not_utf8, 400)["message"]


def test_a_method_a_route_does_not_take_is_405_with_allow(engine: EchoEngine) -> None:
    async def test(client: Any) -> Any:
        return await client.get("/v1/completions"), await client.post("/health")

    completions, health = run(engine, test)
    assert_openai_error(completions, 405)
    assert completions.headers["allow"] == "POST"
    assert_openai_error(health, 405)
    assert health.headers["allow"] == "GET"


def test_metrics_use_vllms_names_by_default_and_hybridkv_names_when_asked(engine: EchoEngine) -> None:
    async def test(client: Any) -> str:
        text: str = (await client.get("/metrics")).text
        return text

    text = run(engine, test)
    assert f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0.0' in text
    assert f'vllm:kv_cache_usage_perc{{model_name="{MODEL}"}} 0.0' in text
    assert "# TYPE vllm:e2e_request_latency_seconds histogram" in text
    assert "# TYPE vllm:request_params_max_tokens histogram" in text
    assert f'hybridkv_num_free_blocks{{model_name="{MODEL}"}} 100.0' in text  # vLLM has no such metric
    assert "hybridkv_num_requests_waiting" not in text
    text = run(EchoEngine(), test, names="hybridkv")
    assert f'hybridkv_num_requests_waiting{{model_name="{MODEL}"}} 0.0' in text and "vllm:" not in text


def test_a_histogram_ignores_values_that_are_not_finite() -> None:
    h = Histogram((1.0, 10.0))
    for value in (0.5, float("inf"), float("nan"), 5.0):
        h.observe(value)
    assert (h.count, h.total, h.counts) == (2, 5.5, [1, 1, 0])


def test_echo_of_a_token_prompt_starting_with_bos_offsets_index_the_returned_text(engine: EchoEngine) -> None:
    ids = [BOS] + [ord(c) + 10 for c in "Hi there"]

    async def test(client: Any) -> Any:
        return (await client.post("/v1/completions", json={"model": MODEL, "prompt": ids, "echo": True,
                                                            "logprobs": 0, "max_tokens": 1})).json()

    choice = run(engine, test)["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text == "Hi therex"
    assert lp["tokens"][:3] == ["<bos>", "H", "i"]
    assert lp["text_offset"] == [0, 0, 1, 2, 3, 4, 5, 6, 7]  # <bos> is not in the text: it takes no room
    for token, offset in zip(lp["tokens"][1:], lp["text_offset"][1:]):
        assert text[offset:offset + len(token)] == token


# ---------------------------------------------------------------------- limits before work
@pytest.mark.parametrize(("path", "body", "message"), [
    ("/v1/completions", {"prompt": ["a"] * 200_000}, "list of 200000 prompts"),
    ("/v1/completions", {"prompt": [[5]] * 1_000_000}, "more than 16384 JSON arrays and objects"),
    ("/v1/completions", {"prompt": [5] * 100_000}, "100000 tokens; max_model_len is 256"),
    ("/v1/completions", {"prompt": ["a"] * 8, "n": 9}, "8 prompt(s) x n=9 = 72 completions"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}] * 5000}, "messages has 5000"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}] * 200_000},
     "more than 16384 JSON arrays and objects"),
])
def test_counts_are_refused_before_anything_is_tokenized(engine: EchoEngine, path: str, body: dict[str, Any],
                                                         message: str) -> None:
    async def test(client: Any) -> Any:
        return await client.post(path, json={"model": MODEL, **body})

    error = assert_openai_error(run(engine, test), 400)
    assert message in error["message"]
    assert engine.tokenizer.encodes == 0


def test_brackets_inside_strings_are_not_counted_as_json_containers(engine: EchoEngine) -> None:
    async def test(client: Any) -> Any:
        return await client.post("/v1/completions", json={"model": MODEL, "prompt": "[{" * 20_000,
                                                          "max_tokens": 1})

    error = assert_openai_error(run(engine, test), 400)  # too long for max_model_len 256, not too many containers
    assert "characters" in error["message"] and engine.tokenizer.encodes == 0


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hello there", "max_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 1}),
    ("/tokenize", {"prompt": "Hello there"}),
])
def test_health_answers_while_a_request_is_being_tokenized(engine: EchoEngine, path: str,
                                                           body: dict[str, Any]) -> None:
    gate = engine.tokenizer.gate = threading.Event()

    async def test(client: Any) -> tuple[float, Any]:
        heavy = asyncio.ensure_future(client.post(path, json={"model": MODEL, **body}))
        while engine.tokenizer.encodes == 0:  # the request is inside encode, held by the gate
            await asyncio.sleep(0.01)
        start = time.perf_counter()
        health = await client.get("/health")
        took = time.perf_counter() - start
        assert health.status_code == 200 and not heavy.done()
        gate.set()
        return took, await heavy

    took, resp = run(engine, test)
    assert took < 1.0  # an encode on the event loop would have held /health until the gate opened (10 s)
    assert resp.status_code == 200, resp.text


def test_a_scored_request_reaches_the_engine_with_prompt_logprobs(engine: EchoEngine) -> None:
    async def test(client: Any) -> Any:
        return (await client.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "echo": True,
                                                            "logprobs": 1, "max_tokens": 0})).json()

    choice = run(engine, test)["choices"][0]
    assert choice["text"] == "abc" and choice["logprobs"]["token_logprobs"] == [-1.0, -1.0, -1.0]
    assert json.dumps(choice)  # plain JSON


def test_parsing_rendering_and_tokenizing_run_off_the_event_loop(engine: EchoEngine,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import hybridkv.server.app as app_module
    from hybridkv.server.chat import ChatTemplate

    threads: dict[str, int] = {}
    parse, render, encode = app_module.parse_body, ChatTemplate.render, engine.tokenizer.encode

    def spy(name: str, call: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            threads[name] = threading.get_ident()
            return call(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(app_module, "parse_body", spy("parse", parse))
    monkeypatch.setattr(ChatTemplate, "render", spy("render", render))
    monkeypatch.setattr(engine.tokenizer, "encode", spy("encode", encode))

    async def test(client: Any) -> tuple[int, Any]:
        resp = await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1,
                                                               "messages": [{"role": "user", "content": "Hi"}]})
        return threading.get_ident(), resp

    loop_thread, resp = run(engine, test)
    assert resp.status_code == 200, resp.text
    assert set(threads) == {"parse", "render", "encode"} and loop_thread not in threads.values()


def test_openapi_lists_the_request_bodies(engine: EchoEngine) -> None:
    async def test(client: Any) -> Any:
        return (await client.get("/openapi.json")).json()

    spec = run(engine, test)
    schemas = spec["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "ChatMessage", "TokenizeRequest"} <= set(schemas)
    assert "prompt" in schemas["CompletionRequest"]["properties"]
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/CompletionRequest"}


def test_the_openai_sdk_raises_bad_request_error_for_a_validation_error(engine: EchoEngine) -> None:
    openai = pytest.importorskip("openai")

    async def test(client: Any) -> Any:
        sdk = openai.AsyncOpenAI(api_key="none", base_url="http://test/v1", http_client=client, max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk.completions.create(model=MODEL, prompt="hi", extra_body={"frequency_penality": 1})
        return caught.value

    error = run(engine, test)
    assert error.status_code == 400 and "frequency_penality" in error.message


# ---------------------------------------------------------------------- checkpoint hints
@pytest.mark.parametrize(("messages", "hinted"), [
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hi"}], "You are terse."),
    ([{"role": "developer", "content": "Rule one."}, {"role": "system", "content": "Rule two."},
      {"role": "user", "content": "hi"}], "Rule two."),
    ([{"role": "user", "content": "hi"}], None),
])
def test_a_chat_marks_its_system_prompts_end_as_a_checkpoint_hint(engine: EchoEngine, messages: list[Any],
                                                                  hinted: str | None) -> None:
    """The engine gets, as a checkpoint hint, the token position right after the leading system
    messages (one token per character here), so a recurrent model checkpoints its state there."""
    async def test(client: Any) -> Any:
        resp = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 1})
        assert resp.status_code == 200, resp.text

    run(engine, test)
    ((rid, hints),) = engine.hints.items()
    if hinted is None:
        assert hints == ()
        return
    prompt = engine.tokenizer.decode(engine.prompts[rid], skip_special_tokens=False)
    assert hints == (prompt.index(hinted) + len(hinted),)

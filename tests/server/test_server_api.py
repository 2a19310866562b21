"""The OpenAI dialect real clients send, against a running server on the real Gemma 3 270M:
chat completions, ``n`` and prompt lists, ``logprobs`` and ``echo``, penalties and ``logit_bias``,
``<bos>`` for token-id prompts, the tokenizer endpoints, metrics under vLLM's names, the OpenAI SDK
and LangChain, and the regressions of requests that used to break the server.

The server runs in this process (``gemma.server_url``: uvicorn on a thread, on the shared weights).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

import gemma

pytestmark = pytest.mark.model  # loads the embedded Gemma 3 270M

gemma.require_model()
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

MODEL = gemma.MODEL_NAME
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 6, "ignore_eos": True}
PROMPT = "The capital of France is"
LONG_PROMPT = " ".join(f"Line {i}: the ferry leaves the harbour at seven and returns at noon." for i in range(8))


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with httpx.Client(base_url=gemma.server_url(), timeout=120) as c:
        yield c


def post(client: Any, path: str, **body: Any) -> dict[str, Any]:
    resp = client.post(path, json=body)
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    return data


def error(client: Any, path: str, body: Any, status: int, *, content: bytes | None = None) -> dict[str, Any]:
    resp = (client.post(path, content=content, headers={"content-type": "application/json"}) if content is not None
            else client.post(path, json=body))
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    err: dict[str, Any] = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def events(client: Any, path: str, **body: Any) -> list[Any]:
    with client.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def metric_values(client: Any) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics").text
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def tokenize(client: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    tokens: list[int] = post(client, "/tokenize", prompt=text, add_special_tokens=add_special_tokens)["tokens"]
    return tokens


# ---------------------------------------------------------------------- chat
def test_chat_renders_gemma_turns_with_the_system_message_in_the_first_user_turn(client: Any) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another?"}]
    rendered = post(client, "/tokenize", messages=messages)["tokens"]
    expected = ("<bos><start_of_turn>user\nBe brief.\n\nName a colour.<end_of_turn>\n<start_of_turn>model\nBlue."
                "<end_of_turn>\n<start_of_turn>user\nAnother?<end_of_turn>\n<start_of_turn>model\n")
    assert rendered == tokenize(client, expected, add_special_tokens=False)
    assert rendered[:2] == [2, 105]  # <bos> <start_of_turn>, parsed as special tokens
    out = post(client, "/v1/chat/completions", messages=messages, model=MODEL, max_tokens=4, temperature=0)
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    assert out["choices"][0]["message"]["role"] == "assistant"
    assert out["usage"]["prompt_tokens"] == len(rendered)


def test_chat_reply_ends_at_the_end_of_turn_token(client: Any) -> None:
    end_of_turn = 106
    out = post(client, "/v1/chat/completions", model=MODEL, messages=[{"role": "user", "content": "Hi"}],
               max_tokens=5, logit_bias={str(end_of_turn): 100}, return_token_ids=True)
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["token_ids"] == [end_of_turn] and choice["message"]["content"] == ""


def test_chat_stream_deltas_add_up_to_the_whole_reply(client: Any) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Count to five:"}]}],
            "max_completion_tokens": 8, "temperature": 0}
    whole = post(client, "/v1/chat/completions", **body)["choices"][0]["message"]["content"]
    chunks = events(client, "/v1/chat/completions", **body, stream_options={"include_usage": True})
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1]) == whole
    assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 8


def test_chat_logprobs_list_each_token_with_its_bytes(client: Any) -> None:
    out = post(client, "/v1/chat/completions", model=MODEL, messages=[{"role": "user", "content": "Hello"}],
               max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    for entry in content:
        assert len(entry["top_logprobs"]) == 2
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])  # greedy: the best one
        assert bytes(entry["bytes"]).decode("utf-8", "replace").replace("\ufffd", "") in entry["token"] + "\ufffd"


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "'tool' is not supported"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools", "tool calling"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs", "logprobs: true"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}},
     "response_format", "only 'text'"),
])
def test_chat_requests_the_model_cannot_serve_get_400_naming_the_field(client: Any, body: dict[str, Any],
                                                                      param: str, message: str) -> None:
    err = error(client, "/v1/chat/completions", {"model": MODEL, **body}, 400)
    assert err["param"] == param and message in err["message"]


# ---------------------------------------------------------------------- n, prompt lists, prefix sharing
def test_n_choices_of_one_prompt_share_its_cached_prefix(client: Any) -> None:
    prompt = f"[{time.monotonic_ns()}] {LONG_PROMPT}"  # a fresh first block: nothing earlier can hit
    n_tokens = len(tokenize(client, prompt))
    before = metric_values(client)
    out = post(client, "/v1/completions", model=MODEL, prompt=prompt, n=3, max_tokens=3, temperature=1.0, seed=7)
    after = metric_values(client)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    label = json.dumps({"model_name": MODEL})
    hits = after["vllm:prefix_cache_hits_total" + label] - before["vllm:prefix_cache_hits_total" + label]
    assert hits >= 2 * (n_tokens // 16 * 16 - 16), (hits, n_tokens)  # choices 1 and 2 reuse choice 0's blocks
    assert out["usage"]["prompt_tokens"] == n_tokens and out["usage"]["completion_tokens"] == 9
    again = post(client, "/v1/completions", model=MODEL, prompt=prompt, n=3, max_tokens=3, temperature=1.0, seed=7)
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in out["choices"]]  # seeded: reproducible


def test_a_list_of_prompts_answers_each_as_a_single_request_would(client: Any) -> None:
    prompts = [PROMPT, "Once upon a time", "def add(a, b):"]
    alone = [post(client, "/v1/completions", prompt=p, **GREEDY)["choices"][0]["text"] for p in prompts]
    batch = post(client, "/v1/completions", prompt=prompts, n=2, **GREEDY)
    assert [c["index"] for c in batch["choices"]] == list(range(6))
    assert [c["text"] for c in batch["choices"]] == [t for t in alone for _ in range(2)]


# ---------------------------------------------------------------------- logprobs, echo, BOS
def test_echo_with_logprobs_scores_every_prompt_token_like_the_model_does(client: Any) -> None:
    import torch

    from hybridkv.engine.engine import EngineConfig, LLMEngine
    from hybridkv.engine.sampling import SamplingParams

    out = post(client, "/v1/completions", model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=1,
               temperature=0)
    lp = out["choices"][0]["logprobs"]
    assert "".join(lp["tokens"]) == out["choices"][0]["text"] and out["choices"][0]["text"].startswith(PROMPT)
    ids = gemma.tokenizer().encode(PROMPT)  # <bos> first: not echoed, so every echoed token has a log-prob
    assert len(lp["tokens"]) == len(ids) - 1 + 1
    chunks: list[Any] = []
    eng = LLMEngine(gemma.weights(), gemma.tokenizer(), EngineConfig(dtype="float32", max_model_len=256,
                                                                         kv_cache_memory=16 << 20))
    eng.add_request("score", ids, SamplingParams(max_tokens=1), logits_sink=lambda _pos, lg: chunks.append(lg))
    while eng.has_unfinished:
        eng.step()
    logprobs = torch.log_softmax(torch.cat(chunks), -1)
    expected = [logprobs[i, t].item() for i, t in enumerate(ids[1:])]
    assert lp["token_logprobs"][:-1] == pytest.approx(expected, abs=1e-3)
    assert all(len(top) >= 1 for top in lp["top_logprobs"])


def test_echo_with_max_tokens_0_scores_the_prompt_without_generating(client: Any) -> None:
    out = post(client, "/v1/completions", model=MODEL, prompt=PROMPT, echo=True, logprobs=0, max_tokens=0)
    choice = out["choices"][0]
    assert choice["text"] == PROMPT and out["usage"]["completion_tokens"] == 0
    assert "".join(choice["logprobs"]["tokens"]) == PROMPT
    assert all(lp is not None and lp < 0 for lp in choice["logprobs"]["token_logprobs"])


def test_token_id_prompts_get_a_hidden_bos_unless_they_start_with_one(client: Any) -> None:
    ids = gemma.tokenizer().encode(PROMPT)
    with_bos = post(client, "/v1/completions", prompt=ids, return_token_ids=True, **GREEDY)["choices"][0]
    without = post(client, "/v1/completions", prompt=ids[1:], return_token_ids=True, echo=True, **GREEDY)["choices"][0]
    assert without["prompt_token_ids"] == ids and with_bos["prompt_token_ids"] == ids
    assert without["token_ids"] == with_bos["token_ids"]
    assert without["text"] == PROMPT + with_bos["text"]  # the echo is what the client sent
    raw = post(client, "/v1/completions", prompt=ids[1:], add_special_tokens=False, return_token_ids=True,
               **GREEDY)["choices"][0]
    assert raw["prompt_token_ids"] == ids[1:]


def test_generated_logprobs_list_the_top_k_and_the_chosen_token(client: Any) -> None:
    out = post(client, "/v1/completions", prompt=PROMPT, logprobs=3, **GREEDY)["choices"][0]["logprobs"]
    assert len(out["tokens"]) == 6
    for token, logprob, top in zip(out["tokens"], out["token_logprobs"], out["top_logprobs"]):
        assert token in top and top[token] == logprob
        assert 3 <= len(top) <= 4 and logprob == max(top.values())  # greedy picks the most likely


# ---------------------------------------------------------------------- penalties and bias
def test_frequency_presence_and_repetition_penalties_break_a_loop(client: Any) -> None:
    def most_common(prompt: str, **extra: Any) -> int:
        body = {**GREEDY, "prompt": prompt, "max_tokens": 12, "return_token_ids": True, **extra}
        ids = post(client, "/v1/completions", **body)["choices"][0]["token_ids"]
        return Counter(ids).most_common(1)[0][1]

    loop = "yes yes yes yes yes yes yes yes"
    assert most_common(loop) == 12  # the base model repeats " yes"
    assert most_common(loop, frequency_penalty=2.0) <= 6
    assert most_common(loop, repetition_penalty=5.0) <= 2
    counting = "yes " * 30  # the model counts "1. 2. 3. 4.": the "." repeats
    assert most_common(counting) == 4
    assert most_common(counting, presence_penalty=2.0) < 4


def test_logit_bias_forces_and_bans_tokens(client: Any) -> None:
    forced = 9259
    out = post(client, "/v1/completions", prompt=PROMPT, logit_bias={str(forced): 100}, return_token_ids=True,
               **GREEDY)["choices"][0]
    assert out["token_ids"] == [forced] * 6
    first = post(client, "/v1/completions", prompt=PROMPT, return_token_ids=True, **GREEDY)["choices"][0]["token_ids"]
    banned = post(client, "/v1/completions", prompt=PROMPT, logit_bias={str(first[0]): -100}, return_token_ids=True,
                  **GREEDY)["choices"][0]["token_ids"]
    assert banned[0] != first[0]


# ---------------------------------------------------------------------- endpoints
def test_models_by_id_and_tokenizer_endpoints(client: Any) -> None:
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert error(client, "/v1/models/nope", None, 405)  # GET only: a POST is refused with a JSON body
    resp = client.get("/v1/models/org/nope")
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
    ids = tokenize(client, PROMPT)
    assert ids == gemma.tokenizer().encode(PROMPT)
    assert post(client, "/detokenize", tokens=ids[1:])["prompt"] == PROMPT
    info = client.get("/tokenizer_info").json()
    assert (info["bos_token"], info["eos_token"]) == ("<bos>", "<eos>") and "<start_of_turn>" in info["chat_template"]


def test_metrics_use_vllm_names_with_model_name_and_process_metrics(client: Any) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    post(client, "/v1/completions", prompt=LONG_PROMPT, **GREEDY)
    post(client, "/v1/completions", prompt=LONG_PROMPT, **GREEDY)  # its prompt now comes from the cache
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:num_preemptions",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:request_success",
                 "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "process_resident_memory_bytes", "process_cpu_seconds"):
        assert name in families, name
    for family in families.values():
        if family.name.startswith(("hybridkv_", "vllm:")):
            assert all(s.labels.get("model_name") == MODEL for s in family.samples), family.name
    values = metric_values(client)
    label = json.dumps({"model_name": MODEL})

    def v(name: str, **labels: str) -> float:
        return values[name + json.dumps({"model_name": MODEL, **labels}, sort_keys=True)]

    by_source = sum(v("vllm:prompt_tokens_by_source_total", source=s)
                    for s in ("local_compute", "local_cache_hit", "external_kv_transfer"))
    assert v("vllm:prompt_tokens_total") == by_source  # cached tokens are prompt tokens too (vLLM's rule)
    assert v("vllm:prompt_tokens_by_source_total", source="local_cache_hit") > 0
    assert v("vllm:prompt_tokens_cached_total") == v("vllm:prompt_tokens_by_source_total",
                                                          source="local_cache_hit")
    assert values["vllm:request_prompt_tokens_count" + label] == values[
        "vllm:e2e_request_latency_seconds_count" + label]
    assert values["vllm:inter_token_latency_seconds_count" + label] > 0
    assert values["process_resident_memory_bytes{}"] > 100e6  # the weights alone are ~1 GB in fp32


# ---------------------------------------------------------------------- real clients
def test_openai_sdk_completions_and_chat_plain_and_streamed(client: Any) -> None:
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url=gemma.server_url() + "/v1", api_key="unused")
    text = sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                                                            temperature=0, stream=True))
    assert streamed == text != ""
    messages = [{"role": "user", "content": "Say one word."}]
    reply = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    with pytest.raises(openai.NotFoundError):
        sdk.completions.create(model="gpt-4", prompt="x")


def test_langchain_openai_and_chat_openai(client: Any) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    sent: list[dict[str, Any]] = []
    http = httpx.Client(event_hooks={"request": [lambda r: sent.append(json.loads(r.content))]}, timeout=120)
    base = gemma.server_url() + "/v1"
    llm = langchain_openai.OpenAI(base_url=base, api_key="unused", model=MODEL, max_tokens=4, temperature=0,
                                  http_client=http)
    assert llm.invoke(PROMPT) == post(client, "/v1/completions", prompt=PROMPT, model=MODEL, max_tokens=4,
                                      temperature=0)["choices"][0]["text"]
    assert {"frequency_penalty": 0, "presence_penalty": 0, "logprobs": None}.items() <= sent[0].items()
    chat = langchain_openai.ChatOpenAI(base_url=base, api_key="unused", model=MODEL, max_tokens=4, temperature=0,
                                       http_client=http)
    reply = chat.invoke("Say one word.")
    assert reply.content == "".join(chunk.content for chunk in chat.stream("Say one word."))


# ---------------------------------------------------------------------- requests that used to break the server
def test_a_seed_beyond_64_bits_is_refused_and_the_largest_one_works(client: Any) -> None:
    err = error(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 2**64}, 400)
    assert err["param"] == "seed"
    post(client, "/v1/completions", model=MODEL, prompt="hi", seed=2**64 - 1, max_tokens=2, temperature=1)
    assert client.get("/health").json() == {"status": "ok"}


def test_a_tiny_temperature_samples_greedily(client: Any) -> None:
    greedy = post(client, "/v1/completions", prompt=PROMPT, **GREEDY)["choices"][0]["text"]
    tiny = post(client, "/v1/completions", prompt=PROMPT, **{**GREEDY, "temperature": 1e-300})["choices"][0]["text"]
    assert tiny == greedy
    assert client.get("/health").json() == {"status": "ok"}


def test_a_lone_surrogate_is_a_json_400_naming_the_field(client: Any) -> None:
    for field, value in (("prompt", "\ud800"), ("stop", ["\udfff"]), ("user", "a\ud800")):
        body = json.dumps({"model": MODEL, "prompt": "hi", field: value}).encode()  # json escapes it as \ud800
        err = error(client, "/v1/completions", None, 400, content=body)
        assert err["param"] == field and "unicode" in err["message"].lower()
    chat = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text",
                                                                                  "text": "\ud800"}]}]})
    assert error(client, "/v1/chat/completions", None, 400, content=chat.encode())["param"] == "messages"
    image = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}
    assert error(client, "/v1/chat/completions", image, 400)["param"] == "messages"


def test_a_20_mb_prompt_is_refused_at_once_with_413(client: Any) -> None:
    start = time.monotonic()
    err = error(client, "/v1/completions", {"model": MODEL, "prompt": "x" * 20_000_000}, 413)
    assert err["code"] == "request_too_large"
    chunked = client.post("/v1/completions", headers={"content-type": "application/json"},  # no content-length
                          content=iter([b'{"model": "x", "prompt": "', b"y" * 9_000_000, b'"}']))
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"
    long_but_small = "word " * 200_000  # 1 MB: under the body limit, over what 1024 tokens can hold
    err = error(client, "/v1/completions", {"model": MODEL, "prompt": long_but_small}, 400)
    assert err["param"] == "prompt" and "characters" in err["message"]
    assert time.monotonic() - start < 10  # neither was tokenized


@pytest.mark.parametrize(("body", "param"), [
    ({"stop": ["x"] * 17}, "stop"), ({"stop": "y" * 300}, "stop"), ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"n": 65}, "n"), ({"best_of": 3}, "best_of"),
    ({"suffix": "!"}, "suffix"), ({"logit_bias": {"999999999": 1}}, "logit_bias"),
    ({"logit_bias": {"a": 1}}, "logit_bias"), ({"logprobs": 21}, "logprobs"), ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"prompt": [[]]}, "prompt"), ({"prompt": [5, 10**9]}, "prompt"),
])
def test_bad_values_are_400_naming_the_field(client: Any, body: dict[str, Any], param: str) -> None:
    resp = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_a_request_whose_sampling_fails_gets_a_500_and_the_others_go_on(client: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import concurrent.futures

    import hybridkv.engine.engine as engine_module

    real_sample = engine_module.sample

    def sample(logits: Any, params: Any, generator: Any) -> int:
        if params.seed == 424242:
            raise RuntimeError("a sampler bug")
        return real_sample(logits, params, generator)

    monkeypatch.setattr(engine_module, "sample", sample)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        good = pool.submit(client.post, "/v1/completions", json={**GREEDY, "prompt": PROMPT, "max_tokens": 12})
        bad = pool.submit(client.post, "/v1/completions", json={**GREEDY, "prompt": PROMPT, "seed": 424242,
                                                                "temperature": 1.0})
        bad_resp, good_resp = bad.result(), good.result()
    assert bad_resp.status_code == 500 and bad_resp.json()["error"]["code"] == "engine_error"
    assert "a sampler bug" in bad_resp.json()["error"]["message"]
    assert good_resp.status_code == 200 and good_resp.json()["usage"]["completion_tokens"] == 12
    streamed = client.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, "seed": 424242, "temperature": 1.0,
                                                   "stream": True})
    assert streamed.status_code == 500 and streamed.json()["error"]["code"] == "engine_error"
    assert client.get("/health").json() == {"status": "ok"}

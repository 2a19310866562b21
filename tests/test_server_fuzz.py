"""Random schema-valid requests against a running server on the real model: no 5xx, ever, and a
healthy engine afterwards.

Bodies come from the server's own ``/openapi.json`` (hypothesis-jsonschema), with only the sizes
that decide run time bounded (``max_tokens``, ``n``, prompt lists) so a run stays short; every
other field, its type, range and presence, is the schema's. Both completion endpoints, plain and
streamed. ``HYPOTHESIS_PROFILE=long`` runs ten times as many.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

import gemma

gemma.require_model()
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
hypothesis_jsonschema = pytest.importorskip("hypothesis_jsonschema")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

EXAMPLES = 60
"""Per endpoint (the default profile); the long profile multiplies it by 10."""
STATUS: dict[str, list[int]] = {}


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with httpx.Client(base_url=gemma.server_url(), timeout=120) as c:
        yield c


def request_strategy(schema_name: str) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies valid under the server's OpenAPI schema ``schema_name``, with run time bounded."""
    with httpx.Client(base_url=gemma.server_url()) as c:
        spec = c.get("/openapi.json").json()
    components = spec["components"]["schemas"]
    schema = json.loads(json.dumps(components[schema_name]).replace("#/components/schemas/", "#/definitions/"))
    props = schema["properties"]
    props["model"] = {"const": gemma.MODEL_NAME}  # a wrong model is a plain 404: test it elsewhere
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props:
            props[name] = {"anyOf": [{"type": "integer", "minimum": -2, "maximum": 4}, {"type": "null"}]}
    props["n"] = {"anyOf": [{"type": "integer", "minimum": -1, "maximum": 3}, {"type": "null"}]}
    props["stream"] = {"type": "boolean"}
    if "prompt" in props:
        props["prompt"] = {"anyOf": [
            {"type": "string", "maxLength": 200},
            {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3},
            {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 262_200}, "maxItems": 40},
            {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                  "maximum": 262_143}, "maxItems": 20},
             "maxItems": 2}]}
    if "messages" in props:
        props["messages"]["maxItems"] = 4
        # Requests with max_tokens null generate until max_model_len: only when ignoring nothing else.
    schema["definitions"] = json.loads(json.dumps(components).replace("#/components/schemas/", "#/definitions/"))
    return hypothesis_jsonschema.from_schema(schema)


def check(client: Any, path: str, body: dict[str, Any]) -> None:
    if body.get("max_tokens", 0) is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 3  # null means "up to max_model_len": correct, but too slow to fuzz
    if body.get("stream"):
        with client.stream("POST", path, json=body) as resp:
            text = resp.read().decode()
        if resp.status_code == 200:
            assert text.rstrip().endswith("data: [DONE]"), text[-500:]
            assert '"type": "server_error"' not in text, text[-500:]
    else:
        resp = client.post(path, json=body)
        text = resp.text
        if resp.status_code == 200:
            assert resp.json()["choices"], text
    STATUS.setdefault(path, []).append(resp.status_code)
    assert resp.status_code < 500, (body, text)
    if resp.status_code >= 400:
        assert resp.headers["content-type"] == "application/json"
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


@settings(max_examples=EXAMPLES, deadline=None)
@given(body=st.deferred(lambda: request_strategy("CompletionRequest")))
def test_random_completion_requests_never_get_a_5xx(client: Any, body: dict[str, Any]) -> None:
    check(client, "/v1/completions", body)


@settings(max_examples=EXAMPLES, deadline=None)
@given(body=st.deferred(lambda: request_strategy("ChatCompletionRequest")))
def test_random_chat_requests_never_get_a_5xx(client: Any, body: dict[str, Any]) -> None:
    check(client, "/v1/chat/completions", body)


def test_the_engine_is_healthy_after_the_fuzzing(client: Any) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    out = client.post("/v1/completions", json={"model": gemma.MODEL_NAME, "prompt": "The capital of France is",
                                               "max_tokens": 3, "temperature": 0})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3
    metrics = client.get("/metrics").text
    assert f'hybridkv_num_requests_running{{model_name="{gemma.MODEL_NAME}"}} 0.0' in metrics
    print({path: {"requests": len(codes), "2xx": sum(c < 300 for c in codes), "4xx": sum(c >= 400 for c in codes)}
           for path, codes in STATUS.items()})

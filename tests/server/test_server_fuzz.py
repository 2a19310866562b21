"""Random schema-valid requests against a running server on the real model: no 5xx, ever, and a
healthy engine afterwards.

Bodies are drawn by hypothesis from the server's own ``/openapi.json`` (``from_schema`` below covers
the JSON Schema that pydantic writes), with only the sizes that decide run time bounded
(``max_tokens``, ``n``, prompt lists) so a run stays short; every
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

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.model  # loads the embedded Gemma 3 270M

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                                                                                 allow_infinity=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
                           max_leaves=6)

EXAMPLES = 40
"""Per endpoint (the default profile); the long profile multiplies it by 10."""
STATUS: dict[str, list[int]] = {}


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    with httpx.Client(base_url=gemma.server_url(), timeout=120) as c:
        yield c


def from_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid under ``schema`` (the subset of JSON Schema pydantic emits; ``$ref`` into ``defs``)."""
    if "$ref" in schema:
        return st.deferred(lambda: from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(s, defs) for s in schema[key]])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        lo = lo if "exclusiveMinimum" not in schema else int(schema["exclusiveMinimum"]) + 1
        hi = hi if "exclusiveMaximum" not in schema else int(schema["exclusiveMaximum"]) - 1
        return st.integers(lo, hi)
    if kind == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        hi = schema.get("maximum", schema.get("exclusiveMaximum"))
        return st.floats(lo, hi, exclude_min="exclusiveMinimum" in schema, exclude_max="exclusiveMaximum" in schema,
                         allow_nan=False, allow_infinity=False)
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 40))
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), defs), min_size=schema.get("minItems", 0),
                        max_size=schema.get("maxItems", 4))
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        if props:
            return st.fixed_dictionaries({k: from_schema(v, defs) for k, v in props.items() if k in required},
                                         optional={k: from_schema(v, defs) for k, v in props.items()
                                                   if k not in required})
        if "patternProperties" in schema:
            ((pattern, value_schema),) = schema["patternProperties"].items()
            return st.dictionaries(st.from_regex(pattern, fullmatch=True), from_schema(value_schema, defs), max_size=3)
        extra = schema.get("additionalProperties", True)
        values = from_schema(extra, defs) if isinstance(extra, dict) else JSON_VALUES
        keys = from_schema({"type": "string", **schema.get("propertyNames", {"maxLength": 10})}, defs)
        return st.dictionaries(keys, values, max_size=3)
    return JSON_VALUES


def request_strategy(schema_name: str) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies valid under the server's OpenAPI schema ``schema_name``, with run time bounded."""
    with httpx.Client(base_url=gemma.server_url()) as c:
        spec = c.get("/openapi.json").json()
    components = spec["components"]["schemas"]
    schema = json.loads(json.dumps(components[schema_name]))
    props = schema["properties"]
    props["model"] = {"const": gemma.MODEL_NAME}  # a wrong model is a plain 404: test it elsewhere
    for name in ("max_tokens", "max_completion_tokens"):
        if name in props:
            props[name] = {"anyOf": [{"type": "integer", "minimum": 0 if name == "max_tokens" else 1, "maximum": 4},
                                     {"type": "null"}]}
    props["n"] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 3}, {"type": "null"}]}
    props["stream"] = {"type": "boolean"}
    if "prompt" in props:
        props["prompt"] = {"anyOf": [
            {"type": "string", "minLength": 1, "maxLength": 200},
            {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 60}, "minItems": 1,
             "maxItems": 3},
            {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 262_200}, "minItems": 1,
             "maxItems": 40},
            {"type": "array", "items": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                  "maximum": 262_143}, "minItems": 1,
                                        "maxItems": 20}, "minItems": 1, "maxItems": 2}]}
    if "messages" in props:
        props["messages"]["maxItems"] = 4
    return from_schema(schema, components)


def check(client: Any, path: str, body: dict[str, Any]) -> None:
    unbounded = body.get("max_tokens") is None and body.get("max_completion_tokens") is None
    if unbounded and ("max_tokens" in body or path.endswith("/chat/completions")):
        body["max_tokens"] = 3  # no limit means "up to max_model_len": correct, but too slow to fuzz
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
    assert f'vllm:num_requests_running{{model_name="{gemma.MODEL_NAME}"}} 0.0' in metrics
    print({path: {"requests": len(codes), "2xx": sum(c < 300 for c in codes), "4xx": sum(c >= 400 for c in codes)}
           for path, codes in STATUS.items()})

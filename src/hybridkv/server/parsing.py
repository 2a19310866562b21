"""Request bodies from bytes to validated pydantic models, with every count checked before the work
it bounds, run off the event loop (``parse_body`` in a worker thread).

Order: the body's JSON arrays and objects are counted (at most ``MAX_JSON_CONTAINERS``), then it is
parsed, then list lengths are checked (prompts, messages, token ids), and only then validated.
A C call (``json.loads``, pydantic) holds the GIL for its whole run, so a worker thread alone does
not keep the event loop free: bounding what each such call receives does.
"""

from __future__ import annotations

import json
import json.decoder
import json.scanner
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from hybridkv.server.errors import APIError, validation_error
from hybridkv.server.protocol import MAX_CHOICES

MAX_JSON_CONTAINERS = 16384
"""Most JSON arrays and objects one request body may hold."""
MAX_MESSAGES = 4096
"""Most messages one chat request may hold."""

M = TypeVar("M", bound=BaseModel)


class _TooMany(Exception):
    pass


class _CountingDecoder(json.JSONDecoder):
    """The pure-Python JSON decoder, stopping at the ``limit``-th array or object: for bodies whose
    bracket characters could be that many containers (it lets other threads run while it parses)."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        left = limit
        parse_array: Any = getattr(json.decoder, "JSONArray")  # noqa: B009 (untyped in typeshed)
        parse_object: Any = getattr(json.decoder, "JSONObject")  # noqa: B009

        def spend() -> None:
            nonlocal left
            left -= 1
            if left < 0:
                raise _TooMany

        def counted_array(*args: Any) -> Any:
            spend()
            return parse_array(*args)

        def counted_object(*args: Any) -> Any:
            spend()
            return parse_object(*args)

        self.parse_array = counted_array
        self.parse_object = counted_object
        self.scan_once = json.scanner.py_make_scanner(self)  # type: ignore[attr-defined]


def load_json(raw: bytes, limit: int = MAX_JSON_CONTAINERS) -> Any:
    """The JSON value of ``raw``; ``APIError`` 400 for invalid JSON or more than ``limit`` arrays and objects."""
    try:
        text = raw.decode("utf-8")
        if raw.count(b"[") + raw.count(b"{") <= limit:  # cannot hold more containers than bracket characters
            return json.loads(text)
        return _CountingDecoder(limit).decode(text)
    except _TooMany:
        raise APIError(400, f"the request body holds more than {limit} JSON arrays and objects") from None
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays and objects too deeply") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None


def check_counts(data: dict[str, Any], *, max_model_len: int) -> None:
    """``APIError`` 400 for a list longer than its field allows: prompts, messages, token ids."""
    prompt = data.get("prompt")
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], int) and len(prompt) >= max_model_len:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; max_model_len is {max_model_len} "
                                f"(prompt plus at least one generated token)", param="prompt")
        if not isinstance(prompt[0], int) and len(prompt) > MAX_CHOICES:
            raise APIError(400, f"the prompt is a list of {len(prompt)} prompts; at most {MAX_CHOICES} completions "
                                f"per request", param="prompt")
    messages = data.get("messages")
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise APIError(400, f"messages has {len(messages)} messages; at most {MAX_MESSAGES} are allowed",
                       param="messages")
    tokens = data.get("tokens")
    if isinstance(tokens, list) and len(tokens) > max_model_len:
        raise APIError(400, f"tokens has {len(tokens)} ids; at most max_model_len ({max_model_len})", param="tokens")


def parse_body(raw: bytes, model: type[M], *, max_model_len: int) -> M:
    """``raw`` as a validated ``model``; ``APIError`` 400 naming the problem. Meant for a worker thread."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object (sent with Content-Type: application/json)")
    check_counts(data, max_model_len=max_model_len)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None

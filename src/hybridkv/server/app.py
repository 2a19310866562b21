"""The OpenAI-compatible HTTP API: ``/v1/completions`` (plain and SSE streaming), ``/v1/models``,
``/health`` and ``/metrics``.

Every error body has the OpenAI form ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar, cast

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict
from starlette.exceptions import HTTPException as StarletteHTTPException

from hybridkv.engine.engine import RequestOutput
from hybridkv.engine.sampling import SamplingParams
from hybridkv.errors import InvalidInputError
from hybridkv.server.async_engine import AsyncEngine, EngineClosedError

T = TypeVar("T")

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False
    """Send one more chunk, with ``usage`` and no choices, before ``[DONE]``."""


class CompletionRequest(BaseModel):
    """The body of ``POST /v1/completions``: OpenAI's fields plus hybridkv extensions."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    """``None``: generate up to ``max_model_len``."""
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    echo: bool = False
    # hybridkv extensions
    top_k: int = 0
    cache_salt: str | None = None
    """Requests share prefix-cache blocks only with requests of the same salt (tenant isolation)."""
    ignore_eos: bool = False
    priority: int = 0
    return_token_ids: bool = False
    """Add ``prompt_token_ids`` and ``token_ids`` to the choice."""


class APIError(Exception):
    """An error answered as an OpenAI error body with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _finish_reason(output: RequestOutput) -> str:
    """The OpenAI finish reason; an output that ended any other way raises ``APIError``."""
    reason = output.finish_reason or ""
    if reason in ("stop", "length"):
        return reason
    if reason == "max_model_len":
        return "length"
    if reason.startswith("rejected"):
        raise APIError(503, f"the request was {reason}", type="server_error", code="request_rejected")
    raise APIError(503, f"the request ended early ({reason}): the server is shutting down",
                   type="server_error", code="request_aborted")


def _prompt(body: CompletionRequest) -> str | list[int]:
    """The one prompt of ``body``: a string or token ids (a one-element batch is unwrapped)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"one prompt per request: got a batch of {len(prompt)} prompts", param="prompt")
        return prompt[0]
    return cast("str | list[int]", prompt)


def _sampling_params(body: CompletionRequest, max_model_len: int) -> SamplingParams:
    if body.n != 1:
        raise APIError(400, f"only n=1 is supported, got n={body.n}", param="n")
    if body.echo:
        raise APIError(400, "echo=true is not supported", param="echo")
    stop = () if body.stop is None else (body.stop,) if isinstance(body.stop, str) else tuple(body.stop)
    try:
        return SamplingParams(
            max_tokens=max_model_len if body.max_tokens is None else body.max_tokens,
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=stop,
            ignore_eos=body.ignore_eos,
        )
    except InvalidInputError as exc:
        raise APIError(400, str(exc)) from exc


def _usage(output: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens + output.num_external_tokens,
                                      "external_tokens": output.num_external_tokens}}


async def _cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``; cancel it and return ``None`` if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def wait_for_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(wait_for_disconnect())
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait((task,))  # let the request's cleanup (its abort) run
    return None if task.cancelled() else task.result()


def _validation_message(exc: RequestValidationError) -> tuple[int, str, str | None]:
    """Status, message and first offending field of a FastAPI validation error."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid").get("ctx", {}).get("error", "")
        return 400, f"the request body is not valid JSON: {detail}".rstrip(": "), None
    if any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return 400, "the request body must be a JSON object (sent with Content-Type: application/json)", None
    parts, fields = [], []
    for e in errors:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        field = ".".join(loc) or "body"
        fields.append(field)
        hint = f" (unknown field {loc[-1]!r})" if e.get("type") == "extra_forbidden" and loc else ""
        parts.append(f"{field}: {e.get('msg', 'invalid')}{hint}")
    return 422, "; ".join(parts), fields[0].split(".", 1)[0] if fields else None


def build_app(async_engine: AsyncEngine, model_name: str) -> FastAPI:
    """The FastAPI app serving ``async_engine`` as model ``model_name``; its shutdown drains the engine."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(async_engine.shutdown, True)

    app = FastAPI(title="hybridkv", summary="OpenAI-compatible completions on the hybridkv engine",
                  lifespan=lifespan)
    created = int(time.time())
    max_model_len = async_engine.config.max_model_len

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        status, message, param = _validation_message(exc)
        return APIError(status, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return APIError(exc.status_code, f"{exc.detail} ({request.method} {request.url.path})").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        if async_engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(async_engine.metrics_text(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "hybridkv", "max_model_len": max_model_len}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        if body.model != model_name:
            raise APIError(404, f"The model `{body.model}` does not exist; this server serves `{model_name}`",
                           param="model", code="model_not_found")
        prompt = _prompt(body)
        params = _sampling_params(body, max_model_len)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        outputs = async_engine.generate(request_id, prompt, params, body.cache_salt, priority=body.priority)
        try:
            first = await _cancel_on_disconnect(request, anext(outputs))
        except InvalidInputError as exc:
            raise APIError(400, str(exc), param="prompt") from exc
        except EngineClosedError as exc:
            raise APIError(503, str(exc), type="server_error", code="shutting_down") from exc
        if first is None:  # the client went away
            await outputs.aclose()
            return Response(status_code=499)
        head: RequestOutput = first
        if head.finished:
            _finish_reason(head)  # a rejected or aborted request is an error before any byte is sent
        created_at = int(time.time())

        def choice(text: str, output: RequestOutput, finish_reason: str | None) -> dict[str, Any]:
            data: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            if body.return_token_ids:
                data |= {"prompt_token_ids": output.prompt_token_ids, "token_ids": output.token_ids}
            return data

        def envelope(**fields: Any) -> dict[str, Any]:
            return {"id": request_id, "object": "text_completion", "created": created_at, "model": model_name,
                    **fields}

        if not body.stream:
            async def collect() -> RequestOutput:
                last = head
                async for output in outputs:
                    last = output
                return last

            final = head if head.finished else await _cancel_on_disconnect(request, collect())
            if final is None:
                return Response(status_code=499)
            return JSONResponse(envelope(choices=[choice(final.text, final, _finish_reason(final))],
                                         usage=_usage(final)))

        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def event(data: dict[str, Any]) -> str:
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        async def sse() -> AsyncIterator[str]:
            try:
                output: RequestOutput | None = head
                while output is not None:
                    if output.finished:
                        try:
                            reason = _finish_reason(output)
                        except APIError as exc:
                            yield event(exc.body())
                            break
                        yield event(envelope(choices=[choice(output.new_text, output, reason)]))
                        if include_usage:
                            yield event(envelope(choices=[], usage=_usage(output)))
                    elif output.new_text:
                        yield event(envelope(choices=[choice(output.new_text, output, None)]))
                    output = await anext(outputs, None)
                yield "data: [DONE]\n\n"
            finally:
                await outputs.aclose()

        return StreamingResponse(sse(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return app

"""The OpenAI-compatible HTTP API: ``/v1/completions`` and ``/v1/chat/completions`` (plain and SSE
streaming), ``/v1/models`` and ``/v1/models/{id}``, ``/health`` and ``/metrics``, and vLLM's
``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` (lm-eval tokenizes through them).

Every error body has the OpenAI form ``{"error": {"message", "type", "param", "code"}}``. Nothing
that grows with a request runs on the event loop: bodies are parsed and validated
(``parsing.parse_body``), conversations rendered and prompts tokenized in worker threads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from hybridkv.server.async_engine import AsyncEngine
from hybridkv.server.chat import END_OF_TURN, ChatTemplate
from hybridkv.server.chat_completions import create_chat_completion
from hybridkv.server.completions import create_completion
from hybridkv.server.context import ServerContext
from hybridkv.server.errors import APIError, BodySizeLimit, install_error_handlers
from hybridkv.server.generation import Tokenize
from hybridkv.server.openai_format import TokenText
from hybridkv.server.parsing import parse_body
from hybridkv.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from hybridkv.server.tokenize_api import detokenize, tokenize, tokenizer_info

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)


@dataclass(frozen=True)
class ServerOptions:
    chat_template: Path | None = None
    """A Jinja chat template file overriding the model's (``--chat-template``)."""
    max_request_bytes: int = 8 << 20
    """Bodies over this get 413 before they are parsed."""
    bos_for_token_prompts: bool = True
    """Put ``<bos>`` before a token-id prompt that lacks it (not echoed); False sends the ids as given."""


def _max_token_chars(tokenizer: Any) -> int:
    """An upper bound on the characters one token stands for (vocabulary entries are at least as long)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return 64
    return max(len(token) for token in backend.get_vocab(with_added_tokens=True))


def _process_metrics() -> Any:
    """A renderer of process metrics (memory, CPU, open files, GC), or None without prometheus-client."""
    try:
        from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
        from prometheus_client.exposition import generate_latest
    except ImportError:
        return None
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return lambda: generate_latest(registry).decode()


def build_context(async_engine: AsyncEngine, model_name: str, options: ServerOptions) -> ServerContext:
    """What the handlers need; ``InvalidInputError`` for a chat template that does not compile."""
    tokenizer = async_engine.tokenizer
    token_to_id = getattr(tokenizer, "token_to_id", lambda _: None)
    template = ChatTemplate.choose(options.chat_template, async_engine.model_chat_template,
                                   bos_token="<bos>", eos_token="<eos>")
    tokenize = Tokenize(lambda text, add_bos: tokenizer.encode(text, add_bos=add_bos),
                        bos_token_id=getattr(tokenizer, "bos_token_id", 2),
                        vocab_size=getattr(tokenizer, "vocab_size", 262_144),
                        max_model_len=async_engine.config.max_model_len, max_token_chars=_max_token_chars(tokenizer),
                        bos_for_token_prompts=options.bos_for_token_prompts)
    return ServerContext(async_engine, model_name, tokenizer, tokenize, TokenText(tokenizer), template,
                         token_to_id(END_OF_TURN))


def _body_schemas() -> dict[str, Any]:
    """JSON schemas of the request bodies and the models they use, by name (for ``/openapi.json``)."""
    schemas: dict[str, Any] = {}
    for model in (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    return schemas


def _body(model: type[Any]) -> dict[str, Any]:
    """A route's ``openapi_extra``: its JSON body is a ``model`` (parsed by the route, not by FastAPI)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def build_app(async_engine: AsyncEngine, model_name: str, options: ServerOptions | None = None,
              context: ServerContext | None = None) -> FastAPI:
    """The FastAPI app serving ``async_engine`` as model ``model_name``; its shutdown drains the engine."""
    options = options or ServerOptions()
    ctx = context or build_context(async_engine, model_name, options)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await asyncio.to_thread(async_engine.shutdown, True)

    app = FastAPI(title="hybridkv", summary="OpenAI-compatible completions on the hybridkv engine",
                  lifespan=lifespan)
    app.add_middleware(BodySizeLimit, limit=options.max_request_bytes)
    install_error_handlers(app)
    _add_status_routes(app, async_engine, model_name, ctx)
    _add_openapi_bodies(app)
    _add_api_routes(app, async_engine, ctx)
    return app


def _add_status_routes(app: FastAPI, async_engine: AsyncEngine, model_name: str, ctx: ServerContext) -> None:
    """``/health``, ``/metrics`` and the model list ``/v1/models``."""
    created = int(time.time())
    process_metrics = _process_metrics()

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "hybridkv", "root": model_name,
                "max_model_len": async_engine.config.max_model_len}

    @app.get("/health")
    async def health() -> JSONResponse:
        if async_engine.is_running:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "draining" if async_engine.is_draining else "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        text = async_engine.metrics_text()
        if process_metrics is not None:
            text += process_metrics()
        return Response(text, media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        ctx.check_model(model_id)
        return model_card()


def _add_openapi_bodies(app: FastAPI) -> None:
    """The OpenAPI schema lists the request bodies (the routes read them raw, see ``_add_api_routes``)."""
    default_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = default_openapi()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(_body_schemas())
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _add_api_routes(app: FastAPI, async_engine: AsyncEngine, ctx: ServerContext) -> None:
    """The completions, chat completions and tokenizer routes."""

    async def parsed(request: Request, model: type[Body]) -> Body:
        """The request's body as ``model``: read here, parsed and validated in a worker thread."""
        raw = await request.body()
        return await asyncio.to_thread(parse_body, raw, model, max_model_len=ctx.max_model_len)

    @app.post("/v1/completions", response_model=None, openapi_extra=_body(CompletionRequest))
    async def completions(request: Request) -> Response:
        _check_open(async_engine)
        return await create_completion(await parsed(request, CompletionRequest), request, ctx)

    @app.post("/v1/chat/completions", response_model=None, openapi_extra=_body(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        _check_open(async_engine)
        return await create_chat_completion(await parsed(request, ChatCompletionRequest), request, ctx)

    @app.post("/tokenize", openapi_extra=_body(TokenizeRequest))
    async def tokenize_route(request: Request) -> dict[str, Any]:
        return await asyncio.to_thread(tokenize, await parsed(request, TokenizeRequest), ctx)

    @app.post("/detokenize", openapi_extra=_body(DetokenizeRequest))
    async def detokenize_route(request: Request) -> dict[str, Any]:
        return await asyncio.to_thread(detokenize, await parsed(request, DetokenizeRequest), ctx)

    @app.get("/tokenizer_info")
    async def tokenizer_info_route() -> dict[str, Any]:
        return tokenizer_info(ctx)


def _check_open(async_engine: AsyncEngine) -> None:
    if not async_engine.is_running:
        raise APIError(503, "the engine is shutting down" if async_engine.is_draining else "the engine failed",
                       type="server_error", code="shutting_down")

"""What the request handlers share: the engine, the served model's name, tokenization, the chat
template; and waiting on the engine while watching for the client going away."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import Request

from hybridkv.engine.config import RequestOutput, Tokenizer
from hybridkv.errors import InvalidInputError
from hybridkv.server.async_engine import AsyncEngine, EngineClosedError
from hybridkv.server.chat import ChatTemplate
from hybridkv.server.errors import APIError
from hybridkv.server.generation import Choice, Tokenize, run_choices
from hybridkv.server.openai_format import TokenText, finish_reason

T = TypeVar("T")


@dataclass
class ServerContext:
    engine: AsyncEngine
    model_name: str
    tokenizer: Tokenizer
    tokenize: Tokenize
    token_text: TokenText
    chat_template: ChatTemplate
    end_of_turn_id: int | None
    """The token that ends an assistant turn (a chat stop token besides end-of-sequence)."""

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           param="model", code="model_not_found")


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
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


async def first_or_error(request: Request, outputs: AsyncIterator[T]) -> T | None:
    """The first item of ``outputs``, errors submitting the request as ``APIError``; None if the client left."""
    try:
        first = await cancel_on_disconnect(request, anext(outputs))
    except InvalidInputError as exc:
        raise APIError.bad_input(exc, "prompt") from exc
    except EngineClosedError as exc:
        raise APIError(503, str(exc), type="server_error", code="shutting_down") from exc
    if first is None:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()
    return first


ChoiceOutputs = AsyncGenerator[tuple[Choice, RequestOutput], None]


async def start_choices(ctx: ServerContext, request: Request, request_id: str, choices: list[Choice], *,
                        cache_salt: str | None, priority: int, n: int
                        ) -> tuple[tuple[Choice, RequestOutput], ChoiceOutputs] | None:
    """Submit ``choices``: their first output and the rest to come, None if the client left. A request
    that failed or was refused at once raises its ``APIError`` (bad input, shutting down, too large)."""
    outputs = run_choices(ctx.engine, request_id, choices, cache_salt=cache_salt, priority=priority, n=n)
    first = await first_or_error(request, outputs)
    if first is None:
        return None
    if first[1].finished:
        finish_reason(first[1])
    return first, outputs

"""The one server-sent-events loop of ``/v1/completions`` and ``/v1/chat/completions``: choices'
outputs as they arrive, rendered into chunks by the endpoint, then the usage chunk and ``[DONE]``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

from fastapi.responses import StreamingResponse

from hybridkv.engine.engine import RequestOutput
from hybridkv.server.context import ChoiceOutputs
from hybridkv.server.errors import APIError
from hybridkv.server.generation import Choice
from hybridkv.server.openai_format import finish_reason, sse

Finals = list[tuple[Choice, RequestOutput]]
Render = Callable[[Choice, RequestOutput, int, bool, "str | None"], "dict[str, Any] | None"]
"""``(choice, output, tokens sent so far, first output of the choice, finish reason)``: the chunk to
send, or None when there is nothing new."""


def stream_response(first: tuple[Choice, RequestOutput], outputs: ChoiceOutputs,
                    num_choices: int, render: Render, *,
                    opening: Callable[[Choice], Iterable[dict[str, Any]]] = lambda choice: (),
                    closing: Callable[[Finals], dict[str, Any]] | None = None) -> StreamingResponse:
    """Stream every choice's outputs (``first`` already taken from ``outputs``) as server-sent events.

    ``opening(choice)``: chunks sent before a choice's first output; ``closing(finals)``: a last chunk
    (the usage) once every choice finished, with their final outputs in choice order. A choice whose
    finish reason cannot be given (an engine error) ends the stream with the error's body.
    """

    async def events() -> AsyncIterator[str]:
        sent: dict[int, int] = {}  # per choice: tokens sent
        finals: dict[int, tuple[Choice, RequestOutput]] = {}
        pending = [first]
        try:
            while pending or len(finals) < num_choices:
                choice, output = pending.pop() if pending else await anext(outputs)
                i = choice.index
                starting = i not in sent
                if starting:
                    sent[i] = 0
                    for chunk in opening(choice):
                        yield sse(chunk)
                reason = None
                if output.finished:
                    try:
                        reason = finish_reason(output)
                    except APIError as exc:
                        yield sse(exc.body())
                        break
                    finals[i] = (choice, output)
                rendered = render(choice, output, sent[i], starting, reason)
                if rendered is None:
                    continue
                sent[i] = len(output.token_ids)
                yield sse(rendered)
            else:
                if closing is not None:
                    yield sse(closing([finals[k] for k in sorted(finals)]))
            yield sse("[DONE]")
        finally:
            await outputs.aclose()

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

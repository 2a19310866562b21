"""``POST /v1/chat/completions``: a conversation rendered by the chat template, ``n`` replies, each
ending at the model's end-of-turn token; ``logprobs``/``top_logprobs``; streamed or whole."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import replace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from hybridkv.engine.engine import RequestOutput
from hybridkv.errors import InvalidInputError
from hybridkv.server.chat import plain_messages
from hybridkv.server.context import ServerContext, cancel_on_disconnect, start_choices
from hybridkv.server.errors import APIError
from hybridkv.server.generation import Choice, collect_finals, make_choices, system_prompt_end
from hybridkv.server.openai_format import chat_logprobs, check_n, finish_reason, sampling_params, usage
from hybridkv.server.protocol import MAX_CHOICES, ChatCompletionRequest
from hybridkv.server.streaming import stream_response


def _check_unsupported(body: ChatCompletionRequest) -> None:
    if body.tools:
        raise APIError(400, "tools are not supported: the model has no tool calling", param="tools")
    if body.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice is not supported: the model has no tool calling", param="tool_choice")
    if body.response_format is not None and body.response_format.type != "text":
        raise APIError(400, f"response_format {body.response_format.type!r} is not supported: only 'text'",
                       param="response_format")
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")


def _prepare(body: ChatCompletionRequest, ctx: ServerContext) -> tuple[list[Choice], int, int | None]:
    """The choices, ``n`` and top-logprobs count of ``body``: checks first, then the conversation
    rendered and tokenized (blocking: run it in a worker thread)."""
    ctx.check_model(body.model)
    _check_unsupported(body)
    n = check_n(body.n, 1, MAX_CHOICES)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be a positive integer, got {max_tokens}",
                       param="max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens")
    k = (body.top_logprobs or 0) if body.logprobs else None
    stops = () if ctx.end_of_turn_id is None or body.ignore_eos else (ctx.end_of_turn_id,)
    params = sampling_params(body, max_tokens=ctx.max_model_len if max_tokens is None else max_tokens,
                             vocab_size=ctx.tokenize.vocab_size, logprobs=k, stop_token_ids=stops)
    try:
        messages = plain_messages(body.messages)
        text = ctx.chat_template.render(messages, body.add_generation_prompt is not False)
        prompt = ctx.tokenize.text(text, False, "the rendered conversation")
    except InvalidInputError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    hints = system_prompt_end(messages, text, prompt, ctx.tokenize.encode)
    return make_choices([replace(prompt, checkpoint_hints=hints)], params, n), n, k


async def create_chat_completion(body: ChatCompletionRequest, request: Request, ctx: ServerContext) -> Response:
    choices, n, k = await asyncio.to_thread(_prepare, body, ctx)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    started = await start_choices(ctx, request, request_id, choices, cache_salt=body.cache_salt,
                                  priority=body.priority or 0, n=n)
    if started is None:
        return Response(status_code=499)
    first, outputs = started
    created = int(time.time())

    def logprobs(output: RequestOutput, start: int) -> dict[str, Any] | None:
        return None if k is None else chat_logprobs((output.logprobs or [])[start:], ctx.token_text)

    def extras(output: RequestOutput) -> dict[str, Any]:
        if not body.return_token_ids:
            return {}
        return {"prompt_token_ids": output.prompt_token_ids, "token_ids": output.token_ids}

    def envelope(obj: str, **fields: Any) -> dict[str, Any]:
        return {"id": request_id, "object": obj, "created": created, "model": ctx.model_name, **fields}

    if not body.stream:
        ordered = await cancel_on_disconnect(request, collect_finals(first, outputs))
        if ordered is None:
            return Response(status_code=499)
        replies = [{"index": c.index, "message": {"role": "assistant", "content": o.text, "refusal": None,
                                                   "tool_calls": []},
                    "logprobs": logprobs(o, 0), "finish_reason": finish_reason(o), **extras(o)} for c, o in ordered]
        return JSONResponse(envelope("chat.completion", choices=replies,
                                     usage=usage({0: ordered[0][1]}, [o for _, o in ordered])))

    include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)

    def opening(choice: Choice) -> list[dict[str, Any]]:
        return [envelope("chat.completion.chunk", choices=[
            {"index": choice.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}])]

    def chunk(choice: Choice, output: RequestOutput, start: int, starting: bool, reason: str | None
              ) -> dict[str, Any] | None:
        if not (output.new_text or reason or (k is not None and len(output.token_ids) > start)):
            return None
        delta = {"content": output.new_text} if output.new_text or not reason else {}
        return envelope("chat.completion.chunk", choices=[
            {"index": choice.index, "delta": delta, "logprobs": logprobs(output, start), "finish_reason": reason,
             **(extras(output) if reason else {})}])

    def closing(finals: list[tuple[Choice, RequestOutput]]) -> dict[str, Any]:
        return envelope("chat.completion.chunk", choices=[], usage=usage({0: finals[0][1]}, [o for _, o in finals]))

    return stream_response(first, outputs, len(choices), chunk, opening=opening,
                           closing=closing if include_usage else None)

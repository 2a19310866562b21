"""``POST /v1/completions``: one or many prompts (text or token ids), ``n`` choices each, ``echo``,
``logprobs`` (for the completion and, with ``echo``, for the prompt: what lm-eval's loglikelihood
tasks read), streamed as server-sent events or answered whole."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from hybridkv.engine.engine import RequestOutput
from hybridkv.errors import InvalidInputError
from hybridkv.server.context import ServerContext, cancel_on_disconnect, start_choices
from hybridkv.server.errors import APIError
from hybridkv.server.generation import Choice, Prompt, collect_finals, make_choices
from hybridkv.server.openai_format import check_n, completion_logprobs, finish_reason, sampling_params, usage
from hybridkv.server.protocol import MAX_CHOICES, CompletionRequest
from hybridkv.server.streaming import stream_response


def _prompt_items(body: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts as sent: texts or token-id lists."""
    raw = body.prompt
    if isinstance(raw, str):
        return [raw]
    if raw and all(isinstance(p, int) for p in raw):
        return [cast("list[int]", raw)]
    items = cast("list[str | list[int]]", list(raw))
    if not items:
        raise APIError(400, "the prompt is empty", param="prompt")
    return items


def _tokenized(items: list[str | list[int]], add_bos: bool, ctx: ServerContext) -> list[Prompt]:
    out = []
    for i, item in enumerate(items):
        what = "the prompt" if len(items) == 1 else f"prompt[{i}]"
        try:
            out.append(ctx.tokenize.text(item, add_bos, what) if isinstance(item, str)
                       else ctx.tokenize.token_ids(item, add_bos, what))
        except InvalidInputError as exc:
            raise APIError(400, str(exc), param="prompt") from exc
    return out


@dataclass(frozen=True)
class _Prepared:
    choices: list[Choice]
    n: int
    echo: bool
    prompt_only: bool
    """``max_tokens`` 0 with ``echo``: score the prompt without generating."""


def _prepare(body: CompletionRequest, ctx: ServerContext) -> _Prepared:
    """Checks, tokenization and the choices of ``body`` (blocking: run it in a worker thread)."""
    ctx.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported: the model has no fill-in-the-middle mode", param="suffix")
    echo = bool(body.echo)
    max_tokens = 16 if "max_tokens" not in body.model_fields_set else body.max_tokens
    if max_tokens is not None and max_tokens < (0 if echo else 1):
        raise APIError(400, f"max_tokens must be a positive integer{' (or 0 with echo)' if echo else ''}, "
                            f"got {max_tokens}", param="max_tokens")
    items = _prompt_items(body)
    n = check_n(body.n, len(items), MAX_CHOICES)
    if body.best_of is not None and body.best_of != n:
        raise APIError(400, f"best_of must be None or equal to n ({n}): every generated completion is returned",
                       param="best_of")
    params = sampling_params(body, max_tokens=ctx.max_model_len if max_tokens is None else max(1, max_tokens),
                             vocab_size=ctx.tokenize.vocab_size, logprobs=body.logprobs,
                             prompt_logprobs=body.logprobs if echo and body.logprobs is not None else None)
    prompts = _tokenized(items, body.add_special_tokens is not False, ctx)  # last: every count is checked
    return _Prepared(make_choices(prompts, params, n), n, echo, max_tokens == 0)


async def create_completion(body: CompletionRequest, request: Request, ctx: ServerContext) -> Response:
    prepared = await asyncio.to_thread(_prepare, body, ctx)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    started = await start_choices(ctx, request, request_id, prepared.choices, cache_salt=body.cache_salt,
                                  priority=body.priority or 0, n=prepared.n)
    if started is None:
        return Response(status_code=499)
    first, outputs = started
    responses = _Responses(body, ctx, prepared, request_id, int(time.time()))
    if not body.stream:
        finals = await cancel_on_disconnect(request, collect_finals(first, outputs))
        if finals is None:
            return Response(status_code=499)
        # a scored prompt has an entry per token: built in a worker thread
        return await asyncio.to_thread(responses.whole, finals)
    include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
    return stream_response(first, outputs, len(prepared.choices), responses.chunk,
                           closing=responses.closing if include_usage else None)


@dataclass
class _Responses:
    """A completion's response bodies: whole (``whole``) or streamed (``chunk``, then ``closing``)."""

    body: CompletionRequest
    ctx: ServerContext
    prepared: _Prepared
    request_id: str
    created: int
    sent_chars: dict[int, int] = field(default_factory=dict)
    """Per choice: characters of text sent (the logprobs' text offsets)."""

    def whole(self, finals: list[tuple[Choice, RequestOutput]]) -> JSONResponse:
        echo, prompt_only = self.prepared.echo, self.prepared.prompt_only
        body_choices = []
        for choice, output in finals:
            reason = finish_reason(output)
            head = self._prompt_text(choice.prompt) if echo else ""
            text = head + ("" if prompt_only else output.text)
            body_choices.append(self._choice(choice, output, text, reason, self._logprobs(choice, output, 0, echo, 0)))
        return JSONResponse(self._envelope(choices=body_choices, usage=self._usage(finals)))

    def chunk(self, choice: Choice, output: RequestOutput, start: int, starting: bool, reason: str | None
              ) -> dict[str, Any] | None:
        i = choice.index
        text, with_prompt = "", False
        if starting:  # the choice's first chunk carries the echoed prompt
            self.sent_chars[i] = 0
            if self.prepared.echo:
                text, with_prompt = self._prompt_text(choice.prompt), True
        if not self.prepared.prompt_only:
            text += output.new_text
        if not (text or reason or (self.body.logprobs is not None and len(output.token_ids) > start)):
            return None
        lp = self._logprobs(choice, output, start, with_prompt, self.sent_chars[i])
        self.sent_chars[i] += len(text)
        return self._envelope(choices=[self._choice(choice, output, text, reason, lp)])

    def closing(self, finals: list[tuple[Choice, RequestOutput]]) -> dict[str, Any]:
        return self._envelope(choices=[], usage=self._usage(finals))

    def _usage(self, finals: list[tuple[Choice, RequestOutput]]) -> dict[str, Any]:
        per_prompt = {c.prompt_index: o for c, o in reversed(finals)}
        return usage(per_prompt, [] if self.prepared.prompt_only else [o for _, o in finals])

    def _prompt_text(self, prompt: Prompt) -> str:
        if prompt.text is not None:
            return prompt.text
        return self.ctx.tokenizer.decode(prompt.token_ids[prompt.num_added:])

    def _logprobs(self, choice: Choice, output: RequestOutput, start: int, with_prompt: bool, offset: int
                  ) -> dict[str, Any] | None:
        if self.body.logprobs is None:
            return None
        entries: list[tuple[int, Any]] = []
        if with_prompt:
            skip = choice.prompt.num_added
            scores = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
            entries += list(zip(output.prompt_token_ids[skip:], scores[skip:]))
        if not self.prepared.prompt_only:
            entries += list(zip(output.token_ids[start:], (output.logprobs or [])[start:]))
        return completion_logprobs(entries, self.ctx.token_text, offset)

    def _choice(self, choice: Choice, output: RequestOutput, text: str, reason: str | None,
                lp: dict[str, Any] | None) -> dict[str, Any]:
        data: dict[str, Any] = {"index": choice.index, "text": text, "logprobs": lp, "finish_reason": reason}
        if self.body.return_token_ids:
            data |= {"prompt_token_ids": output.prompt_token_ids,
                     "token_ids": [] if self.prepared.prompt_only else output.token_ids}
        return data

    def _envelope(self, **fields: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.ctx.model_name, **fields}

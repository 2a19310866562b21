"""Pieces both endpoints share: sampling parameters from a body, finish reasons (or the error a
failed request answers), usage, log-probabilities in the completions and the chat formats, SSE."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterable
from typing import Any

from hybridkv.engine.config import RequestOutput, Tokenizer
from hybridkv.engine.sampling import SamplingParamError, SamplingParams, TokenLogprob
from hybridkv.server.errors import APIError
from hybridkv.server.protocol import SamplingFields

MIN_LOGPROB = -9999.0
"""Log-probabilities are clamped here (as vLLM does): JSON has no -Infinity."""
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def sampling_params(body: SamplingFields, *, max_tokens: int, vocab_size: int, logprobs: int | None = None,
                    prompt_logprobs: int | None = None, stop_token_ids: Iterable[int] = ()) -> SamplingParams:
    """The engine's ``SamplingParams`` for ``body``; ``APIError`` 400 naming the field for a bad value."""
    bias: dict[int, float] = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.strip().lstrip("-").isdigit():
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        token = int(key)
        if not 0 <= token < vocab_size:
            raise APIError(400, f"logit_bias: token id {token} is not in [0, {vocab_size})", param="logit_bias")
        bias[token] = value
    stop_ids = list(body.stop_token_ids or ())
    if any(not 0 <= t < vocab_size for t in stop_ids):
        raise APIError(400, f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed,
            stop=() if body.stop is None else (body.stop,) if isinstance(body.stop, str) else tuple(body.stop),
            stop_token_ids=(*stop_ids, *stop_token_ids),
            ignore_eos=bool(body.ignore_eos), presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            logit_bias=tuple(bias.items()), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
    except SamplingParamError as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


def check_n(n: int | None, num_prompts: int, limit: int) -> int:
    n = 1 if n is None else n
    if n < 1:
        raise APIError(400, f"n must be a positive integer, got {n}", param="n")
    if n * num_prompts > limit:
        raise APIError(400, f"{num_prompts} prompt(s) x n={n} = {n * num_prompts} completions; at most {limit} per "
                            f"request", param="n")
    return n


def finish_reason(output: RequestOutput) -> str:
    """The OpenAI finish reason; an output that ended any other way raises the ``APIError`` to answer."""
    reason = output.finish_reason or ""
    if reason in ("stop", "length"):
        return reason
    if reason == "max_model_len":
        return "length"
    if reason == "error":
        raise APIError(500, f"the request failed: {output.error}", type="server_error", code="engine_error")
    if reason.startswith("rejected"):
        raise APIError(400, f"the request was {reason}: ask for fewer tokens (max_tokens)", param="max_tokens",
                       code="request_too_large")
    raise APIError(503, "the request was aborted: the server is shutting down", type="server_error",
                   code="request_aborted")


def usage(prompts: dict[int, RequestOutput], outputs: Iterable[RequestOutput], num_added: int = 0) -> dict[str, Any]:
    """OpenAI usage: prompt tokens once per prompt (``prompts``: one output per prompt), completion tokens of all."""
    prompt = sum(len(o.prompt_token_ids) for o in prompts.values())
    completion = sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {
                "cached_tokens": sum(o.num_cached_tokens + o.num_external_tokens for o in prompts.values()),
                "external_tokens": sum(o.num_external_tokens for o in prompts.values())}}


class TokenText:
    """The text and bytes of single tokens (for log-probabilities), cached."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._text)
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)
        self.width = functools.lru_cache(maxsize=65536)(self._width)

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _width(self, token_id: int) -> int:
        """Characters the token adds to returned text: 0 for a special token (``<bos>``), which the
        echoed prompt and the generated text leave out; else its text's length."""
        return len(self.text(token_id)) if self.tokenizer.decode([token_id], skip_special_tokens=True) else 0

    def _bytes(self, token_id: int) -> list[int]:
        piece = getattr(self.tokenizer, "id_to_token", lambda _: None)(token_id)
        if isinstance(piece, str):
            byte = _BYTE_TOKEN.fullmatch(piece)
            if byte:
                return [int(byte.group(1), 16)]
            return list(piece.replace("\u2581", " ").encode("utf-8"))
        return list(self.text(token_id).encode("utf-8"))


def _lp(value: float) -> float:
    return max(value, MIN_LOGPROB)


def completion_logprobs(entries: list[tuple[int, TokenLogprob | None]], tokens: TokenText,
                        text_offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object of ``(token id, entry)`` pairs (entry None: no log-prob);
    ``text_offset`` indexes the returned text, which holds no special tokens."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, entry in entries:
        text = tokens.text(token_id)
        out["tokens"].append(text)
        out["text_offset"].append(text_offset)
        text_offset += tokens.width(token_id)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(_lp(entry.logprob))
        top = {tokens.text(t): _lp(lp) for t, lp in entry.top}
        top.setdefault(text, _lp(entry.logprob))  # the chosen token is always listed (as vLLM does)
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(entries: list[TokenLogprob], tokens: TokenText) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    return {"content": [
        {"token": tokens.text(e.token_id), "logprob": _lp(e.logprob), "bytes": tokens.bytes(e.token_id),
         "top_logprobs": [{"token": tokens.text(t), "logprob": _lp(lp), "bytes": tokens.bytes(t)} for t, lp in e.top]}
        for e in entries
    ], "refusal": None}


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"

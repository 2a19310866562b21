"""Request bodies of the OpenAI-compatible API: OpenAI's fields, the vLLM extensions hybridkv
implements, and the fields real clients send with their defaults (accepted, or refused with a
reason when they ask for something this server does not do).

Every string must be valid Unicode text (a lone surrogate such as ``"\\ud800"`` is refused), every
number finite; unknown fields are refused so a misspelt parameter never passes silently.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from hybridkv.engine.sampling import MAX_LOGPROBS


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text: {exc.reason} at character {exc.start}") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]

MAX_CHOICES = 64
"""Most completions one request may ask for (prompts x n)."""


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool | None = False
    """Send one more chunk, with ``usage`` and no choices, before ``[DONE]``."""
    continuous_usage_stats: bool | None = False
    """Accepted for vLLM clients; usage comes in the last chunk only."""


class SamplingFields(_Body):
    """Fields both endpoints share."""

    model: Text
    max_tokens: int | None = None
    """``None``: 16 for completions (OpenAI's default), up to ``max_model_len`` for chat."""
    temperature: float | None = None
    """``None``: 1.0. Below 1e-5: greedy."""
    top_p: float | None = None
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[Text, float] | None = None
    """Token id (as a string, as JSON object keys are) -> bias in [-100, 100]."""
    seed: int | None = None
    user: Text | None = None
    """Accepted and logged with nothing else: the end user's id, for the operator."""
    # vLLM extensions
    top_k: int | None = None
    """0 or -1: no top-k cut."""
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    # hybridkv extensions
    cache_salt: Text | None = None
    """Requests share prefix-cache blocks only with requests of the same salt (tenant isolation)."""
    priority: int | None = 0
    return_token_ids: bool | None = False
    """Add ``prompt_token_ids`` and ``token_ids`` to each choice."""


class CompletionRequest(SamplingFields):
    """The body of ``POST /v1/completions``."""

    prompt: Text | list[Text] | list[int] | list[list[int]]
    echo: bool | None = False
    """Return the prompt before the completion (and, with ``logprobs``, the prompt tokens' log-probabilities)."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Log-probabilities of each token plus this many most likely alternatives."""
    best_of: int | None = None
    """Only ``None`` or equal to ``n``: every generated completion is returned."""
    suffix: Text | None = None
    """Only ``None``: the model has no fill-in-the-middle mode."""
    add_special_tokens: bool | None = True
    """Put ``<bos>`` before a text prompt (and before a token-id prompt where the server adds it)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    role: Text
    content: Text | list[dict[str, Any]] | None = None
    """Text, or a list of ``{"type": "text", "text": ...}`` parts (joined)."""
    name: Text | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Text


class ChatCompletionRequest(SamplingFields):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = None
    """OpenAI's newer name for ``max_tokens`` (it wins when both are given)."""
    response_format: ResponseFormat | None = None
    """Only ``{"type": "text"}``."""
    tools: list[dict[str, Any]] | None = None
    """Only none: the model has no tool calling."""
    tool_choice: Text | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    metadata: dict[str, Text] | None = None
    service_tier: Text | None = None
    add_generation_prompt: bool | None = True
    """End the rendered conversation with the assistant's turn header (vLLM's field)."""


class TokenizeRequest(_Body):
    """The body of ``POST /tokenize`` (vLLM's endpoint; lm-eval's remote tokenizer uses it)."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    """A conversation, rendered by the chat template first (instead of ``prompt``)."""
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True


class DetokenizeRequest(_Body):
    """The body of ``POST /detokenize``."""

    model: Text | None = None
    tokens: list[int]

"""Request bodies of the OpenAI-compatible API: OpenAI's fields, the vLLM extensions hybridkv
implements, and the fields real clients send with their defaults (accepted, or refused with a
reason when they ask for something this server does not do).

Every string must be valid Unicode text (a lone surrogate such as ``"\\ud800"`` is refused), every
number finite; unknown fields are refused so a misspelt parameter never passes silently.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from hybridkv.engine.sampling import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_STOP_LENGTH, MAX_STOP_STRINGS, SEED_RANGE


def _utf8(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"not valid Unicode text: {exc.reason} at character {exc.start}") from None
    return value


Text = Annotated[str, AfterValidator(_utf8)]

MAX_CHOICES = 64
"""Most completions one request may ask for (prompts x n)."""
PromptText = Annotated[str, StringConstraints(min_length=1), AfterValidator(_utf8)]
StopText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_STOP_LENGTH), AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
TokenKey = Annotated[str, StringConstraints(pattern=r"^[0-9]{1,7}$")]
"""A token id as a JSON object key."""


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
    max_tokens: int | None = Field(None, ge=0)
    """Absent: 16 for completions (OpenAI's default); ``None``: up to ``max_model_len``. 0 only with ``echo``."""
    temperature: float | None = Field(None, ge=0)
    """``None``: 1.0. Below 1e-5: greedy."""
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_STOP_STRINGS)] | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    logit_bias: dict[TokenKey, Bias] | None = None
    """Token id (as a string, as JSON object keys are) -> bias in [-100, 100]."""
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    user: Text | None = None
    """Accepted (OpenAI clients send it) and not used."""
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1)
    """0 or -1: no top-k cut."""
    repetition_penalty: float | None = Field(None, gt=0, le=100)
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = False
    # hybridkv extensions
    cache_salt: Text | None = None
    """Requests share prefix-cache blocks only with requests of the same salt (tenant isolation)."""
    priority: int | None = 0
    return_token_ids: bool | None = False
    """Add ``prompt_token_ids`` and ``token_ids`` to each choice."""


class CompletionRequest(SamplingFields):
    """The body of ``POST /v1/completions``."""

    prompt: (PromptText | Annotated[list[PromptText], Field(min_length=1)]
             | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
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


class TextPart(_Body):
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    """``tool`` and ``function`` are refused with a reason: the model has no tool calling."""
    content: Text | list[TextPart] | None = None
    """Text, or a list of ``{"type": "text", "text": ...}`` parts (joined with newlines)."""
    name: Text | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Text


class ChatCompletionRequest(SamplingFields):
    """The body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
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

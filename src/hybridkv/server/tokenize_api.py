"""vLLM's tokenizer endpoints: ``POST /tokenize``, ``POST /detokenize``, ``GET /tokenizer_info``.

lm-eval's ``local-completions`` finds them and tokenizes through the server, so no Hugging Face
tokenizer (or hub access) is needed to evaluate the served model.
"""

from __future__ import annotations

from typing import Any

from hybridkv.errors import InvalidInputError
from hybridkv.server.chat import plain_messages
from hybridkv.server.context import ServerContext
from hybridkv.server.errors import APIError
from hybridkv.server.protocol import DetokenizeRequest, TokenizeRequest


def tokenize(body: TokenizeRequest, ctx: ServerContext) -> dict[str, Any]:
    """The ``/tokenize`` answer (blocking: run it in a worker thread)."""
    if body.model is not None:
        ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    try:
        if body.messages is not None:
            text = ctx.chat_template.render(plain_messages(body.messages), body.add_generation_prompt is not False)
            add_bos = False
        else:
            text, add_bos = body.prompt or "", body.add_special_tokens is not False
        if len(text) > ctx.tokenize.max_chars:
            raise InvalidInputError(f"the text has {len(text)} characters: more than max_model_len "
                                    f"({ctx.max_model_len}) tokens can hold")
    except InvalidInputError as exc:
        raise APIError(400, str(exc), param="messages" if body.messages is not None else "prompt") from exc
    tokens = ctx.tokenize.encode(text, add_bos)
    return {"count": len(tokens), "max_model_len": ctx.max_model_len, "tokens": tokens, "token_strs": None}


def detokenize(body: DetokenizeRequest, ctx: ServerContext) -> dict[str, Any]:
    """The ``/detokenize`` answer (blocking: run it in a worker thread)."""
    if body.model is not None:
        ctx.check_model(body.model)
    vocab = ctx.tokenize.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(400, f"tokens must be token ids in [0, {vocab})", param="tokens")
    if len(body.tokens) > ctx.tokenize.max_chars:
        raise APIError(400, f"at most {ctx.tokenize.max_chars} tokens", param="tokens")
    text = ctx.tokenizer.decode(body.tokens)
    return {"prompt": text}


def tokenizer_info(ctx: ServerContext) -> dict[str, Any]:
    tok = ctx.tokenizer
    names = {name: getattr(tok, "id_to_token", lambda _: None)(getattr(tok, f"{name}_token_id", -1))
             for name in ("bos", "eos", "pad", "unk")}
    return {"tokenizer_class": type(tok).__name__, "bos_token": names["bos"], "eos_token": names["eos"],
            "pad_token": names["pad"], "unk_token": names["unk"], "add_bos_token": True,
            "model_max_length": ctx.max_model_len, "chat_template": ctx.chat_template.source}

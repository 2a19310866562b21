"""Chat conversations to prompt text: the model's chat template (from the GGUF, or a file given
with ``--chat-template``), or Gemma's turn format for a model without one.

Gemma's format: ``<bos>`` then one ``<start_of_turn>{user|model}\\n{text}<end_of_turn>\\n`` per
turn; system messages are put at the start of the first user turn; the prompt ends with
``<start_of_turn>model\\n`` for the reply, which ends with ``<end_of_turn>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hybridkv.errors import InvalidInputError
from hybridkv.server.protocol import ChatMessage

GEMMA_TURNS = """\
{{- bos_token -}}
{%- set ns = namespace(system='', first=true) -%}
{%- for message in messages -%}
{%- if message['role'] == 'system' -%}
{%- set ns.system = ns.system + message['content'] | trim + '\\n\\n' -%}
{%- else -%}
{{- '<start_of_turn>' + ('model' if message['role'] == 'assistant' else 'user') + '\\n' -}}
{%- if ns.first -%}{{- ns.system -}}{%- set ns.first = false -%}{%- endif -%}
{{- message['content'] | trim + '<end_of_turn>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if ns.first and ns.system -%}
{{- '<start_of_turn>user\\n' + ns.system | trim + '<end_of_turn>\\n' -}}
{%- endif -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}
"""
"""Gemma 3's turn format for text conversations (the packaged GGUF has no chat template)."""

END_OF_TURN = "<end_of_turn>"
ROLES = ("system", "developer", "user", "assistant")


class TemplateError(InvalidInputError):
    """A conversation the template refuses (its ``raise_exception``) or cannot render."""


def _raise(message: str) -> None:
    raise TemplateError(message)


class ChatTemplate:
    """A Jinja chat template in Hugging Face's convention, rendered in a sandbox."""

    def __init__(self, source: str, *, bos_token: str, eos_token: str, origin: str) -> None:
        self.source = source
        self.origin = origin
        """Where the template comes from: ``gguf``, a file path, or ``gemma turns (built in)``."""
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise InvalidInputError(f"chat template {origin}: {exc}") from exc
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def choose(cls, override: Path | None, from_model: str | None, *, bos_token: str, eos_token: str
               ) -> ChatTemplate:
        """``override`` (a file) if given, else the model's own template, else Gemma's turn format."""
        if override is not None:
            try:
                source = override.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise InvalidInputError(f"cannot read --chat-template {override}: {exc}") from None
            return cls(source, bos_token=bos_token, eos_token=eos_token, origin=str(override))
        if from_model:
            return cls(from_model, bos_token=bos_token, eos_token=eos_token, origin="the GGUF metadata")
        return cls(GEMMA_TURNS, bos_token=bos_token, eos_token=eos_token, origin="Gemma turns (built in)")

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of ``messages`` (``role``/``content`` dicts); ``TemplateError`` if refused."""
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:
            raise TemplateError(f"the chat template ({self.origin}) cannot render these messages: {exc}") from exc


def plain_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """``role``/``content`` dicts with text content; ``InvalidInputError`` for what a text model cannot take."""
    if not messages:
        raise InvalidInputError("messages is empty: give at least one message")
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise InvalidInputError(f"messages[{i}].role {m.role!r} is not supported: use one of {', '.join(ROLES)} "
                                    f"(this model has no tool calling)")
        extra = {k: v for k, v in (m.model_extra or {}).items() if v not in (None, [], "")}
        if extra:
            raise InvalidInputError(f"messages[{i}] has fields this server does not support: {', '.join(extra)}")
        content = m.content if not isinstance(m.content, list) else "\n".join(part.text for part in m.content)
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
    return out

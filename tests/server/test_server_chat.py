"""Chat templates: Gemma's turn format when the model has none, the GGUF's own when it has one,
a ``--chat-template`` file over both, and clear errors for what cannot be rendered."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("jinja2")
pytest.importorskip("fastapi")

from hybridkv.errors import InvalidInputError
from hybridkv.server.chat import ChatTemplate, TemplateError, plain_messages
from hybridkv.server.protocol import ChatMessage

TOKENS = {"bos_token": "<bos>", "eos_token": "<eos>"}


def gemma(override: Path | None = None, from_model: str | None = None) -> ChatTemplate:
    return ChatTemplate.choose(override, from_model, **TOKENS)


def test_gemma_turns_put_the_system_message_in_the_first_user_turn() -> None:
    text = gemma().render([{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " Hi "},
                           {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    assert gemma().render([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nHi<end_of_turn>\n")
    assert gemma().render([{"role": "system", "content": "Only this."}]) == (
        "<bos><start_of_turn>user\nOnly this.<end_of_turn>\n<start_of_turn>model\n")
    assert gemma().origin == "Gemma turns (built in)"


def test_the_models_template_wins_over_gemma_turns_and_a_file_wins_over_both(tmp_path: Path) -> None:
    model = gemma(from_model="{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    assert model.render([{"role": "user", "content": "x"}]) == "[user]x" and model.origin == "the GGUF metadata"
    path = tmp_path / "t.jinja"
    path.write_text("{{ bos_token }}{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
                    "{% if add_generation_prompt %}>>{% endif %}")
    override = gemma(path, from_model="ignored")
    assert override.render([{"role": "user", "content": "x"}]) == "<bos><x>>>" and override.origin == str(path)


def test_templates_that_fail_give_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="cannot read --chat-template"):
        gemma(tmp_path / "missing.jinja")
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    with pytest.raises(InvalidInputError, match=r"chat template .*bad\.jinja"):
        gemma(tmp_path / "bad.jinja")
    strict = gemma(from_model="{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}")
    with pytest.raises(TemplateError, match="user first"):
        strict.render([{"role": "assistant", "content": "x"}])
    sandboxed = gemma(from_model="{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateError, match="cannot render"):
        sandboxed.render([{"role": "user", "content": "x"}])


def test_messages_become_text_with_roles_a_text_model_takes() -> None:
    messages = [ChatMessage(role="developer", content="Rules."),
                ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]),
                ChatMessage(role="assistant", content=None)]
    assert plain_messages(messages) == [{"role": "system", "content": "Rules."}, {"role": "user", "content": "a\nb"},
                                        {"role": "assistant", "content": ""}]
    with pytest.raises(InvalidInputError, match="'tool' is not supported"):
        plain_messages([ChatMessage(role="tool", content="42")])
    with pytest.raises(InvalidInputError, match="tool_calls"):
        plain_messages([ChatMessage.model_validate({"role": "assistant", "tool_calls": [{"id": "1"}]})])

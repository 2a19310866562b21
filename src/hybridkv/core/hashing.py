"""Chained, content-addressed block hashes.

Each block's hash covers the whole prefix up to its end; the cache salt and the adapter id enter
the first block. ``sha256`` by default; ``xxh3_128`` is faster but not cryptographic.
See docs/ARCHITECTURE.md, "Block hashes".
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import Literal

from hybridkv.errors import InvalidInputError

HashAlgorithm = Literal["sha256", "xxh3_128"]
HASH_ALGORITHMS: tuple[HashAlgorithm, ...] = ("sha256", "xxh3_128")

_EMPTY_EXTRA = b"\x00\x00\x00\x00"


def _digest_fn(algorithm: str) -> Callable[[bytes], bytes]:
    if algorithm == "sha256":
        sha256 = hashlib.sha256

        def digest(data: bytes) -> bytes:
            return sha256(data).digest()

        return digest
    if algorithm == "xxh3_128":
        try:
            import xxhash
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise InvalidInputError(
                "hash algorithm 'xxh3_128' needs the xxhash package: pip install 'hybridkv[xxhash]'"
            ) from exc
        return xxhash.xxh3_128_digest
    raise InvalidInputError(
        f"unknown hash algorithm {algorithm!r}; choose one of {', '.join(HASH_ALGORITHMS)}"
    )


def encode_extra_keys(cache_salt: str | bytes | None, adapter_id: str | int | None) -> bytes:
    """Length-prefixed, unambiguous encoding of the first block's extra keys."""
    parts: list[bytes] = []
    for tag, value in ((b"s", cache_salt), (b"a", adapter_id)):
        if value is None:
            continue
        if isinstance(value, bytes):
            raw = value
        elif isinstance(value, (str, int)) and not isinstance(value, bool):
            raw = str(value).encode()
        else:
            raise InvalidInputError(f"extra key {tag.decode()!r} must be str, bytes or int, got {type(value).__name__}")
        parts.append(tag + len(raw).to_bytes(4, "little") + raw)
    body = b"".join(parts)
    return len(body).to_bytes(4, "little") + body


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian unsigned 64-bit integers (raises on non-integers)."""
    return array("Q", token_ids).tobytes()


class BlockHasher:
    """Computes chained block hashes with one algorithm.

    Deterministic across processes and machines: nothing depends on ``PYTHONHASHSEED``.
    """

    __slots__ = ("algorithm", "_digest", "none_hash")

    def __init__(self, algorithm: HashAlgorithm = "sha256") -> None:
        self.algorithm = algorithm
        self._digest = _digest_fn(algorithm)
        # The parent of every first block: a constant, so chains are comparable across processes.
        self.none_hash: bytes = self._digest(b"hybridkv/v1/none/" + algorithm.encode())

    @property
    def cryptographic(self) -> bool:
        """False for the opt-in non-cryptographic hash."""
        return self.algorithm == "sha256"

    def hash_block(self, parent: bytes, token_ids: Sequence[int], extra: bytes = _EMPTY_EXTRA) -> bytes:
        """Hash of one block given its parent's hash, its tokens and its encoded extra keys."""
        return self._digest(parent + extra + token_bytes(token_ids))

    def hash_full_blocks(
        self,
        token_ids: Sequence[int],
        block_size: int,
        existing: list[bytes],
        first_extra: bytes,
    ) -> None:
        """Append to ``existing`` the hashes of the full blocks of ``token_ids`` it lacks."""
        start = len(existing)
        end = len(token_ids) // block_size
        if start >= end:
            return
        raw = array("Q", token_ids[start * block_size : end * block_size]).tobytes()
        step = block_size * 8
        pos = 0
        parent = existing[-1] if existing else self.none_hash
        if start == 0:  # the first block carries the salt and adapter id
            parent = self._digest(parent + first_extra + raw[:step])
            existing.append(parent)
            pos = step
        if self.algorithm == "sha256":
            # The hot loop inlined: one sha256 per block over parent || no extra keys || tokens.
            sha256 = hashlib.sha256
            append = existing.append
            for off in range(pos, len(raw), step):
                parent = sha256(parent + _EMPTY_EXTRA + raw[off : off + step]).digest()
                append(parent)
            return
        digest = self._digest
        for off in range(pos, len(raw), step):
            parent = digest(parent + _EMPTY_EXTRA + raw[off : off + step])
            existing.append(parent)

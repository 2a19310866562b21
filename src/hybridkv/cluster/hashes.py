"""The block-hash schemes of the engines an index follows, computed from token ids.

``HybridkvHashes`` (the core's chained hashes) and ``VllmHashes`` (vLLM's ``hash_block_tokens``,
sha256 over pickle or xxhash); ``check_block`` tells a scheme that does not match a replica.
See docs/CLUSTER.md, "Hash schemes".
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from typing import Any, Protocol

from hybridkv.core import BlockHasher, HashAlgorithm, Sequence
from hybridkv.errors import InvalidInputError

VLLM_DEFAULT_SEED = "vllm-none-hash"


class HashScheme(Protocol):
    """How one engine hashes blocks."""

    name: str
    """A short label, unique per distinct scheme (replicas with equal names share request hashes)."""

    def chain(self, token_ids: SequenceABC[int], block_size: int, cache_salt: str | None) -> list[bytes]:
        """The hashes of every full ``block_size``-token block of ``token_ids``, chained."""
        ...

    def check_block(self, parent: bytes | None, token_ids: SequenceABC[int]) -> bytes | None:
        """The hash of one block after ``parent`` (None: the first block, no salt), or None when this
        scheme cannot recompute it from these inputs."""
        ...


class HybridkvHashes:
    """The core's block hashes (``sha256`` by default)."""

    def __init__(self, algorithm: HashAlgorithm = "sha256") -> None:
        self.hasher = BlockHasher(algorithm)
        self.name = f"hybridkv-{algorithm}"

    def chain(self, token_ids: SequenceABC[int], block_size: int, cache_salt: str | None) -> list[bytes]:
        return list(Sequence("index", token_ids, cache_salt=cache_salt).block_hashes(self.hasher, block_size))

    def check_block(self, parent: bytes | None, token_ids: SequenceABC[int]) -> bytes | None:
        # A first block's extra keys (the salt) are not in the event: only later blocks can be checked.
        return None if parent is None else self.hasher.hash_block(parent, token_ids)


def _vllm_sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


class VllmHashes:
    """vLLM's prefix-cache block hashes (``--prefix-caching-hash-algo sha256`` or ``xxhash``)."""

    def __init__(self, algorithm: str = "sha256", seed: str | None = None) -> None:
        if algorithm == "sha256":
            digest: Callable[[Any], bytes] = _vllm_sha256
        elif algorithm == "xxhash":
            if seed is None:
                raise InvalidInputError(
                    "vLLM's xxhash block hashes start from a random seed unless PYTHONHASHSEED is set: "
                    "pass that value as the seed"
                )
            try:
                import xxhash
            except ImportError as exc:  # pragma: no cover - depends on the environment
                raise InvalidInputError("vLLM's xxhash scheme needs the xxhash package") from exc
            xxh = xxhash.xxh3_128_digest

            def digest(obj: Any) -> bytes:
                return bytes(xxh(pickle.dumps(obj, protocol=5)))
        else:
            raise InvalidInputError(
                f"unsupported vLLM hash algorithm {algorithm!r}: choose sha256 or xxhash "
                f"(the cbor variants are not mirrored)"
            )
        self.algorithm = algorithm
        self.seed = VLLM_DEFAULT_SEED if seed is None else seed
        self._digest = digest
        self.none_hash = digest(self.seed)
        self.name = f"vllm-{algorithm}-{self.seed}"

    def chain(self, token_ids: SequenceABC[int], block_size: int, cache_salt: str | None) -> list[bytes]:
        digest = self._digest
        tokens = tuple(token_ids)
        out: list[bytes] = []
        parent = self.none_hash
        extra: tuple[Any, ...] | None = (("cache_salt", cache_salt),) if cache_salt else None
        for start in range(0, len(tokens) - block_size + 1, block_size):
            parent = digest((parent, tokens[start : start + block_size], extra))
            out.append(parent)
            extra = None
        return out

    def check_block(self, parent: bytes | None, token_ids: SequenceABC[int]) -> bytes | None:
        return self._digest((self.none_hash if parent is None else parent, tuple(token_ids), None))


def scheme_named(spec: str) -> HashScheme:
    """A scheme from its command-line spelling: ``vllm`` (sha256, vLLM's default seed),
    ``vllm:xxhash:SEED``, ``vllm:sha256:SEED``, ``hybridkv`` or ``hybridkv:xxh3_128``."""
    parts = spec.split(":")
    if parts[0] == "vllm" and len(parts) <= 3:
        return VllmHashes(parts[1] if len(parts) > 1 else "sha256", parts[2] if len(parts) > 2 else None)
    if parts[0] == "hybridkv" and len(parts) <= 2:
        algorithm = parts[1] if len(parts) > 1 else "sha256"
        if algorithm not in ("sha256", "xxh3_128"):
            raise InvalidInputError(f"hash scheme {spec!r}: hybridkv hashes are sha256 or xxh3_128")
        return HybridkvHashes(algorithm)  # type: ignore[arg-type]
    raise InvalidInputError(
        f"unknown hash scheme {spec!r}: use vllm, vllm:ALGORITHM[:SEED], hybridkv or hybridkv:ALGORITHM"
    )

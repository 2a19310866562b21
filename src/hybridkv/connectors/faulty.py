"""A tier wrapper that injects faults, for tests: deterministic per key, by a map or a rate."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Literal

from hybridkv.connectors.base import Change, KVTier, TierError, TierTimeout

Fault = Literal["error", "timeout", "short", "corrupt", "lose"]
FAULTS: tuple[Fault, ...] = ("error", "timeout", "short", "corrupt", "lose")


class FaultyTier(KVTier):
    """Wraps ``inner``; a read of a faulty key misbehaves.

    ``error`` / ``timeout`` fail the whole ``get_many`` call, ``short`` truncates the value,
    ``corrupt`` flips its last byte, ``lose`` returns None although ``exists_many`` said yes
    (an entry lost between lookup and load). A key's fault is ``faults[key]`` if listed, else,
    with probability ``rate``, one of ``kinds`` chosen by a digest of ``seed`` and the key.
    """

    def __init__(self, inner: KVTier, faults: Mapping[bytes, Fault] | None = None, *, rate: float = 0.0,
                 kinds: Sequence[Fault] = FAULTS, seed: int = 0) -> None:
        super().__init__()
        self.inner = inner
        self.name = f"faulty({inner.name})"
        self.shared = inner.shared
        self.priorities = inner.priorities
        self.medium = inner.medium
        self.stats = inner.stats
        self.faults = dict(faults or {})
        self.rate = rate
        self.kinds = tuple(kinds)
        self.seed = seed

    def fault_for(self, key: bytes) -> Fault | None:
        """The fault a read of ``key`` injects, if any."""
        if key in self.faults:
            return self.faults[key]
        if not self.rate or not self.kinds:
            return None
        d = hashlib.sha256(self.seed.to_bytes(8, "little", signed=True) + key).digest()
        if int.from_bytes(d[:8], "little") >= self.rate * 2**64:
            return None
        return self.kinds[d[8] % len(self.kinds)]

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        return self.inner.exists_many(keys)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        faults = [self.fault_for(k) for k in keys]
        if "timeout" in faults:
            raise TierTimeout("injected timeout")
        if "error" in faults:
            raise TierError("injected error")
        out: list[bytes | None] = []
        for fault, value in zip(faults, self.inner.get_many(keys)):
            if value is not None and fault == "short":
                value = value[: len(value) // 2]
            elif value is not None and fault == "corrupt":
                value = value[:-1] + bytes([value[-1] ^ 0xFF])
            elif fault == "lose":
                value = None
            out.append(value)
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]], low: bool = False) -> None:
        self.inner.put_many(items, low)

    def delete(self, key: bytes) -> None:
        self.inner.delete(key)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        self.inner.touch_many(keys)

    def prioritize_many(self, keys: Sequence[bytes]) -> None:
        self.inner.prioritize_many(keys)

    def record_changes(self, on: bool = True) -> None:
        self.inner.record_changes(on)

    def take_changes(self) -> list[Change]:
        return self.inner.take_changes()

"""The tier interface: a byte store keyed by tier keys, with faults raised as ``TierError``.

Also what a store offers a tier (``BlockOffer``, ``KVTier.offer``) and the fault guard the
connector lends a tier operation (``Guard``): how tiers are used is in docs/TIERS.md.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Literal, Protocol, TypeVar

Change = tuple[bool, bytes]
"""``(entered, key)``: the tier began (True) or stopped (False) holding ``key``."""

_T = TypeVar("_T")
_A = TypeVar("_A")


class Failed(enum.Enum):
    """The answer of a ``Guard``ed call that raised (the fault is counted)."""

    FAILED = 0


FAILED = Failed.FAILED


class Guard(Protocol):
    """``guard(method, arg)``: ``method(arg)``, or ``FAILED`` once the fault it raised is counted."""

    def __call__(self, method: Callable[[_A], _T], arg: _A, /) -> _T | Literal[Failed.FAILED]: ...


@dataclass(slots=True)
class BlockOffer:
    """Blocks a store offers at one priority, in order: what ``KVTier.offer`` takes.

    ``runs``: ``(group, count)`` pairs, the keys' groups in order (``count`` keys of ``group``, then
    the next run). ``value(i)`` is what to store under ``keys[i]`` (the codec's encoding of the
    block's payload), built on first use and shared by the tiers."""

    keys: list[bytes]
    runs: list[tuple[int, int]]
    low: bool
    value: Callable[[int], bytes]


class TierError(Exception):
    """A tier could not answer (connection lost, I/O error). The connector counts it as a miss."""


class TierTimeout(TierError):
    """A tier did not answer in time."""


@dataclass
class TierStats:
    """Counters of one tier since it was built."""

    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    corrupt: int = 0
    """Entries the tier's own check rejected (and dropped)."""
    bytes_read: int = 0
    bytes_written: int = 0
    low_puts: int = 0
    """Entries stored at low priority (``put_many(low=True)``)."""
    low_evictions: int = 0
    """Low-priority entries evicted (also counted in ``evictions``)."""
    low_skipped: int = 0
    """Low-priority puts dropped: they would have evicted a normal entry."""
    low_promotions: int = 0
    """Low-priority entries that served a read (or were stored again at normal priority): now normal."""


class KVTier(ABC):
    """One external store of framed KV blocks.

    Methods raise ``TierError`` (or ``TierTimeout``) on faults and never return partial answers:
    a result lists one entry per key, ``None`` for a key the tier does not hold. A tier may be called
    from two threads at once (a background load beside the engine's stores): it guards its own state.
    """

    name: str = "tier"
    shared: bool = False
    """True when other instances read the tier: then only a cryptographic block hash is safe."""
    priorities: bool = False
    """True when the tier keeps low-priority entries (``put_many(low=True)``): it evicts them before any
    other entry, least recently used first, never evicts a normal entry to make room for one, and makes
    one that serves a read (``get_many``) or is marked (``prioritize_many``) normal. A tier without
    priorities stores a low put as a normal one; the connector offers it none (``connectors.storage``)."""
    medium: str | None = None
    """The storage medium its KV events name, in vLLM's strings (``CPU``: host memory, ``STORAGE``: a
    disk), for a tier that can log which keys enter and leave it (``record_changes``); None: no events."""
    _changes: deque[Change] | None = None

    def __init__(self) -> None:
        self.stats = TierStats()

    @abstractmethod
    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the tier holds each key (cheap: no payload is read)."""

    @abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The stored value of each key, or None."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, bytes]], low: bool = False) -> None:
        """Store ``(key, value)`` pairs, evicting older entries to stay within the budget; ``low``: at low
        priority (see ``priorities``; a key the tier holds at normal priority stays normal)."""

    @abstractmethod
    def delete(self, key: bytes) -> None:
        """Forget ``key`` (no error if absent)."""

    def offer(self, offer: BlockOffer, batch: int, guard: Guard) -> tuple[list[bytes], int]:
        """Store what the tier lacks of ``offer``, ``batch`` keys at a time: ``exists_many``; the absent
        keys' values (``offer.value``) in one ``put_many`` (``low``: at low priority); for a normal
        offer, the present ones made normal (``prioritize_many``). Every call goes through ``guard``:
        a fault skips that step of that batch. Returns the keys put and their values' bytes."""
        put: list[bytes] = []
        nbytes = 0
        keys, low, value = offer.keys, offer.low, offer.value
        for lo in range(0, len(keys), batch):
            part = keys[lo : lo + batch]
            present = guard(self.exists_many, part)
            if present is FAILED:
                continue
            items = [(k, value(lo + j)) for j, (k, there) in enumerate(zip(part, present)) if not there]
            if items and guard(partial(self.put_many, low=low), items) is not FAILED:
                put += [k for k, _ in items]
                nbytes += sum(len(v) for _, v in items)
            if not low and self.priorities and len(items) < len(part):
                guard(self.prioritize_many, [k for k, there in zip(part, present) if there])
        return put, nbytes

    def touch_many(self, keys: Sequence[bytes]) -> None:
        """Mark ``keys`` recently used, the last one most recently (absent keys are skipped). A tier that
        keeps no eviction order of its own (Redis evicts by its own policy) ignores it."""
        return None

    def prioritize_many(self, keys: Sequence[bytes]) -> None:
        """Make the low-priority entries among ``keys`` normal (others are left as they are). A tier
        without priorities ignores it."""
        return None

    def takes_low_puts(self, min_bytes: int) -> bool:
        """Whether a low-priority put of a value of at least ``min_bytes`` bytes could be stored now.
        False only when every one would be skipped (a tier full of normal entries, none low to
        evict), so the connector need not choose or build them; True when in doubt. Default:
        ``priorities`` (a tier without priorities is offered no low puts)."""
        return self.priorities

    def record_changes(self, on: bool = True) -> None:
        """Start (``on``) or stop logging which keys enter and leave the tier, for ``take_changes``. Off
        by default (nothing is kept); a tier without a ``medium`` cannot tell and ignores it."""
        return None

    def take_changes(self) -> list[Change]:
        """The keys that entered or left the tier since the last call, in order: a key is reported once
        when it becomes held (stored) and once when it stops being held (evicted, deleted, found corrupt
        or gone), never twice in a row the same way. Empty unless recording. Safe beside another thread
        that stores or loads."""
        log = self._changes
        if not log:
            return []
        return [log.popleft() for _ in range(len(log))]

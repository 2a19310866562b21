"""An in-process tier: an LRU dictionary with a byte budget, low-priority entries evicted first."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Sequence

from hybridkv.connectors.base import KVTier
from hybridkv.errors import InvalidInputError


class HostTier(KVTier):
    """Host memory of this process: low-priority entries evicted first, then normal ones, least
    recently used first within each (``KVTier.priorities``). Thread-safe (a background load may read
    while the engine stores). Its KV events name the medium ``CPU``, as vLLM's CPU offloading does."""

    name = "host"
    priorities = True
    medium = "CPU"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise InvalidInputError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()  # least recently used first
        self._low: OrderedDict[bytes, bytes] = OrderedDict()  # low priority, least recently used first
        self._lock = threading.Lock()

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._entries or k in self._low for k in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for k in keys:
                value = self._entries.get(k)
                if value is None and k in self._low:  # served a hit: promoted to normal
                    value = self._entries[k] = self._low.pop(k)
                    self.stats.low_promotions += 1
                if value is None:
                    self.stats.misses += 1
                else:
                    self._entries.move_to_end(k)
                    self.stats.hits += 1
                    self.stats.bytes_read += len(value)
                out.append(value)
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]], low: bool = False) -> None:
        with self._lock:
            log = self._changes
            for key, value in items:
                if len(value) > self.capacity_bytes:
                    continue  # would evict everything and still not fit
                as_low = low and key not in self._entries  # a normal entry stays normal
                had = self._delete(key)
                if not self._make_room(len(value), as_low):
                    self.stats.low_skipped += 1
                    if had and log is not None:
                        log.append((False, key))
                    continue
                (self._low if as_low else self._entries)[key] = value
                self.used_bytes += len(value)
                self.stats.puts += 1
                self.stats.bytes_written += len(value)
                self.stats.low_puts += as_low
                if not had and log is not None:
                    log.append((True, key))

    def takes_low_puts(self, min_bytes: int) -> bool:
        with self._lock:  # a low put evicts only low entries: with none, it needs free room
            return bool(self._low) or self.used_bytes + min_bytes <= self.capacity_bytes

    def _make_room(self, size: int, low: bool) -> bool:
        """Evict low entries, then (for a normal put) normal ones, until ``size`` more bytes fit."""
        while self.used_bytes + size > self.capacity_bytes:
            if self._low:
                key, old = self._low.popitem(last=False)
                self.stats.low_evictions += 1
            elif low:
                return False
            else:
                key, old = self._entries.popitem(last=False)
            self.used_bytes -= len(old)
            self.stats.evictions += 1
            if self._changes is not None:
                self._changes.append((False, key))
        return True

    def touch_many(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                for entries in (self._entries, self._low):
                    if k in entries:
                        entries.move_to_end(k)

    def prioritize_many(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                if k in self._low:
                    self._entries[k] = self._low.pop(k)
                    self.stats.low_promotions += 1

    def delete(self, key: bytes) -> None:
        with self._lock:
            if self._delete(key) and self._changes is not None:
                self._changes.append((False, key))

    def _delete(self, key: bytes) -> bool:
        """Drop ``key`` without logging it; whether it was held."""
        old = self._entries.pop(key, None)
        if old is None:
            old = self._low.pop(key, None)
        if old is None:
            return False
        self.used_bytes -= len(old)
        return True

    def record_changes(self, on: bool = True) -> None:
        with self._lock:
            if not on:
                self._changes = None
            elif self._changes is None:
                self._changes = deque()

    def low_priority_entries(self) -> int:
        """How many entries the tier holds at low priority."""
        with self._lock:
            return len(self._low)

    def __len__(self) -> int:
        return len(self._entries) + len(self._low)

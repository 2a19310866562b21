"""An in-process tier: an LRU dictionary with a byte budget."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from hybridkv.connectors.base import KVTier
from hybridkv.errors import InvalidInputError


class HostTier(KVTier):
    """Host memory of this process, least recently used entry evicted first. Thread-safe (a background
    load may read while the engine stores)."""

    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise InvalidInputError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for k in keys:
                value = self._entries.get(k)
                if value is None:
                    self.stats.misses += 1
                else:
                    self._entries.move_to_end(k)
                    self.stats.hits += 1
                    self.stats.bytes_read += len(value)
                out.append(value)
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        with self._lock:
            for key, value in items:
                if len(value) > self.capacity_bytes:
                    continue  # would evict everything and still not fit
                self._delete(key)
                while self.used_bytes + len(value) > self.capacity_bytes:
                    _, old = self._entries.popitem(last=False)
                    self.used_bytes -= len(old)
                    self.stats.evictions += 1
                self._entries[key] = value
                self.used_bytes += len(value)
                self.stats.puts += 1
                self.stats.bytes_written += len(value)

    def touch_many(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            entries = self._entries
            for k in keys:
                if k in entries:
                    entries.move_to_end(k)

    def delete(self, key: bytes) -> None:
        with self._lock:
            self._delete(key)

    def _delete(self, key: bytes) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_bytes -= len(old)

    def __len__(self) -> int:
        return len(self._entries)

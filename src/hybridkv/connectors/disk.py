"""A tier in a directory: one file per entry, LRU by modification time, survives restarts.

A file is ``b"HKVD" | crc32 u32 | length u64 | value``. Writes go to a temporary file renamed
into place (``os.replace``), so a reader sees a whole entry or none; leftover temporary files
are never served. Reads verify length and crc32 and delete a file that fails. A read bumps the
file's modification time, which orders eviction, also across restarts.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import uuid
import zlib
from collections import OrderedDict
from collections.abc import Sequence

from hybridkv.connectors.base import KVTier, TierError
from hybridkv.errors import InvalidInputError

_MAGIC = b"HKVD"
_HEADER = struct.Struct("<4sIQ")
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"


class DiskTier(KVTier):
    """Entries as files under ``path`` within ``capacity_bytes`` (headers included).

    ``shared=True`` marks a directory other instances use too: existence is then checked on disk
    (another process may have written the entry), leftover temporary files are left alone, and
    the budget is enforced per process (each process evicts what it knows of).
    """

    name = "disk"

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, *, shared: bool = False,
                 fsync: bool = False) -> None:
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise InvalidInputError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        self.path = os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.shared = shared
        self.fsync = fsync
        self.used_bytes = 0
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recently used first
        try:
            os.makedirs(self.path, exist_ok=True)
            found: list[tuple[float, str, int]] = []
            with os.scandir(self.path) as it:
                for entry in it:
                    if entry.name.endswith(_SUFFIX):
                        st = entry.stat()
                        found.append((st.st_mtime, entry.name, st.st_size))
                    elif entry.name.endswith(_TMP_SUFFIX) and not shared:
                        os.remove(entry.path)  # a write that never completed
        except OSError as exc:
            raise InvalidInputError(f"cannot use {self.path!r} as a disk tier: {exc}") from exc
        for _, name, size in sorted(found):
            self._index[name] = size
            self.used_bytes += size
        self._evict(0)

    def _name(self, key: bytes) -> str:
        return hashlib.sha256(key).hexdigest() + _SUFFIX

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        names = [self._name(k) for k in keys]
        if self.shared:
            return [os.path.exists(os.path.join(self.path, n)) for n in names]
        return [n in self._index for n in names]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self._get(self._name(k)) for k in keys]

    def _get(self, name: str) -> bytes | None:
        file = os.path.join(self.path, name)
        try:
            with open(file, "rb") as f:
                data = f.read()
            os.utime(file)
        except FileNotFoundError:
            self._forget(name)
            self.stats.misses += 1
            return None
        except OSError as exc:
            raise TierError(f"disk tier {self.path!r}: {exc}") from exc
        value = self._verified(data)
        if value is None:
            self.stats.corrupt += 1
            self._remove(name)
            return None
        self._index[name] = len(data)
        self._index.move_to_end(name)
        self.stats.hits += 1
        self.stats.bytes_read += len(data)
        return value

    @staticmethod
    def _verified(data: bytes) -> bytes | None:
        if len(data) < _HEADER.size:
            return None
        magic, crc, length = _HEADER.unpack_from(data)
        value = data[_HEADER.size :]
        if magic != _MAGIC or length != len(value) or zlib.crc32(value) != crc:
            return None
        return value

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> None:
        for key, value in items:
            data = _HEADER.pack(_MAGIC, zlib.crc32(value), len(value)) + value
            if len(data) > self.capacity_bytes:
                continue
            name = self._name(key)
            self._forget(name)
            self._evict(len(data))
            final = os.path.join(self.path, name)
            tmp = f"{final}.{os.getpid()}.{uuid.uuid4().hex}{_TMP_SUFFIX}"
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, final)
            except OSError as exc:
                self._remove_quietly(tmp)
                raise TierError(f"disk tier {self.path!r}: {exc}") from exc
            self._index[name] = len(data)
            self.used_bytes += len(data)
            self.stats.puts += 1
            self.stats.bytes_written += len(data)

    def delete(self, key: bytes) -> None:
        self._remove(self._name(key))

    def _evict(self, incoming: int) -> None:
        """Remove least recently used files until ``incoming`` more bytes fit."""
        while self._index and self.used_bytes + incoming > self.capacity_bytes:
            name = next(iter(self._index))
            self._remove(name)
            self.stats.evictions += 1

    def _forget(self, name: str) -> None:
        size = self._index.pop(name, None)
        if size is not None:
            self.used_bytes -= size

    def _remove(self, name: str) -> None:
        self._forget(name)
        self._remove_quietly(os.path.join(self.path, name))

    @staticmethod
    def _remove_quietly(file: str) -> None:
        with contextlib.suppress(OSError):  # already gone (another process, or never written)
            os.remove(file)

    def __len__(self) -> int:
        return len(self._index)

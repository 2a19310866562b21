"""A tier in a directory: one file per entry, LRU by modification time, survives restarts.

Atomic writes (temporary file renamed into place), a crc32 checked on read, low-priority entries
aged ``LOW_AGE_S`` into the past, and an untrusted environment (read-only or full filesystems,
other processes sharing the directory). The file layout and the rules: docs/TIERS.md, "The disk
tier's layout".
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import re
import socket
import struct
import threading
import time
import uuid
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

from hybridkv.connectors.base import KVTier, TierError
from hybridkv.errors import InvalidInputError

_MAGIC = b"HKVD"
_HEADER = struct.Struct("<4sIQ")
_SUFFIX = ".kv"
_TMP_SUFFIX = ".tmp"
_FULL = (errno.ENOSPC, errno.EDQUOT)
STALE_TEMP_S = 3600.0
"""A temporary file this old is abandoned whoever wrote it (a write takes milliseconds)."""
LOW_AGE_S = float(2**30)
"""How far in the past a low-priority entry's modification time is set (about 34 years); an entry
older than half of it is low priority."""


_T = TypeVar("_T")
_P = ParamSpec("_P")


def _locked(method: Callable[_P, _T]) -> Callable[_P, _T]:
    """Run a tier method under the tier's lock (a background load may read while the engine stores)."""

    @functools.wraps(method)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        with args[0]._lock:  # type: ignore[attr-defined]
            return method(*args, **kwargs)

    return run


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:40] or "host"


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return pid > 0  # another user's process (or an absurd number: not ours to judge)
    return True


class DiskTier(KVTier):
    """Entries as files under ``path`` within ``capacity_bytes`` (headers included). Thread-safe.

    ``shared=True`` marks a directory other instances use too: existence is then checked on disk
    (another process may have written the entry). In either mode the budget is the directory's:
    every re-sync counts every entry on disk, whoever wrote it, and eviction removes the least
    recently used of them.
    """

    name = "disk"
    priorities = True
    medium = "STORAGE"

    def __init__(self, path: str | os.PathLike[str], capacity_bytes: int, *, shared: bool = False,
                 fsync: bool = False, resync_interval_s: float = 10.0) -> None:
        super().__init__()
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise InvalidInputError(f"capacity_bytes must be a positive integer, got {capacity_bytes!r}")
        if not resync_interval_s >= 0:
            raise InvalidInputError(f"resync_interval_s must be >= 0, got {resync_interval_s!r}")
        self.path = os.fspath(path)
        self.capacity_bytes = capacity_bytes
        self.shared = shared
        self.fsync = fsync
        self.resync_interval_s = resync_interval_s
        self.used_bytes = 0
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, least recently used first
        self._low: OrderedDict[str, int] = OrderedDict()  # the low-priority ones, least recently used first
        self._lock = threading.RLock()
        self._tmp_tag = f"{_host()}.{os.getpid()}"
        self._known: dict[str, bytes] | None = None
        """While recording changes: the key of every entry reported as entered (they are all indexed)."""
        self._synced_at = 0.0
        try:
            if not os.path.isdir(self.path):
                os.makedirs(self.path, exist_ok=True)
            self.resync()
        except OSError as exc:
            raise InvalidInputError(f"cannot use {self.path!r} as a disk tier: {exc}") from exc
        self._evict(0)

    # ------------------------------------------------------------------ the directory
    @_locked
    def resync(self) -> None:
        """Re-read the directory: the index and ``used_bytes`` become what is on disk now.

        Also removes stale temporary files (docs/TIERS.md, "The disk tier's layout"). Raises ``OSError`` only
        when the directory itself cannot be listed.
        """
        found: list[tuple[float, str, int]] = []
        now = time.time()
        with os.scandir(self.path) as it:
            for entry in it:
                try:
                    if entry.name.endswith(_SUFFIX):
                        st = entry.stat()
                        found.append((st.st_mtime, entry.name, st.st_size))
                    elif entry.name.endswith(_TMP_SUFFIX) and self._stale_temp(entry.name, entry.stat().st_mtime, now):
                        os.remove(entry.path)
                except OSError:  # gone already (another process), or not ours to remove
                    continue
        found.sort()
        cut = now - LOW_AGE_S / 2
        self._low = OrderedDict((name, size) for mtime, name, size in found if mtime < cut)
        self._index = OrderedDict((name, size) for mtime, name, size in found if mtime >= cut)
        self.used_bytes = sum(self._index.values()) + sum(self._low.values())
        self._synced_at = time.monotonic()
        if self._known:
            for name in [n for n in self._known if n not in self._index and n not in self._low]:
                self._left(name)  # removed by another process

    def _stale_temp(self, name: str, mtime: float, now: float) -> bool:
        """Whether a temporary file was abandoned: its writer is gone, or it is very old."""
        if now - mtime > STALE_TEMP_S:
            return True
        parts = name.split(".")  # <sha256>.kv.<host>.<pid>.<uuid>.tmp
        if len(parts) != 6 or parts[2] != _host():
            return False  # another host's write (or an unknown name): only age tells
        try:
            pid = int(parts[3])
        except ValueError:
            return False
        return pid != os.getpid() and not _pid_running(pid)

    def _maybe_resync(self) -> None:
        if time.monotonic() - self._synced_at >= self.resync_interval_s:
            with contextlib.suppress(OSError):
                self.resync()

    def _name(self, key: bytes) -> str:
        return hashlib.sha256(key).hexdigest() + _SUFFIX

    # ------------------------------------------------------------------ reads
    @_locked
    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        names = [self._name(k) for k in keys]
        if self.shared:
            return [os.path.exists(os.path.join(self.path, n)) for n in names]
        return [n in self._index or n in self._low for n in names]

    @_locked
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self._get(self._name(k)) for k in keys]

    def _get(self, name: str) -> bytes | None:
        file = os.path.join(self.path, name)
        try:
            with open(file, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(name)
            self._left(name)
            self.stats.misses += 1
            return None
        except OSError as exc:
            raise TierError(f"disk tier {self.path!r}: {exc}") from exc
        value = self._verified(data)
        if value is None:
            self.stats.corrupt += 1
            self._remove(name)
            return None
        with contextlib.suppress(OSError):  # read-only filesystem, another owner, or just evicted
            os.utime(file)  # a low-priority entry that served a read becomes normal
        if name in self._low:
            self.stats.low_promotions += 1
        self._forget(name)
        self._index[name] = len(data)
        self.used_bytes += len(data)
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

    # ------------------------------------------------------------------ writes
    @_locked
    def put_many(self, items: Sequence[tuple[bytes, bytes]], low: bool = False) -> None:
        self._maybe_resync()
        known, log = self._known, self._changes
        for key, value in items:
            data = _HEADER.pack(_MAGIC, zlib.crc32(value), len(value)) + value
            if len(data) > self.capacity_bytes:
                continue
            name = self._name(key)
            as_low = low and name not in self._index  # a normal entry stays normal
            self._forget(name)
            try:
                stored = self._evict(len(data), as_low) and self._write(name, data, as_low)
            except TierError:
                self._left(name)
                raise
            if not stored:
                self.stats.low_skipped += 1
                self._left(name)
                continue
            (self._low if as_low else self._index)[name] = len(data)
            self.used_bytes += len(data)
            self.stats.puts += 1
            self.stats.bytes_written += len(data)
            self.stats.low_puts += as_low
            if known is not None and log is not None and name not in known:
                known[name] = key
                log.append((True, key))

    def _write(self, name: str, data: bytes, low: bool = False) -> bool:
        """Write ``data`` as ``name`` atomically (``low``: with a low-priority time); on a full filesystem
        evict and retry. False when a low entry would have to evict a normal one."""
        final = os.path.join(self.path, name)
        tmp = f"{final}.{self._tmp_tag}.{uuid.uuid4().hex}{_TMP_SUFFIX}"
        resynced = False
        while True:
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                if low:
                    stamp = time.time() - LOW_AGE_S
                    os.utime(tmp, (stamp, stamp))
                os.replace(tmp, final)
                return True
            except OSError as exc:
                self._remove_quietly(tmp)
                if exc.errno not in _FULL:
                    raise TierError(f"disk tier {self.path!r}: {exc}") from exc
                if not resynced:  # the budget is larger than the filesystem: count what is there
                    resynced = True
                    with contextlib.suppress(OSError):
                        self.resync()
                    self._forget(name)
                if not self._evict_bytes(len(data), low):
                    if low:
                        return False
                    raise TierError(f"disk tier {self.path!r}: {exc} and nothing left to evict") from exc

    @_locked
    def delete(self, key: bytes) -> None:
        self._remove(self._name(key))

    @_locked
    def touch_many(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            name = self._name(key)
            for entries, age in ((self._index, 0.0), (self._low, LOW_AGE_S)):
                if name in entries:
                    entries.move_to_end(name)
                    self._stamp(name, age)

    @_locked
    def prioritize_many(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            name = self._name(key)
            if name in self._low:
                self._index[name] = self._low.pop(name)
                self._stamp(name, 0.0)
                self.stats.low_promotions += 1

    def _stamp(self, name: str, age: float) -> None:
        """Set ``name``'s modification time to ``age`` seconds ago: the order survives a restart where it can."""
        stamp = time.time() - age
        with contextlib.suppress(OSError):
            os.utime(os.path.join(self.path, name), (stamp, stamp))

    # ------------------------------------------------------------------ eviction and accounting
    def _evict(self, incoming: int, low: bool = False) -> bool:
        """Remove least recently used files, low-priority ones first, until ``incoming`` more bytes fit;
        for a ``low`` entry only low-priority ones (False if it still does not fit)."""
        while self.used_bytes + incoming > self.capacity_bytes:
            if self._pop_oldest(low) is None:
                return not self._index and not self._low
        return True

    def _evict_bytes(self, nbytes: int, low_only: bool = False) -> bool:
        """Remove least recently used files (low-priority first; only those if ``low_only``) of at least
        ``nbytes``; False if none was left."""
        if not self._low and (low_only or not self._index):
            return False
        freed = 0
        while freed < nbytes:
            size = self._pop_oldest(low_only)
            if size is None:
                break
            freed += size
        return True

    def _pop_oldest(self, low_only: bool) -> int | None:
        """Remove the least recently used low-priority file, else (unless ``low_only``) normal one: its bytes
        (None if none)."""
        entries = self._low or (None if low_only else self._index)
        if not entries:
            return None
        name, size = next(iter(entries.items()))
        if entries is self._low:
            self.stats.low_evictions += 1
        self._remove(name)
        self.stats.evictions += 1
        return size

    def _forget(self, name: str) -> None:
        size = self._index.pop(name, None)
        if size is None:
            size = self._low.pop(name, None)
        if size is not None:
            self.used_bytes -= size

    def _remove(self, name: str) -> None:
        self._forget(name)
        self._left(name)
        self._remove_quietly(os.path.join(self.path, name))

    def _left(self, name: str) -> None:
        """``name`` is no longer indexed: report its key if it was reported as entered."""
        known, log = self._known, self._changes
        if known is not None and log is not None and name in known:
            log.append((False, known.pop(name)))

    @_locked
    def record_changes(self, on: bool = True) -> None:
        if not on:
            self._changes = self._known = None
        elif self._known is None:
            self._changes, self._known = deque(), {}

    @staticmethod
    def _remove_quietly(file: str) -> None:
        with contextlib.suppress(OSError):  # already gone (another process, or never written)
            os.remove(file)

    def low_priority_entries(self) -> int:
        """How many entries the tier holds at low priority (as this process last saw the directory)."""
        return len(self._low)

    def __len__(self) -> int:
        return len(self._index) + len(self._low)

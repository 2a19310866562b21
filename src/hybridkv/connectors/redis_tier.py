"""A tier in Redis, shared by every instance that connects to the same server.

The ``redis`` package is imported when a ``RedisTier`` is built (``pip install 'hybridkv[tiers]'``).
The byte budget is the server's: run it with ``maxmemory`` and ``maxmemory-policy allkeys-lru``
(or give entries a TTL). Redis has no low priority (``KVTier.priorities``): the server's policy
decides what goes, so the connector offers it only the blocks a hit can use (``connectors.storage``);
a low put is stored as a normal one. After a fault the tier answers ``TierError`` at once for
``retry_after_s`` seconds instead of waiting for a dead server on every call.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from hybridkv.connectors.base import KVTier, TierError, TierTimeout
from hybridkv.errors import InvalidInputError


class RedisTier(KVTier):
    """Entries as Redis strings (``MGET``, pipelined ``EXISTS`` / ``SET``)."""

    name = "redis"
    shared = True

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, timeout_s: float = 0.5,
                 ttl_s: float | None = None, retry_after_s: float = 1.0) -> None:
        super().__init__()
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise InvalidInputError("RedisTier needs the redis package: pip install 'hybridkv[tiers]'") from exc
        self.url = url
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.retry_after_s = retry_after_s
        self._timeouts: tuple[type[BaseException], ...] = (redis.exceptions.TimeoutError, TimeoutError)
        self._faults: tuple[type[BaseException], ...] = (redis.exceptions.RedisError, OSError)
        self._down_until = 0.0
        self._client: Any = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
        )

    def _call(self, what: str, fn: Any) -> Any:
        """Run ``fn()`` translating client faults into ``TierError`` / ``TierTimeout``."""
        if time.monotonic() < self._down_until:
            raise TierError(f"redis tier {self.url}: down after a recent fault")
        try:
            return fn()
        except self._timeouts as exc:
            self._down_until = time.monotonic() + self.retry_after_s
            raise TierTimeout(f"redis tier {self.url}: {what} timed out: {exc}") from exc
        except self._faults as exc:
            self._down_until = time.monotonic() + self.retry_after_s
            raise TierError(f"redis tier {self.url}: {what} failed: {exc}") from exc

    def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def run() -> list[Any]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return list(pipe.execute())

        return [bool(n) for n in self._call("EXISTS", run)]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        values: list[bytes | None] = list(self._call("MGET", lambda: self._client.mget(list(keys))))
        for v in values:
            if v is None:
                self.stats.misses += 1
            else:
                self.stats.hits += 1
                self.stats.bytes_read += len(v)
        return values

    def put_many(self, items: Sequence[tuple[bytes, bytes]], low: bool = False) -> None:
        if not items:
            return

        def run() -> None:
            pipe = self._client.pipeline(transaction=False)
            for k, v in items:
                pipe.set(k, v, px=self.ttl_ms)
            pipe.execute()

        self._call("SET", run)
        self.stats.puts += len(items)
        self.stats.bytes_written += sum(len(v) for _, v in items)

    def delete(self, key: bytes) -> None:
        self._call("DEL", lambda: self._client.delete(key))

    def close(self) -> None:
        """Close the connection pool."""
        self._client.close()

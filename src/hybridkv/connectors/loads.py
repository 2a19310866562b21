"""Tier loads that do not stall the caller: a pending load per waiting request.

``DoneLoad`` is finished when started (the synchronous connector); ``ThreadLoad`` runs on one of
``BackgroundLoads``' worker threads and is a miss if it fails or outlasts ``timeout_s``. Nothing a
tier does can raise out of ``result()``. Specification: docs/TIERS.md, "Loads".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

from hybridkv.errors import InvalidInputError

if TYPE_CHECKING:
    from hybridkv.connectors.connector import FetchedKV


class PendingLoad:
    """The external tokens of one waiting request, read from the tiers starting at ``start_token``."""

    start_token: int

    def done(self) -> bool:
        """Whether ``result()`` is available without waiting."""
        raise NotImplementedError

    def result(self) -> FetchedKV:
        """The verified payloads (no tokens for a load that failed or timed out); call once ``done()``."""
        raise NotImplementedError

    def cancel(self) -> None:
        """Drop the load (its request was preempted, aborted or looked up again at another hit)."""


class DoneLoad(PendingLoad):
    """A load that finished when it was started."""

    __slots__ = ("start_token", "_fetched")

    def __init__(self, fetched: FetchedKV) -> None:
        self.start_token = fetched.start_token
        self._fetched = fetched

    def done(self) -> bool:
        return True

    def result(self) -> FetchedKV:
        return self._fetched


class ThreadLoad(PendingLoad):
    """A load on a worker thread, a miss once ``deadline`` (monotonic seconds) has passed."""

    __slots__ = ("start_token", "_future", "_deadline", "_miss", "_on_timeout", "_timed_out")

    def __init__(self, future: Future[FetchedKV], start_token: int, deadline: float, miss: FetchedKV,
                 on_timeout: Callable[[], None]) -> None:
        self.start_token = start_token
        self._future = future
        self._deadline = deadline
        self._miss = miss
        self._on_timeout = on_timeout
        self._timed_out = False

    def done(self) -> bool:
        return self._future.done() or time.monotonic() >= self._deadline

    def result(self) -> FetchedKV:
        if self._future.done() and not self._timed_out:
            exc = self._future.exception()
            return self._miss if exc is not None else self._future.result()
        if not self._timed_out:
            self._timed_out = True
            self._future.cancel()
            self._on_timeout()
        return self._miss

    def cancel(self) -> None:
        self._future.cancel()


class BackgroundLoads:
    """``workers`` threads that run tier loads (a slow one does not hold up the others), each a miss
    after ``timeout_s`` seconds."""

    def __init__(self, timeout_s: float = 5.0, workers: int = 4) -> None:
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise InvalidInputError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not isinstance(workers, int) or workers < 1:
            raise InvalidInputError(f"workers must be a positive integer, got {workers!r}")
        self.timeout_s = float(timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="hybridkv-tier-load")
        self._finished = threading.Event()

    def submit(self, work: Callable[[], FetchedKV], miss: FetchedKV, on_timeout: Callable[[], None]) -> ThreadLoad:
        """Run ``work`` on the worker thread; ``miss`` is the result should it time out or fail."""
        future = self._pool.submit(work)
        future.add_done_callback(lambda _f: self._finished.set())
        return ThreadLoad(future, miss.start_token, time.monotonic() + self.timeout_s, miss, on_timeout)

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` seconds or until a load finishes (for a caller with nothing else to do)."""
        self._finished.wait(timeout_s)
        self._finished.clear()

    def close(self) -> None:
        """Stop the worker once the loads in flight have finished."""
        self._pool.shutdown(wait=False, cancel_futures=True)

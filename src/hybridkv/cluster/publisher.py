"""Publish KV-cache events in vLLM's wire format over ZMQ (needs the ``cluster`` extra).

``KVEventPublisher`` numbers batches on a PUB socket and keeps the last ``buffer_steps`` for a
ROUTER replay socket, from a background thread (``publish`` never blocks); ``publish_manager``
turns a manager's and its tiers' events into one batch. See docs/CLUSTER.md, "The publisher".
"""

from __future__ import annotations

import queue
import threading
import typing
from collections import deque
from collections.abc import Iterable, Sequence
from types import TracebackType

import zmq

from hybridkv.cluster.events import MEDIUM_GPU, WireEvent, from_core_events, group_metadata, make_batch
from hybridkv.cluster.wire import END_SEQ, encode_batch, seq_bytes
from hybridkv.core import KVCacheEvent, KVCacheManager
from hybridkv.errors import InvalidInputError

_IDLE = object()


class KVEventPublisher:
    """Numbered KV-event batches on a PUB socket, with a bounded replay buffer."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue: int = 100_000,
                 data_parallel_rank: int | None = None, int_hashes: bool = False) -> None:
        if buffer_steps < 1:
            raise InvalidInputError(f"buffer_steps must be at least 1, got {buffer_steps}")
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.int_hashes = int_hashes
        self.num_dropped = 0
        """Batches dropped because the send queue was full."""
        # A context of its own: terminating it on close waits until the ports are released.
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self.endpoint = _bind(self._pub, endpoint, "KV events endpoint")
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # a whole replay and its marker
                self.replay_endpoint = _bind(self._replay, replay_endpoint, "KV events replay endpoint")
        except BaseException:
            self._close_sockets()
            self._ctx.term()
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=max_queue)
        self._lock = threading.Lock()
        self._next_seq = 0
        self._metadata: dict[int, tuple[tuple[str, int | None], ...]] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ publishing
    def publish(self, events: Sequence[WireEvent], ts: float | None = None) -> int | None:
        """Queue one batch; returns its number (None when the queue was full and it was dropped)."""
        if self._closed:
            raise InvalidInputError("the KV event publisher is closed")
        batch = make_batch(events, ts=ts, data_parallel_rank=self.data_parallel_rank)
        payload = encode_batch(batch)
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._queue.put_nowait((seq, payload))
            except queue.Full:
                self.num_dropped += 1
                return None
        return seq

    def publish_manager(self, manager: KVCacheManager, *, medium: str = MEDIUM_GPU,
                        tiers: Iterable[tuple[str, Sequence[KVCacheEvent]]] = ()) -> int | None:
        """Publish the events ``manager`` collected since the last call as ``medium``, then ``tiers``'
        (each of its own medium: ``KVConnector.take_events()``), as one batch (nothing when there are
        none); returns the batch number."""
        meta = self._metadata.get(id(manager))
        if meta is None:
            meta = self._metadata[id(manager)] = group_metadata(manager.layout)
        events = from_core_events(manager.take_events(), meta, medium=medium, int_hashes=self.int_hashes)
        for tier_medium, tier_events in tiers:
            events += from_core_events(tier_events, meta, medium=tier_medium, int_hashes=self.int_hashes)
        return self.publish(events) if events else None

    @property
    def num_published(self) -> int:
        """Batches numbered so far (the next batch's number)."""
        return self._next_seq

    # ------------------------------------------------------------------ the sending thread
    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._queue.get(timeout=0.005)
                except queue.Empty:
                    item = _IDLE
                if item is None:
                    break
                if item is not _IDLE:
                    seq, payload = typing.cast(tuple[int, bytes], item)
                    self._pub.send_multipart((self.topic, seq_bytes(seq), payload))
                    self._buffer.append((seq, payload))
                while self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
        finally:
            self._close_sockets(linger_ms=500)  # let subscribers have what was sent
            self._ctx.term()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) < 2 or len(frames[-1]) != 8:
            return  # not a replay request: ignored
        envelope, start = frames[:-1], int.from_bytes(frames[-1], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((*envelope, self.topic, seq_bytes(seq), payload))
        self._replay.send_multipart((*envelope, b"", END_SEQ, b""))

    def _close_sockets(self, linger_ms: int = 0) -> None:
        self._pub.close(linger=linger_ms)
        if self._replay is not None:
            self._replay.close(linger=0)

    # ------------------------------------------------------------------ lifetime
    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _bind(sock: zmq.Socket[bytes], endpoint: str, what: str) -> str:
    """Bind ``sock``; returns the endpoint actually bound (the port chosen for ``:0``)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        raise InvalidInputError(f"{what} {endpoint!r}: {exc}") from exc
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)

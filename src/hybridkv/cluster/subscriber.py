"""Follow replicas' KV-event streams over ZMQ into a ``ClusterIndex`` (needs the ``cluster`` extra).

One SUB socket per replica (the socket tells who sent a batch). A gap in the batch numbers is
filled from the replica's replay socket (a ROUTER, asked through a fresh DEALER per request); what
it cannot fill the index resyncs (see ``index.py``). Works with hybridkv's ``KVEventPublisher`` and
vLLM's ``ZmqEventPublisher`` alike.

A replica that restarts numbers its batches from 0 again, but the first ones can be lost while the
subscription reconnects, and the numbers that do arrive may then continue the old ones. So every
time a connection drops (a socket monitor reports it), the next batch is preceded by a continuity
check: the replay buffer must still hold the last batch applied, byte for byte. If it does not (or
there is no replay socket), the replica is treated as restarted: its view is cleared and its new
stream replayed from the start.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from hybridkv.cluster.events import EventBatch, EventDecodeError
from hybridkv.cluster.index import ClusterIndex
from hybridkv.cluster.wire import decode_batch, seq_bytes, seq_from
from hybridkv.errors import InvalidInputError


@dataclass
class _Source:
    name: str
    endpoint: str
    replay_endpoint: str | None
    socket: zmq.Socket[bytes]
    monitor: zmq.Socket[bytes]
    suspect: bool = False
    """The connection dropped since: check continuity before applying the next batch."""


class KVEventSubscriber:
    """Feeds a ``ClusterIndex`` from replicas' PUB sockets. ``lock`` (optional) is held around every
    change to the index, for callers that read it from other threads."""

    def __init__(self, index: ClusterIndex, *, replay_timeout: float = 1.0,
                 lock: threading.Lock | threading.RLock | None = None) -> None:
        self.index = index
        self.replay_timeout = replay_timeout
        self.lock = lock
        self.num_undecodable = 0
        self.num_disconnects = 0
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sources: dict[str, _Source] = {}
        self._by_socket: dict[zmq.Socket[bytes], _Source] = {}
        self._by_monitor: dict[zmq.Socket[bytes], _Source] = {}
        self._last: dict[str, tuple[int, bytes]] = {}
        """Per replica, the number and payload of the last batch applied from its live stream."""
        self._poller = zmq.Poller()

    def connect(self, name: str, endpoint: str, replay_endpoint: str | None = None, topic: str = "") -> None:
        """Follow replica ``name`` (already added to the index) publishing on ``endpoint``."""
        if name not in self.index.views:
            raise InvalidInputError(f"add replica {name!r} to the index before subscribing to it")
        if name in self._sources:
            raise InvalidInputError(f"already subscribed to replica {name!r}")
        sock = self._ctx.socket(zmq.SUB)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)
            raise InvalidInputError(f"replica {name!r}: KV events endpoint {endpoint!r}: {exc}") from exc
        sock.setsockopt(zmq.SUBSCRIBE, topic.encode())
        source = _Source(name, endpoint, replay_endpoint, sock, monitor)
        # Reconnecting to a replica followed before: its stream may have moved on or restarted.
        source.suspect = self.index.streams[name].next_seq is not None
        self._sources[name] = source
        self._by_socket[sock] = source
        self._by_monitor[monitor] = source
        self._poller.register(monitor, zmq.POLLIN)
        self._poller.register(sock, zmq.POLLIN)

    def disconnect(self, name: str) -> None:
        """Stop following ``name`` (the index keeps its view)."""
        source = self._sources.pop(name, None)
        if source is None:
            return
        for sock, table in ((source.monitor, self._by_monitor), (source.socket, self._by_socket)):
            self._poller.unregister(sock)
            del table[sock]
        source.socket.disable_monitor()
        source.monitor.close(linger=0)
        source.socket.close(linger=0)

    def poll(self, timeout: float = 0.0) -> int:
        """Apply every batch that has arrived, waiting up to ``timeout`` seconds for the first one;
        returns how many batches were applied."""
        applied = 0
        wait_ms = int(timeout * 1000)
        while True:
            ready = dict(self._poller.poll(wait_ms))
            if not ready:
                return applied
            wait_ms = 0
            for sock in ready:  # connection drops first: they decide how the next batch is taken
                source = self._by_monitor.get(sock)
                if source is not None:
                    self._drain_monitor(source)
            for sock in ready:
                source = self._by_socket.get(sock)
                if source is None:
                    continue
                while True:
                    try:
                        frames = source.socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    applied += self._receive(source, frames)

    def _drain_monitor(self, source: _Source) -> None:
        while True:
            try:
                event = recv_monitor_message(source.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.num_disconnects += 1
                source.suspect = True

    def _receive(self, source: _Source, frames: list[bytes]) -> int:
        if len(frames) != 3:
            self.num_undecodable += 1
            return 0
        try:
            seq = seq_from(frames[1])
        except EventDecodeError:
            self.num_undecodable += 1
            return 0
        if source.suspect:
            source.suspect = False
            if not self._continues(source):
                with self._locked():
                    self.index.streams[source.name].restarts += 1
                    self.index.resync(source.name)
                self._last.pop(source.name, None)
        try:
            batch = decode_batch(frames[2])
        except EventDecodeError:
            self.num_undecodable += 1
            with self._locked():
                self.index.lost(source.name, seq)
            return 0
        # Fetch a gap's batches before taking the lock: lookups need not wait on the network.
        next_seq = self.index.streams[source.name].next_seq
        expected = 0 if next_seq is None or seq < next_seq else next_seq
        replayed = self._decoded(self._replay(source, expected)) if seq > expected else []
        with self._locked():
            self.index.deliver(source.name, seq, batch, lambda start: replayed)
        self._last[source.name] = (seq, frames[2])
        return 1

    def _continues(self, source: _Source) -> bool:
        """Whether the replica still holds the last batch applied from it, unchanged."""
        last = self._last.get(source.name)
        if last is None:
            return self.index.streams[source.name].next_seq is None
        seq, payload = last
        got = self._replay(source, seq)
        return bool(got) and got[0] == (seq, payload)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if self.lock is None:
            yield
        else:
            with self.lock:
                yield

    def _decoded(self, raw: list[tuple[int, bytes]]) -> list[tuple[int, EventBatch]]:
        out = []
        for seq, payload in raw:
            try:
                out.append((seq, decode_batch(payload)))
            except EventDecodeError:
                self.num_undecodable += 1
        return out

    def _replay(self, source: _Source, start: int) -> list[tuple[int, bytes]]:
        """The batches ``source``'s replay buffer holds from ``start`` on, as ``(number, payload)``
        (empty without a replay socket, or what arrived when it does not finish in time)."""
        if source.replay_endpoint is None:
            return []
        out: list[tuple[int, bytes]] = []
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(source.replay_endpoint)
            sock.send_multipart((b"", seq_bytes(start)))
            deadline = time.monotonic() + self.replay_timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    return out
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = seq_from(frames[2])
                if seq < 0:
                    return out
                out.append((seq, frames[3]))
        except (zmq.ZMQError, EventDecodeError):
            return out
        finally:
            sock.close(linger=0)

    def run(self, stop: threading.Event, interval: float = 0.05) -> None:
        """Poll until ``stop`` is set (the body of a background thread)."""
        while not stop.is_set():
            self.poll(interval)

    def close(self) -> None:
        """Close every socket."""
        for name in list(self._sources):
            self.disconnect(name)

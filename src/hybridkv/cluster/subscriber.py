"""Follow replicas' KV-event streams over ZMQ into a ``ClusterIndex`` (needs the ``cluster`` extra).

One SUB socket per replica; gaps filled from its replay socket, resync otherwise; after a dropped
connection a continuity check against the replay buffer tells a restart; ``poll`` syncs from the
replay buffers every ``sync_interval`` seconds. See docs/CLUSTER.md, "Following the streams".
"""

from __future__ import annotations

import contextlib
import hashlib
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

_REMEMBERED = 256
"""Batches remembered per replica to recognise one that arrives twice."""
_SYNC_TIMEOUT = 0.25
_SYNC_BACKOFF = 5.0
"""A periodic sync waits this little for a replay buffer, and leaves one that did not answer alone
this long: a replica that is down must not hold up the others' events."""


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

    def __init__(self, index: ClusterIndex, *, replay_timeout: float = 1.0, sync_interval: float = 1.0,
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
        self._quiet_until: dict[str, float] = {}
        """Per replica, when a sync may ask it again after it did not answer."""
        self._applied: dict[str, dict[int, bytes]] = {}
        """Per replica, the digests of the recent batches applied, by number."""
        self.sync_interval = sync_interval
        self._next_sync = 0.0
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
        """Apply every batch that has arrived, waiting up to ``timeout`` seconds for the first one
        (and, every ``sync_interval`` seconds, what the replay buffers hold that never arrived);
        returns how many batches were applied."""
        applied = 0
        if time.monotonic() >= self._next_sync:
            applied += self.sync_all()
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
                    if len(frames) != 3:
                        self.num_undecodable += 1
                        continue
                    applied += self._receive(source, frames[1], frames[2])

    def sync_all(self) -> int:
        """Ask every replica's replay buffer for the batches after the last one applied (a batch
        sent while a subscription was coming up, or the last one before a replica went quiet, is
        otherwise only noticed when the next one arrives); returns how many were applied."""
        self._next_sync = time.monotonic() + self.sync_interval
        applied = 0
        now = time.monotonic()
        for source in list(self._sources.values()):
            if source.replay_endpoint is None or self._quiet_until.get(source.name, 0.0) > now:
                continue
            start = self.index.streams[source.name].next_seq or 0
            got = self._replay(source, start, timeout=_SYNC_TIMEOUT)
            if got is None:  # no answer: the replica is down or busy; ask again later
                self._quiet_until[source.name] = now + _SYNC_BACKOFF
                continue
            for seq, payload in got:
                if seq >= start:
                    applied += self._receive(source, seq_bytes(seq), payload)
        return applied

    def _drain_monitor(self, source: _Source) -> None:
        while True:
            try:
                event = recv_monitor_message(source.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self.num_disconnects += 1
                source.suspect = True

    def _receive(self, source: _Source, number: bytes, payload: bytes) -> int:
        """Apply one batch of ``source`` (from the live stream or a sync); returns 1 if applied."""
        try:
            seq = seq_from(number)
        except EventDecodeError:
            self.num_undecodable += 1
            return 0
        name = source.name
        applied = self._applied.setdefault(name, {})
        digest = hashlib.blake2b(payload, digest_size=16).digest()
        if applied.get(seq) == digest:
            return 0  # had it already (a sync and the live stream both brought it)
        if source.suspect:
            source.suspect = False
            if not self._continues(source):
                self._restarted(name)
        next_seq = self.index.streams[name].next_seq
        if next_seq is not None and seq < next_seq:
            self._restarted(name)  # numbers going back that are not a batch already applied
            next_seq = None
        try:
            batch = decode_batch(payload)
        except EventDecodeError:
            self.num_undecodable += 1
            with self._locked():
                self.index.lost(name, seq)
            return 0
        # Fetch a gap's batches before taking the lock: lookups need not wait on the network.
        expected = 0 if next_seq is None else next_seq
        raw = (self._replay(source, expected) or []) if seq > expected else []
        raw = [(s, p) for s, p in raw if expected <= s < seq]
        replayed = self._decoded(raw)
        with self._locked():
            self.index.deliver(name, seq, batch, lambda start: replayed)
        for s, p in raw:
            applied[s] = hashlib.blake2b(p, digest_size=16).digest()
        applied[seq] = digest
        for old in [s for s in applied if s < seq - _REMEMBERED]:
            del applied[old]
        return 1

    def _restarted(self, name: str) -> None:
        with self._locked():
            self.index.streams[name].restarts += 1
            self.index.resync(name)
        self._applied.pop(name, None)

    def _continues(self, source: _Source) -> bool:
        """Whether the replica still holds the last batch applied from it, unchanged."""
        applied = self._applied.get(source.name)
        if not applied:
            return self.index.streams[source.name].next_seq is None
        seq = max(applied)
        got = self._replay(source, seq)
        if not got or got[0][0] != seq:
            return False
        return hashlib.blake2b(got[0][1], digest_size=16).digest() == applied[seq]

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

    def _replay(self, source: _Source, start: int, timeout: float | None = None) -> list[tuple[int, bytes]] | None:
        """The batches ``source``'s replay buffer holds from ``start`` on, as ``(number, payload)``;
        None when it has no replay socket or does not finish answering within ``timeout`` (default
        ``replay_timeout``)."""
        if source.replay_endpoint is None:
            return None
        out: list[tuple[int, bytes]] = []
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.connect(source.replay_endpoint)
            sock.send_multipart((b"", seq_bytes(start)))
            deadline = time.monotonic() + (self.replay_timeout if timeout is None else timeout)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    return None
                frames = sock.recv_multipart()
                if len(frames) != 4:
                    continue
                seq = seq_from(frames[2])
                if seq < 0:
                    return out
                out.append((seq, frames[3]))
        except (zmq.ZMQError, EventDecodeError):
            return None
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

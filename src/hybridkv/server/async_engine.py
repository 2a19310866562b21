"""An asyncio front for ``LLMEngine``: one background thread owns the engine and steps every request.

The engine is not thread-safe, so no other thread touches it. Coroutines submit ``add``/``abort``
commands through a locked queue; the engine thread drains it before every step, steps while any
request is unfinished, sleeps on a condition variable when idle, and hands each ``RequestOutput``
to the submitting event loop with ``call_soon_threadsafe``. Requests from many clients share the
one engine, so they are batched together.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from hybridkv.engine.engine import EngineConfig, LLMEngine, RequestOutput
from hybridkv.engine.sampling import SamplingParams
from hybridkv.errors import HybridKVError, InvalidInputError

logger = logging.getLogger(__name__)


class EngineClosedError(HybridKVError):
    """The engine no longer accepts requests: it is shutting down or its thread failed."""


@dataclass(eq=False)
class _Stream:
    """Where one request's outputs go: a queue on the event loop that submitted it."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread; a closed loop means nobody is listening any more."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    priority: int
    stream: _Stream


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncEngine:
    """Runs ``engine`` on a background thread started here; ``generate`` streams outputs per request."""

    def __init__(self, engine: LLMEngine) -> None:
        self._engine = engine
        self.config: EngineConfig = engine.config
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._streams: dict[str, _Stream] = {}
        """Requests in flight; guarded by ``_cond``."""
        self._accepting = True
        self._stopping = False
        self._failure: BaseException | None = None
        self._metrics_text = self._render_metrics()
        self._thread = threading.Thread(target=self._run, name="hybridkv-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ asyncio side
    @property
    def is_running(self) -> bool:
        """True while new requests are accepted."""
        return self._accepting and self._failure is None

    def metrics_text(self) -> str:
        """Prometheus text as of the engine thread's last step (or idle moment)."""
        return self._metrics_text

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       cache_salt: str | None = None, *, priority: int = 0) -> AsyncGenerator[RequestOutput, None]:
        """Submit a request and yield its outputs until the finished one.

        Errors from ``LLMEngine.add_request`` (bad or too-long prompt) are raised from the first
        iteration. Leaving the iteration early (cancellation, ``aclose``) aborts the request.
        """
        stream = _Stream(asyncio.get_running_loop())
        with self._cond:
            if not self.is_running:
                raise EngineClosedError("the engine is shutting down" if self._failure is None
                                        else f"the engine failed: {self._failure!r}")
            if request_id in self._streams:
                raise InvalidInputError(f"request id {request_id!r} is already in flight")
            self._streams[request_id] = stream
            self._commands.append(_Add(request_id, prompt, params, cache_salt, priority, stream))
            self._cond.notify()
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._submit_abort(request_id)

    def _submit_abort(self, request_id: str) -> None:
        with self._cond:
            self._commands.append(_Abort(request_id))
            self._cond.notify()

    def shutdown(self, graceful: bool = True) -> None:
        """Stop accepting requests; let in-flight ones finish (``graceful``) or abort them; join the thread."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            if not graceful:
                self._commands.extend(_Abort(rid) for rid in self._streams)
            self._cond.notify()
        self._thread.join()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self._engine
        try:
            while True:
                with self._cond:
                    while not (self._commands or self._stopping or engine.has_unfinished):
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for command in commands:
                    self._apply(command)
                if engine.has_unfinished:
                    outputs = engine.step()
                    self._metrics_text = self._render_metrics()
                    self._deliver(outputs)
                elif stopping:
                    return
                else:
                    self._metrics_text = self._render_metrics()
        except Exception as exc:
            logger.exception("the engine thread failed; failing every request in flight")
            with self._cond:
                self._failure = exc
                streams, self._streams = self._streams, {}
            for stream in streams.values():
                stream.put(exc)

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self._engine.abort(command.request_id)
            return
        try:
            self._engine.add_request(command.request_id, command.prompt, command.params,
                                     cache_salt=command.cache_salt, priority=command.priority)
        except Exception as exc:
            with self._cond:
                del self._streams[command.request_id]
            command.stream.put(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._cond:
            targets = [(self._streams.pop(o.request_id) if o.finished else self._streams[o.request_id], o)
                       for o in outputs]
        for stream, output in targets:
            stream.put(output)

    def _render_metrics(self) -> str:
        return self._engine.metrics_text()

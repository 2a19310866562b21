"""An asyncio front for ``LLMEngine``: one background thread owns the engine and steps every request.

Coroutines submit commands through a locked queue; outputs go back with ``call_soon_threadsafe``.
A failed step ends the requests in flight; ``MAX_CONSECUTIVE_FAILURES`` in a row kill the engine.
See docs/ENGINE.md, "The server's engine thread".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from hybridkv.engine.engine import EngineConfig, LLMEngine, RequestOutput
from hybridkv.engine.metrics import MetricNames
from hybridkv.engine.sampling import SamplingParams
from hybridkv.errors import HybridKVError, InvalidInputError

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILURES = 3


class EngineClosedError(HybridKVError):
    """The engine no longer accepts requests: it is shutting down or its thread failed."""


ENGINE_NICENESS = 5
"""How much lower the engine thread's CPU priority is than the event loop's (Linux: per thread)."""


def _yield_to_the_event_loop() -> None:
    """Called on the engine thread: requests, ``/health`` and streams are answered at once however busy
    the engine is. The thread (and the math library's worker threads it starts, which inherit its
    priority) runs at a lower CPU priority, so the event loop wins a contended core, and the GIL
    changes hands every millisecond instead of every five."""
    sys.setswitchinterval(0.001)
    with contextlib.suppress(AttributeError, OSError):  # not Linux, or not permitted: no change
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ENGINE_NICENESS)


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
    n: int | None = None
    """The request's ``n`` (counted once per request, by its first choice)."""
    checkpoint_hints: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncEngine:
    """Runs ``engine`` on a background thread started here; ``generate`` streams outputs per request."""

    def __init__(self, engine: LLMEngine, model_name: str = "gemma-3-270m", *,
                 metrics_names: MetricNames = "vllm") -> None:
        self._engine = engine
        self.model_name = model_name
        self.metrics_names: MetricNames = metrics_names
        """``vllm``: vLLM's metrics as ``vllm:*`` (dashboards and routers built for vLLM read them); ``hybridkv``."""
        self.config: EngineConfig = engine.config
        self.tokenizer = engine.tokenizer
        """Thread-safe for encoding and decoding: the server tokenizes prompts on worker threads."""
        self.model_chat_template: str | None = getattr(engine, "chat_template", None)
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._streams: dict[str, _Stream] = {}
        """Requests in flight; guarded by ``_cond``."""
        self._accepting = True
        self._stopping = False
        self._drain_timer: threading.Timer | None = None
        self._failure: BaseException | None = None
        self._metrics_text = ""
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

    @property
    def is_draining(self) -> bool:
        """True once shutdown began (requests in flight may still be finishing)."""
        return not self._accepting

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       cache_salt: str | None = None, *, priority: int = 0,
                       n: int | None = None, checkpoint_hints: tuple[int, ...] = ()
                       ) -> AsyncGenerator[RequestOutput, None]:
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
            self._commands.append(_Add(request_id, prompt, params, cache_salt, priority, stream, n, checkpoint_hints))
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

    def begin_drain(self, timeout: float | None) -> None:
        """Stop accepting requests; after ``timeout`` seconds abort the ones still in flight (their
        streams end with an error event). ``None``: wait for them however long they take."""
        with self._cond:
            if not self._accepting:
                return
            self._accepting = False
            in_flight = len(self._streams)
        logger.info("draining %d request(s) in flight%s", in_flight,
                    "" if timeout is None else f" for up to {timeout:g} s")
        if timeout is not None:
            self._drain_timer = threading.Timer(timeout, self.abort_all, kwargs={"why": "the drain timeout passed"})
            self._drain_timer.daemon = True
            self._drain_timer.start()

    def abort_all(self, why: str = "") -> None:
        """Abort every request in flight (each ends with ``finish_reason == "abort"``)."""
        with self._cond:
            if self._streams:
                logger.warning("aborting %d request(s) in flight%s", len(self._streams), f": {why}" if why else "")
            self._commands.extend(_Abort(rid) for rid in self._streams)
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
        if self._drain_timer is not None:
            self._drain_timer.cancel()
        self._engine.close()

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        _yield_to_the_event_loop()
        engine = self._engine
        failures = 0
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
                    try:
                        outputs = engine.step()
                    except Exception as exc:
                        failures += 1
                        if failures >= MAX_CONSECUTIVE_FAILURES:
                            raise
                        logger.exception("an engine step failed; ending every request in flight with an error")
                        outputs = self._fail_in_flight(exc)
                    else:
                        failures = 0
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

    def _fail_in_flight(self, exc: BaseException) -> list[RequestOutput]:
        """Abort every request the engine holds; a finished ``error`` output for each request in flight."""
        with self._cond:
            ids = list(self._streams)
        outputs = []
        for rid in ids:
            with contextlib.suppress(Exception):
                self._engine.abort(rid)
            outputs.append(RequestOutput(rid, [], [], "", "", True, "error", 0, 0, None,
                                         error=f"the engine step failed: {exc!r}"))
        with contextlib.suppress(Exception):
            while self._engine.has_unfinished:  # collect the aborts so the engine holds nothing
                self._engine.step()
        return outputs

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            try:
                self._engine.abort(command.request_id)
            except Exception:
                logger.exception("aborting request %s failed", command.request_id)
            return
        try:
            self._engine.add_request(command.request_id, command.prompt, command.params,
                                     cache_salt=command.cache_salt, priority=command.priority,
                                     checkpoint_hints=command.checkpoint_hints)
            if command.n is not None:
                self._engine.metrics.request_n.observe(command.n)
        except Exception as exc:
            with self._cond:
                self._streams.pop(command.request_id, None)
            command.stream.put(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        with self._cond:
            targets = [(self._streams.pop(o.request_id, None) if o.finished else self._streams.get(o.request_id), o)
                       for o in outputs]
        for stream, output in targets:
            if stream is not None:
                stream.put(output)

    def _render_metrics(self) -> str:
        try:
            return self._engine.metrics_text(self.model_name, self.metrics_names)
        except Exception:
            logger.exception("rendering the metrics failed")
            return self._metrics_text

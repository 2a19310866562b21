"""The KV-aware router: an OpenAI-compatible proxy in front of N backends (needs the ``cluster`` extra).

Each request goes to the backend ranked best by predicted hit (the index, per medium) against load
(``routing.Policy``, load scraped from ``/metrics``), unchanged; streams pass through. A failed
backend is taken out of rotation. It keeps no state a restart would lose.
See docs/CLUSTER.md, "Routing" and "The router's request".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hybridkv.cluster.hashes import scheme_named
from hybridkv.cluster.index import ClusterIndex
from hybridkv.cluster.inflight import InFlightPrefixes
from hybridkv.cluster.replica import RequestKeys
from hybridkv.cluster.routing import (
    BALANCE,
    HOME_TOKENS,
    JUNCTION_WEIGHT,
    MISS_WEIGHT,
    SLACK,
    BackendState,
    Decision,
    Policy,
    estimate_hits,
)
from hybridkv.cluster.scrape import parse_load
from hybridkv.cluster.subscriber import KVEventSubscriber

logger = logging.getLogger("hybridkv.route")
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class BackendSpec:
    """One backend: its HTTP base URL, its KV-event endpoints, how it hashes and its group count."""

    url: str
    events: str | None = None
    replay: str | None = None
    hash_scheme: str = "vllm"
    groups: int | None = None

    @property
    def name(self) -> str:
        return self.url.split("://", 1)[-1].rstrip("/")


@dataclass
class RouterConfig:
    backends: list[BackendSpec]
    policy: str = "hybrid_exact"
    load_weight: float = 0.25
    kv_weight: float = 0.0
    metrics_interval: float = 0.5
    request_timeout: float = 600.0
    shared_media: list[str] = field(default_factory=list)
    medium_weights: dict[str, float] = field(default_factory=dict)
    """What a hit token on each medium is worth against one on the device (``routing.MEDIUM_WEIGHTS``)."""
    balance: float = BALANCE
    slack: int = SLACK
    home_tokens: int = HOME_TOKENS
    miss_weight: float = MISS_WEIGHT
    junction_weight: float = JUNCTION_WEIGHT
    """``hybrid_exact``'s load bound, ring key, miss and junction weights (``routing.Policy``)."""


class ClusterRouter:
    """The router's state: backends, the index and its subscriber, counters."""

    def __init__(self, config: RouterConfig, *, client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self.policy = Policy(config.policy, load_weight=config.load_weight, kv_weight=config.kv_weight,
                             medium_weights=config.medium_weights, balance=config.balance, slack=config.slack,
                             home_tokens=config.home_tokens, miss_weight=config.miss_weight,
                             junction_weight=config.junction_weight)
        self.backends = {s.name: BackendState(s.name, s.url.rstrip("/")) for s in config.backends}
        self.index = ClusterIndex(shared_media=config.shared_media)
        self.inflight = InFlightPrefixes()
        """The chains of the requests in flight at each backend (``inflight``)."""
        self.lock = threading.Lock()
        self.subscriber = KVEventSubscriber(self.index, lock=self.lock)
        for spec in config.backends:
            self.index.add_replica(spec.name, scheme=scheme_named(spec.hash_scheme), expected_groups=spec.groups)
            if spec.events:
                self.subscriber.connect(spec.name, spec.events, spec.replay)
        self.client = client or httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout, connect=2.0))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.subscriber.run, args=(self._stop,), name="kv-events",
                                        daemon=True)
        self._scraper: asyncio.Task[None] | None = None
        self.requests: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.retries = 0
        self.failed = 0
        self.prompt_tokens: Counter[str] = Counter()
        self.predicted_tokens: Counter[str] = Counter()
        self.reported_tokens: Counter[str] = Counter()
        self._tokenize_turn = 0

    # ------------------------------------------------------------------ lifetime
    async def start(self) -> None:
        """Start following events and scraping load."""
        self._thread.start()
        await self.scrape_all()
        self._scraper = asyncio.create_task(self._scrape_loop())

    async def stop(self) -> None:
        if self._scraper is not None:
            self._scraper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._scraper
        self._stop.set()
        await asyncio.to_thread(self._thread.join, 2.0)
        self.subscriber.close()
        await self.client.aclose()

    async def _scrape_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.metrics_interval)
            await self.scrape_all()

    async def scrape_all(self) -> None:
        """Read every backend's /metrics: its load, and whether it is up."""
        await asyncio.gather(*(self._scrape(b) for b in self.backends.values()))

    async def _scrape(self, b: BackendState) -> None:
        try:
            resp = await self.client.get(f"{b.url}/metrics", timeout=2.0)
        except httpx.HTTPError:
            b.mark_failed()
            return
        if resp.status_code != 200:
            b.mark_failed()
            return
        b.mark_ok(parse_load(resp.text))

    # ------------------------------------------------------------------ routing
    async def _token_ids(self, kind: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids: given in the body, or from a backend's ``/tokenize``."""
        if kind == "completions":
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
                prompt = prompt[0]
            if isinstance(prompt, list) and all(type(t) is int and t >= 0 for t in prompt):
                return list(prompt)
            if not isinstance(prompt, str):
                return None
            ask: dict[str, Any] = {"prompt": prompt}
        else:
            messages = body.get("messages")
            if not isinstance(messages, list):
                return None
            ask = {"messages": messages}
        if "model" in body:
            ask["model"] = body["model"]
        healthy = [b for b in self.backends.values() if b.healthy] or list(self.backends.values())
        for i in range(len(healthy)):
            b = healthy[(self._tokenize_turn + i) % len(healthy)]
            try:
                resp = await self.client.post(f"{b.url}/tokenize", json=ask, timeout=5.0)
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                self._tokenize_turn += 1
                tokens = resp.json().get("tokens")
                if isinstance(tokens, list) and all(type(t) is int and t >= 0 for t in tokens):
                    return tokens
            return None  # the backend answered: the prompt is not tokenizable there either
        return None

    async def decide(self, kind: str, body: dict[str, Any]) -> tuple[Decision, int]:
        """The backends to try for ``body``, and its prompt length in tokens (0 when unknown)."""
        decision, prompt_tokens, _ = await self._decide(kind, body)
        return decision, prompt_tokens

    async def _decide(self, kind: str, body: dict[str, Any]
                      ) -> tuple[Decision, int, dict[str, tuple[list[bytes], int]]]:
        """``decide``, and each backend's full-attention chain of the prompt with its block size."""
        tokens = await self._token_ids(kind, body) if self.policy.uses_hits else None
        if not tokens:
            decision = self.policy.rank(list(self.backends.values()), {}, 0)
            return decision, 0, {}
        salt = body.get("cache_salt")
        keys = RequestKeys(tokens, salt if isinstance(salt, str) else None)
        with self.lock:
            hits = estimate_hits(self.policy, self.index, keys, list(self.backends), self.inflight, len(tokens))
        decision = self.policy.rank(list(self.backends.values()), hits.predicted, len(tokens),
                                    credited=hits.credited, home=hits.home, junctions=hits.junctions)
        return decision, len(tokens), hits.chains

    async def forward(self, kind: str, body: dict[str, Any]) -> Response:
        """Route one request and relay the chosen backend's answer."""
        decision, prompt_tokens, chains = await self._decide(kind, body)
        path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
        stream = bool(body.get("stream"))
        last_error: Response | None = None
        for attempt, name in enumerate(decision.order):
            b = self.backends[name]
            if attempt:
                self.retries += 1
            b.inflight += 1
            b.sent_tokens += max(0, prompt_tokens - decision.predicted.get(name, 0))  # until its next report
            chain = chains.get(name)
            ticket = self.inflight.add(name, chain[0]) if chain is not None else None
            handed_over = False
            try:
                if stream:
                    req = self.client.build_request("POST", b.url + path, json=body)
                    resp = await self.client.send(req, stream=True)
                    if resp.status_code >= 500:
                        last_error = Response(await resp.aread(), status_code=resp.status_code,
                                              media_type=resp.headers.get("content-type"))
                        await resp.aclose()
                        b.mark_failed()
                        continue
                    self._count(name, decision, prompt_tokens, attempt)
                    self._log_decision(name, decision, prompt_tokens, attempt, None)
                    handed_over = True
                    return StreamingResponse(self._relay(b, resp, ticket), status_code=resp.status_code,
                                             media_type=resp.headers.get("content-type", "text/event-stream"))
                resp = await self.client.post(b.url + path, json=body)
                if resp.status_code >= 500:
                    last_error = Response(resp.content, status_code=resp.status_code,
                                          media_type=resp.headers.get("content-type"))
                    b.mark_failed()
                    continue
                self._count(name, decision, prompt_tokens, attempt)
                cached = self._note_usage(name, resp.content)
                self._log_decision(name, decision, prompt_tokens, attempt, cached, resp.content)
                return Response(resp.content, status_code=resp.status_code,
                                media_type=resp.headers.get("content-type", "application/json"))
            except httpx.TransportError:
                b.mark_failed()
                continue
            finally:
                if not handed_over:
                    b.inflight -= 1
                    if ticket is not None:
                        self.inflight.remove(ticket)
        self.failed += 1
        if last_error is not None:
            return last_error  # every backend answered with a server error: pass the last one on
        return JSONResponse({"error": {"message": f"no backend could answer ({len(decision.order)} tried)",
                                       "type": "server_error", "code": "no_backend"}}, status_code=503)

    def _count(self, name: str, decision: Decision, prompt_tokens: int, attempt: int) -> None:
        self.requests[name] += 1
        self.decisions["retry" if attempt else decision.reason] += 1
        self.prompt_tokens[name] += prompt_tokens
        self.predicted_tokens[name] += decision.predicted.get(name, 0)

    def _note_usage(self, name: str, content: bytes) -> int | None:
        """Add the cached tokens a backend reported in a response's ``usage``; returns them (None when
        the answer reports none)."""
        try:
            usage = json.loads(content).get("usage") or {}
        except (ValueError, AttributeError):
            return None
        details = usage.get("prompt_tokens_details") or {} if isinstance(usage, dict) else {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(cached) is not int:
            return None
        self.reported_tokens[name] += cached
        return cached

    def _log_decision(self, name: str, decision: Decision, prompt_tokens: int, attempt: int,
                      cached: int | None, content: bytes = b"") -> None:
        """One debug line per routed request: where it went, why, what each backend looked like, and the
        answer's id and cached tokens (a stream's are not known yet)."""
        if not logger.isEnabledFor(logging.DEBUG):
            return
        try:
            answer_id = json.loads(content).get("id") if content else None
        except (ValueError, AttributeError):
            answer_id = None
        with self.lock:
            blocks = self.index.num_blocks()
        seen = {n: {"predicted": decision.predicted.get(n, 0), "cost": round(decision.costs.get(n, 0.0), 1),
                    "blocks": blocks.get(n, 0)} for n in self.backends}
        logger.debug("routed %s", json.dumps({"id": answer_id, "backend": name,
                                              "reason": "retry" if attempt else decision.reason,
                                              "prompt_tokens": prompt_tokens, "cached_tokens": cached,
                                              "backends": seen}))

    async def _relay(self, b: BackendState, resp: httpx.Response, ticket: int | None) -> AsyncIterator[bytes]:
        tail = b""
        try:
            async for chunk in resp.aiter_raw():
                tail = (tail + chunk)[-65536:]
                yield chunk
        except httpx.TransportError:
            b.mark_failed()
            error = {"error": {"message": f"backend {b.name} failed mid-stream", "type": "server_error",
                               "code": "backend_failed"}}
            yield f"data: {json.dumps(error)}\n\n".encode()
        finally:
            b.inflight -= 1
            if ticket is not None:
                self.inflight.remove(ticket)
            await resp.aclose()
        for line in reversed(tail.split(b"\n")):
            if line.startswith(b"data: {") and b'"usage"' in line:
                self._note_usage(b.name, line[6:])
                break

    # ------------------------------------------------------------------ metrics
    def metrics_text(self) -> str:
        """The router's own Prometheus exposition."""
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP hybridkv_router_{name} {help_text}", f"# TYPE hybridkv_router_{name} {kind}"])
            lines.extend(f"hybridkv_router_{name}{labels} {value:g}" for labels, value in samples)

        def per_backend(counter: Counter[str] | dict[str, float]) -> list[tuple[str, float]]:
            return [(f'{{backend="{n}"}}', float(counter.get(n, 0))) for n in self.backends]

        with self.lock:
            blocks = self.index.num_blocks()
            streams = {n: self.index.streams[n] for n in self.backends}
        family("requests_total", "counter", "Requests forwarded, by backend.", per_backend(self.requests))
        family("decisions_total", "counter", "Routing decisions: hit (the chosen backend alone had the largest "
               "predicted hit), load (another had a larger one), home (no hit stood out; the consistent-hash ring "
               "chose), tie (no hit stood out; load or turn chose), round_robin, retry (another backend after a "
               "failure).",
               [(f'{{reason="{r}"}}', float(n)) for r, n in sorted(self.decisions.items())])
        family("retries_total", "counter", "Attempts on another backend after one failed.", [("", self.retries)])
        family("failed_total", "counter", "Requests no backend could answer.", [("", self.failed)])
        family("prompt_tokens_total", "counter", "Prompt tokens forwarded.", per_backend(self.prompt_tokens))
        family("predicted_cached_tokens_total", "counter", "Prompt tokens the index predicted the chosen "
               "backend would serve from its caches (or from the prompts in flight there, once computed).",
               per_backend(self.predicted_tokens))
        family("reported_cached_tokens_total", "counter", "Cached prompt tokens the backends reported in usage.",
               per_backend(self.reported_tokens))
        family("backend_healthy", "gauge", "1 while the backend answers.",
               per_backend({n: float(b.healthy) for n, b in self.backends.items()}))
        family("backend_inflight", "gauge", "Requests in flight at the backend through this router.",
               per_backend({n: float(b.inflight) for n, b in self.backends.items()}))
        family("index_blocks", "gauge", "Block hashes indexed for the backend.",
               per_backend({n: float(blocks.get(n, 0)) for n in self.backends}))
        family("event_batches_total", "counter", "KV-event batches applied.",
               per_backend({n: float(s.batches) for n, s in streams.items()}))
        family("event_resyncs_total", "counter", "Index resyncs after lost events.",
               per_backend({n: float(s.resyncs) for n, s in streams.items()}))
        family("backend_restarts_total", "counter", "Backend restarts seen in the event stream.",
               per_backend({n: float(s.restarts) for n, s in streams.items()}))
        return "\n".join(lines) + "\n"


def build_app(router: ClusterRouter) -> FastAPI:
    """The router's HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="hybridkv router", lifespan=lifespan)

    async def body_of(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the request body must be a JSON object",
                                           "type": "invalid_request_error"}}, status_code=400)
        return body

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        body = await body_of(request)
        return body if isinstance(body, Response) else await router.forward("completions", body)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        body = await body_of(request)
        return body if isinstance(body, Response) else await router.forward("chat", body)

    @app.get("/v1/models", response_model=None)
    async def models() -> Response:
        for b in sorted(router.backends.values(), key=lambda b: not b.healthy):
            try:
                resp = await router.client.get(f"{b.url}/v1/models", timeout=5.0)
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                return Response(resp.content, media_type="application/json")
        return JSONResponse({"error": {"message": "no backend answered", "type": "server_error"}}, status_code=503)

    @app.get("/health")
    async def health() -> JSONResponse:
        up = [n for n, b in router.backends.items() if b.healthy]
        return JSONResponse({"status": "ok" if up else "unavailable", "backends_up": up},
                            status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics_text(), media_type=METRICS_CONTENT_TYPE)

    return app

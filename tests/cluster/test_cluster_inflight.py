"""Requests in flight count as the prefix their backend will hold: a document is placed once.

Pure parts (``InFlightPrefixes``), then the router's ``forward`` in front of mock backends whose
answers the test releases, so a second request for a document arrives while the first is still
being computed and before any KV event names it.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from hybridkv.cluster.hashes import HybridkvHashes
from hybridkv.cluster.inflight import InFlightPrefixes
from hybridkv.cluster.replica import RequestKeys
from hybridkv.cluster.router import BackendSpec, ClusterRouter, RouterConfig

from helpers import full, layout, tokens

SCHEME = HybridkvHashes()


def chain(token_ids: list[int]) -> list[bytes]:
    return RequestKeys(token_ids).hashes(SCHEME, 16, 16, False)


def test_a_shared_prefix_in_flight_is_predicted_in_whole_blocks_on_that_backend_only() -> None:
    flight = InFlightPrefixes()
    document = tokens(1000, 200)
    flight.add("a", chain(document + [1, 2, 3]))
    asked = document + [7, 8]  # 202 tokens: the 12 whole blocks of the document are shared
    assert flight.predict("a", chain(asked), 16, len(asked)) == 192
    assert flight.predict("b", chain(asked), 16, len(asked)) == 0
    other = tokens(5000, 200) + [7, 8]
    assert flight.predict("a", chain(other), 16, len(other)) == 0


def test_the_prediction_stops_below_the_last_prompt_token() -> None:
    flight = InFlightPrefixes()
    document = tokens(1000, 160)  # 10 whole blocks
    flight.add("a", chain(document))
    assert flight.predict("a", chain(document), 16, 160) == 144  # the last token is always computed


def test_a_prefix_stays_predicted_until_the_last_request_sharing_it_ends() -> None:
    flight = InFlightPrefixes()
    document = tokens(1000, 64)
    first, second = flight.add("a", chain(document + [1])), flight.add("a", chain(document + [2]))
    flight.remove(first)
    assert flight.predict("a", chain(document + [3]), 16, 65) == 64
    flight.remove(second)
    flight.remove(second)  # twice: ignored
    assert flight.predict("a", chain(document + [3]), 16, 65) == 0
    assert len(flight) == 0


class Backends:
    """Mock backends: each request is held until the test releases it, and answered with 0 cached tokens."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        self.release = asyncio.Event()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.seen.append((request.url.host + f":{request.url.port}", len(body["prompt"])))
        await self.release.wait()
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1, "total_tokens": 1,
                 "prompt_tokens_details": {"cached_tokens": 0}}
        return httpx.Response(200, json={"id": "cmpl-1", "choices": [{"text": "x"}], "usage": usage})


def make_router(backends: Backends, names: list[str]) -> ClusterRouter:
    client = httpx.AsyncClient(transport=httpx.MockTransport(backends.handle))
    router = ClusterRouter(RouterConfig([BackendSpec(f"http://{n}") for n in names]), client=client)
    for n in names:  # a known layout (full attention, 16-token blocks) instead of one learned from events
        router.index.remove_replica(n)
        router.index.add_replica(n, scheme=SCHEME, layout=layout(64, full()))
    return router


def test_a_second_request_for_a_document_in_flight_follows_it_despite_the_queue() -> None:
    async def scenario() -> list[tuple[str, int]]:
        backends = Backends()
        router = make_router(backends, ["a:1", "b:1", "c:1"])
        document = tokens(1000, 320)
        first = asyncio.create_task(router.forward("completions", {"prompt": document + [1, 2]}))
        while not backends.seen:
            await asyncio.sleep(0)
        # No event has named the document yet; its first request holds one backend's queue.
        second = asyncio.create_task(router.forward("completions", {"prompt": document + [3, 4]}))
        other = asyncio.create_task(router.forward("completions", {"prompt": tokens(9000, 322)}))
        while len(backends.seen) < 3:
            await asyncio.sleep(0)
        backends.release.set()
        await asyncio.gather(first, second, other)
        assert len(router.inflight) == 0  # every ticket returned
        await router.client.aclose()
        return backends.seen

    seen = asyncio.run(scenario())
    (where, _), (again, _), (elsewhere, _) = seen
    # 320 of the second prompt's 322 tokens will be cached where the first went: (322 - 320) + 0.25 * 322 * 1
    # queued = 82.5 beats 322 on an idle backend. The unrelated prompt goes to a third, idle backend.
    assert again == where
    assert elsewhere not in (where, again)

"""The KV-aware router in front of small fake backends.

A fake backend (this file run as a program) is a tiny OpenAI-style server around a real hybridkv
``KVCacheManager`` (full attention + a sliding window, a small pool): a request is looked up,
admitted, "computed" after a short sleep, freed; its events go out through ``KVEventPublisher``;
its response reports the cached tokens the manager found. Tokens are a prompt's UTF-8 bytes.

* Routed by predicted hits, a shared-prefix workload gets >= 2x the cached tokens round-robin gets,
  and the router's predicted cached tokens equal what the backends report.
* A backend killed mid-run loses no request: what it had not answered is retried elsewhere.
* Streams pass through; chat completions are tokenized by a backend; the router's /metrics.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hybridkv.cluster import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    BlockStoredEvent,
    ClusterIndex,
    HybridkvHashes,
    make_batch,
)
from hybridkv.cluster.inflight import InFlightPrefixes
from hybridkv.cluster.replica import Prediction, RequestKeys
from hybridkv.cluster.router_cli import main as route_main
from hybridkv.cluster.routing import BackendState, Policy, estimate_hits
from hybridkv.cluster.scrape import BackendLoad, parse_load
from hybridkv.engine.metrics import EngineMetrics
from hybridkv.errors import InvalidInputError

from helpers import full, layout, manager, swa, tokens

HERE = Path(__file__).resolve()


# ---------------------------------------------------------------------- pure parts
def test_metrics_of_both_engines_are_read() -> None:
    ours = EngineMetrics().render({"kv_cache_usage_perc": (0.5, "KV-cache usage."),  # as hybridkv serve names them
                                   "num_requests_running": (3, "Running."), "num_requests_waiting": (2, "Waiting.")},
                                  model_name="gemma-3-270m")
    vllm = 'vllm:num_requests_running{model_name="m",engine="0"} 1.0\n' \
           'vllm:num_requests_running{model_name="m",engine="1"} 2.0\n' \
           'vllm:num_requests_waiting{model_name="m",engine="0"} 4.0\nvllm:kv_cache_usage_perc{engine="0"} 0.25\n'
    assert parse_load(ours) == BackendLoad(3, 2, 0.5)
    assert parse_load(vllm) == BackendLoad(3, 4, 0.25)
    assert parse_load("up 1\n") is None


def test_the_prefix_policy_trades_a_predicted_hit_against_the_queue() -> None:
    a, b = BackendState("a", "http://a"), BackendState("b", "http://b")
    policy = Policy("prefix", load_weight=0.25, kv_weight=0)
    b.load = BackendLoad(running=2)
    decision = policy.rank([a, b], {"b": 1000}, prompt_tokens=1200)
    assert decision.order == ("b", "a") and decision.reason == "hit"  # 200 + 0.25 * 1200 * 2 = 800 < 1200
    b.load = BackendLoad(running=4)
    decision = policy.rank([a, b], {"b": 1000}, prompt_tokens=1200)
    assert decision.order == ("a", "b") and decision.reason == "load"  # 200 + 1200 > 1200


def test_the_balance_of_hit_and_load_does_not_depend_on_the_prompt_length() -> None:
    a, b = BackendState("a", "http://a"), BackendState("b", "http://b")
    b.load = BackendLoad(running=3, kv_usage=0.5)
    policy = Policy("prefix")
    for prompt in (300, 3_000, 30_000):  # b holds 90% of the prompt, a nothing
        assert policy.rank([a, b], {"b": prompt * 9 // 10}, prompt_tokens=prompt).order == ("b", "a")


def test_hybrid_exact_keeps_a_prefix_where_it_is_until_its_backlog_outweighs_the_hit() -> None:
    a, b = BackendState("a", "http://a"), BackendState("b", "http://b")
    policy = Policy("hybrid_exact", miss_weight=4)
    a.load = BackendLoad(running=2, prefill_tokens=0)
    for backlog, winner in ((0, "b"), (3_999, "b"), (4_001, "a"), (20_000, "a")):
        # b holds 1,000 of the 1,200 prompt tokens: it wins while its backlog is under 4 x 1,000 tokens.
        b.load = BackendLoad(running=2, prefill_tokens=backlog)
        decision = policy.rank([a, b], {"b": 1000}, prompt_tokens=1200)
        assert decision.order[0] == winner
        assert decision.reason == ("hit" if winner == "b" else "load")
        running = 0.1 * 1200 * 2  # each running request weighs a tenth of the prompt
        assert decision.costs == pytest.approx({"a": 4 * 1200 + running, "b": 4 * 200 + backlog + running})
    # Requests decoding weigh too: five more running on b (5 x 0.1 x 1,200 = 600) outweigh a hit of 125
    # tokens (4 x 125 = 500), not one of 250 (1,000).
    b.load = BackendLoad(running=7, prefill_tokens=0)
    assert policy.rank([a, b], {"b": 125}, prompt_tokens=1200).order[0] == "a"
    assert policy.rank([a, b], {"b": 250}, prompt_tokens=1200).order[0] == "b"


def test_hybrid_exact_moves_a_prefix_off_an_overloaded_backend_whatever_it_holds() -> None:
    a, b, c = (BackendState(n, f"http://{n}") for n in "abc")
    policy = Policy("hybrid_exact", balance=1.25, slack=2)
    for queued in range(12):
        b.load = BackendLoad(running=queued, prefill_tokens=0)  # nothing to prefill: only the bound can move it
        decision = policy.rank([a, b, c], {"b": 1200}, prompt_tokens=1200)
        bound = math.ceil(1.25 * (queued + 1) / 3) + 2
        assert decision.bound == bound
        if queued + 1 <= bound:
            assert decision.order[0] == "b" and decision.reason == "hit"
        else:
            assert decision.order[0] in "ac" and decision.order[-1] == "b" and decision.reason == "load"
    assert next(q for q in range(12) if q + 1 > math.ceil(1.25 * (q + 1) / 3) + 2) == 5  # the bound did move it


def test_the_prefill_ahead_of_a_backend_counts_what_the_router_sent_since_its_last_report() -> None:
    b = BackendState("b", "http://b")
    assert b.prefill_ahead is None  # a backend that does not report it: requests in flight stand in
    b.mark_ok(BackendLoad(running=2, prefill_tokens=500))
    b.sent_tokens += 300
    assert b.prefill_ahead == 800
    b.mark_ok()  # a request answered: no new report
    assert b.prefill_ahead == 800
    b.mark_ok(BackendLoad(running=2, prefill_tokens=100))  # the next report includes what was sent
    assert b.prefill_ahead == 100
    text = EngineMetrics().render({"num_requests_running": (2, "r"), "num_prefill_tokens_pending": (640, "p")},
                                  model_name="m")
    assert parse_load(text) == BackendLoad(2, 0, 0, 640)


def test_hybrid_exact_prefers_the_larger_credited_hit_among_backends_within_the_bound() -> None:
    a, b, c = (BackendState(n, f"http://{n}") for n in "abc")
    policy = Policy("hybrid_exact")
    found = {"a": Prediction("a", 800, (("CPU", 800),)), "b": Prediction("b", 700, (("GPU", 700),)),
             "c": Prediction("c", 0, ())}
    decision = policy.rank([a, b, c], {n: p.tokens for n, p in found.items()}, 1000,
                           credited={n: policy.credit(p) for n, p in found.items()})
    assert decision.order == ("b", "a", "c")  # 800 host tokens are worth 640 device tokens: less than 700
    assert decision.reason == "hit"


def test_hybrid_exact_sends_a_prompt_to_the_tier_that_holds_its_chain_past_the_hit() -> None:
    # A 200-token prompt (12 full blocks; a hit needs the 3 window blocks before it). Nobody can serve a
    # hit: a and b hold its full-attention chain to block 9 without the windows (a on its device, b in
    # its host tier), c holds nothing and has the least prefill queued.
    scheme = HybridkvHashes()
    prompt = tokens(0, 200)
    h = scheme.chain(prompt, 16, None)
    index = ClusterIndex()
    for name in "abc":
        index.add_replica(name, scheme=scheme, layout=layout(10, full(16), swa(40, 16)))
    for name, medium in (("a", MEDIUM_GPU), ("b", MEDIUM_CPU)):
        index.apply_events(name, make_batch([BlockStoredEvent(tuple(h[:10]), None, (), 16, medium, 0,
                                                              "full_attention")]))
    backends = [BackendState(n, "", load=BackendLoad(prefill_tokens=q)) for n, q in (("a", 50), ("b", 100),
                                                                                         ("c", 0))]

    def route(policy: Policy) -> tuple[tuple[str, ...], str, dict[str, float]]:
        hits = estimate_hits(policy, index, RequestKeys(prompt), "abc", InFlightPrefixes(), len(prompt))
        assert hits.predicted == {"a": 0, "b": 0, "c": 0}
        decision = policy.rank(backends, hits.predicted, len(prompt), credited=hits.credited, home=hits.home,
                               junctions=hits.junctions)
        return decision.order, decision.reason, hits.junctions

    # b's tier holds 160 tokens of the chain past the hit: computed on b, the request leaves the window
    # at that junction in b's tier, where the next prompt sharing the 160 tokens hits. Worth half of 160
    # host tokens (0.8 each): 6 * 64 = 384 tokens of queue, more than b's 100 more than c's. A chain on
    # the device only is worth nothing (a device keeps such windows for seconds, not for the next sharer).
    order, reason, junctions = route(Policy("hybrid_exact"))
    assert junctions == {"b": 128.0}
    assert (order, reason) == (("b", "c", "a"), "junction")
    # Without the junction term the least queue wins.
    order, reason, junctions = route(Policy("hybrid_exact", junction_weight=0))
    assert (order, reason, junctions) == (("c", "a", "b"), "tie", {})
    # The junction never outweighs a hit: c holding the whole chain on its device (windows too) wins.
    index.apply_events("c", make_batch([BlockStoredEvent(tuple(h[:10]), None, (), 16, MEDIUM_GPU, 0, "full_attention"),
                                        BlockStoredEvent(tuple(h[7:10]), None, (), 16, MEDIUM_GPU, 1,
                                                         "sliding_window", 40)]))
    hits = estimate_hits(Policy("hybrid_exact"), index, RequestKeys(prompt), "abc", InFlightPrefixes(), len(prompt))
    assert hits.predicted["c"] == 160
    assert Policy("hybrid_exact").rank(backends, hits.predicted, len(prompt), credited=hits.credited,
                                       junctions=hits.junctions).order[0] == "c"


def test_a_junction_is_the_chain_past_the_hit_in_the_tiers_at_their_weights() -> None:
    policy = Policy("hybrid_exact")
    chain = Prediction("r", 1000, ((MEDIUM_GPU, 300), (MEDIUM_CPU, 500), ("STORAGE", 200)))
    assert policy.junction(chain, 0) == 0.8 * 500 + 0.5 * 200  # the device's 300 count for nothing
    assert policy.junction(chain, 600) == 0.8 * 200 + 0.5 * 200
    assert policy.junction(chain, 900) == 0.5 * 100
    assert policy.junction(chain, 1000) == 0


def test_a_new_prefix_goes_to_its_home_on_the_ring_and_stays_there() -> None:
    names = [f"replica-{i}" for i in range(8)]
    backends = [BackendState(n, "") for n in names]
    policy = Policy("hybrid_exact")
    homes = {}
    for i in range(800):
        key = hashlib.sha256(b"prefix %d" % i).digest()
        decision = policy.rank(backends, {}, 1000, home=key)
        assert decision.reason == "home"
        assert policy.rank(backends, {}, 1000, home=key).order == decision.order  # the same home every time
        homes[key] = decision.order[0]
    spread = Counter(homes.values())
    assert set(spread) == set(names) and max(spread.values()) < 2.5 * 100  # 100 each on average
    # A backend leaving moves only the keys whose home it was.
    fewer = Policy("hybrid_exact")
    moved = [k for k, home in homes.items() if fewer.rank(backends[1:], {}, 1000, home=k).order[0] != home]
    assert all(homes[k] == "replica-0" for k in moved)


def test_a_hot_prefix_never_piles_a_backend_past_the_bound() -> None:
    names = [f"replica-{i}" for i in range(6)]
    backends = {n: BackendState(n, "") for n in names}
    policy = Policy("hybrid_exact", balance=1.25, slack=1)
    key = hashlib.sha256(b"the one hot system prompt").digest()
    ring = policy.ring_order(names, key)
    held: set[str] = set()
    for _ in range(60):  # every request shares the prefix; none finishes
        predicted = dict.fromkeys(held, 900)
        decision = policy.rank(list(backends.values()), predicted, 1000, home=key)
        chosen = decision.order[0]
        assert backends[chosen].queue + 1 <= decision.bound  # never past the bound
        if not held:
            assert chosen == ring[0]
        elif chosen not in held:  # the holders are all at the bound: the next backend on the ring takes it
            assert chosen == next(n for n in ring if n not in held)
        held.add(chosen)
        backends[chosen].inflight += 1
    # The busiest holds at most 1.25 times the mean plus the slack; the prefix spread over as few
    # backends as that allows (a cold backend stays free for other prefixes).
    loads = [b.inflight for b in backends.values()]
    assert max(loads) <= math.ceil(1.25 * 60 / 6) + 1 == 14
    assert len(held) == math.ceil(60 / 14)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"balance": 0.9}, "balance must be a number >= 1"),
    ({"slack": -1}, "slack must be a whole number"),
    ({"home_tokens": 0}, "home_tokens must be a positive number"),
    ({"miss_weight": 0}, "miss_weight must be a positive number"),
    ({"junction_weight": 1.5}, "junction_weight must be a fraction"),
])
def test_bad_locality_settings_are_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        Policy("hybrid_exact", **kwargs)


def test_a_failed_backend_is_tried_last() -> None:
    a, b, c = (BackendState(n, f"http://{n}") for n in "abc")
    a.mark_failed()
    assert Policy("hybrid_exact").rank([a, b, c], {"a": 5000}, 6000).order == ("b", "c", "a")
    assert Policy("round_robin").rank([a, b, c], {}, 0).order[-1] == "a"


def test_a_tier_hit_is_credited_below_a_device_hit_of_the_same_length() -> None:
    a, b = BackendState("a", "http://a"), BackendState("b", "http://b")
    policy = Policy("hybrid_exact")

    def rank(pa: Prediction, pb: Prediction) -> tuple[str, ...]:
        found = {"a": pa, "b": pb}
        return policy.rank([a, b], {n: p.tokens for n, p in found.items()}, 1000,
                           credited={n: policy.credit(p) for n, p in found.items()}).order

    device = Prediction("a", 800, (("GPU", 800),))
    # 800 host tokens are worth 640 device tokens: the device hit wins whichever backend comes first.
    assert rank(device, Prediction("b", 800, (("CPU", 800),))) == ("a", "b")
    assert rank(Prediction("a", 800, (("CPU", 800),)), Prediction("b", 800, (("GPU", 800),))) == ("b", "a")
    # 100 device tokens and 900 host tokens (100 + 720 = 820) beat 800 on the device.
    assert rank(device, Prediction("b", 1000, (("GPU", 100), ("CPU", 900)))) == ("b", "a")
    # A disk hit counts half: 1000 disk tokens (500) lose to 800 on the device.
    assert rank(device, Prediction("b", 1000, (("STORAGE", 1000),))) == ("a", "b")


def test_medium_weights_can_be_set_and_unknown_media_count_half() -> None:
    policy = Policy("hybrid_exact", medium_weights={"STORAGE": 0.9, "CPU": 1})
    hit = Prediction("a", 700, (("GPU", 100), ("CPU", 200), ("STORAGE", 300), ("REDIS", 100)))
    assert policy.credit(hit) == 100 + 200 + 270 + 50
    assert Policy("hybrid_exact").credit(hit) == 100 + 160 + 150 + 50


@pytest.mark.parametrize(("argv", "message"), [
    (["--backend", "127.0.0.1:8001"], "must be an http:// or https:// URL"),
    (["--backend", "http://h:1,events=h:2"], "events must be a ZMQ endpoint"),
    (["--backend", "http://h:1,replay=tcp://h:3"], "a replay endpoint needs an events endpoint"),
    (["--backend", "http://h:1,groups=zero"], "groups must be a positive integer"),
    (["--backend", "http://h:1,colour=red"], "unknown option 'colour'"),
    (["--backend", "http://h:1", "--backend", "http://h:1"], "the same URL given twice"),
    (["--backend", "http://h:1,hash=md5"], "unknown hash scheme 'md5'"),
    (["--backend", "http://h:1", "--medium-weight", "CPU"], "--medium-weight 'CPU': expected MEDIUM=FRACTION"),
    (["--backend", "http://h:1", "--medium-weight", "CPU=1.5"], "with a fraction in [0, 1]"),
    (["--backend", "http://h:1", "--balance", "0.5"], "balance must be a number >= 1"),
    (["--backend", "http://h:1", "--home-tokens", "0"], "home_tokens must be a positive number"),
])
def test_a_bad_command_line_is_one_line_and_exit_2(argv: list[str], message: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert route_main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


# ---------------------------------------------------------------------- processes
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Fake:
    """A fake backend process."""

    def __init__(self, num_blocks: int = 120, delay: float = 0.0) -> None:
        tests = str(HERE.parents[1])  # the suite's shared helpers
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen([sys.executable, str(HERE), "--fake-backend", str(num_blocks), str(delay)],
                                     stdout=subprocess.PIPE, text=True, cwd=HERE.parent, env=env)
        assert self.proc.stdout is not None
        info = json.loads(self.proc.stdout.readline())
        self.url, self.events, self.replay = info["url"], info["events"], info["replay"]

    @property
    def spec(self) -> str:
        return f"{self.url},events={self.events},replay={self.replay},hash=hybridkv,groups=2"

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


class Router:
    def __init__(self, backends: list[Fake], policy: str = "hybrid_exact") -> None:
        self.port = _free_port()
        argv = [sys.executable, "-m", "hybridkv.cluster.router_cli", "--port", str(self.port), "--policy", policy,
                "--metrics-interval", "0.2"]
        for b in backends:
            argv += ["--backend", b.spec]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
            assert time.monotonic() < deadline, "router did not start"
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def total(self, family: str) -> float:
        return sum(v for k, v in self.metrics().items() if k.startswith(f"hybridkv_router_{family}"))

    def close(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Any:
    made: list[Any] = []

    def make(n: int, policy: str = "hybrid_exact", **kw: Any) -> tuple[Router, list[Fake]]:
        fakes = [Fake(**kw) for _ in range(n)]
        made.extend(fakes)
        router = Router(fakes, policy)
        made.append(router)
        return router, fakes

    yield make
    for thing in made:
        if isinstance(thing, Router):
            thing.close()
        elif thing.proc.poll() is None:
            thing.kill()


def _synced(router: Router, fakes: list[Fake]) -> None:
    """Wait until the router has applied every batch the backends published."""
    deadline = time.monotonic() + 10
    while True:
        published = sum(httpx.get(f"{f.url}/published").json()["published"] for f in fakes if f.proc.poll() is None)
        if router.total("event_batches_total") >= published:
            return
        assert time.monotonic() < deadline, "the router's index did not catch up"
        time.sleep(0.05)


def _prompts() -> list[str]:
    """35 requests over 5 shared prefixes of ~370 tokens: one backend's pool holds 4 of them at most;
    5 prefixes over 3 backends in turn means every backend sees every prefix."""
    heads = [f"system prompt {p}: " + "you are a helpful assistant. " * 12 for p in range(5)]
    return [heads[i % 5] + f"question {i}?" for i in range(35)]


def _cached_tokens(policy: str, cluster: Any) -> tuple[float, float]:
    router, fakes = cluster(3, policy)
    with httpx.Client(timeout=30) as client:
        for prompt in _prompts():
            _synced(router, fakes)
            r = client.post(f"{router.url}/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 4})
            assert r.status_code == 200, r.text
    return router.total("reported_cached_tokens_total"), router.total("predicted_cached_tokens_total")


def test_routing_by_predicted_hits_doubles_the_cached_tokens_of_round_robin(cluster: Any) -> None:
    hybrid, predicted = _cached_tokens("hybrid_exact", cluster)
    round_robin, _ = _cached_tokens("round_robin", cluster)
    assert hybrid >= 2 * round_robin, (hybrid, round_robin)
    assert predicted == hybrid  # every prediction was what the backend then found


def test_a_backend_killed_mid_run_loses_no_request(cluster: Any) -> None:
    router, fakes = cluster(3, delay=0.4)
    prompts = _prompts()

    def send(prompt: str) -> int:
        with httpx.Client(timeout=60) as client:
            r = client.post(f"{router.url}/v1/completions", json={"model": "fake", "prompt": prompt, "max_tokens": 2})
            return r.status_code

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(send, p) for p in prompts]
        deadline = time.monotonic() + 20
        while parse_load(httpx.get(f"{fakes[0].url}/metrics").text).running < 1:  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "no request reached the first backend"
            time.sleep(0.02)
        fakes[0].kill()  # with requests in flight there, and others about to be routed to it
        codes = [f.result() for f in futures]
    assert codes == [200] * len(prompts)
    m = router.metrics()
    assert m["hybridkv_router_retries_total"] >= 1
    assert m[f'hybridkv_router_backend_healthy{{backend="{fakes[0].url.split("://")[1]}"}}'] == 0


def test_a_stream_passes_through_with_its_usage(cluster: Any) -> None:
    router, fakes = cluster(2)
    body = {"model": "fake", "prompt": "hello " * 40, "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.Client(timeout=30) as client:
        for _ in range(2):
            _synced(router, fakes)
            with client.stream("POST", f"{router.url}/v1/completions", json=body) as r:
                lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1] if '"choices": [{' in line]
    assert texts == ["t0", "t1", "t2", "t3", "t4"]
    assert router.total("reported_cached_tokens_total") == router.total("predicted_cached_tokens_total") == 224


def test_chat_completions_are_tokenized_by_a_backend_and_routed_by_hits(cluster: Any) -> None:
    router, fakes = cluster(3)
    messages = [{"role": "system", "content": "be brief. " * 30}, {"role": "user", "content": "hi"}]
    with httpx.Client(timeout=30) as client:
        for _ in range(3):
            _synced(router, fakes)
            r = client.post(f"{router.url}/v1/chat/completions", json={"model": "fake", "messages": messages})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    m = router.metrics()
    assert sorted(v for k, v in m.items() if k.startswith("hybridkv_router_requests_total")) == [0, 0, 3]
    # The first placed by the ring (no backend held anything), the next two by the hit it left.
    assert (m['hybridkv_router_decisions_total{reason="home"}'], m['hybridkv_router_decisions_total{reason="hit"}']) \
        == (1, 2)


# ---------------------------------------------------------------------- the fake backend
def _fake_backend(num_blocks: int, delay: float) -> None:  # pragma: no cover - runs in a subprocess
    import asyncio

    import uvicorn

    from hybridkv import Sequence
    from hybridkv.cluster.publisher import KVEventPublisher

    mgr = manager(num_blocks, full(16), swa(64, 16), max_model_len=4096, batch=4096, enable_events=True)
    pub = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    app = FastAPI()
    state = {"running": 0, "n": 0}

    def tokens(text: str) -> list[int]:
        return list(text.encode())

    async def generate(prompt: list[int], salt: str | None) -> int:
        state["n"] += 1
        seq = Sequence(f"r{state['n']}", prompt, cache_salt=salt)
        hit = mgr.lookup(seq)
        state["running"] += 1
        try:
            while mgr.allocate(seq, seq.num_tokens - hit.num_tokens, hit=hit) is None:
                await asyncio.sleep(0.01)
                hit = mgr.lookup(seq)
            pub.publish_manager(mgr)
            await asyncio.sleep(delay)
            seq.num_computed_tokens = seq.num_tokens
            mgr.free(seq)
            pub.publish_manager(mgr)
            return hit.num_tokens
        finally:
            state["running"] -= 1

    def usage(prompt: list[int], cached: int, n: int) -> dict[str, Any]:
        return {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": len(prompt) + n,
                "prompt_tokens_details": {"cached_tokens": cached}}

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        body = await request.json()
        prompt = body["prompt"] if isinstance(body["prompt"], list) else tokens(body["prompt"])
        cached = await generate(prompt, body.get("cache_salt"))
        n = body.get("max_tokens", 4)
        if not body.get("stream"):
            return JSONResponse({"object": "text_completion", "choices": [{"index": 0, "text": " ok" * n}],
                                 "usage": usage(prompt, cached, n)})

        async def sse() -> Any:
            for i in range(n):
                yield f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n"
                await asyncio.sleep(0.01)
            yield f"data: {json.dumps({'choices': [], 'usage': usage(prompt, cached, n)})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(sse(), media_type="text/event-stream")

    def chat_tokens(messages: list[dict[str, str]]) -> list[int]:
        return tokens("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        body = await request.json()
        prompt = chat_tokens(body["messages"])
        cached = await generate(prompt, body.get("cache_salt"))
        return {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant",
                                                                                   "content": "ok"}}],
                "usage": usage(prompt, cached, 1)}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await request.json()
        ids = chat_tokens(body["messages"]) if "messages" in body else tokens(body["prompt"])
        return {"tokens": ids, "count": len(ids)}

    @app.get("/metrics", response_model=None)
    async def metrics() -> Response:
        return Response(f"hybridkv_num_requests_running {state['running']}\nhybridkv_num_requests_waiting 0\n"
                        f"hybridkv_kv_cache_usage {mgr.usage}\n")

    @app.get("/published")
    async def published() -> dict[str, int]:
        return {"published": pub.num_published}

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(json.dumps({"url": f"http://127.0.0.1:{sock.getsockname()[1]}", "events": pub.endpoint,
                      "replay": pub.replay_endpoint}), flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="error")).run(sockets=[sock])


if __name__ == "__main__" and sys.argv[1:2] == ["--fake-backend"]:  # pragma: no cover
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    _fake_backend(int(sys.argv[2]), float(sys.argv[3]))

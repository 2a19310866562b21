"""A real cluster on this machine: N ``hybridkv serve`` replicas with their own host tiers, the
KV-aware router, optionally a shared Redis tier.

    python bench/cluster_serve.py [--workload shared-prefix|multi-turn] [--replicas 3] [--pool SIZE]
        [--host-tier SIZE|0] [--prefixes 9] [--requests 54] [--conversations 12] [--turns 4]
        [--max-tokens N] [--in-flight 3] [--max-model-len N]
        [--policies hybrid_exact,prefix,round_robin,least_loaded]
        [--no-redis] [--kill] [--no-big] [--router-args '...'] [--json FILE]

Each replica serves the embedded Gemma 3 270M with a small KV pool (``--pool``; default 24 MiB for
shared-prefix, 16 MiB for multi-turn) and its own host-memory tier (``--kv-tier host:SIZE``;
``--host-tier``, default 3x the pool, ``0`` for none), and publishes its KV events
(``--kv-events-endpoint``: the device pool's as medium ``GPU``, the host tier's stores and
evictions as ``CPU``, which the router credits per medium). With Redis (default) every replica
also writes through to, and loads from, one shared Redis tier. For each routing policy the
replicas start afresh, the router (``hybridkv route``) starts in front of them, and the same
workload goes through it, closed loop with ``--in-flight`` requests outstanding:

* ``shared-prefix`` (default): PREFIXES documents of ~300 tokens, each asked REQUESTS / PREFIXES
  questions, in an interleaved random order (2 output tokens each);
* ``multi-turn``: CONVERSATIONS conversations of TURNS turns, each opening with its own ~270-token
  text (no two share a block, so reuse comes only from a conversation's own history); each next
  turn's prompt is the previous prompt, the model's actual reply to it (temperature 0, MAX_TOKENS
  tokens) and a new user message, sent only once the previous turn's answer is back. The turns go
  out in rounds, each round a seeded permutation of the conversations (the earliest pending turn
  whose conversation is idle goes next), so between two turns of a conversation every other
  conversation has a turn: the device pools alone cannot hold all conversations, and a next turn
  is served from cache only where its history is (a replica's device pool or host tier).

The cached prompt tokens the replicas report in ``usage`` are summed, split into those served from
the replica's own device cache (``cached_tokens - external_tokens``) and those loaded from a tier
(``external_tokens``: its host tier or the shared Redis tier). A single replica with REPLICAS times
the pool and REPLICAS times the host tier (no Redis) serves the same workload as the upper bound. With
``--kill`` one more ``hybrid_exact`` run kills one replica (SIGKILL) halfway through: every request
must still be answered (the router retries on another replica; a conversation whose history was
there continues elsewhere).

Prints, per configuration: prompt tokens, cached prompt tokens (device, tier, total) and the total's
share of prompt tokens, the router's predicted cached tokens, failed requests, wall time; then the
order of the policies by total cached share (to compare with the simulator's, ``hybridkv simulate
--compare router=...``), and hybrid_exact's total cached share over round_robin's and over the
single big replica's (with a shared Redis tier every policy reaches about the same total: compare
device-cached tokens, also printed). Targets (issue 26): the simulator's order of policies
(hybrid_exact first); ``hybrid_exact`` >= 2x ``round_robin`` and >= 90% of the single big replica
(device-cached tokens on shared-prefix with Redis, as the README measures); 0 failed requests when a
replica is killed. ``--json FILE`` writes the settings, every row (with each request's figures),
the order and the ratios.
Needs the engine, server and cluster extras and ``redis-server`` on PATH (or ``--no-redis``).
Several minutes on a 2-core machine (each replica loads the model; CPU prefill is ~2-3 s per
300-token prompt here): ``--workload multi-turn --no-redis --kill`` took about 12.5 minutes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
HYBRIDKV = [sys.executable, "-m", "hybridkv.cli"]
TOPICS = ["harbour", "orchard", "library", "railway", "observatory", "market", "bridge", "theatre"]
POLICIES = "hybrid_exact,prefix,round_robin,least_loaded"
BIG = "one replica, x pool"
DEFAULT_POOL = {"shared-prefix": "24MiB", "multi-turn": "16MiB"}
HOST_TIER_TIMES_POOL = 3
"""``--host-tier`` default: this many times the pool (a host tier holds copies of what the device holds:
write-through, so it must be larger than the pool to add anything)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def workload(prefixes: int, requests: int, seed: int = 5) -> tuple[list[str], list[int]]:
    """Prompts: a ~300-token document per prefix plus a question, the documents in a random order;
    and each prompt's document."""
    rng = random.Random(seed)
    docs = []
    for i in range(prefixes):
        topic = TOPICS[i % len(TOPICS)]
        sentences = [f"The {topic} committee met on day {d} to discuss item {rng.randrange(1000)}, "
                     f"and the members recorded {rng.randrange(100)} points about the {topic}." for d in range(12)]
        docs.append(" ".join(sentences))
    questions = ["What was decided?", "Who attended?", "How many points were recorded?", "When is the next meeting?",
                 "Which item mattered most?", "What did the members ask?", "Summarise the minutes.", "Any objections?"]
    # Each document's questions arrive in a random order, as real traffic does (a fixed cycle over the
    # documents would let round robin map each document to one replica by accident).
    order = [i % prefixes for i in range(requests)]
    rng.shuffle(order)
    asked = [0] * prefixes
    prompts = []
    for doc in order:
        k = asked[doc]
        asked[doc] += 1
        prompts.append(f"{docs[doc]}\nQuestion {k}: {questions[k % len(questions)]}\nAnswer:")
    return prompts, order


NAMES = ["Ada", "Bruno", "Chiara", "Dmitri", "Elif", "Farah", "Goran", "Hana", "Ines", "Jonas", "Kenji", "Lena"]
FOLLOW_UPS = ["Can you say more about that?", "Which of these matters most, and why?",
              "What should we do first next week?", "Summarise it in one sentence.", "Are there any risks left?",
              "Who should own the follow-up?", "What numbers back that up?", "What would you change?"]


def conversations(count: int, turns: int, seed: int = 7) -> tuple[list[str], list[list[str]], list[int]]:
    """Multi-turn chats: per conversation an opening text of ~250 tokens (system line, notes, first
    question) that differs from every other from its first block on, and its later user messages;
    and the order the turns are sent in: ``turns`` rounds, each a seeded permutation of the
    conversations (entry ``c`` in round ``t`` is conversation ``c``'s turn ``t``)."""
    rng = random.Random(seed)
    openings, messages = [], []
    for c in range(count):
        topic = TOPICS[c % len(TOPICS)]
        name = NAMES[c % len(NAMES)]
        notes = " ".join(f"Note {k}: on day {rng.randrange(1, 365)} the {topic} team under {name} handled "
                         f"case {rng.randrange(10000)} with {rng.randrange(2, 90)} people and a budget of "
                         f"{rng.randrange(100, 9999)} euros." for k in range(6))
        openings.append(f"Conversation {c} with {name}, who runs the {topic} project number {rng.randrange(1000)}. "
                        f"System: you are a concise assistant for the {topic} project.\n"
                        f"User: here are my notes. {notes} What stands out in these notes?\nAssistant:")
        messages.append([f"\nUser: {rng.choice(FOLLOW_UPS)} (about case {rng.randrange(10000)})\nAssistant:"
                         for _ in range(turns - 1)])
    order: list[int] = []
    for _ in range(turns):
        round_ = list(range(count))
        rng.shuffle(round_)
        order += round_
    return openings, messages, order


class Replica:
    def __init__(self, name: str, pool: str, redis_url: str | None, env: dict[str, str], log_dir: Path,
                 host_tier: int = 0, max_model_len: int = 1024) -> None:
        self.name = name
        self.options = ["--kv-cache-memory", pool, "--max-model-len", str(max_model_len),
                        "--max-num-batched-tokens", "512", "--log-level", "warning"]
        if host_tier:
            self.options += ["--kv-tier", f"host:{host_tier}"]
        if redis_url:
            self.options += ["--kv-store", redis_url]
        self.env = env
        self.log_path = log_dir / f"{name}.log"
        self._start()

    def _start(self) -> None:
        """Start the server on free ports (chosen now: another process may take one first, see ``wait``)."""
        self.port = free_port()
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        cmd = [*HYBRIDKV, "serve", "--port", str(self.port), "--kv-events-endpoint", self.events,
               "--kv-events-replay-endpoint", self.replay, *self.options]
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT)

    def wait(self, timeout: float = 300.0) -> None:
        """Wait until it serves; started again on new ports (up to twice) when one of its ports was
        taken between choosing it and binding it."""
        for attempt in range(3):
            try:
                wait_ready(self.url, self.proc, timeout)
                return
            except RuntimeError:
                self.log.close()
                if attempt == 2 or "Address already in use" not in self.log_path.read_text():
                    raise
                self._start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def backend(self) -> str:
        return f"{self.url},events={self.events},replay={self.replay},hash=hybridkv,groups=6"

    def stop(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def wait_ready(url: str, proc: subprocess.Popen[Any], timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not ready after {timeout:.0f} s")


def complete(url: str, prompt: str, salt: str, max_tokens: int) -> dict[str, Any] | None:
    """One completion through ``url`` (temperature 0); None when it failed."""
    body = {"model": "gemma-3-270m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "cache_salt": salt}
    try:
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=600.0)
    except httpx.HTTPError:
        return None
    return resp.json() if resp.status_code == 200 else None


class Tally:
    """Cached prompt tokens summed over answers, and per request in sending order."""

    def __init__(self) -> None:
        self.cached = self.external = self.prompt_tokens = self.failed = 0
        self.requests: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()

    def add(self, answer: dict[str, Any] | None, **where: Any) -> None:
        if answer is None:
            self.failed += 1
            self.requests.append({**where, "failed": True})
            return
        usage = answer["usage"]
        details = usage.get("prompt_tokens_details") or {}
        cached, external = details.get("cached_tokens", 0), details.get("external_tokens", 0)
        self.prompt_tokens += usage["prompt_tokens"]
        self.cached += cached
        self.external += external
        self.requests.append({**where, "id": answer.get("id"), "prompt_tokens": usage["prompt_tokens"],
                              "cached_tokens": cached, "tier_tokens": external})

    def row(self) -> dict[str, Any]:
        return {"cached_tokens": self.cached, "device_cached_tokens": self.cached - self.external,
                "tier_tokens": self.external, "prompt_tokens": self.prompt_tokens,
                "cached_share": self.cached / max(1, self.prompt_tokens), "failed": self.failed,
                "seconds": time.perf_counter() - self.t0, "requests": self.requests}


def send_all(url: str, prompts: list[str], salt: str, kill: Callable[[], None] | None = None,
             docs: list[int] | None = None, in_flight: int = 3, max_tokens: int = 2) -> dict[str, Any]:
    """The shared-prefix workload through ``url``, ``in_flight`` at a time; cached tokens from each
    answer's usage, in all and per request (``requests``: document, answer id, prompt, cached and tier
    tokens, in sending order)."""
    tally = Tally()
    with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        futures = [pool.submit(complete, url, p, salt, max_tokens) for p in prompts]
        for i, fut in enumerate(futures):
            answer = fut.result()
            if kill is not None and i + 1 == len(prompts) // 2:
                kill()
            tally.add(answer, doc=docs[i] if docs else None)
    return tally.row()


def send_conversations(url: str, openings: list[str], messages: list[list[str]], order: list[int], salt: str,
                       kill: Callable[[], None] | None = None, in_flight: int = 3,
                       max_tokens: int = 8) -> dict[str, Any]:
    """The multi-turn workload through ``url``, closed loop: ``in_flight`` turns outstanding; the next one
    sent is the earliest in ``order`` whose conversation has no turn outstanding (a conversation's
    turns go one after the other, each prompt its predecessor plus the reply plus a new message). A
    failed turn counts as failed and its conversation goes on with an empty reply."""
    tally = Tally()
    prompts = list(openings)
    turn_of = [0] * len(openings)
    busy: set[int] = set()
    pending = list(order)
    done = 0
    outstanding: dict[concurrent.futures.Future[dict[str, Any] | None], tuple[int, int]] = {}
    with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        while pending or outstanding:
            while len(outstanding) < in_flight:
                nxt = next((k for k, c in enumerate(pending) if c not in busy), None)
                if nxt is None:
                    break
                conv = pending.pop(nxt)
                busy.add(conv)
                fut = pool.submit(complete, url, prompts[conv], salt, max_tokens)
                outstanding[fut] = (conv, turn_of[conv])
            finished, _ = concurrent.futures.wait(outstanding, return_when=concurrent.futures.FIRST_COMPLETED)
            for fut in finished:
                conv, turn = outstanding.pop(fut)
                answer = fut.result()
                tally.add(answer, conversation=conv, turn=turn, prompt_chars=len(prompts[conv]))
                busy.discard(conv)
                reply = answer["choices"][0]["text"] if answer is not None else ""
                turn_of[conv] += 1
                if turn_of[conv] <= len(messages[conv]):
                    prompts[conv] += reply + messages[conv][turn_of[conv] - 1]
                done += 1
                if kill is not None and done == len(order) // 2:
                    kill()
    return tally.row()


def router_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=5.0).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        for key in ("predicted_cached_tokens_total", "reported_cached_tokens_total", "retries_total"):
            if name.split("{")[0].endswith(key):
                out[key] = out.get(key, 0.0) + float(value)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["shared-prefix", "multi-turn"], default="shared-prefix")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--pool", default=None,
                    help="KV pool per replica (default: 24MiB for shared-prefix, 16MiB for multi-turn)")
    ap.add_argument("--host-tier", default=None,
                    help=f"host-memory KV tier per replica (--kv-tier host:SIZE), 0 for none "
                         f"(default: {HOST_TIER_TIMES_POOL}x the pool)")
    ap.add_argument("--prefixes", type=int, default=9,
                    help="shared-prefix: documents; the default outgrows one replica's pool, not three "
                         "(default: %(default)s)")
    ap.add_argument("--requests", type=int, default=54, help="shared-prefix: requests (default: %(default)s)")
    ap.add_argument("--conversations", type=int, default=12, help="multi-turn: conversations (default: %(default)s)")
    ap.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="output tokens per request (default: 2 for shared-prefix, 8 for multi-turn)")
    ap.add_argument("--in-flight", type=int, default=3, help="requests outstanding (default: %(default)s)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="each replica's; a longer prompt fails (default: 1024 for shared-prefix, 768 for multi-turn, "
                         "which a 16 MiB pool can hold)")
    ap.add_argument("--policies", default=POLICIES)
    ap.add_argument("--no-redis", action="store_true", help="no shared Redis tier")
    ap.add_argument("--kill", action="store_true",
                    help="one more hybrid_exact run in which one replica is killed halfway through")
    ap.add_argument("--router-args", default="",
                    help="extra options for hybridkv route, e.g. '--load-weight 64' (default: none)")
    ap.add_argument("--no-big", action="store_true", help="skip the single big replica")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from hybridkv.sizes import parse_bytes

    multi = args.workload == "multi-turn"
    pool_size = args.pool or DEFAULT_POOL[args.workload]
    pool_bytes = parse_bytes(pool_size)
    host_bytes = HOST_TIER_TIMES_POOL * pool_bytes if args.host_tier is None else parse_bytes(args.host_tier)
    max_tokens = args.max_tokens if args.max_tokens is not None else (8 if multi else 2)
    max_model_len = args.max_model_len or (768 if multi else 1024)
    env = {**os.environ, "HYBRIDKV_TIER_KEY": os.environ.get("HYBRIDKV_TIER_KEY", "bench-cluster-tier-key-0123456789")}
    if multi:
        openings, messages, order = conversations(args.conversations, args.turns)
        num_requests = len(order)
        described = (f"{num_requests} requests: {args.conversations} conversations x {args.turns} turns, "
                     f"{max_tokens} output tokens each")

        def run(url: str, salt: str, kill: Callable[[], None] | None = None) -> dict[str, Any]:
            return send_conversations(url, openings, messages, order, salt, kill=kill, in_flight=args.in_flight,
                                      max_tokens=max_tokens)
    else:
        prompts, docs = workload(args.prefixes, args.requests)
        num_requests = len(prompts)
        described = f"{num_requests} requests over {args.prefixes} shared documents"

        def run(url: str, salt: str, kill: Callable[[], None] | None = None) -> dict[str, Any]:
            return send_all(url, prompts, salt, kill=kill, docs=docs, in_flight=args.in_flight, max_tokens=max_tokens)

    tmp = Path(tempfile.mkdtemp(prefix="hkv-cluster-"))
    redis = None
    redis_url = None
    if not args.no_redis:
        server = shutil.which("redis-server")
        if server is None:
            print("redis-server is not on PATH (apt-get install redis-server, or pass --no-redis)", file=sys.stderr)
            return 2
        port = free_port()
        redis = subprocess.Popen([server, "--port", str(port), "--save", "", "--appendonly", "no"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        redis_url = f"redis://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # before the first FLUSHALL
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
    rows: dict[str, Any] = {}
    started = time.perf_counter()
    try:
        runs = [(p, False) for p in args.policies.split(",") if p]
        if args.kill:
            runs.append(("hybrid_exact", True))
        for policy, killing in runs:
            name = f"{policy}, one replica killed" if killing else policy
            if redis is not None:
                subprocess.run([shutil.which("redis-cli") or "redis-cli", "-u", redis_url or "", "FLUSHALL"],
                               stdout=subprocess.DEVNULL, check=False)
            replicas = [Replica(f"{policy}{'-killed' if killing else ''}-r{i}", pool_size, redis_url, env, tmp,
                                host_tier=host_bytes, max_model_len=max_model_len)
                        for i in range(args.replicas)]
            router = None
            try:
                for r in replicas:
                    r.wait()
                rport = free_port()
                cmd = [*HYBRIDKV, "route", "--port", str(rport), "--policy", policy, *args.router_args.split()]
                for r in replicas:
                    cmd += ["--backend", r.backend()]
                log = tmp / f"router-{policy}{'-killed' if killing else ''}.log"
                router = subprocess.Popen(cmd, stdout=open(log, "w"),  # noqa: SIM115
                                          stderr=subprocess.STDOUT, env=env, cwd=ROOT)
                rurl = f"http://127.0.0.1:{rport}"
                wait_ready(rurl, router, 60)
                time.sleep(1.0)  # the router subscribes to every replica's events
                victim = replicas[-1]
                kill = (lambda v=victim: v.stop(kill=True)) if killing else None
                row = run(rurl, f"run-{name}", kill)
                row.update(router_counters(rurl))
                rows[name] = row
            finally:
                if router is not None and router.poll() is None:
                    router.terminate()
                    router.wait(30)
                for r in replicas:
                    r.stop()
            print(f"{name:>14}: {_brief(row)}", flush=True)
        if not args.no_big:
            big = Replica("single-big", str(pool_bytes * args.replicas), redis_url=None, env=env, log_dir=tmp,
                          host_tier=host_bytes * args.replicas, max_model_len=max_model_len)
            try:
                big.wait()
                rows[BIG] = run(big.url, "run-big")
            finally:
                big.stop()
            print(f"{'one replica':>14}: {_brief(rows[BIG])}", flush=True)
    finally:
        if redis is not None:
            redis.terminate()
            redis.wait(10)
    total_seconds = time.perf_counter() - started
    tiers = f"{_mib(host_bytes)} host tiers each" if host_bytes else "no host tiers"
    if not args.no_redis:
        tiers += ", and a shared Redis tier"
    print(f"\n{args.workload}: {args.replicas} replicas with {_mib(pool_bytes)} KV pools and {tiers}; "
          f"{described}, {args.in_flight} in flight; the single replica has {args.replicas}x the pool and "
          f"{args.replicas}x the host tier")
    # Device-cached tokens are what routing controls directly; "from tier" is what replicas loaded from
    # their host tier (or the shared Redis tier: a hit there still moves the KV).
    print(f"{'configuration':>32} {'prompt':>8} {'device cached':>14} {'from tier':>10} {'total cached':>13} "
          f"{'share':>7} {'predicted':>10} {'failed':>7} {'seconds':>8}")
    for name, row in rows.items():
        predicted = row.get("predicted_cached_tokens_total", 0)
        print(f"{name:>32} {row['prompt_tokens']:>8,} {row['device_cached_tokens']:>14,} {row['tier_tokens']:>10,} "
              f"{row['cached_tokens']:>13,} {row['cached_share']:>7.1%} {predicted:>10,.0f} {row['failed']:>7} "
              f"{row['seconds']:>8.1f}")
    policies = [p for p in args.policies.split(",") if p in rows]
    ranked = sorted(policies, key=lambda p: -rows[p]["cached_share"])
    order_text = ranked[0] if ranked else ""
    for prev, p in itertools.pairwise(ranked):
        same = abs(rows[prev]["cached_share"] - rows[p]["cached_share"]) < 0.0005
        order_text += f" {'=' if same else '>'} {p}"
    summary: dict[str, Any] = {"order_by_total_cached_share": ranked, "order": order_text}
    if ranked:
        print(f"order of policies by total cached share: {order_text}")
    he = rows.get("hybrid_exact")
    if he is not None:
        for other, label in (("round_robin", "round_robin"), (BIG, f"one replica with {args.replicas}x the memory")):
            if other in rows:
                ratio = he["cached_share"] / max(1e-9, rows[other]["cached_share"])
                summary[f"hybrid_exact_over_{'big' if other == BIG else other}_total_share"] = ratio
                print(f"total cached share, hybrid_exact / {label}: {ratio:.2f}")
        if "round_robin" in rows:
            ratio = he["device_cached_tokens"] / max(1, rows["round_robin"]["device_cached_tokens"])
            summary["hybrid_exact_over_round_robin_device_cached"] = ratio
            print(f"device-cached tokens, hybrid_exact / round_robin: {ratio:.2f}x (target >= 2 on shared-prefix "
                  f"with Redis)")
        if BIG in rows:
            ratio = he["device_cached_tokens"] / max(1, rows[BIG]["device_cached_tokens"])
            summary["hybrid_exact_over_big_device_cached"] = ratio
            print(f"device-cached tokens, hybrid_exact / one replica: {ratio:.2f} (target >= 0.90 on shared-prefix "
                  f"with Redis)")
    killed = [name for name in rows if name.endswith("killed")]
    for name in killed:
        print(f"{name}: {rows[name]['failed']} failed requests of {num_requests} (target 0), "
              f"{rows[name].get('retries_total', 0):.0f} retried by the router")
    print(f"whole bench: {total_seconds:.0f} s; logs in {tmp}")
    if args.json:
        settings = {"workload": args.workload, "replicas": args.replicas, "pool_bytes": pool_bytes,
                    "host_tier_bytes": host_bytes, "redis": not args.no_redis, "in_flight": args.in_flight,
                    "max_tokens": max_tokens, "requests": num_requests, "max_model_len": max_model_len,
                    "router_args": args.router_args, "seconds": total_seconds}
        if multi:
            settings.update(conversations=args.conversations, turns=args.turns)
        else:
            settings.update(prefixes=args.prefixes)
        Path(args.json).write_text(json.dumps({"settings": settings, "rows": rows, **summary}, indent=1))
    return 0


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    """A row without its per-request list."""
    return {k: v for k, v in row.items() if k != "requests"}


def _mib(n: int) -> str:
    return f"{n / (1 << 20):g} MiB"


if __name__ == "__main__":
    sys.exit(main())

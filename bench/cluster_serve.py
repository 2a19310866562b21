"""A real cluster on this machine: N ``hybridkv serve`` replicas, the KV-aware router, a shared Redis tier.

    python bench/cluster_serve.py [--replicas 3] [--pool 24MiB] [--prefixes 9] [--requests 54]
        [--policies hybrid_exact,prefix,round_robin,least_loaded] [--no-redis] [--kill] [--json FILE]

Each replica serves the embedded Gemma 3 270M with a small KV pool and publishes its KV events
(``--kv-events-endpoint``); with Redis (default) every replica also writes through to, and loads
from, one shared Redis tier. For each routing policy the replicas start afresh, the router
(``hybridkv route``) starts in front of them, and the same shared-prefix workload (PREFIXES
documents of ~300 tokens, each asked REQUESTS / PREFIXES questions, in an interleaved order, 3 in
flight) goes through it; the cached prompt tokens the replicas report in ``usage`` are summed, split
into those served from the replica's own device cache (what routing controls) and those loaded
from the shared tier.
A single replica with REPLICAS times the pool serves the same workload as the reference point.
With ``--kill`` one more ``hybrid_exact`` run kills one replica (SIGKILL) halfway through: every
request must still be answered (the router retries on another replica).

Prints, per configuration: cached prompt tokens, their share of prompt tokens, the router's
predicted cached tokens, failed requests, wall time. Targets (issue): ``hybrid_exact`` >= 2x
``round_robin`` and >= 90% of the single big replica; no request lost to the killed replica.
Needs the engine, server and cluster extras and ``redis-server`` on PATH (or ``--no-redis``).
Several minutes on a 2-core machine (each replica loads the model).
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
HYBRIDKV = [sys.executable, "-m", "hybridkv.cli"]
TOPICS = ["harbour", "orchard", "library", "railway", "observatory", "market", "bridge", "theatre"]


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


class Replica:
    def __init__(self, name: str, pool: str, redis_url: str | None, env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.port = free_port()
        self.events = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        cmd = [*HYBRIDKV, "serve", "--port", str(self.port), "--kv-cache-memory", pool, "--max-model-len", "1024",
               "--max-num-batched-tokens", "512", "--kv-events-endpoint", self.events,
               "--kv-events-replay-endpoint", self.replay, "--log-level", "warning"]
        if redis_url:
            cmd += ["--kv-store", redis_url]
        self.log = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

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


def send_all(url: str, prompts: list[str], salt: str, kill: Any = None,
             docs: list[int] | None = None) -> dict[str, Any]:
    """The workload through ``url``, 3 in flight; cached tokens from each answer's usage, in all and per
    request (``requests``: document, answer id, prompt, cached and tier tokens, in sending order)."""
    cached = external = prompt_tokens = failed = 0
    done = 0
    per_request: list[dict[str, Any]] = []

    def one(prompt: str) -> dict[str, Any] | None:
        body = {"model": "gemma-3-270m", "prompt": prompt, "max_tokens": 2, "temperature": 0, "cache_salt": salt}
        try:
            resp = httpx.post(f"{url}/v1/completions", json=body, timeout=600.0)
        except httpx.HTTPError:
            return None
        return resp.json() if resp.status_code == 200 else None

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        for i, fut in enumerate(futures):
            answer = fut.result()
            done += 1
            if kill is not None and done == len(prompts) // 2:
                kill()
            doc = docs[i] if docs else None
            if answer is None:
                failed += 1
                per_request.append({"doc": doc, "failed": True})
                continue
            usage = answer["usage"]
            prompt_tokens += usage["prompt_tokens"]
            details = usage.get("prompt_tokens_details") or {}
            cached += details.get("cached_tokens", 0)
            external += details.get("external_tokens", 0)
            per_request.append({"doc": doc, "id": answer.get("id"), "prompt_tokens": usage["prompt_tokens"],
                                "cached_tokens": details.get("cached_tokens", 0),
                                "tier_tokens": details.get("external_tokens", 0)})
    return {"cached_tokens": cached, "device_cached_tokens": cached - external, "tier_tokens": external,
            "prompt_tokens": prompt_tokens, "failed": failed,
            "seconds": time.perf_counter() - t0, "requests": per_request}


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
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--pool", default="24MiB", help="KV pool per replica (default: %(default)s)")
    ap.add_argument("--prefixes", type=int, default=9,
                    help="shared documents; the default outgrows one replica's pool, not three (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=54)
    ap.add_argument("--policies", default="hybrid_exact,prefix,round_robin,least_loaded")
    ap.add_argument("--no-redis", action="store_true", help="no shared Redis tier")
    ap.add_argument("--kill", action="store_true",
                    help="one more hybrid_exact run in which one replica is killed halfway through")
    ap.add_argument("--router-args", default="",
                    help="extra options for hybridkv route, e.g. '--load-weight 64' (default: none)")
    ap.add_argument("--no-big", action="store_true", help="skip the single big replica")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    env = {**os.environ, "HYBRIDKV_TIER_KEY": os.environ.get("HYBRIDKV_TIER_KEY", "bench-cluster-tier-key-0123456789")}
    prompts, docs = workload(args.prefixes, args.requests)
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
    rows: dict[str, Any] = {}
    try:
        runs = [(p, False) for p in args.policies.split(",") if p]
        if args.kill:
            runs.append(("hybrid_exact", True))
        for policy, killing in runs:
            name = f"{policy}, one replica killed" if killing else policy
            if redis is not None:
                subprocess.run([shutil.which("redis-cli") or "redis-cli", "-u", redis_url or "", "FLUSHALL"],
                               stdout=subprocess.DEVNULL, check=False)
            replicas = [Replica(f"{policy}-r{i}", args.pool, redis_url, env, tmp) for i in range(args.replicas)]
            router = None
            try:
                for r in replicas:
                    wait_ready(r.url, r.proc)
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
                row = send_all(rurl, prompts, salt=f"run-{name}", kill=kill, docs=docs)
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
            big = Replica("single-big", _times(args.pool, args.replicas), redis_url=None, env=env, log_dir=tmp)
            try:
                wait_ready(big.url, big.proc)
                rows["one replica, x pool"] = send_all(big.url, prompts, salt="run-big", docs=docs)
            finally:
                big.stop()
            print(f"{'one replica':>14}: {_brief(rows['one replica, x pool'])}", flush=True)
    finally:
        if redis is not None:
            redis.terminate()
            redis.wait(10)
    tier = "" if args.no_redis else " and a shared Redis tier"
    print(f"\n{args.replicas} replicas with {args.pool} KV pools each{tier}; "
          f"{len(prompts)} requests over {args.prefixes} shared documents")
    # Device-cached tokens are what routing controls (a tier load still moves the KV over the network);
    # with a shared tier every policy can reach the same total.
    print(f"{'configuration':>22} {'device cached':>14} {'share':>7} {'from tier':>10} {'total cached':>13} "
          f"{'predicted':>10} {'failed':>7} {'seconds':>8}")
    for name, row in rows.items():
        share = row["device_cached_tokens"] / max(1, row["prompt_tokens"])
        predicted = row.get("predicted_cached_tokens_total", 0)
        print(f"{name:>22} {row['device_cached_tokens']:>14,} {share:>7.1%} {row['tier_tokens']:>10,} "
              f"{row['cached_tokens']:>13,} {predicted:>10,.0f} {row['failed']:>7} {row['seconds']:>8.1f}")
    if "hybrid_exact" in rows and "round_robin" in rows:
        he, rr = rows["hybrid_exact"]["device_cached_tokens"], rows["round_robin"]["device_cached_tokens"]
        big_cached = rows.get("one replica, x pool", {}).get("device_cached_tokens", 0)
        print(f"device-cached tokens, hybrid_exact / round_robin: {he / max(1, rr):.2f}x (target >= 2); "
              f"hybrid_exact / one replica with {args.replicas}x the pool: {he / max(1, big_cached):.2f} "
              f"(target >= 0.90)")
    print(f"logs in {tmp}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def _brief(row: dict[str, Any]) -> dict[str, Any]:
    """A row without its per-request list."""
    return {k: v for k, v in row.items() if k != "requests"}


def _times(size: str, k: int) -> str:
    from hybridkv.sizes import parse_bytes

    return str(parse_bytes(size) * k)


if __name__ == "__main__":
    sys.exit(main())

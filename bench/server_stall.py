"""Does any request stall the others? A real ``hybridkv serve`` (a subprocess) with one running stream,
then three heavy requests at once: a long prompt, a scoring request of the same length (``echo`` +
``logprobs``, what lm-eval's loglikelihood sends) and a 7 MB chat request (200,000 system messages).

Prints the stream's median and largest inter-token gap, one prefill chunk's time (a lone prompt of
``--chunk-tokens`` tokens, the server's step budget, from an empty context), the bound ``3 x median +
chunk``, ``/health`` latency (polled every 50 ms throughout), and the cost of scoring against a plain
prefill of the same tokens (measured first, same server).

    python bench/server_stall.py                      # 4,000-token prompts, a couple of minutes idle
    python bench/server_stall.py --prompt-tokens 1000 # quicker on a busy machine
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import httpx

MODEL = "gemma-3-270m"


def start_server(extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "hybridkv.server", "--port", "0", "--log-level", "warning",
                             *extra], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if "ready at " in line:
            return proc, line.rsplit("ready at ", 1)[1].strip().removesuffix("/v1")
    raise SystemExit(f"the server exited with {proc.wait()} before it was ready")


def token_prompt(n: int, seed: int) -> list[int]:
    """``n`` token ids (``<bos>`` then random ordinary tokens): no two prompts share a cached block."""
    rng = random.Random(seed)
    return [2] + [rng.randrange(1000, 200_000) for _ in range(n - 1)]


def timed_post(client: httpx.Client, body: dict[str, Any], path: str = "/v1/completions") -> tuple[float, int]:
    start = time.perf_counter()
    resp = client.post(path, json=body)
    return time.perf_counter() - start, resp.status_code


class Stream(threading.Thread):
    """A streamed completion; ``times`` holds each token's arrival."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.times: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=self.url, timeout=600) as client, \
                client.stream("POST", "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    self.times.append(time.perf_counter())
                if self.stop.is_set():
                    return


class HealthPoller(threading.Thread):
    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.latencies: list[float] = []
        self.stop = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as client:
            while not self.stop.is_set():
                start = time.perf_counter()
                client.get("/health").raise_for_status()
                self.latencies.append(time.perf_counter() - start)
                time.sleep(0.05)


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--score-tokens", type=int, default=500, help="tokens of the scoring-cost comparison")
    parser.add_argument("--chunk-tokens", type=int, default=1024, help="the server's max_num_batched_tokens")
    parser.add_argument("--chat-messages", type=int, default=200_000)
    args, server_args = parser.parse_known_args()
    proc, url = start_server(["--max-num-batched-tokens", str(args.chunk_tokens), *server_args])
    try:
        with httpx.Client(base_url=url, timeout=900) as client:
            timed_post(client, {"model": MODEL, "prompt": token_prompt(64, 0), "max_tokens": 1})  # warm-up
            timed_post(client, {"model": MODEL, "prompt": token_prompt(64, 1), "max_tokens": 0, "echo": True,
                                "logprobs": 1})  # builds the scoring head
            plain, _ = timed_post(client, {"model": MODEL, "prompt": token_prompt(args.score_tokens, 2),
                                           "max_tokens": 1})
            scored, _ = timed_post(client, {"model": MODEL, "prompt": token_prompt(args.score_tokens, 3),
                                            "max_tokens": 0, "echo": True, "logprobs": 1})
            whole, _ = timed_post(client, {"model": MODEL, "prompt": token_prompt(args.prompt_tokens, 4),
                                           "max_tokens": 1})
            # one chunk: a prompt of exactly one step's tokens from an empty context (later chunks of a
            # long prompt attend over more keys; the scheduler's context cost makes them shorter)
            chunk, _ = timed_post(client, {"model": MODEL, "prompt": token_prompt(args.chunk_tokens, 7),
                                           "max_tokens": 1})
        print(f"{args.score_tokens}-token prompt: plain prefill {plain:.2f} s, scored (echo + logprobs=1) "
              f"{scored:.2f} s: {scored / plain:.2f}x")
        print(f"{args.prompt_tokens}-token prompt alone: {whole:.2f} s; one prefill chunk (a lone "
              f"{args.chunk_tokens}-token prompt): {chunk:.2f} s")

        stream, health = Stream(url), HealthPoller(url)
        stream.start()
        health.start()
        while len(stream.times) < 20:
            time.sleep(0.05)
        messages = [{"role": "system", "content": "Hi."}] * args.chat_messages
        heavy = {
            f"{args.prompt_tokens}-token prompt": ({"model": MODEL, "prompt": token_prompt(args.prompt_tokens, 5),
                                                    "max_tokens": 1}, "/v1/completions"),
            f"{args.prompt_tokens}-token scoring": ({"model": MODEL, "prompt": token_prompt(args.prompt_tokens, 6),
                                                     "max_tokens": 0, "echo": True, "logprobs": 1},
                                                    "/v1/completions"),
            f"{len(json.dumps(messages)) / 1e6:.1f} MB chat": ({"model": MODEL, "messages": messages,
                                                                "max_tokens": 1}, "/v1/chat/completions"),
        }
        results: dict[str, tuple[float, int]] = {}

        def fire(name: str, body: dict[str, Any], path: str) -> None:
            with httpx.Client(base_url=url, timeout=900) as client:
                results[name] = timed_post(client, body, path)

        start_index = len(stream.times)
        threads = [threading.Thread(target=fire, args=(name, *spec)) for name, spec in heavy.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        end_index = len(stream.times)
        time.sleep(1.0)
        stream.stop.set()
        health.stop.set()
        health.join()
        for name, (seconds, status) in results.items():
            print(f"{name}: HTTP {status} in {seconds:.2f} s")
        all_gaps = gaps(stream.times)
        during = gaps(stream.times[max(0, start_index - 1):end_index + 1])
        median = statistics.median(all_gaps)
        bound = 3 * median + chunk
        print(f"stream: {len(stream.times)} tokens, median gap {median * 1e3:.0f} ms, largest gap "
              f"{max(all_gaps):.2f} s ({len(during)} gaps while the heavy requests ran, largest "
              f"{max(during):.2f} s); bound 3 x median + chunk = {bound:.2f} s: "
              f"{'OK' if max(all_gaps) <= bound else 'OVER'}")
        lat = sorted(health.latencies)
        print(f"/health: {len(lat)} polls, median {statistics.median(lat) * 1e3:.0f} ms, "
              f"p99 {lat[int(len(lat) * 0.99)] * 1e3:.0f} ms, max {lat[-1] * 1e3:.0f} ms: "
              f"{'OK' if lat[-1] <= 0.1 else 'OVER'} (100 ms)")
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

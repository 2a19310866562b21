"""Simulator workloads and trace files: deterministic generators, shared content, exact round trips."""

from __future__ import annotations

import gzip
import json
import random
import re
import statistics
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path

import pytest

from hybridkv.errors import InvalidInputError
from hybridkv.sim.trace import read_trace, write_trace
from hybridkv.sim.workloads import (
    SHAREGPT_INPUT,
    SHAREGPT_OUTPUT,
    Bursty,
    ClosedLoop,
    LengthDist,
    Poisson,
    SimRequest,
    Workload,
    chat_lengths,
    multi_turn_chat,
    output_key,
    release_time,
    shared_prefix,
)


def _prefix_workload(seed: int = 0, **kwargs: object) -> Workload:
    args: dict[str, object] = {"max_new_tokens": 16, "arrivals": Poisson(rate=5.0), "seed": seed}
    args.update(kwargs)
    return shared_prefix(200, 4, 64, 8, **args)  # type: ignore[arg-type]


# --- generators ----------------------------------------------------------------------------------------------


def test_same_seed_gives_the_same_workload_and_another_seed_a_different_one() -> None:
    assert _prefix_workload(seed=1) == _prefix_workload(seed=1)
    assert _prefix_workload(seed=1) != _prefix_workload(seed=2)
    chat = {
        "num_conversations": 5,
        "turns": 3,
        "system_prompt_len": 32,
        "user_len": LengthDist(20, 0.5),
        "max_new_tokens": LengthDist(30, 0.5),
    }
    assert multi_turn_chat(**chat, seed=3) == multi_turn_chat(**chat, seed=3)  # type: ignore[arg-type]
    assert multi_turn_chat(**chat, seed=3) != multi_turn_chat(**chat, seed=4)  # type: ignore[arg-type]
    assert chat_lengths(50, seed=5) == chat_lengths(50, seed=5)
    assert chat_lengths(50, seed=5) != chat_lengths(50, seed=6)


def test_changing_the_arrival_process_keeps_the_prompts() -> None:
    open_loop = _prefix_workload(arrivals=Poisson(rate=5.0))
    closed = _prefix_workload(arrivals=ClosedLoop(concurrency=8))
    assert [r.segments for r in open_loop.requests] == [r.segments for r in closed.requests]


def test_requests_are_sorted_by_arrival_and_ids_are_unique() -> None:
    chat = multi_turn_chat(10, 4, system_prompt_len=16, user_len=8, max_new_tokens=8, think_time_s=2.0)
    for wl in (_prefix_workload(), chat_lengths(100, arrivals=Bursty(rate=20.0, burstiness=0.2)), chat):
        times = [r.arrival_time for r in wl.requests]
        assert times == sorted(times)
        assert len({r.request_id for r in wl.requests}) == len(wl.requests)


def test_shared_prefix_requests_share_exactly_the_prefix_run() -> None:
    wl = shared_prefix(50, 3, 100, 20, max_new_tokens=8, seed=0)
    for r in wl.requests:
        assert r.segments == ((f"prefix-{r.prefix_group}", 100), (f"suffix-{r.request_id}", 20))
        assert r.prompt_len == 120
    a, b = _same_group(wl)
    ids_a, ids_b = a.prompt_token_ids(), b.prompt_token_ids()
    assert ids_a[:100] == ids_b[:100]
    assert ids_a[100:] != ids_b[100:]
    other = next(r for r in wl.requests if r.prefix_group != a.prefix_group)
    assert other.prompt_token_ids()[:100] != ids_a[:100]


def _same_group(wl: Workload) -> tuple[SimRequest, SimRequest]:
    first = wl.requests[0]
    second = next(r for r in wl.requests[1:] if r.prefix_group == first.prefix_group)
    return first, second


def test_token_ids_depend_only_on_key_and_position() -> None:
    short = SimRequest("x", 0.0, (("doc", 10),), 1)
    long = SimRequest("y", 0.0, (("other", 3), ("doc", 50)), 1)
    ids = long.prompt_token_ids(vocab_size=1000)
    assert short.prompt_token_ids(vocab_size=1000) == ids[3:13]
    assert all(1 <= t < 1000 for t in ids)
    assert SimRequest("z", 0.0, (("a", 5),), 1, token_ids=None).prompt_token_ids(vocab_size=2) == [1] * 5


def test_prompt_token_ids_are_pinned_across_processes_and_versions() -> None:
    # crc32 of the key and the position only (no hash(), no random state): these values never change.
    assert SimRequest("x", 0.0, (("prefix-0", 4),), 1).prompt_token_ids() == [19613, 3496, 24318, 19702]


def test_explicit_token_ids_are_the_prompt() -> None:
    r = SimRequest("t", 0.0, (("ids:t", 3),), 4, token_ids=(7, 0, 9))
    assert r.prompt_token_ids() == [7, 0, 9] and r.prompt_len == 3
    with pytest.raises(InvalidInputError, match="segments must be"):
        SimRequest("t", 0.0, (("doc", 3),), 4, token_ids=(7, 0, 9))


def test_zipf_popularity_favours_the_first_prefix() -> None:
    wl = shared_prefix(4000, 10, 16, 4, max_new_tokens=1, popularity="zipf", zipf_s=1.0, seed=0)
    counts = Counter(r.prefix_group for r in wl.requests)
    # Zipf(1) over 10 groups: group 0 has weight 1 / H(10) = 34%, vs 10% uniform.
    assert counts[0] / 4000 > 0.28
    assert counts[0] > counts[1] > counts[4] > counts[9]


def test_uniform_popularity_is_roughly_balanced() -> None:
    wl = shared_prefix(4000, 10, 16, 4, max_new_tokens=1, popularity="uniform", seed=0)
    counts = Counter(r.prefix_group for r in wl.requests)
    assert set(counts) == set(range(10))
    assert all(320 <= c <= 480 for c in counts.values())


def test_multi_turn_prompt_extends_the_previous_prompt_and_its_output() -> None:
    wl = multi_turn_chat(
        4,
        5,
        system_prompt_len=64,
        user_len=LengthDist(16, 0.5),
        max_new_tokens=LengthDist(20, 0.5),
        think_time_s=1.5,
        seed=7,
    )
    by_conv: dict[str, list[SimRequest]] = {}
    for r in wl.requests:
        assert r.conversation_id is not None
        by_conv.setdefault(r.conversation_id, []).append(r)
    for turns in by_conv.values():
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2, 3, 4]
        assert turns[0].segments[0] == ("system", 64)
        for prev, cur in pairwise(turns):
            head = (*prev.segments, (output_key(prev.request_id), prev.max_new_tokens))
            assert cur.segments[: len(head)] == head
            assert len(cur.segments) == len(head) + 1
            assert cur.segments[-1][0] == f"user-{cur.request_id}"
            # token ids: the new prompt starts with the old prompt and the old output's run
            out_ids = SimRequest("o", 0.0, ((output_key(prev.request_id), prev.max_new_tokens),), 1).prompt_token_ids()
            context = prev.prompt_token_ids() + out_ids
            assert cur.prompt_token_ids()[: len(context)] == context
            # open loop: previous arrival + estimated decode time (20 ms/token by default) + think time
            assert cur.arrival_time == pytest.approx(prev.arrival_time + prev.max_new_tokens * 0.02 + 1.5)
    assert wl.think_time_s == 1.5 and wl.concurrency is None


def test_multi_turn_system_prompt_is_shared_or_per_conversation() -> None:
    shared = multi_turn_chat(3, 1, system_prompt_len=10, user_len=5, max_new_tokens=5, seed=0)
    own = multi_turn_chat(3, 1, system_prompt_len=10, user_len=5, max_new_tokens=5, shared_system_prompt=False, seed=0)
    assert {r.segments[0] for r in shared.requests} == {("system", 10)}
    assert len({r.segments[0] for r in own.requests}) == 3
    none = multi_turn_chat(3, 1, system_prompt_len=0, user_len=5, max_new_tokens=5, seed=0)
    assert all(len(r.segments) == 1 for r in none.requests)


def test_release_time_waits_for_the_previous_turn_and_the_think_time() -> None:
    r = SimRequest("c-1", 3.0, (("a", 1),), 1, conversation_id="c", turn=1)
    assert release_time(r, None, 2.0) == 3.0
    assert release_time(r, 0.5, 2.0) == 3.0
    assert release_time(r, 4.0, 2.0) == 6.0


def test_closed_loop_sets_concurrency_and_zero_arrivals() -> None:
    chat = multi_turn_chat(5, 3, system_prompt_len=8, user_len=4, max_new_tokens=4, arrivals=ClosedLoop(2))
    for wl, concurrency in (
        (_prefix_workload(arrivals=ClosedLoop(concurrency=16)), 16),
        (chat_lengths(30, arrivals=ClosedLoop(concurrency=4)), 4),
        (chat, 2),
    ):
        assert wl.concurrency == concurrency
        assert all(r.arrival_time == 0.0 for r in wl.requests)
    assert _prefix_workload(arrivals=Poisson(rate=1.0)).concurrency is None


def test_log_normal_median_matches_the_configured_median() -> None:
    rng = random.Random(0)
    for dist in (LengthDist(median=300, sigma=1.0), SHAREGPT_INPUT, SHAREGPT_OUTPUT, LengthDist(median=40, sigma=0)):
        samples = [dist.sample(rng) for _ in range(4000)]
        assert statistics.median(samples) == pytest.approx(dist.median, rel=0.08)
        assert min(samples) >= dist.min_len
        assert dist.max_len is None or max(samples) <= dist.max_len


def test_chat_lengths_follows_the_length_presets() -> None:
    wl = chat_lengths(3000, seed=1)
    assert statistics.median(r.prompt_len for r in wl.requests) == pytest.approx(SHAREGPT_INPUT.median, rel=0.1)
    assert statistics.median(r.max_new_tokens for r in wl.requests) == pytest.approx(SHAREGPT_OUTPUT.median, rel=0.1)
    assert len({r.segments[0][0] for r in wl.requests}) == 3000  # every prompt is unique content


def test_poisson_inter_arrival_mean_is_one_over_rate() -> None:
    wl = chat_lengths(5000, input=8, output=8, arrivals=Poisson(rate=40.0), seed=2)
    times = [r.arrival_time for r in wl.requests]
    gaps = [b - a for a, b in pairwise(times)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 40, rel=0.05)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, rel=0.1)


def test_bursty_arrivals_keep_the_rate_and_raise_the_variance() -> None:
    wl = chat_lengths(5000, input=8, output=8, arrivals=Bursty(rate=40.0, burstiness=0.25), seed=2)
    times = [r.arrival_time for r in wl.requests]
    gaps = [b - a for a, b in pairwise(times)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 40, rel=0.1)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(2.0, rel=0.15)  # 1 / sqrt(0.25)


def test_ten_thousand_shared_prefix_requests_generate_fast() -> None:
    start = time.perf_counter()
    wl = shared_prefix(10_000, 30, 28_000, LengthDist(256, 0.5), max_new_tokens=128, popularity="zipf", seed=0)
    assert time.perf_counter() - start < 1.0
    assert len(wl.requests) == 10_000


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: shared_prefix(0, 1, 1, 1, max_new_tokens=1), "num_requests must be >= 1; got 0"),
        (lambda: shared_prefix(1, 1, 1, 1, max_new_tokens=0), "max_new_tokens must be >= 1; got 0"),
        (lambda: shared_prefix(1, 1, 1, 1, max_new_tokens=1, popularity="pareto"), "popularity must be"),  # type: ignore[arg-type]
        (lambda: multi_turn_chat(1, 0, system_prompt_len=1, user_len=1, max_new_tokens=1), "turns must be >= 1"),
        (lambda: Poisson(rate=0.0), "Poisson.rate must be a finite number > 0.0; got 0.0"),
        (lambda: ClosedLoop(concurrency=0), "ClosedLoop.concurrency must be >= 1; got 0"),
        (lambda: LengthDist(median=10, sigma=1, max_len=5), r"median 10 must lie within \[min_len, max_len\]"),
        (lambda: chat_lengths(1, arrivals=3.0), "arrivals must be Poisson, Bursty or ClosedLoop"),  # type: ignore[arg-type]
    ],
)
def test_bad_arguments_name_the_input_and_the_limit(call: object, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        call()  # type: ignore[operator]


# --- trace files ---------------------------------------------------------------------------------------------


def _all_workloads() -> list[Workload]:
    explicit = SimRequest(
        "ids-0", 0.25, (("ids:ids-0", 3),), 5, prefix_group=2, cache_salt="tenant", token_ids=(4, 0, 31999)
    )
    return [
        _prefix_workload(popularity="zipf"),
        shared_prefix(20, 2, 32, LengthDist(8, 1.0), max_new_tokens=LengthDist(8, 1.0), arrivals=ClosedLoop(3)),
        multi_turn_chat(3, 3, system_prompt_len=16, user_len=LengthDist(8, 1.0), max_new_tokens=8, think_time_s=0.5),
        chat_lengths(40, arrivals=Bursty(rate=3.0)),
        Workload([explicit], None, "explicit"),
    ]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_trace_round_trip_is_exact(tmp_path: Path, suffix: str) -> None:
    for i, wl in enumerate(_all_workloads()):
        path = tmp_path / f"w{i}{suffix}"
        write_trace(path, wl)
        assert read_trace(path) == wl


def test_gzip_trace_is_compressed_and_reproducible(tmp_path: Path) -> None:
    wl = _prefix_workload()
    write_trace(tmp_path / "a.jsonl.gz", wl)
    write_trace(tmp_path / "b.jsonl.gz", wl)
    data = (tmp_path / "a.jsonl.gz").read_bytes()
    assert data == (tmp_path / "b.jsonl.gz").read_bytes()
    assert json.loads(gzip.decompress(data).splitlines()[0]) == {
        "hybridkv_trace": 1,
        "name": "shared_prefix",
        "concurrency": None,
        "think_time_s": 0.0,
    }


def _read_lines(tmp_path: Path, *lines: str) -> Workload:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return read_trace(path)


def test_trace_without_header_and_segments_builds_prompts_from_lengths(tmp_path: Path) -> None:
    wl = _read_lines(
        tmp_path,
        '{"request_id": "b", "timestamp": 2, "prompt_len": 100, "prefix_group": 1, "prefix_len": 60, "output_len": 4}',
        "",
        '{"request_id": "a", "timestamp": 1.5, "prompt_len": 10, "max_new_tokens": 2}',
        '{"request_id": "c", "timestamp": 3, "prompt_len": 60, "prefix_group": 1, "prefix_len": 60, "output_len": 1}',
    )
    assert wl.name == "t" and wl.concurrency is None
    assert [r.request_id for r in wl.requests] == ["a", "b", "c"]  # sorted by timestamp
    a, b, c = wl.requests
    assert a.segments == (("prompt-a", 10),) and a.max_new_tokens == 2
    assert b.segments == (("prefix-1", 60), ("suffix-b", 40)) and b.max_new_tokens == 4
    assert c.segments == (("prefix-1", 60),)


def test_closed_loop_header_is_read(tmp_path: Path) -> None:
    wl = _read_lines(
        tmp_path,
        '{"hybridkv_trace": 1, "concurrency": 8}',
        '{"request_id": "a", "timestamp": 0, "prompt_len": 10, "max_new_tokens": 2}',
    )
    assert wl.concurrency == 8 and wl.requests[0].arrival_time == 0.0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "t.jsonl:2: not valid JSON"),
        ("[1, 2]", "t.jsonl:2: expected a JSON object"),
        ('{"timestamp": 0, "prompt_len": 1, "max_new_tokens": 1}', "t.jsonl:2: missing required field 'request_id'"),
        ('{"request_id": "x", "prompt_len": 1, "max_new_tokens": 1}', "t.jsonl:2: missing required field 'timestamp'"),
        ('{"request_id": "x", "timestamp": -1, "prompt_len": 1, "max_new_tokens": 1}', "field 'timestamp' must be"),
        ('{"request_id": "x", "timestamp": 0, "prompt_len": 0, "max_new_tokens": 1}', "field 'prompt_len' must be"),
        ('{"request_id": "x", "timestamp": 0, "prompt_len": 5}', "t.jsonl:2: missing required field 'max_new_tokens'"),
        ('{"request_id": "x", "timestamp": 0, "prompt_len": 5, "output_len": 1.5}', "field 'output_len' must be an"),
        ('{"request_id": "x", "timestamp": 0, "max_new_tokens": 1}', "t.jsonl:2: missing the prompt"),
        (
            '{"request_id": "x", "timestamp": 0, "prompt_token_ids": [1, -2], "max_new_tokens": 1}',
            "field 'prompt_token_ids' must hold integers >= 0; found -2",
        ),
        (
            '{"request_id": "x", "timestamp": 0, "segments": [["a", 0]], "max_new_tokens": 1}',
            "field 'segments' item 0 must be",
        ),
        (
            '{"request_id": "x", "timestamp": 0, "segments": [["a", 3]], "prompt_len": 4, "max_new_tokens": 1}',
            "field 'prompt_len' is 4 but 'segments' hold 3 tokens",
        ),
        (
            '{"request_id": "x", "timestamp": 0, "prompt_len": 5, "prefix_len": 3, "max_new_tokens": 1}',
            "field 'prefix_len' needs 'prefix_group'",
        ),
        (
            '{"request_id": "x", "timestamp": 0, "prompt_len": 5, "prefix_group": 0, "prefix_len": 9, "output_len": 1}',
            "field 'prefix_len' is 9, more than prompt_len 5",
        ),
        ('{"request_id": "x", "timestamp": 0, "prompt_len": 5, "max_new_tokens": 1, "turn": -1}', "field 'turn'"),
        (
            '{"request_id": "x", "timestamp": 0, "prompt_len": 5, "max_new_tokens": 1, "max_tokens": 1}',
            "t.jsonl:2: unknown field 'max_tokens'",
        ),
        (
            '{"request_id": "a", "timestamp": 0, "prompt_len": 5, "max_new_tokens": 1}',
            "t.jsonl:2: request_id 'a' already used on line 1",
        ),
        ('{"hybridkv_trace": 1}', "t.jsonl:2: the header .* must be the first line"),
    ],
)
def test_malformed_trace_lines_name_the_line_and_the_field(tmp_path: Path, line: str, message: str) -> None:
    first = '{"request_id": "a", "timestamp": 0, "prompt_len": 5, "max_new_tokens": 1}'
    with pytest.raises(InvalidInputError, match=message):
        _read_lines(tmp_path, first, line)


def test_bad_header_is_reported(tmp_path: Path) -> None:
    with pytest.raises(
        InvalidInputError, match=re.escape("t.jsonl:1: field 'hybridkv_trace' is 2; this reader knows version 1")
    ):
        _read_lines(tmp_path, '{"hybridkv_trace": 2}')
    with pytest.raises(InvalidInputError, match=re.escape("t.jsonl:2: field 'timestamp' is 1.0; a closed-loop trace")):
        _read_lines(
            tmp_path,
            '{"hybridkv_trace": 1, "concurrency": 2}',
            '{"request_id": "a", "timestamp": 1, "prompt_len": 5, "max_new_tokens": 1}',
        )


def test_unreadable_trace_file_is_reported_with_its_path(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(InvalidInputError, match=re.escape("x.jsonl.gz:1: cannot read the file")):
        read_trace(tmp_path / "x.jsonl.gz")


def test_a_token_level_conversation_holds_the_simulators_answers() -> None:
    from hybridkv.sim.workloads import SIM_ANSWER_TOKEN, with_token_ids

    w = multi_turn_chat(2, 3, system_prompt_len=32, user_len=10, max_new_tokens=7, seed=3)
    t = with_token_ids(w)
    assert [r.request_id for r in t.requests] == [r.request_id for r in w.requests]
    by_id = {r.request_id: r for r in t.requests}
    for r in w.requests:
        ids = list(by_id[r.request_id].token_ids or ())
        assert len(ids) == r.prompt_len and ids[:32] == r.prompt_token_ids()[:32]
        if r.turn:
            prev = by_id[f"{r.conversation_id}-turn-{r.turn - 1}"]
            n = len(prev.token_ids or ())
            # The previous prompt, its answer as the simulator generates it, a new user message.
            assert ids[:n] == list(prev.token_ids or ()) and ids[n : n + 7] == [SIM_ANSWER_TOKEN] * 7
    path = Path(__file__).parent / "_tmp_tokens.jsonl"
    try:
        write_trace(path, t)
        assert read_trace(path).requests == t.requests
    finally:
        path.unlink(missing_ok=True)

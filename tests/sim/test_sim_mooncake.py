"""Mooncake traces in the simulator: the reader, replay options, the CLI and the LRU ceilings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.cli import main
from hybridkv.errors import InvalidInputError
from hybridkv.sim.ceilings import lru_ceiling
from hybridkv.sim.mooncake import read_mooncake
from hybridkv.sim.simulator import SimConfig, simulate
from hybridkv.sim.tiers import parse_tiers
from hybridkv.sim.trace import read_trace, replay, write_trace
from hybridkv.sim.workloads import SimRequest

# 8 requests, attribution in tests/data/NOTICE.md
EXCERPT = Path(__file__).resolve().parents[1] / "data" / "mooncake_excerpt.jsonl"


def test_hash_ids_become_512_token_runs_with_a_partial_last_block() -> None:
    w = read_mooncake(EXCERPT)
    first = w.requests[0]
    assert first.request_id == "mooncake-0" and first.prompt_len == 2752 and first.max_new_tokens == 35
    assert first.segments == tuple((f"mooncake:{h}", 512) for h in (708, 709, 710, 711, 712)) + (("mooncake:713", 192),)
    assert w.requests[1].segments == (("mooncake:714", 33),)
    assert w.content_block_size == 512 and w.concurrency is None


def test_a_partial_last_block_is_marked_where_a_longer_prompt_parts() -> None:
    w = read_mooncake(EXCERPT, mark_last_block=True)
    assert w.requests[0].checkpoint_hints == (5 * 512,)  # 2,752 tokens: the sixth block is partial
    assert w.requests[1].checkpoint_hints == ()  # one block: nothing before it to part at
    assert {r.checkpoint_hints for r in read_mooncake(EXCERPT).requests} == {()}  # the trace as logged
    with pytest.raises(InvalidInputError, match="mark_last_block must be True or False"):
        read_mooncake(EXCERPT, mark_last_block="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("mark", [False, True])
def test_a_recurrent_hybrids_next_turn_hits_where_the_mark_is(tmp_path: Path, mark: bool) -> None:
    # Nemotron-H 8B (Mamba layers: a hit needs a state checkpointed exactly there), one request at
    # a time. Turn 1 has 7 full blocks and a partial one; turn 2 continues it, so it holds a full
    # block there and parts at 7 * 512 = 3,584, 100 tokens before turn 1's end. Unmarked, turn 1
    # leaves no state there and turn 2 recomputes everything; marked, turn 1 checkpoints there.
    def line(ids: list[int], n: int) -> str:
        return json.dumps({"timestamp": 0, "input_length": n, "output_length": 8, "hash_ids": ids})

    lines = [line(list(range(1, 9)), 7 * 512 + 100)]
    lines += [line(list(range(1000 * k, 1000 * k + 4)), 4 * 512) for k in range(1, 5)]  # unrelated
    lines += [line(list(range(1, 8)) + [100, 101], 9 * 512 - 10)]
    path = tmp_path / "turns.jsonl"
    path.write_text("\n".join(lines))
    w = read_mooncake(path, concurrency=1, mark_last_block=mark)
    result = simulate(w, SimConfig(model="nemotron-h-8b", gpu="h100-80gb", kv_cache_tokens=60_000, max_model_len=8192))
    assert result.requests[w.requests[-1].request_id]["hit_tokens"] == (3584 if mark else 0)


def test_timestamps_are_milliseconds_scaled_by_the_time_scale() -> None:
    assert [r.arrival_time for r in read_mooncake(EXCERPT).requests][:3] == [3.437, 4.297, 14.284]
    assert [r.arrival_time for r in read_mooncake(EXCERPT, time_scale=0.5).requests][:3] == [1.7185, 2.1485, 7.142]


def test_a_closed_loop_ignores_the_timestamps_and_limit_keeps_the_first_requests() -> None:
    w = read_mooncake(EXCERPT, concurrency=4, limit=3)
    assert w.concurrency == 4 and [r.arrival_time for r in w.requests] == [0.0, 0.0, 0.0]
    assert [r.prompt_len for r in w.requests] == [2752, 33, 2725]


def test_skip_starts_the_window_later_and_counts_its_arrivals_from_its_first_request() -> None:
    whole = read_mooncake(EXCERPT).requests
    window = read_mooncake(EXCERPT, skip=2, limit=3).requests
    assert [r.segments for r in window] == [r.segments for r in whole[2:5]]
    assert [r.request_id for r in window] == ["mooncake-0", "mooncake-1", "mooncake-2"]
    start = whole[2].arrival_time
    assert [r.arrival_time for r in window] == pytest.approx([r.arrival_time - start for r in whole[2:5]])
    assert {r.arrival_time for r in read_mooncake(EXCERPT, skip=2, concurrency=2).requests} == {0.0}
    with pytest.raises(InvalidInputError, match="no requests after the first 8"):
        read_mooncake(EXCERPT, skip=8)
    with pytest.raises(InvalidInputError, match="skip must be a whole number"):
        read_mooncake(EXCERPT, skip=-1)


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1]}', "1 hash_ids for input_length 1000"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [1], "text": "x"}', "unknown field 'text'"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 5, "hash_ids": [1]}', "field 'timestamp'"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 5, "hash_ids": [1]}', "field 'input_length'"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": ["a"]}', "field 'hash_ids' must hold"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 5}', "field 'hash_ids'"),
    ('{"timestamp": 0, "input_length": 10', "not valid JSON"),
])
def test_a_malformed_line_names_the_line_and_the_field(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(EXCERPT.read_text().splitlines()[0] + "\n" + line + "\n")
    with pytest.raises(InvalidInputError, match=message) as exc:
        read_mooncake(path)
    assert f"{path}:2:" in str(exc.value)


def test_shared_hash_ids_are_shared_prefixes_in_the_simulation() -> None:
    # One request at a time on an ample pool: request 3 repeats request 0 (hit up to its last aligned
    # token, 2736), requests 3, 4 and 6 share the 5 full blocks of request 0 (2,560 tokens), request 7
    # the 7 full blocks of request 4 (3,584).
    w = read_mooncake(EXCERPT, concurrency=1)
    res = simulate(w, SimConfig(model="gemma-3-1b", gpu="l4-24gb", max_model_len=8192))
    hits = [res.requests[f"mooncake-{i}"]["hit_tokens"] for i in range(8)]
    assert hits == [0, 0, 0, 2560, 0, 2736, 2560, 3584]


def test_replay_scales_limits_and_closes_a_hybridkv_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, read_mooncake(EXCERPT))
    w = read_trace(path)
    assert replay(w, limit=2, time_scale=2.0).requests[1].arrival_time == pytest.approx(8.594)
    closed = replay(w, concurrency=3)
    assert closed.concurrency == 3 and {r.arrival_time for r in closed.requests} == {0.0}
    with pytest.raises(InvalidInputError, match="not both"):
        replay(w, time_scale=2.0, concurrency=3)


ARGS = ["simulate", "--model", "gemma-3-1b", "--gpu", "l4-24gb", "--max-model-len", "8192", "--workload", "trace",
        "--trace", str(EXCERPT), "--trace-format", "mooncake", "--no-progress"]


def test_cli_replays_a_mooncake_trace_closed_or_open_loop(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--concurrency", "2", "--requests", "5", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["requests"] == 5 and doc["finished"] == 5
    assert main([*ARGS, "--time-scale", "0.001", "--json", "-"]) == 0
    fast = json.loads(capsys.readouterr().out)
    assert main([*ARGS, "--json", "-"]) == 0
    logged = json.loads(capsys.readouterr().out)
    assert logged["duration_s"] > 476.5 > fast["duration_s"]  # the last request arrives at 476.593 s


@pytest.mark.parametrize("extra, message", [
    (["--time-scale", "2", "--concurrency", "2"], "not both"),
    (["--rate", "2"], "brings its own arrivals"),
])
def test_cli_rejects_conflicting_replay_options_with_status_2(capsys: pytest.CaptureFixture[str], extra: list[str],
                                                             message: str) -> None:
    assert main([*ARGS, *extra]) == 2
    assert message in capsys.readouterr().err


def test_cli_replay_options_need_a_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--workload", "chat", "--requests", "2", "--time-scale", "2", "--no-progress"]) == 2
    assert "--time-scale applies to --workload trace" in capsys.readouterr().err


def test_cli_marks_last_blocks_of_a_mooncake_trace_only(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main([*ARGS, "--mark-last-block", "--concurrency", "2", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["finished"] == 8
    ours = tmp_path / "t.jsonl"
    write_trace(ours, read_mooncake(EXCERPT))
    assert main([*ARGS[:-5], "--trace", str(ours), "--mark-last-block", "--no-progress"]) == 2
    assert "give --trace-format mooncake" in capsys.readouterr().err
    assert main(["simulate", "--workload", "chat", "--requests", "2", "--mark-last-block", "--no-progress"]) == 2
    assert "--mark-last-block applies to --workload trace" in capsys.readouterr().err


def test_a_trace_request_longer_than_max_model_len_is_rejected_not_fatal() -> None:
    w = read_mooncake(EXCERPT, concurrency=2)
    s = simulate(w, SimConfig(model="gemma-3-1b", gpu="l4-24gb", max_model_len=3000,
                              tiers=parse_tiers("host:1GiB"))).summary
    assert s["rejected"] == 2 and s["rejected_too_long"] == 2 and s["finished"] == 6  # the two 3,840-token ones


# ---------------------------------------------------------------------- ceilings

def blocks(rid: str, ids: list[int], last: int = 512) -> SimRequest:
    segs = tuple((f"b{h}", 512) for h in ids[:-1]) + ((f"b{ids[-1]}", last),)
    return SimRequest(rid, 0.0, segs, 1)


CHAT = [blocks("t0", [1, 2, 3], 100), blocks("t1", [1, 2, 4, 5], 200), blocks("t2", [1, 2, 4, 6, 7], 300),
        blocks("d1", [1, 8, 10], 50), blocks("d2", [1, 9, 11], 50)]
# Prompt tokens: 1124 + 1736 + 2348 + 1074 + 1074 = 7356.


def ceiling(model: str, capacity: float = 1e12, requests: list[SimRequest] = CHAT) -> float:
    return lru_ceiling(requests, capacity, model=model, growing_bytes_per_token=1.0,
                       checkpoint_bytes=lambda p: 10.0, block_size=512).hit_rate


def test_ceilings_of_a_small_conversation_by_hand() -> None:
    # t1 and t2 hold the chain of their previous turn to 1024 and 1536 tokens, d1 and d2 to 512.
    assert ceiling("infinite") == pytest.approx((1024 + 1536 + 512 + 512) / 7356)
    assert ceiling("growing") == pytest.approx((1024 + 1536 + 512 + 512) / 7356)
    # Checkpoints at each prompt's last full block: t0's at 1024, t1's at 1536; none at 512.
    assert ceiling("end-checkpoint") == pytest.approx((1024 + 1536) / 7356)
    # d1 finds the chain to 512 with no checkpoint there (a junction): it keeps one, and d2 resumes.
    assert ceiling("junctions") == pytest.approx((1024 + 1536 + 512) / 7356)


def test_a_cache_too_small_for_a_prompt_keeps_its_head() -> None:
    # 600 bytes: t0's tail blocks (3, then 2) are evicted, its first block stays, and t1 resumes at 512.
    two = CHAT[:2]
    assert ceiling("growing", 600, two) == pytest.approx(512 / (1124 + 1736))
    assert ceiling("growing", 1e12, two) == pytest.approx(1024 / (1124 + 1736))

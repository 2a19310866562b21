"""Message boundaries a client marks (``checkpoint_hints``): workloads carry them, traces keep them,
and on a recurrent hybrid they let the second request sharing a system prompt hit it."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

from hybridkv.errors import InvalidInputError
from hybridkv.sim.simulator import SimConfig, simulate
from hybridkv.sim.trace import read_trace
from hybridkv.sim.workloads import ClosedLoop, Workload, multi_turn_chat, shared_prefix


def test_chat_shaped_workloads_mark_the_system_prompts_end() -> None:
    assert {r.checkpoint_hints for r in shared_prefix(20, 3, 100, 50, max_new_tokens=4).requests} == {(100,)}
    chat = multi_turn_chat(2, 3, system_prompt_len=64, user_len=10, max_new_tokens=4)
    assert {r.checkpoint_hints for r in chat.requests} == {(64,)}
    bare = multi_turn_chat(2, 3, system_prompt_len=0, user_len=10, max_new_tokens=4)
    assert {r.checkpoint_hints for r in bare.requests} == {()}


def test_a_trace_line_keeps_its_hints_and_a_named_prefix_is_one(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [{"request_id": "a", "timestamp": 0, "prompt_len": 300, "prefix_group": 1, "prefix_len": 100,
              "max_new_tokens": 4},
             {"request_id": "b", "timestamp": 0, "segments": [["x", 50], ["y", 50]], "max_new_tokens": 4,
              "checkpoint_hints": [50]},
             {"request_id": "c", "timestamp": 0, "prompt_len": 30, "max_new_tokens": 4}]
    path.write_text("\n".join(json.dumps(x) for x in lines))
    assert [r.checkpoint_hints for r in read_trace(path).requests] == [(100,), (50,), ()]


@pytest.mark.parametrize("hints", [[0], [301], ["5"], 5])
def test_a_bad_hint_in_a_trace_names_the_line(tmp_path: Path, hints: object) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"request_id": "a", "timestamp": 0, "prompt_len": 300, "max_new_tokens": 4,
                                "checkpoint_hints": hints}))
    with pytest.raises(InvalidInputError, match=r"t\.jsonl:1: .*checkpoint.hint"):
        read_trace(path)


def _misses_per_prefix(work: Workload) -> Counter[int]:
    cfg = SimConfig(model="nemotron-h-8b", gpu="h100-80gb", max_model_len=4096)
    result = simulate(work, cfg)
    return Counter(r.prefix_group for r in work.requests  # type: ignore[misc]
                   if result.requests[r.request_id]["hit_tokens"] == 0)


def test_on_a_recurrent_hybrid_only_the_first_request_of_a_system_prompt_misses() -> None:
    """With the hint the first request checkpoints its state at the prompt's end (100 -> 96) and a
    burst's later requests wait one step for it; without it the second request must reveal the
    junction first (and a burst computes the prefix several times)."""
    work = shared_prefix(64, 4, 100, 200, max_new_tokens=8, arrivals=ClosedLoop(8))
    assert _misses_per_prefix(work) == dict.fromkeys(range(4), 1)
    bare = dataclasses.replace(work, requests=[dataclasses.replace(r, checkpoint_hints=()) for r in work.requests])
    assert all(n >= 2 for n in _misses_per_prefix(bare).values())

"""What ``hybridkv plan --num-speculative-tokens K`` reports for layouts with recurrent (Mamba) state:
the draft slots' blocks in attention groups, none in a state at its bound, and the most drafts a
state block takes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from hybridkv import InvalidInputError
from hybridkv.cli import main
from hybridkv.planning.planner import PlanInput, make_plan, render_text

from helpers import decoding_requests

# Nemotron-H 8B on an L4: one full-attention group and 24 Mamba-2 states spread over 198 page groups.
NEMOTRON = PlanInput(model="nemotron-h-8b", gpu="l4-24gb", max_model_len=4096, request_lens=(32, 33, 1000, 1024))


def test_drafts_add_attention_blocks_and_state_pages_only_below_the_states_bound() -> None:
    plain = make_plan(NEMOTRON).report
    spec = make_plan(replace(NEMOTRON, num_speculative_tokens=3)).report
    s = spec["speculative"]
    state_pages = sum(st["pages_per_state"] for st in spec["recurrent_states"])
    assert state_pages == 198 and len(spec["groups"]) == 199
    assert s["max_speculative_tokens"] == 15  # one 16-token block of the state, less the step's token
    # The full-attention group: one block; the states (at most 3 each, 2 + one checkpoint) none, but
    # for a request of at most 32 tokens, below that bound, one more state.
    assert (s["draft_blocks_per_request"], s["draft_state_blocks_per_request"]) == (1, 198)
    assert s["draft_state_blocks_up_to_tokens"] == 32
    usable = spec["num_blocks"] - 1
    assert s["max_concurrency"] == usable // (spec["blocks_per_request"] + 1)
    at, before = s["concurrency_at_request_len"], plain["concurrency_at_request_len"]
    assert at["32"] == usable // (3 + 198 * 3) < before["32"] == usable // (2 + 198 * 2)
    assert at["33"] == before["33"] and at["1000"] == before["1000"]  # no block boundary in reach
    # 1024 tokens end on a block boundary: one more attention block.
    assert (at["1024"], before["1024"]) == (usable // (65 + 198 * 3), usable // (64 + 198 * 3))


def test_the_real_manager_decodes_as_many_recurrent_requests_with_drafts_as_without() -> None:
    plan = make_plan(replace(NEMOTRON, num_speculative_tokens=3))
    planned = plan.report["speculative"]["concurrency_at_request_len"]["1000"]
    assert decoding_requests(plan.layout, 1000, 3) == decoding_requests(plan.layout, 1000, 0) >= planned > 0


def test_the_report_says_the_limit_and_the_state_pages() -> None:
    text = render_text(make_plan(replace(NEMOTRON, num_speculative_tokens=3)))
    assert ("speculative decoding, 3 draft tokens (at most 15 here): up to 1 more blocks per request (198 more "
            "in recurrent states up to 32 tokens)") in text


def test_more_drafts_than_a_state_block_takes_are_refused() -> None:
    with pytest.raises(InvalidInputError, match=r"num_speculative_tokens=16, but a decode step of this layout "
                                                r"verifies at most 15 draft tokens: .* 16-token block"):
        make_plan(replace(NEMOTRON, num_speculative_tokens=16))
    # Larger blocks take more drafts, up to the scheduler's 16.
    wide = make_plan(replace(NEMOTRON, block_size=32, num_speculative_tokens=16)).report["speculative"]
    assert wide["max_speculative_tokens"] == 16 and wide["draft_state_blocks_up_to_tokens"] == 64
    # Without a recurrent state, one step's token budget is the limit.
    with pytest.raises(InvalidInputError, match=r"at most 7 draft tokens: one step computes at most "
                                                r"max_num_batched_tokens=8 tokens"):
        make_plan(PlanInput(model="gemma-3-1b", max_model_len=4096, max_num_batched_tokens=8,
                            num_speculative_tokens=9))


def test_cli_plan_of_a_recurrent_model_with_drafts(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--model", "qwen3-next-80b-a3b", "--tp", "4", "--max-model-len", "8192"]
    assert main([*args, "--num-speculative-tokens", "4", "--json", "-"]) == 0
    s = json.loads(capsys.readouterr().out)["speculative"]
    # Three states of 17 pages each and one full-attention group.
    assert (s["num_speculative_tokens"], s["max_speculative_tokens"]) == (4, 15)
    assert (s["draft_blocks_per_request"], s["draft_state_blocks_per_request"]) == (1, 51)
    assert main([*args, "--num-speculative-tokens", "16"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert "--num-speculative-tokens=16" in out.err and "at most 15 draft tokens" in out.err

"""The LRU ceiling of conversations (``sim.ceilings.turn_ceiling``): prompts and answers in blocks."""

from __future__ import annotations

import pytest

from hybridkv.errors import InvalidInputError
from hybridkv.sim.ceilings import turn_ceiling
from hybridkv.sim.workloads import SimRequest, multi_turn_chat, with_token_ids


def window(p: int) -> list[tuple[int, int, float]]:
    """A sliding window of two 16-token blocks before ``p`` (one block each)."""
    return [(1, i, 1.0) for i in range(max(0, p // 16 - 2), p // 16)]


def hits(model: str, capacity: float = 1e9, requests: list[SimRequest] | None = None) -> int:
    res = turn_ceiling(requests or two_turns(), capacity, model=model, growing_per_token=1 / 16, span=window,
                       alignment=16)
    return res.hit_tokens


def two_turns() -> list[SimRequest]:
    first = SimRequest("c-turn-0", 0.0, (("user-0", 100),), 50, conversation_id="c", turn=0)
    second = SimRequest("c-turn-1", 0.0, (("user-0", 100), ("out:c-turn-0", 50), ("user-1", 30)), 10,
                        conversation_id="c", turn=1)
    return [first, second]


def test_the_next_turn_resumes_at_the_previous_answers_end_with_a_turn_end_checkpoint() -> None:
    assert hits("turn-end") == 144  # 100 + 50 - 1 computed, rounded down to 16
    assert hits("prompt-end") == 96  # the previous prompt's last boundary before its last token
    assert hits("growing") == hits("infinite") == 144  # anywhere: all computed blocks (the answer's last token
    # never is), so a turn-end checkpoint reaches the growing ceiling on a conversation


def test_a_token_level_trace_gives_the_same_ceiling() -> None:
    w = multi_turn_chat(3, 3, system_prompt_len=64, user_len=20, max_new_tokens=40, seed=1)
    for model in ("growing", "prompt-end", "turn-end", "infinite"):
        assert hits(model, requests=w.requests) == hits(model, requests=with_token_ids(w).requests), model


def test_capacity_evicts_least_recently_used_blocks_first() -> None:
    # 1 unit holds 16 growing blocks; each window block is 1 unit: nothing but a few blocks fit.
    assert hits("turn-end", capacity=2.0) < hits("turn-end")


def test_an_unknown_model_is_an_error() -> None:
    with pytest.raises(InvalidInputError, match="turn-end"):
        hits("end-checkpoint")

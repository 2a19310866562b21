"""The next turn's checkpoint: a released sequence's computed end (prompt plus answer, rounded down to
the hit alignment) is where the next turn of a conversation resumes, on the device (window retention)
and in a tier (``StoreHitSpans``)."""

from __future__ import annotations

import pytest

from hybridkv import KVCacheManager, Sequence, WindowRetention
from hybridkv.connectors import HostTier, KVConnector
from hybridkv.connectors.storage import StoreHitSpans

from helpers import full, mamba, manager, run_prefill, swa, tokens

ANSWER = 500_000  # first token id of generated answers


def converse(mgr: KVCacheManager, seq: Sequence, answer: int, conn: KVConnector | None = None) -> int:
    """Prefill in one step, decode ``answer`` tokens as an engine does (store after each step, once it
    is reported computed; the last sampled token is appended but never computed), free. Returns the hit."""
    hit = run_prefill(mgr, seq, 4096)
    if conn is not None:
        conn.store(seq, seq.num_computed_tokens, lambda g, b: b"k", hit)
    for k in range(answer - 1):
        seq.append_token_ids([ANSWER + k])
        c = seq.num_computed_tokens
        assert mgr.allocate(seq, 1) is not None
        seq.num_computed_tokens = c + 1
        if conn is not None:
            conn.store(seq, c + 1, lambda g, b: b"k", c)
        mgr.check_invariants()
    seq.append_token_ids([ANSWER + answer - 1])
    mgr.free(seq)
    mgr.check_invariants()
    return hit


def next_turn(previous: Sequence, sid: str = "t1") -> Sequence:
    """The previous turn's prompt and answer, then a new user message."""
    return Sequence(sid, list(previous.token_ids) + tokens(9_000, 40))


def pressure_trajectory(group: object, keep_ends: bool, prompt: int, answer: int) -> list[tuple[int, int]]:
    """(hit, full-attention hit) of the next turn after each of 40 small unrelated requests."""
    mgr = manager(160, full(), group, max_model_len=4096, batch=4096, retention=WindowRetention(keep_ends=keep_ends))
    converse(mgr, Sequence("old", tokens(700_000, 400)), 1)  # the oldest blocks in the LRU
    t0 = Sequence("t0", tokens(0, prompt))
    converse(mgr, t0, answer)
    out = []
    for i in range(40):
        hit = mgr.lookup(next_turn(t0))
        out.append((hit.num_tokens, hit.full_hit_tokens))
        converse(mgr, Sequence(f"x{i}", tokens(100_000 * (i + 1), 90)), 1)
    return out


# (group, prompt, answer): 300 + 115 = 415 tokens, 414 computed, end 400. The window of 64 tokens
# drops its first block inside the end's span at the last step; the recurrent state at 400 is
# dropped 14 steps before the end.
CASES = {"sliding window": (swa(64), 300, 115), "recurrent": (mamba(), 300, 115)}


@pytest.mark.parametrize("case", CASES)
def test_the_next_turn_hits_through_the_answers_end_as_long_as_its_chain_is_cached(case: str) -> None:
    group, prompt, answer = CASES[case]
    trajectory = pressure_trajectory(group, True, prompt, answer)
    assert trajectory[0] == (400, 400)
    assert all(hit == 400 for hit, chain in trajectory if chain == 400), trajectory
    assert trajectory[-1][1] < 400  # the pressure did evict the chain in the end


@pytest.mark.parametrize("case", CASES)
def test_without_the_end_checkpoint_pressure_takes_the_end_while_its_chain_is_cached(case: str) -> None:
    group, prompt, answer = CASES[case]
    trajectory = pressure_trajectory(group, False, prompt, answer)
    assert trajectory[0] == (400, 400)
    assert any(hit < 400 for hit, chain in trajectory if chain == 400), trajectory


def test_a_decoding_sequence_leaves_only_its_current_ends_state_out_of_low() -> None:
    mgr = manager(400, full(), mamba(), max_model_len=4096, batch=4096, retention="window")
    seq = Sequence("s", tokens(0, 300))
    run_prefill(mgr, seq, 4096)
    pool = mgr.pool
    states = []
    for k in range(100):
        seq.append_token_ids([ANSWER + k])
        assert mgr.allocate(seq, 1) is not None
        seq.num_computed_tokens += 1
        free_states = [b for b in range(1, pool.num_blocks) if pool.block_group[b] == 1 and pool.block_hash[b]
                       and not pool.ref_cnt[b]]
        in_lru = [b for b in free_states if pool.queue_of(b) == "lru"]
        # The state at the current end (dropped once the sequence moved past it) waits in the LRU;
        # the earlier decode states went to ``low``; the state at the prompt's end (288) to the LRU.
        assert len(in_lru) <= 2 and pool.num_kept_blocks == 0
        states.append(len(free_states))
        mgr.check_invariants()
    assert states[-1] == 7  # 288 (the prompt's end), then 304 .. 384 dropped during decode
    assert len(in_lru) == 2  # 288 and 384 (400 computed: the end is 400, 384 is let go at the next step)
    mgr.free(seq)
    assert mgr.lookup(next_turn(seq)).num_tokens == 400  # the running state at 400, registered at free
    assert pool.num_kept_blocks == 1  # it is kept under the anchor at 400


def test_a_preempted_sequence_is_readmitted_from_its_computed_end() -> None:
    lost = {}
    for keep_ends in (True, False):
        mgr = manager(160, full(), mamba(), max_model_len=4096, batch=4096,
                      retention=WindowRetention(keep_ends=keep_ends))
        converse(mgr, Sequence("old", tokens(700_000, 400)), 1)
        seq = Sequence("s", tokens(0, 300))
        run_prefill(mgr, seq, 4096)
        for k in range(30):  # 330 computed when preempted: the state at 320 was dropped 9 steps before
            seq.append_token_ids([ANSWER + k])
            assert mgr.allocate(seq, 1) is not None
            seq.num_computed_tokens += 1
        mgr.free(seq)
        seq.num_computed_tokens = 0
        trajectory = []
        for i in range(30):
            hit = mgr.lookup(seq)
            trajectory.append((hit.num_tokens, hit.full_hit_tokens))
            converse(mgr, Sequence(f"x{i}", tokens(100_000 * (i + 1), 90)), 1)
        assert trajectory[0] == (320, 320) and trajectory[-1][1] < 320
        lost[keep_ends] = [hit for hit, chain in trajectory if chain == 320 and hit < 320]
    assert lost[True] == []
    assert lost[False] and set(lost[False]) == {288}  # back to the prompt's end checkpoint


def test_a_tier_stores_the_window_at_the_answers_end_for_the_next_turn() -> None:
    for answer_ends, expected in ((True, 400), (False, 288)):
        host = HostTier(1 << 20)
        storage = StoreHitSpans(answer_ends=answer_ends)
        mgr = manager(400, full(), swa(64), retention="none")
        conn = KVConnector([host], mgr, namespace="m", payload_bytes={0: 1, 1: 1}, storage=storage)
        t0 = Sequence("t0", tokens(0, 300))
        converse(mgr, t0, 115, conn)
        # A fresh device: the next turn loads through the answer's end (400), or only to the prompt's (288).
        other = manager(400, full(), swa(64), retention="none")
        reader = KVConnector([host], other, namespace="m", payload_bytes={0: 1, 1: 1}, storage=storage)
        assert reader.num_external_tokens(next_turn(t0), 0) == expected, answer_ends


def test_a_tier_stores_the_recurrent_state_at_the_answers_end() -> None:
    host = HostTier(1 << 20)
    mgr = manager(400, full(), mamba(), retention="none")
    conn = KVConnector([host], mgr, namespace="m", payload_bytes={0: 1, 1: 1}, storage=StoreHitSpans())
    t0 = Sequence("t0", tokens(0, 300))
    converse(mgr, t0, 115, conn)
    reader = KVConnector([host], manager(400, full(), mamba(), retention="none"), namespace="m",
                         payload_bytes={0: 1, 1: 1}, storage=StoreHitSpans())
    assert reader.num_external_tokens(next_turn(t0), 0) == 400

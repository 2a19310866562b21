"""Window retention: junction windows survive memory pressure; admission never stalls."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

from hybridkv import Sequence, WindowRetention

from helpers import full, manager, run_prefill, swa, tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from reference_trace import TraceConfig, build_workload, run_trace

SMALL = replace(TraceConfig(), requests=240, prefixes=8, prefix_len=512, suffix_len=128, decode_steps=16,
                max_running=16, token_budget=2048, num_blocks=700, max_model_len=2048)


def test_window_retention_recovers_hybrid_hits_under_pressure() -> None:
    prompts = build_workload(SMALL)
    full_only = run_trace("full", SMALL, "none", prompts)
    lru = run_trace("hybrid", SMALL, "none", prompts)
    kept = run_trace("hybrid", SMALL, "window", prompts)
    assert lru.hit_rate < 0.5 * full_only.hit_rate  # the hybrid hit-rate collapse under plain LRU
    assert kept.hit_rate >= 0.75 * full_only.hit_rate
    assert kept.calls["junctions_found"] > 0 and kept.calls["retained"] > 0


def test_keeping_sequence_ends_costs_shared_prefix_hits_nothing() -> None:
    # Gemma 3 27B under pressure: 120 requests on 4 prefixes of 2,048 tokens. A sequence's end (its
    # decode drops reach into the junction's window) must never take the junction's window blocks.
    from hybridkv.sim.simulator import SimConfig, simulate
    from hybridkv.sim.workloads import ClosedLoop, shared_prefix

    w = shared_prefix(120, num_prefixes=4, prefix_len=2048, suffix_len=256, max_new_tokens=64, arrivals=ClosedLoop(16))
    rates = [simulate(w, SimConfig(kv_cache_tokens=60000, max_model_len=8192,
                                   retention=WindowRetention(keep_ends=keep))).summary["prefix_hit_rate"]
             for keep in (False, True)]
    assert rates[1] >= rates[0] > 0.8


def test_window_retention_does_not_lose_to_lru_when_everything_fits() -> None:
    roomy = replace(SMALL, num_blocks=20000)
    prompts = build_workload(roomy)
    lru = run_trace("hybrid", roomy, "none", prompts)
    kept = run_trace("hybrid", roomy, "window", prompts)
    assert kept.hit_rate >= lru.hit_rate


@pytest.mark.parametrize("chunk", [16, 64])  # 16: the window drops one block per step
def test_junction_window_is_retained_and_released_with_its_prefix(chunk: int) -> None:
    mgr = manager(60, full(16), swa(32, 16), retention="window", max_model_len=512, batch=64)
    prefix = tokens(0, 128)
    run_prefill(mgr, Sequence("a", prefix + tokens(1000, 64)), 64)
    mgr.free("a")
    # b shares the prefix: its lookup finds full attention matching to the junction at 128.
    b = Sequence("b", prefix + tokens(2000, 64))
    run_prefill(mgr, b, chunk)
    mgr.free(b)
    assert mgr.stats.retention["junctions_found"] == 1
    # cdiv(31, 16) = 2 window blocks ending at the junction (128), and 2 ending at each freed
    # sequence's end (192: a re-sent prompt or the next turn resumes there).
    assert mgr.pool.num_kept_blocks == 6
    kept = mgr.pool.kept
    assert kept is not None
    anchors = {mgr.pool.block_hash[a] for a in kept.by_anchor}
    # Pressure: unrelated prompts take the whole pool; the window goes only with its prefix.
    for i in range(6):
        s = Sequence(f"x{i}", tokens(10000 * (i + 2), 300))
        run_prefill(mgr, s, 64, use_hit=False)
        mgr.free(s)
        mgr.check_invariants()
    hit = mgr.lookup(Sequence("c", prefix + tokens(3000, 10)))
    assert hit.num_tokens in (0, 128)
    if hit.num_tokens == 0:  # released together with the evicted prefix (the x's keep their own ends)
        assert anchors.isdisjoint(mgr.pool.block_hash[a] for a in kept.by_anchor)


def test_retention_never_stalls_a_running_sequence() -> None:
    # A single sequence in a pool sized by the admission bound runs to the end with retention on.
    mgr = manager(78, full(), swa(64), max_model_len=1024, batch=128, retention="window")
    run_prefill(mgr, Sequence("warm", tokens(0, 600)), 128)
    mgr.free("warm")
    seq = Sequence("long", tokens(0, 600) + tokens(5000, 400))
    run_prefill(mgr, seq, 128, whole=True)


def test_a_policy_object_is_configuration_shared_by_managers() -> None:
    policy = WindowRetention(max_junctions=8)
    a = manager(60, full(16), swa(32, 16), retention=policy, max_model_len=512, batch=64)
    b = manager(60, full(16), swa(32, 16), retention=policy, max_model_len=512, batch=64)
    prefix = tokens(0, 128)
    for sid in ("x", "y"):
        run_prefill(a, Sequence(sid, prefix + tokens(len(sid) * 1000 + ord(sid), 64)), 64)
        a.free(sid)
    assert a.stats.retention["junctions_found"] == 1
    assert b.stats.retention["junctions_found"] == 0  # each manager keeps its own junctions
    assert a.retention is b.retention is policy


def _junction(a_suffix: int = 64, num_blocks: int = 120):  # type: ignore[no-untyped-def]
    """a and b share 128 tokens: b's lookup finds the junction; b's window at 128 is kept (the
    windows at a's and b's ends are not: junctions alone)."""
    mgr = manager(num_blocks, full(16), swa(32, 16), retention=WindowRetention(keep_ends=False),
                  max_model_len=2048, batch=2048)
    prefix = tokens(0, 128)
    a = Sequence("a", prefix + tokens(1000, a_suffix))
    run_prefill(mgr, a, 256)
    mgr.free(a)
    b = Sequence("b", prefix + tokens(2000, 64))
    run_prefill(mgr, b, 256)
    mgr.free(b)
    return mgr, prefix


def _fill(mgr, blocks: int, sid: str = "filler") -> Sequence:  # type: ignore[no-untyped-def]
    """A running one-step prefill holding ``blocks`` blocks (full + SWA: two per 16 tokens)."""
    assert blocks % 2 == 0
    seq = Sequence(sid, tokens(90_000, 8 * blocks))
    assert mgr.allocate(seq, seq.num_tokens) is not None
    assert sum(1 for t in mgr.block_table(sid) for b in t if b) == blocks
    return seq


def test_a_junction_is_where_full_attention_stops_short_of_the_prompt() -> None:
    mgr, prefix = _junction()
    assert mgr.stats.retention["junctions_found"] == 1
    # The whole prompt matched (a re-sent prompt): no junction.
    again = Sequence("again", prefix + tokens(2000, 64))
    run_prefill(mgr, again, 256)
    mgr.free(again)
    assert mgr.stats.retention["junctions_found"] == 1
    # A prompt that leaves the chain at its own last aligned boundary: not a junction either.
    edit = Sequence("edit", prefix + tokens(2000, 48) + tokens(7000, 16))  # max hit 176, chain to 176
    assert mgr.lookup(edit).full_hit_tokens == 176
    run_prefill(mgr, edit, 256)
    mgr.free(edit)
    assert mgr.stats.retention["junctions_found"] == 1
    short = Sequence("short", prefix + tokens(2000, 32) + tokens(8000, 33))  # chain to 160 < max hit 208
    run_prefill(mgr, short, 256)
    mgr.free(short)
    assert mgr.stats.retention["junctions_found"] == 2
    # No full-attention match at all: nothing to remember.
    run_prefill(mgr, Sequence("new", tokens(9000, 100)), 256)
    assert mgr.stats.retention["junctions_found"] == 2


def _resend_b(mgr, prefix, extra: int = 0):  # type: ignore[no-untyped-def]
    """d re-sends b's prompt (plus ``extra`` tokens): its hit holds the anchor at 128 but not the
    window kept there (b freed last: its blocks are the newest in the LRU)."""
    d = Sequence("d", prefix + tokens(2000, 64) + tokens(3000, extra))
    hit = mgr.lookup(d)
    assert hit.num_tokens == (176 if not extra else 192) and hit.block_ids[0][7] in mgr.pool.kept.by_anchor
    return d, hit


def test_kept_windows_of_a_held_anchor_are_not_admissible() -> None:
    mgr, prefix = _junction()
    d, hit = _resend_b(mgr, prefix)
    assert mgr.allocate(d, d.num_tokens - hit.num_tokens, hit=hit) is not None
    assert mgr.num_free_blocks - mgr.num_admissible_blocks == 2  # cdiv(32 - 1, 16) window blocks at 128
    # An unrelated prompt needing one block more than is admissible must wait.
    need = mgr.num_admissible_blocks + 2
    big = Sequence("big", tokens(50_000, 8 * need))
    assert mgr.blocks_needed_when_empty(big.num_tokens) == need <= mgr.num_free_blocks
    assert mgr.allocate(big, big.num_tokens) is None
    assert mgr.allocate(Sequence("fits", tokens(60_000, 8 * (need - 2))), 8 * (need - 2)) is not None
    mgr.check_invariants()


def test_adopting_an_anchor_makes_its_kept_windows_reserved_and_admission_counts_them() -> None:
    # With room, the adoption reserves the two windows kept under the anchor d adopts.
    mgr, prefix = _junction(a_suffix=17)
    assert mgr.pool.num_kept_blocks == 2 and mgr.num_admissible_blocks == mgr.num_free_blocks
    d, hit = _resend_b(mgr, prefix, extra=32)
    assert mgr.allocate(d, d.num_tokens - hit.num_tokens, hit=mgr.lookup(d)) is not None
    assert mgr.num_free_blocks - mgr.num_admissible_blocks == 2  # the adopted anchor's kept windows
    mgr.check_invariants()


def test_kept_windows_yield_to_an_admission_they_alone_would_refuse() -> None:
    # Leave free hits + the step (+ 1) admissible blocks: enough only if the two kept windows the
    # adoption would reserve are not counted. They are cache, not work: rather than refuse (a request
    # that fits an idle pool would wait for ever), they leave the kept queue for ``low``.
    mgr, prefix = _junction(a_suffix=17)  # few blocks of a's own: the filler below evicts only those
    d, hit = _resend_b(mgr, prefix, extra=32)
    free_hits = sum(1 for ids in hit.block_ids for b in ids if b and not mgr.pool.ref_cnt[b])
    step = 4  # 32 new tokens: two full blocks, two window blocks
    room = mgr.num_admissible_blocks - (free_hits + step)
    _fill(mgr, room - room % 2)  # an even number of blocks: evicts only free blocks ahead of d's hits
    assert mgr.num_admissible_blocks - (free_hits + step) in (0, 1)
    assert mgr.lookup(d).num_tokens == 192
    assert mgr.allocate(d, d.num_tokens - hit.num_tokens, hit=mgr.lookup(d)) is not None
    assert mgr.pool.num_kept_blocks == 0 and mgr.num_free_blocks == mgr.num_admissible_blocks  # none reserved
    mgr.check_invariants()

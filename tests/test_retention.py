"""Retention (seed 004): junction windows survive memory pressure; admission never stalls."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from hybridkv import Sequence, WindowRetention

from helpers import full, manager, run_prefill, swa, tokens

sys.path.insert(0, str(Path(__file__).parent.parent / "bench"))
from reference_trace import TraceConfig, build_workload, run_trace

SMALL = replace(TraceConfig(), requests=240, prefixes=8, prefix_len=512, suffix_len=128, decode_steps=16,
                max_running=16, token_budget=2048, num_blocks=700, max_model_len=2048)


def test_window_retention_recovers_hybrid_hits_under_pressure() -> None:
    prompts = build_workload(SMALL)
    full_only = run_trace("full", SMALL, "none", prompts)
    lru = run_trace("hybrid", SMALL, "none", prompts)
    kept = run_trace("hybrid", SMALL, "window", prompts)
    assert lru.hit_rate < 0.5 * full_only.hit_rate  # the seed-004 collapse
    assert kept.hit_rate >= 0.75 * full_only.hit_rate
    assert kept.calls["junctions_found"] > 0 and kept.calls["retained"] > 0


def test_window_retention_does_not_lose_to_lru_when_everything_fits() -> None:
    roomy = replace(SMALL, num_blocks=20000)
    prompts = build_workload(roomy)
    lru = run_trace("hybrid", roomy, "none", prompts)
    kept = run_trace("hybrid", roomy, "window", prompts)
    assert kept.hit_rate >= lru.hit_rate


def test_junction_window_is_retained_and_released_with_its_prefix() -> None:
    mgr = manager(60, full(16), swa(32, 16), retention="window", max_model_len=512, batch=64)
    prefix = tokens(0, 128)
    run_prefill(mgr, Sequence("a", prefix + tokens(1000, 64)), 64)
    mgr.free("a")
    # b shares the prefix: its lookup finds full attention matching to the junction at 128.
    b = Sequence("b", prefix + tokens(2000, 64))
    run_prefill(mgr, b, 64)
    mgr.free(b)
    assert mgr.stats.retention["junctions_found"] == 1
    assert mgr.pool.num_kept_blocks == 2  # cdiv(31, 16) blocks ending at 128
    # Pressure: unrelated prompts take the whole pool; the window goes only with its prefix.
    for i in range(6):
        s = Sequence(f"x{i}", tokens(10000 * (i + 2), 300))
        run_prefill(mgr, s, 64, use_hit=False)
        mgr.free(s)
        mgr.check_invariants()
    hit = mgr.lookup(Sequence("c", prefix + tokens(3000, 10)))
    assert hit.num_tokens in (0, 128)
    if hit.num_tokens == 0:
        assert mgr.pool.num_kept_blocks == 0  # released together with the evicted prefix


def test_retention_never_stalls_a_running_sequence() -> None:
    # A single sequence in a pool sized by the seed-001 bound runs to the end with retention on.
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

"""A simulated cluster: replicas behind a router whose index follows their KV events."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from hybridkv.cli import main
from hybridkv.errors import InvalidInputError
from hybridkv.sim.cluster import ClusterConfig, ReplicaSim, Router, cluster_variants, simulate_cluster
from hybridkv.sim.engine import RequestRecords, make_sequence
from hybridkv.sim.simulator import SimConfig, calibrated_cost_model
from hybridkv.sim.tiers import parse_tiers
from hybridkv.sim.workloads import ClosedLoop, SimRequest, Workload, multi_turn_chat, shared_prefix

# Gemma 3 27B (full attention + 1,024-token sliding windows) with room for 100,000 tokens per replica.
CFG = SimConfig(model="gemma-3-27b", kv_cache_tokens=100_000)


def _request(i: int, at: float, *runs: tuple[str, int]) -> SimRequest:
    return SimRequest(f"r{i}", at, tuple(runs), 4)


def _spaced(*prompts: tuple[tuple[str, int], ...], gap: float = 5.0) -> Workload:
    """One request every ``gap`` seconds: each finishes before the next arrives."""
    return Workload([_request(i, i * gap, *runs) for i, runs in enumerate(prompts)], None, "spaced")


def test_hybrid_exact_sends_a_shared_prefix_to_the_replica_that_holds_it() -> None:
    work = _spaced((("A", 4096), ("a1", 200)), (("B", 4096), ("b1", 200)), (("A", 4096), ("a2", 300)),
                   (("B", 4096), ("b2", 300)), (("A", 4096), ("a3", 100)))
    res = simulate_cluster(work, CFG, ClusterConfig(instances=4, router="hybrid_exact"))
    replica = {rid: r["replica"] for rid, r in res.requests.items()}
    assert replica["r2"] == replica["r4"] == replica["r0"]
    assert replica["r3"] == replica["r1"]  # A and B each stay on their replica (their homes may coincide)
    assert [res.requests[f"r{i}"]["hit_tokens"] for i in range(5)] == [0, 0, 4096, 4096, 4096]


def test_round_robin_spreads_requests_that_share_a_prefix() -> None:
    work = _spaced(*[(("A", 2048), (f"s{i}", 100)) for i in range(8)], gap=2.0)
    res = simulate_cluster(work, CFG, ClusterConfig(instances=4, router="round_robin"))
    assert sorted(res.summary["routed"].values()) == [2, 2, 2, 2]
    exact = simulate_cluster(work, CFG, ClusterConfig(instances=4, router="hybrid_exact"))
    assert exact.summary["hit_tokens"] == 7 * 2048  # every request after the first hits on one replica
    assert res.summary["hit_tokens"] == 4 * 2048  # each replica computes the prefix once


def test_the_predicted_hit_is_the_hit_the_chosen_replica_finds() -> None:
    # Prefixes of several lengths, revisited at different depths, with a pool that evicts.
    prompts = []
    for i in range(16):
        base = ("P", 6144) if i % 2 else ("Q", 3072)
        prompts.append((base, (f"mid{i % 3}", 1024 * (1 + i % 4)), (f"own{i}", 300)))
    for router in ("hybrid_exact", "prefix"):
        res = simulate_cluster(_spaced(*prompts, gap=4.0), CFG, ClusterConfig(instances=3, router=router))
        found = {rid: r["hit_tokens"] for rid, r in res.requests.items()}
        predicted = {rid: r["predicted_hit_tokens"] for rid, r in res.requests.items()}
        assert sum(found.values()) > 16 * 3072 // 2
        if router == "hybrid_exact":
            assert predicted == found
            assert res.summary["prediction_equal"] == 16


def test_a_chain_only_index_over_predicts_where_the_window_blocks_are_gone() -> None:
    # r0 caches P + Q; its window blocks inside P were freed as the window moved on, its full-attention
    # blocks only when r0 finished. The Y requests that follow evict the window blocks first: P's
    # chain is still cached, the windows at its end are not, and r4 (P + R) can use none of it.
    prompts = [(("P", 8192), ("Q", 8192))] + [((f"Y{i}", 2000),) for i in range(3)] + [(("P", 8192), ("R", 500))]
    res = simulate_cluster(_spaced(*prompts), CFG, ClusterConfig(instances=1, router="hybrid_exact"))
    assert (res.summary["chain_over_requests"], res.summary["chain_over_tokens"]) == (1, 8192)
    assert res.requests["r4"]["predicted_hit_tokens"] == res.requests["r4"]["hit_tokens"] == 0


def test_a_replica_reports_the_prompt_of_its_step_in_progress_as_still_to_prefill() -> None:
    # A step is computed at its start; until it ends the replica's /metrics (rendered after each step)
    # still counts its prompt tokens as pending, so the router must see them until then.
    work = Workload([_request(0, 0.0, ("A", 4096))], None, "one")
    replica = ReplicaSim("r", CFG, work, calibrated_cost_model(CFG), RequestRecords(), {})
    router = Router(ClusterConfig(instances=1), [replica])
    replica.engine.add(make_sequence(work.requests[0]), 4, 0.0)
    assert replica.backend(0.0).load.prefill_tokens == 4096
    replica.step(router.index)  # the whole prompt in one step
    end = replica.now
    assert end > 0 and replica.engine.step_prompt_tokens == 4096
    assert replica.backend(end / 2).load.prefill_tokens == 4096
    assert replica.backend(end).load.prefill_tokens == 0
    replica.step(router.index)  # a decode step: no prompt tokens in progress
    assert replica.backend((end + replica.now) / 2).load.prefill_tokens == 0


def test_compare_router_builds_one_cluster_per_router() -> None:
    got = cluster_variants(ClusterConfig(instances=8), "router=round_robin,prefix")
    assert [(label, c.router, c.instances) for label, c in got] == [
        ("router=round_robin", "round_robin", 8), ("router=prefix", "prefix", 8)]
    with pytest.raises(InvalidInputError, match="unknown router 'nearest'"):
        cluster_variants(ClusterConfig(), "router=nearest")
    with pytest.raises(InvalidInputError, match="instances must be a positive integer"):
        cluster_variants(ClusterConfig(), "instances=0")


BASE = ["simulate", "--workload", "shared-prefix", "--requests", "6", "--prefixes", "2", "--prefix-len", "1024",
        "--kv-cache-tokens", "50000", "--no-progress"]


@pytest.mark.parametrize(("extra", "message"), [
    (["--router", "prefix"], "--router needs --instances N"),
    (["--compare", "router=prefix,hybrid_exact"], "needs --instances N"),
    (["--instances", "2", "--compare", "router=prefix,nearest"], "unknown router 'nearest'"),
    (["--instances", "2", "--plot", "out.png"], "a cluster (--instances) has none"),
    (["--instances", "0"], "--instances"),
    (["--instances", "2", "--load-weight", "-1"], "--load-weight"),
    (["--instances", "2", "--balance", "0.5"], "balance must be a number >= 1"),
    (["--instances", "2", "--miss-weight", "0"], "miss-weight must be a positive number"),
    (["--instances", "2", "--junction-weight", "2"], "junction-weight must be a fraction"),
    (["--instances", "2", "--slack", "-1"], "slack must be a whole number"),
])
def test_cli_rejects_bad_cluster_options_with_one_line_and_status_2(
        capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    try:
        status = main([*BASE, *extra])
    except SystemExit as exc:  # the argument parser's own errors
        status = exc.code  # type: ignore[assignment]
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert "Traceback" not in err


def test_cli_compares_routers_on_a_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*BASE, "--instances", "2", "--compare", "router=round_robin,hybrid_exact"]) == 0
    out = capsys.readouterr().out
    assert "router=round_robin" in out and "router=hybrid_exact" in out
    assert "2 / hybrid_exact" in out


def test_a_cluster_run_leaves_no_reference_cycles_behind_and_restores_the_collector() -> None:
    # ``simulate_cluster`` pauses the cyclic collector, as ``simulate`` does: safe only while a step
    # leaves no cycle behind, so what a full collection finds after a run must not grow with it.
    def cycles_after(requests: int) -> int:
        w = shared_prefix(requests, 4, 3000, 100, max_new_tokens=4, arrivals=ClosedLoop(4), seed=3)
        gc.collect()
        gc.disable()
        try:
            simulate_cluster(w, replace(CFG, tiers=parse_tiers("host:1GiB")),
                             ClusterConfig(instances=3, router="hybrid_exact"))
            assert not gc.isenabled()  # left as the caller had it
            return gc.collect()
        finally:
            gc.enable()

    assert cycles_after(36) == cycles_after(12)
    simulate_cluster(_spaced((("doc", 600),)), CFG, ClusterConfig(instances=2))
    assert gc.isenabled()


def _conversations(turns: int = 3) -> Workload:
    """Seven chats of 1,500-token messages, one request at a time, every chat's first turn first: each
    turn finds its history in the device pool or, once the other chats evicted it there, only in its
    replica's host tier. (Seven, so round robin does not keep a chat on one of three replicas.)"""
    return multi_turn_chat(7, turns, system_prompt_len=0, user_len=1500, max_new_tokens=32,
                           arrivals=ClosedLoop(1), seed=1)


def test_the_index_sees_each_replicas_tier_and_predicts_what_it_serves() -> None:
    cfg = replace(CFG, kv_cache_tokens=50_000, tiers=parse_tiers("host:8GiB"))
    seen = simulate_cluster(_conversations(), cfg, ClusterConfig(instances=3, router="hybrid_exact", explain=True))
    served = {rid: r["hit_tokens"] + r["tier_tokens"] for rid, r in seen.requests.items()}
    assert sum(r["tier_tokens"] for r in seen.requests.values()) > 0  # histories came back from the tiers
    assert {rid: r["predicted_hit_tokens"] for rid, r in seen.requests.items()} == served
    assert seen.summary["routing_breakdown"]["the router did not see it"]["requests"] == 0
    # Fed device events only, the index misses what the tiers hold: predictions fall short.
    blind = simulate_cluster(_conversations(), cfg, ClusterConfig(instances=3, router="hybrid_exact",
                                                                  index_tiers=False, home_tokens=16_000))
    assert blind.summary["prediction_under"] > 0
    assert any(r["predicted_hit_tokens"] < r["hit_tokens"] + r["tier_tokens"] for r in blind.requests.values())


def test_a_shared_tier_is_one_medium_every_replica_is_credited_with() -> None:
    cfg = replace(CFG, kv_cache_tokens=50_000, tiers=parse_tiers("net:8GiB"))
    res = simulate_cluster(_conversations(), cfg, ClusterConfig(instances=3, router="hybrid_exact", explain=True))
    served = {rid: r["hit_tokens"] + r["tier_tokens"] for rid, r in res.requests.items()}
    assert sum(r["tier_tokens"] for r in res.requests.values()) > 0
    assert {rid: r["predicted_hit_tokens"] for rid, r in res.requests.items()} == served


def test_conversations_stay_on_their_replica_and_reuse_more_than_round_robin() -> None:
    cfg = replace(CFG, kv_cache_tokens=50_000, tiers=parse_tiers("host:8GiB"))
    runs = {router: simulate_cluster(_conversations(4), cfg, ClusterConfig(instances=3, router=router, explain=True))
            for router in ("hybrid_exact", "round_robin")}
    exact, rr = (runs[r].summary for r in ("hybrid_exact", "round_robin"))
    by_conv: dict[str, set[float]] = {}
    for rid, r in runs["hybrid_exact"].requests.items():
        by_conv.setdefault(rid.rsplit("-turn-", 1)[0], set()).add(r["replica"])
    assert all(len(replicas) == 1 for replicas in by_conv.values())  # every turn where the first went
    assert exact["total_hit_rate"] >= 1.5 * rr["total_hit_rate"]
    lost = rr["routing_breakdown"]["the router did not see it"]  # round robin sees nothing
    assert lost["requests"] > 0 and lost["reusable_tokens"] > 0
    assert exact["routing_breakdown"]["load sent it elsewhere"]["requests"] == 0


def test_a_cluster_run_places_requests_alike_in_every_process() -> None:
    # Simulated block hashes are Python hash() values, which differ between processes: the ring that
    # places new prefixes must not depend on them, or a run's figures would change from one run to
    # the next.
    argv = [sys.executable, "-m", "hybridkv", "simulate", "--workload", "multi-turn", "--conversations", "12",
            "--turns", "2", "--suffix-len", "300", "--output-len", "8", "--system-prompt-len", "100",
            "--concurrency", "1", "--kv-cache-tokens", "50000", "--instances", "3", "--no-progress", "--json", "-"]
    runs = []
    for seed in ("1", "2"):
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "PYTHONHASHSEED": seed})
        assert done.returncode == 0, done.stderr
        summary = json.loads(done.stdout)
        runs.append((summary["routed"], summary["hit_tokens"], summary["decisions"]))
    assert runs[0] == runs[1]

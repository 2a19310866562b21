"""Simulated external KV tiers: capacity, bandwidth and latency through the real connector."""

from __future__ import annotations

import gc
import json
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cli import main
from hybridkv.connectors import KVConnector, KVTier
from hybridkv.connectors.codec import BlockCodec, PlaceholderCodec
from hybridkv.errors import InvalidInputError
from hybridkv.sim.cli import variants
from hybridkv.sim.cost_model import CostModel, SeqWork
from hybridkv.sim.sim_tier import SimTier
from hybridkv.sim.simulator import SimConfig, build_manager, simulate
from hybridkv.sim.tiers import SimConnector, TierSpec, group_block_bytes, parse_tiers
from hybridkv.sim.workloads import ClosedLoop, Workload, shared_prefix

# Gemma 3 1B (sliding window 512 + full attention) with a 30k-token pool; 10 prefixes of 4,000
# tokens do not fit in it, so without tiers most prefixes are recomputed.
CFG = SimConfig(model="gemma-3-1b", gpu="l4-24gb", max_model_len=8192, max_num_batched_tokens=2048,
                kv_cache_tokens=30_000, retention="none")
TIER_KEYS = ("tiers", "tier_hit_tokens", "tier_hit_rate", "total_hit_rate", "tier_load_s", "tier_stats", "tier_loads",
             "tier_storage", "tier_stored_bytes", "tier_lookup_probes")


@pytest.fixture(scope="module")
def workload() -> Workload:
    return shared_prefix(60, 10, 4000, 100, max_new_tokens=8, arrivals=ClosedLoop(4), seed=7)


def run(w: Workload, tiers: str, **cfg: Any) -> dict[str, Any]:
    return simulate(w, replace(CFG, tiers=parse_tiers(tiers), **cfg)).summary


@pytest.fixture(scope="module")
def no_tier(workload: Workload) -> dict[str, Any]:
    return run(workload, "none")


@pytest.fixture(scope="module")
def host(workload: Workload) -> dict[str, Any]:
    return run(workload, "host:4GiB")


def test_a_tier_raises_the_hit_rate_and_cuts_ttft(no_tier: dict[str, Any], host: dict[str, Any]) -> None:
    assert no_tier["tiers"] == [] and no_tier["tier_hit_tokens"] == 0 and no_tier["tier_stats"] == {}
    assert no_tier["total_hit_rate"] == no_tier["prefix_hit_rate"]
    assert host["finished"] == 60 and host["rejected"] == 0
    assert host["tier_hit_rate"] > 0.3
    assert host["total_hit_rate"] > no_tier["total_hit_rate"] + 0.3
    assert host["total_hit_rate"] == pytest.approx(host["prefix_hit_rate"] + host["tier_hit_rate"])
    assert host["ttft_mean_s"] < 0.7 * no_tier["ttft_mean_s"]
    assert host["ttft_p50_s"] < no_tier["ttft_p50_s"]
    st = host["tier_stats"]["0:host"]
    assert st["loaded_blocks"] > 0 and st["stored_blocks"] > 0 and 0 < st["used_bytes"] <= st["capacity_bytes"]
    assert host["tier_load_s"] == pytest.approx(st["loaded_bytes"] / 25e9)  # host: 25 GB/s, no latency


def test_loaded_bytes_are_the_blocks_real_sizes(workload: Workload, host: dict[str, Any]) -> None:
    mgr, _ = build_manager(CFG)
    sizes = set(group_block_bytes(mgr).values())
    st = host["tier_stats"]["0:host"]
    # Gemma 3 1B groups: 16-token blocks of 5 or 1 layers x 2 (K, V) x 1 head x 256 x bf16.
    assert sizes <= {16 * 2 * 256 * 2 * n for n in range(1, 27)}
    assert min(sizes) * st["loaded_blocks"] <= st["loaded_bytes"] <= max(sizes) * st["loaded_blocks"]


def test_a_tier_too_small_for_a_block_changes_nothing(workload: Workload, no_tier: dict[str, Any]) -> None:
    tiny = run(workload, "host:1KiB")
    assert tiny["tier_stats"]["0:host"]["stored_blocks"] == 0
    assert {k: v for k, v in tiny.items() if k not in TIER_KEYS} == \
        {k: v for k, v in no_tier.items() if k not in TIER_KEYS}


def test_a_capacity_holding_part_of_the_prefixes_helps_less(workload: Workload, host: dict[str, Any]) -> None:
    small = run(workload, "host:256MiB")
    st = small["tier_stats"]["0:host"]
    assert st["evictions"] > 0 and st["used_bytes"] <= 256 << 20
    assert 0 < small["tier_hit_rate"] < host["tier_hit_rate"]


def test_a_slower_tier_gives_a_larger_ttft(workload: Workload) -> None:
    fast = run(workload, "host:4GiB", tier_loads="blocking")
    slow = run(workload, "host:4GiB@0.5GB/s", tier_loads="blocking")
    assert slow["tier_hit_tokens"] == fast["tier_hit_tokens"]  # the same hits, paid more slowly
    assert slow["tier_load_s"] == pytest.approx(50 * fast["tier_load_s"])
    assert slow["ttft_mean_s"] > fast["ttft_mean_s"]
    late = run(workload, "host:4GiB@25GB/s@20ms", tier_loads="blocking")
    assert late["tier_load_s"] > fast["tier_load_s"] + 0.02 * 10
    assert late["ttft_mean_s"] > fast["ttft_mean_s"]


def test_asynchronous_loads_let_the_other_requests_run(workload: Workload) -> None:
    blocking = run(workload, "host:4GiB@0.2GB/s", tier_loads="blocking")
    waiting = run(workload, "host:4GiB@0.2GB/s")
    assert waiting["tier_loads"] == "async" and waiting["tier_hit_tokens"] > 0
    # A load no longer stalls the step that admits it: the batch keeps running while it loads.
    assert waiting["duration_s"] < blocking["duration_s"]
    assert waiting["ttft_p50_s"] < blocking["ttft_p50_s"]


def test_a_load_outlasting_its_timeout_is_a_miss(workload: Workload) -> None:
    s = run(workload, "host:4GiB@0.2GB/s", tier_load_timeout_s=0.001)
    assert s["finished"] == 60 and s["tier_hit_tokens"] == 0


def test_hit_spans_store_a_fraction_of_the_bytes_of_every_layer(workload: Workload) -> None:
    every = run(workload, "host:4GiB", tier_storage="all")
    spans = run(workload, "host:4GiB", tier_storage="hit-spans")
    assert spans["tier_storage"] == "hit-spans" and every["tier_storage"] == "all"
    assert spans["tier_stored_bytes"] < 0.5 * every["tier_stored_bytes"]
    assert spans["tier_hit_rate"] > 0.25


def test_spans_and_spill_hits_as_storing_everything_with_room_and_as_hit_spans_under_pressure(
        workload: Workload, host: dict[str, Any]) -> None:
    every = run(workload, "host:4GiB", tier_storage="all")
    assert host["tier_storage"] == "spans+spill"  # the default
    assert host["total_hit_rate"] == every["total_hit_rate"]  # room for all: the same blocks, some at low priority
    assert host["tier_stats"]["0:host"]["low_entries"] > 0
    spans, spill, every = (run(workload, "host:256MiB", tier_storage=s) for s in ("hit-spans", "spans+spill", "all"))
    assert spill["total_hit_rate"] >= spans["total_hit_rate"] > every["total_hit_rate"] + 0.2
    assert spill["tier_stats"]["0:host"]["low_skipped"] > 0  # low entries never pushed a span out


def test_a_lower_tier_serves_what_the_upper_one_evicted(workload: Workload) -> None:
    two = run(workload, "host:256MiB+disk:64GiB")
    host, disk = two["tier_stats"]["0:host"], two["tier_stats"]["1:disk"]
    assert host["loaded_blocks"] > 0 and disk["loaded_blocks"] > 0
    assert host["stored_blocks"] > disk["stored_blocks"]  # disk hits are promoted into host
    assert disk["evictions"] == 0
    load = (host["loaded_bytes"] / 25e9 + disk["loaded_bytes"] / 5e9 + disk["loaded_sequences"] * 100e-6)
    assert two["tier_load_s"] == pytest.approx(load)
    only_small_host = run(workload, "host:256MiB")
    assert two["tier_hit_rate"] > only_small_host["tier_hit_rate"]


def test_sim_tiers_take_offers_exactly_as_any_tier(workload: Workload, monkeypatch: pytest.MonkeyPatch) -> None:
    # SimTier.offer's bulk path against KVTier.offer's steps (exists_many, put_many, prioritize_many)
    # with values built through the codec, as a real tier takes them.
    fast = run(workload, "host:256MiB+disk:64GiB")
    monkeypatch.setattr(SimTier, "offer", KVTier.offer)
    steps = run(workload, "host:256MiB+disk:64GiB")
    assert steps == fast


def test_sim_connector_reads_and_writes_exactly_as_the_connector(workload: Workload,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Two tiers: reads that fall through to the disk promote into the host tier.
    lean = run(workload, "host:256MiB+disk:64GiB")
    monkeypatch.setattr(PlaceholderCodec, "decode_many", BlockCodec.decode_many)  # decode() key by key
    monkeypatch.setattr(SimConnector, "write", KVConnector.write)
    checked = run(workload, "host:256MiB+disk:64GiB")
    assert checked == lean and lean["tier_stats"]["1:disk"]["loaded_blocks"] > 0


def test_a_run_leaves_no_reference_cycles_behind_and_restores_the_collector() -> None:
    # ``simulate`` pauses the cyclic collector; that is safe only if a step leaves no cycle behind:
    # the garbage a full collection finds after a run (the manager) must not grow with the requests.
    def cycles_after(requests: int) -> int:
        w = shared_prefix(requests, 4, 4000, 100, max_new_tokens=8, arrivals=ClosedLoop(4), seed=7)
        gc.collect()
        gc.disable()  # no collection between the run and the count
        try:
            simulate(w, replace(CFG, tiers=parse_tiers("host:256MiB+disk:64GiB")))
            assert not gc.isenabled()  # left as the caller had it
            return gc.collect()
        finally:
            gc.enable()

    assert cycles_after(60) == cycles_after(20) < 200
    simulate(shared_prefix(4, 2, 500, 50, max_new_tokens=2, arrivals=ClosedLoop(2), seed=1), CFG)
    assert gc.isenabled()


def test_simulation_with_tiers_is_deterministic(workload: Workload, host: dict[str, Any]) -> None:
    assert run(workload, "host:4GiB") == host


def test_cost_model_adds_the_caller_timed_loads() -> None:
    cost = CostModel.from_preset("gemma-3-1b", "l4-24gb")
    work = [SeqWork(100, 2000), SeqWork(1, 500)]
    assert cost.step_time(work, 0.25) == pytest.approx(cost.step_time(work) + 0.25)
    assert cost.breakdown(work, 0.25)["load_s"] == pytest.approx(0.25)
    assert cost.breakdown(work, 0.25)["total_s"] == pytest.approx(cost.step_time(work, 0.25))


# ---------------------------------------------------------------------- specs and CLI

def test_tier_specs_parse_with_defaults_and_overrides() -> None:
    h = TierSpec.parse("host:64GiB")
    assert (h.kind, h.capacity_bytes, h.bandwidth, h.latency_s) == ("host", 64 << 30, 25e9, 0.0)
    d = TierSpec.parse("disk:1TiB@7GB/s@50us")
    assert (d.kind, d.capacity_bytes, d.bandwidth, d.latency_s) == ("disk", 1 << 40, 7e9, pytest.approx(50e-6))
    n = TierSpec.parse("redis:500GB@2ms")
    assert (n.kind, n.capacity_bytes, n.bandwidth, n.latency_s) == ("net", 500 * 10**9, 3e9, pytest.approx(2e-3))
    assert TierSpec.parse("net:1GiB@800MiB/s").bandwidth == 800 * 2**20
    assert h.label == "host:64GiB@25GB/s" and TierSpec.parse(d.label) == d
    assert parse_tiers("none") == () and parse_tiers("host:1GiB+disk:2GiB") == (
        TierSpec.parse("host:1GiB"), TierSpec.parse("disk:2GiB"))


@pytest.mark.parametrize("spec, message", [
    ("gpu:1GiB", "KIND"), ("host", "KIND"), ("host:", "KIND"), ("host:lots", "size"), ("host:0GiB", "> 0"),
    ("host:-1GiB", "size"), ("host:1GiB@fast", "BANDWIDTH"), ("host:1GiB@0GB/s", "> 0"),
    ("host:1GiB@1GB/s@2GB/s", "twice"), ("host:1GiB@1ms@2ms", "twice"), ("host:1GiB@5GB", "LATENCY"),
])
def test_bad_tier_specs_say_why(spec: str, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        TierSpec.parse(spec)


ARGS = ["simulate", "--model", "gemma-3-1b", "--gpu", "l4-24gb", "--max-model-len", "8192", "--kv-cache-tokens",
        "30000", "--retention", "none", "--workload", "shared-prefix", "--requests", "24", "--prefixes", "6",
        "--prefix-len", "4000", "--suffix-len", "100", "--output-len", "4", "--concurrency", "4", "--no-progress"]


def test_cli_tier_flags_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--tier", "host:512MiB", "--tier", "disk:8GiB@2GB/s", "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tiers"] == ["host:512MiB@25GB/s", "disk:8GiB@2GB/s@100us"]
    assert set(doc["tier_stats"]) == {"0:host", "1:disk"}
    assert doc["tier_hit_tokens"] > 0 and doc["total_hit_rate"] > doc["prefix_hit_rate"]
    assert main([*ARGS, "--tier", "host:512MiB"]) == 0
    out = capsys.readouterr().out
    assert "tier / total hit rate" in out and "host:512MiB@25GB/s" in out


def test_cli_compares_tier_sets(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*ARGS, "--compare", "tier=none,host:512MiB+disk:8GiB", "--json", "-"]) == 0
    both = json.loads(capsys.readouterr().out)
    assert set(both) == {"tier=none", "tier=host:512MiB+disk:8GiB"}
    assert both["tier=none"]["tiers"] == [] and len(both["tier=host:512MiB+disk:8GiB"]["tiers"]) == 2
    assert both["tier=host:512MiB+disk:8GiB"]["ttft_mean_s"] < both["tier=none"]["ttft_mean_s"]
    labels = [lbl for lbl, _ in variants(SimConfig(), "tiers=none, host:1GiB")]
    assert labels == ["tier=none", "tier=host:1GiB"]


def test_cli_rejects_bad_tiers_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*ARGS, "--tier", "floppy:1MiB"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--tier" in err and "expected KIND:SIZE" in err
    with pytest.raises(SystemExit) as exc:
        main([*ARGS, "--tier", "host:1GiB@fast"])
    assert exc.value.code == 2 and "BANDWIDTH" in capsys.readouterr().err
    assert main([*ARGS, "--compare", "tier=none,host:big"]) == 2
    assert "tier 'host:big'" in capsys.readouterr().err


_KEYS = [b"hkv1/ns/%d/%03d" % (g, i) for g in range(3) for i in range(40)]


def _by_steps(tier: SimTier, keys: list[bytes], low: bool, batch: int) -> list[bytes]:
    """``KVConnector.store``'s writes of one priority, step by step: presence, puts, promotions."""
    put: list[bytes] = []
    for lo in range(0, len(keys), batch):
        block = keys[lo : lo + batch]
        present = tier.exists_many(block)
        items = [(k, b"") for k, there in zip(block, present) if not there]
        if items:
            tier.put_many(items, low)
            put += [k for k, _ in items]
        if not low and len(items) < len(block):
            tier.prioritize_many([k for k, there in zip(block, present) if there])
    return put


def _state(tier: SimTier) -> tuple[object, ...]:
    st = tier.stats
    return (list(tier._entries.items()), list(tier._low.items()), tier.used_bytes, st.puts, st.evictions,
            st.low_evictions, st.low_skipped, st.low_puts, st.low_promotions, st.bytes_written)


@settings(max_examples=settings.default.max_examples * 3 // 2, deadline=None)  # 150; HYPOTHESIS_PROFILE=long: 1,500
@given(capacity=st.integers(1, 40), batch=st.integers(1, 9),
       ops=st.lists(st.tuples(st.sampled_from(["offer", "offer", "get", "touch", "delete"]), st.booleans(),
                              st.lists(st.sampled_from(_KEYS), min_size=1, max_size=30, unique=True)),
                    max_size=25))
def test_bulk_offers_leave_the_tier_as_puts_one_by_one(capacity: int, batch: int,
                                                       ops: list[tuple[str, bool, list[bytes]]]) -> None:
    # Group 2's blocks are a fifth the size of the others (as Gemma 3 27B's last window group).
    sizes = {0: 5, 1: 5, 2: 1}
    spec = TierSpec("host", capacity, 1e9)
    bulk, steps = SimTier(spec, 0, sizes), SimTier(spec, 0, sizes)
    followed: dict[int, set[bytes]] = {id(bulk): set(), id(steps): set()}  # what a cluster's index learns
    for tier in (bulk, steps):
        tier.record_changes(True)
    for op, low, keys in ops:
        if op == "delete":
            for key in keys[:3]:
                bulk.delete(key)
                steps.delete(key)
        elif op == "offer":
            block_sizes = [sizes[int(k.split(b"/")[2])] for k in keys]
            assert bulk.offer_keys(keys, block_sizes, low, batch) == _by_steps(steps, keys, low, batch)
        elif op == "get":
            assert bulk.get_many(keys) == steps.get_many(keys)
        else:
            bulk.touch_many(keys)
            steps.touch_many(keys)
        assert _state(bulk) == _state(steps)
        for tier in (bulk, steps):
            assert tier.low_bytes == sum(tier._low.values())
            assert tier.used_bytes == sum(tier._entries.values()) + tier.low_bytes <= capacity
            # The change log, replayed, is exactly what the tier holds: each key entering once and
            # leaving once, however the bulk paths evicted it.
            held = followed[id(tier)]
            for entered, key in tier.take_changes():
                assert (key in held) != entered
                (held.add if entered else held.remove)(key)
            assert held == set(tier._entries) | set(tier._low)


def test_a_low_batch_larger_than_its_room_keeps_its_longest_suffix_that_fits() -> None:
    # 12 bytes, 2 held by normal entries: the low entries have 10. A low batch of 1 + 5 + 5 bytes
    # evicts its own first key and keeps the last two, exactly filling the room.
    sizes = {0: 5, 1: 5, 2: 1}
    spec = TierSpec("host", 12, 1e9)
    bulk, steps = SimTier(spec, 0, sizes), SimTier(spec, 0, sizes)
    normal = [b"hkv1/ns/2/n1", b"hkv1/ns/2/n2"]
    batch = [b"hkv1/ns/2/a", b"hkv1/ns/0/b", b"hkv1/ns/1/c"]
    bulk.offer_keys(normal, [1, 1], False, 64)
    _by_steps(steps, normal, False, 64)
    bulk.offer_keys(batch, [1, 5, 5], True, 64)
    _by_steps(steps, batch, True, 64)
    assert list(bulk._low) == batch[1:] and bulk.used_bytes == 12 and bulk.stats.low_evictions == 1
    assert _state(bulk) == _state(steps)

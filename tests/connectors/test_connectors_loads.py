"""Tier loads that do not stall: a request waits for its load while the others run; slow or failed loads are misses."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence as Seq

from hybridkv import Scheduler, SchedulerConfig, Sequence
from hybridkv.connectors import HostTier, KVConnector, TierError
from hybridkv.connectors.loads import BackgroundLoads

from helpers import full, manager, swa, tokens

PAYLOAD = 8


class GatedTier(HostTier):
    """A host tier whose reads wait until ``gate`` is set (a slow network, a busy disk)."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(1 << 24)
        self.gate = threading.Event()
        self.fail = fail

    def get_many(self, keys: Seq[bytes]) -> list[bytes | None]:
        self.gate.wait(10)
        if self.fail:
            raise TierError("the tier went away")
        return super().get_many(keys)


def connector(tier: HostTier, timeout_s: float = 10.0) -> KVConnector:
    mgr = manager(400, full(), swa(64), retention="none")
    return KVConnector([tier], mgr, namespace="m", payload_bytes={0: PAYLOAD, 1: PAYLOAD},
                       loads=BackgroundLoads(timeout_s=timeout_s))


def fill(tier: HostTier, prompt: list[int]) -> None:
    """Store ``prompt``'s blocks in ``tier`` as an engine that computed it would."""
    conn = KVConnector([tier], manager(400, full(), swa(64), retention="none"), namespace="m",
                       payload_bytes={0: PAYLOAD, 1: PAYLOAD})
    mgr = conn.manager
    seq = Sequence("producer", prompt)
    assert mgr.allocate(seq, len(prompt)) is not None
    seq.num_computed_tokens = len(prompt)
    conn.store(seq, len(prompt), lambda g, b: b"k" * PAYLOAD, 0)
    mgr.free(seq)


PROMPT = tokens(0, 300)


def test_a_load_runs_beside_the_caller_and_delivers_its_payloads() -> None:
    tier = GatedTier()
    fill(tier, PROMPT)
    conn = connector(tier)
    t0 = time.perf_counter()
    load = conn.start_load(Sequence("a", PROMPT + [1]), 0)
    assert time.perf_counter() - t0 < 1.0 and not load.done()
    tier.gate.set()
    deadline = time.monotonic() + 10
    while not load.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    got = load.result()
    assert got.num_tokens == 288 and got.blocks_per_group == {0: 18, 1: 4}
    conn.close()


def test_a_load_outlasting_its_timeout_is_a_counted_miss() -> None:
    tier = GatedTier()
    fill(tier, PROMPT)
    conn = connector(tier, timeout_s=0.05)
    load = conn.start_load(Sequence("a", PROMPT + [1]), 0)
    time.sleep(0.1)
    assert load.done() and load.result().num_tokens == 0
    assert conn.stats.faults["timeout"] == 1
    tier.gate.set()
    conn.close()


def test_a_failing_tier_makes_the_load_a_miss_not_an_error() -> None:
    tier = GatedTier(fail=True)
    tier.gate.set()
    fill(tier, PROMPT)
    conn = connector(tier)
    load = conn.start_load(Sequence("a", PROMPT + [1]), 0)
    deadline = time.monotonic() + 10
    while not load.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert load.result().num_tokens == 0 and conn.stats.faults["error"] >= 1
    conn.close()


def test_the_scheduler_admits_the_next_request_while_a_load_is_in_flight() -> None:
    tier = GatedTier()
    fill(tier, PROMPT)
    conn = connector(tier)
    sched = Scheduler(conn.manager, SchedulerConfig(max_num_batched_tokens=512), connector=conn)
    sched.add(Sequence("loads", PROMPT + [1]), 4)
    sched.add(Sequence("other", tokens(5000, 100)), 4)
    out = sched.schedule()
    assert out.admitted == ["other"]  # "loads" waits for its tier load; "other" runs
    sched.update(out, {"other": [7]})
    tier.gate.set()
    deadline = time.monotonic() + 10
    while not sched.waiting[0].load.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    out = sched.schedule()
    assert out.admitted == ["loads"] and out.external["loads"].num_tokens == 288
    assert sched.requests["loads"].num_external_tokens == 288
    conn.close()


def test_written_loads_say_which_groups_they_used() -> None:
    tier = HostTier(1 << 24)
    fill(tier, PROMPT)
    conn = KVConnector([tier], manager(400, full(), swa(64), retention="none"), namespace="m",
                       payload_bytes={0: PAYLOAD, 1: PAYLOAD})
    mgr = conn.manager
    seq = Sequence("a", PROMPT + [1])
    got = conn.start_load(seq, 0).result()
    assert mgr.allocate(seq, 301 - got.num_tokens, hit=mgr.lookup(seq), num_external_tokens=got.num_tokens)
    conn.write(got, mgr.block_table("a"), lambda g, b, data: None)
    assert conn.stats.loaded_blocks_per_group == {0: 18, 1: 4}
    (record,) = conn.stats.recent_loads
    assert (record.seq_id, record.num_tokens, record.blocks_per_group) == ("a", 288, {0: 18, 1: 4})

"""Low-priority tier entries: every block stored, those no hit span needs evicted first."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hybridkv import KVCacheManager, Sequence
from hybridkv.connectors import DiskTier, HostTier, KVConnector
from hybridkv.connectors.base import KVTier
from hybridkv.connectors.storage import StoreHitSpans, StoreSpansSpill
from hybridkv.sim.sim_tier import SimTier
from hybridkv.sim.tiers import TierSpec

from helpers import full, manager, swa, tokens
from test_connectors_storage import PAYLOAD, produce, stored

ENTRY = 100
"""Bytes of one entry's value in the tier tests (a disk entry adds its 16-byte header)."""


def key(name: str) -> bytes:
    return b"hkv1/ns/0/" + name.encode()  # a tier key of group 0 (a simulated tier sizes entries by group)


def host_tier(_tmp: Path) -> KVTier:
    return HostTier(3 * ENTRY)


def disk_tier(tmp: Path) -> KVTier:
    return DiskTier(tmp, 3 * (ENTRY + 16))


def sim_tier(_tmp: Path) -> KVTier:
    return SimTier(TierSpec("host", 3 * ENTRY, 25e9), 0, {0: ENTRY})


TIERS = [pytest.param(host_tier, id="host"), pytest.param(disk_tier, id="disk"), pytest.param(sim_tier, id="sim")]
Make = Callable[[Path], KVTier]


def held(tier: KVTier, *names: str) -> list[str]:
    return [n for n, there in zip(names, tier.exists_many([key(n) for n in names])) if there]


def put(tier: KVTier, name: str, low: bool = False) -> None:
    tier.put_many([(key(name), b"x" * ENTRY)], low)


@pytest.mark.parametrize("make", TIERS)
def test_under_pressure_a_tier_evicts_low_priority_entries_first_oldest_first(make: Make, tmp_path: Path) -> None:
    tier = make(tmp_path)  # room for 3 entries
    put(tier, "a")
    put(tier, "b", low=True)
    put(tier, "c", low=True)
    put(tier, "d")  # evicts b, the older low entry, although a is older still
    assert held(tier, "a", "b", "c", "d") == ["a", "c", "d"]
    put(tier, "e")  # evicts c, the last low entry
    assert held(tier, "a", "c", "d", "e") == ["a", "d", "e"]
    put(tier, "f")  # no low entry left: the least recently used normal one goes
    assert held(tier, "a", "d", "e", "f") == ["d", "e", "f"]
    assert tier.stats.low_evictions == 2 and tier.stats.evictions == 3


@pytest.mark.parametrize("make", TIERS)
def test_a_low_priority_put_never_evicts_a_normal_entry(make: Make, tmp_path: Path) -> None:
    tier = make(tmp_path)
    for name in "abc":
        put(tier, name)
    put(tier, "x", low=True)
    assert held(tier, "a", "b", "c", "x") == ["a", "b", "c"]
    assert tier.stats.low_skipped == 1 and tier.stats.evictions == 0


@pytest.mark.parametrize("make", TIERS)
def test_a_low_priority_entry_that_serves_a_read_becomes_normal(make: Make, tmp_path: Path) -> None:
    tier = make(tmp_path)
    put(tier, "a", low=True)
    put(tier, "b", low=True)
    put(tier, "c")
    assert tier.get_many([key("a")])[0] is not None  # a served a hit: now a normal entry
    put(tier, "d")  # evicts b, the only low entry left
    put(tier, "e")  # then the least recently used normal entry, c (a was read after c was stored)
    assert held(tier, "a", "b", "c", "d", "e") == ["a", "d", "e"]
    assert tier.stats.low_promotions == 1


@pytest.mark.parametrize("make", TIERS)
def test_marking_a_low_entry_normal_keeps_it_under_pressure(make: Make, tmp_path: Path) -> None:
    tier = make(tmp_path)
    put(tier, "a", low=True)
    put(tier, "b", low=True)
    tier.prioritize_many([key("a"), key("missing")])
    put(tier, "c")
    put(tier, "d")  # evicts b, the low one
    assert held(tier, "a", "b", "c", "d") == ["a", "c", "d"]


def test_a_disk_tiers_low_priority_survives_a_restart_and_is_seen_by_other_instances(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, 3 * (ENTRY + 16))
    put(first, "a")
    put(first, "b", low=True)
    other = DiskTier(tmp_path, 3 * (ENTRY + 16), shared=True)  # another process on the same directory
    assert other.low_priority_entries() == 1
    put(other, "c")
    put(other, "d")  # evicts b, the low entry the first instance wrote, not the older a
    assert held(other, "a", "b", "c", "d") == ["a", "c", "d"]


# ---------------------------------------------------------------------- through the connector
def fresh() -> KVCacheManager:
    return manager(400, full(), swa(64), retention="none")


def connector(mgr: KVCacheManager, tier: KVTier, **kw: object) -> KVConnector:
    return KVConnector([tier], mgr, namespace="m", payload_bytes=dict.fromkeys(range(len(mgr.layout.groups)), PAYLOAD),
                       **kw)  # type: ignore[arg-type]


class NoPriorities(HostTier):
    """A tier that evicts by its own policy (as Redis does): it keeps no low priority."""

    priorities = False


def test_spans_and_spill_is_the_default_and_keeps_every_window_block_the_spans_at_normal_priority() -> None:
    host = HostTier(1 << 20)
    conn = connector(fresh(), host)
    assert isinstance(conn.storage, StoreSpansSpill) and conn.storage.name == "spans+spill"
    prompt = tokens(0, 300)
    produce(conn, prompt)
    assert stored(conn, host, prompt, 0) == list(range(18))
    assert stored(conn, host, prompt, 1) == list(range(18))
    # Blocks 14..17 are the window at the prompt's end (288): normal; the other 14 window blocks are low.
    assert host.low_priority_entries() == 14


def test_a_tier_without_priorities_gets_only_the_hit_spans() -> None:
    tier = NoPriorities(1 << 20)
    conn = connector(fresh(), tier)
    prompt = tokens(0, 300)
    produce(conn, prompt)
    assert stored(conn, tier, prompt, 1) == [14, 15, 16, 17]


def test_the_first_reuse_of_a_junction_finds_its_window_and_promotes_it() -> None:
    prompt = tokens(0, 300)
    b = tokens(0, 200) + tokens(9000, 100)  # shares 192 tokens of whole blocks with the prompt
    hits = {}
    for policy in (StoreHitSpans(), StoreSpansSpill()):
        host = HostTier(1 << 20)
        mgr = fresh()
        conn = connector(mgr, host, storage=policy)
        produce(conn, prompt, seq_id="a")
        seq = Sequence("b", b)
        got = conn.fetch(seq, 0, conn.num_external_tokens(seq, 0))
        hits[policy.name] = got.num_tokens
        if policy.name == "spans+spill":
            # The window before 192 (blocks 8..11) was stored at low priority and served the hit: now normal.
            assert sorted(i for g, i in got.payloads if g == 1) == [8, 9, 10, 11]
            assert host.stats.low_promotions == 4 and host.low_priority_entries() == 10
    assert hits == {"hit-spans": 0, "spans+spill": 192}


def test_a_low_entry_a_later_store_offers_at_normal_priority_becomes_normal() -> None:
    host = HostTier(1 << 20)
    mgr = fresh()
    conn = connector(mgr, host)
    produce(conn, tokens(0, 300), seq_id="a")  # blocks 0..13 of the window group are low
    mgr.reset_prefix_cache()
    # A prompt ending at 192 keeps the window there (blocks 8..11) at normal priority: held low, now normal.
    produce(conn, tokens(0, 192) + [5], seq_id="b")
    assert host.low_priority_entries() == 10 and host.stats.low_promotions == 4


@pytest.mark.parametrize("make", TIERS)
def test_a_tier_says_whether_a_low_put_could_land(make: Make, tmp_path: Path) -> None:
    tier = make(tmp_path)  # room for 3 entries
    assert tier.takes_low_puts(ENTRY)
    for name in "ab":
        put(tier, name)
    assert tier.takes_low_puts(ENTRY)  # one entry's room left
    put(tier, "c")
    # Full of normal entries: a low put would be skipped. A disk tier answers "maybe" (the default).
    assert tier.takes_low_puts(ENTRY) == isinstance(tier, DiskTier)
    tier.delete(key("c"))
    put(tier, "x", low=True)
    put(tier, "y", low=True)  # evicts x: a full tier holding a low entry still takes low puts
    assert tier.takes_low_puts(ENTRY) and held(tier, "x", "y") == ["y"]


def test_a_store_chooses_no_low_blocks_no_tier_can_take_and_ends_as_if_it_had_offered_them() -> None:
    def run(offer_anyway: bool) -> HostTier:
        host = HostTier(4_000)  # ~30 entries: full of normal entries after two prompts
        if offer_anyway:
            host.takes_low_puts = lambda min_bytes: True  # type: ignore[method-assign]
        conn = connector(fresh(), host)
        for i in range(4):
            produce(conn, tokens(1000 * i, 300), seq_id=f"s{i}")
        return host

    chosen, offered = run(False), run(True)
    assert list(chosen._entries) == list(offered._entries) and list(chosen._low) == list(offered._low)
    assert chosen.stats.puts == offered.stats.puts and chosen.stats.evictions == offered.stats.evictions
    # The low blocks a full tier would skip were not even chosen.
    assert chosen.stats.low_skipped < offered.stats.low_skipped

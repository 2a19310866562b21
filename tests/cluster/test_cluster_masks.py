"""The index's masks (which replicas hold each hash) and the joint lookup over them: every replica's
prediction equals what its own view predicts, whatever the events did. The bitmask form of the hit
rule itself is tested against ``agreed_hit`` in ``test_hit_rule_forms.py``."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import FullAttentionSpec, KVCacheGroup, KVCacheLayout, MambaSpec, SlidingWindowSpec
from hybridkv.cluster import (
    MEDIUM_GPU,
    AllClearedEvent,
    BlockRemovedEvent,
    BlockStoredEvent,
    ClusterIndex,
    RequestKeys,
    VllmHashes,
    make_batch,
)
from hybridkv.cluster.events import ExternalHash
from hybridkv.cluster.inverted import SLOTS

FULL = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8)
SWA = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, sliding_window=48)
MAMBA = MambaSpec(block_size=32, state_bytes=8, mode="align")
LAYOUTS = {
    "full+swa": (FULL, SWA),
    "full+mamba": (FULL, MAMBA),
    "full+swa+mamba": (FULL, SWA, MAMBA),
    "full+full+swa": (FULL, FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=8), SWA),
}
SCHEME = VllmHashes()


def _layout(name: str) -> KVCacheLayout:
    return KVCacheLayout(2, tuple(KVCacheGroup(s) for s in LAYOUTS[name]))


def _check_masks(index: ClusterIndex) -> None:
    """Replica b's bit for group g is set for hash h exactly while b holds h in g (on that medium)."""
    expect: dict[tuple[str, int], dict[bytes, int]] = {}
    for view in index.views.values():
        for medium, held in view.media.items():
            for g, group in held.items():
                into = expect.setdefault((medium, g // SLOTS), {})
                for h in group:
                    into[h] = into.get(h, 0) | view.bit << g % SLOTS
    assert {k: v for k, v in index.masks.maps.items() if v} == {k: v for k, v in expect.items() if v}


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 100_000))
def test_joint_predictions_equal_each_replicas_own_after_random_events(seed: int) -> None:
    rng = random.Random(seed)
    index = ClusterIndex()
    names = ["a", "b", "c", "d", "e"]
    # Two replicas alike (joint), others with other layouts or 64-bit hashes.
    setup = {"a": ("full+swa", False), "b": ("full+swa", False), "c": ("full+swa", True),
             "d": (rng.choice(sorted(LAYOUTS)), rng.random() < 0.5), "e": (rng.choice(sorted(LAYOUTS)), False)}
    for name in names:
        index.add_replica(name, scheme=SCHEME, layout=_layout(setup[name][0]))
    base = [rng.randrange(20) for _ in range(40)]
    prompts = [base[: rng.randrange(16, 40)] + [rng.randrange(20) for _ in range(rng.randrange(0, 200))]
               for _ in range(6)]

    def hashes(name: str, prompt: list[int], group: int) -> list[bytes]:
        size = _layout(setup[name][0]).groups[group].spec.block_size
        return RequestKeys(prompt).hashes(SCHEME, 16, size, setup[name][1])

    def ext(name: str, hs: list[bytes]) -> tuple[ExternalHash, ...]:
        return tuple(int.from_bytes(h, "big") for h in hs) if setup[name][1] else tuple(hs)

    stored: dict[str, list[tuple[str, int, list[bytes]]]] = {n: [] for n in names}
    for _step in range(rng.randrange(5, 40)):
        name = rng.choice(names)
        op = rng.random()
        medium = MEDIUM_GPU if rng.random() < 0.9 else "CPU"
        if op < 0.6:
            prompt = rng.choice(prompts)
            events = []
            for g in range(len(LAYOUTS[setup[name][0]])):
                hs = hashes(name, prompt, g)
                keep = [h for h in hs if rng.random() < rng.choice([0.6, 1.0])]
                stored[name].append((medium, g, keep))
                events.append(BlockStoredEvent(ext(name, keep), None, (), 16, medium, g))
            index.apply_events(name, make_batch(events))
        elif op < 0.85 and stored[name]:
            medium, g, hs = rng.choice(stored[name])
            gone = [h for h in hs if rng.random() < 0.5]
            index.apply_events(name, make_batch([BlockRemovedEvent(ext(name, gone), medium, g)]))
        elif op < 0.92:
            index.apply_events(name, make_batch([AllClearedEvent()]))
        elif op < 0.96:
            index.resync(name)
        else:
            index.remove_replica(name)
            index.add_replica(name, scheme=SCHEME, layout=_layout(setup[name][0]))
        _check_masks(index)
        for _ in range(3):
            prompt = rng.choice(prompts)
            request = prompt[: rng.randrange(1, len(prompt) + 1)] + [rng.randrange(20) for _ in range(rng.randrange(3))]
            keys = RequestKeys(request)
            assert index.lookup_keys(keys) == index.lookup_each(keys)
            subset = rng.sample(names, 3)
            assert index.lookup_keys(keys, subset) == index.lookup_each(keys, subset)


def test_a_replica_removed_leaves_no_bit_and_its_bit_is_reused() -> None:
    index = ClusterIndex()
    for name in ("a", "b"):
        index.add_replica(name, scheme=SCHEME, layout=_layout("full+swa"))
    prompt = list(range(64))
    hs = RequestKeys(prompt).hashes(SCHEME, 16, 16, False)
    for name in ("a", "b"):
        index.apply_events(name, make_batch([BlockStoredEvent(tuple(hs), None, (), 16, MEDIUM_GPU, 0),
                                             BlockStoredEvent(tuple(hs), None, (), 16, MEDIUM_GPU, 1)]))
    a, b = index.views["a"].bit, index.views["b"].bit
    assert [index.masks.holders(MEDIUM_GPU, g, hs[0]) for g in (0, 1)] == [a | b, a | b]
    index.remove_replica("a")
    assert [index.masks.holders(MEDIUM_GPU, g, hs[0]) for g in (0, 1)] == [b, b]
    index.add_replica("c", scheme=SCHEME, layout=_layout("full+swa"))
    assert index.views["c"].bit == a
    assert {n: p.tokens for n, p in index.lookup(prompt + [1]).items()} == {"b": 64, "c": 0}


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 100_000), layout=st.sampled_from(sorted(LAYOUTS)), short=st.booleans())
def test_alike_replicas_predicted_together_equal_each_replicas_own_after_random_events(
        seed: int, layout: str, short: bool) -> None:
    """Six replicas of one layout, all predicted by one walk of the masks: prefixes held to different
    depths, window and checkpoint blocks with holes (so replicas settle below their chains)."""
    rng = random.Random(seed)
    index = ClusterIndex()
    names = [f"r{i}" for i in range(6)]
    for name in names:
        index.add_replica(name, scheme=SCHEME, layout=_layout(layout))
    sizes = [spec.block_size for spec in LAYOUTS[layout]]
    base = [rng.randrange(8) for _ in range(320)]
    prompts = [base[: rng.randrange(32, 320)] + [rng.randrange(8) for _ in range(rng.randrange(64))] for _ in range(4)]

    def ext(hs: list[bytes]) -> tuple[ExternalHash, ...]:
        return tuple(int.from_bytes(h, "big") for h in hs) if short else tuple(hs)

    stored: dict[str, list[tuple[int, list[bytes]]]] = {n: [] for n in names}
    for _step in range(rng.randrange(10, 50)):
        name = rng.choice(names)
        op = rng.random()
        if op < 0.7:
            prompt = rng.choice(prompts)
            keys = RequestKeys(prompt[: rng.randrange(1, len(prompt) + 1)])
            holes = rng.choice([0.0, 0.05, 0.3])
            events = []
            for g, size in enumerate(sizes):
                hs = keys.hashes(SCHEME, 16, size, short)
                keep = [h for h in hs if g == 0 or rng.random() >= holes]
                stored[name].append((g, keep))
                events.append(BlockStoredEvent(ext(keep), None, (), size, MEDIUM_GPU, g))
            index.apply_events(name, make_batch(events))
        elif op < 0.9 and stored[name]:
            g, hs = rng.choice(stored[name])
            gone = [h for h in hs if rng.random() < 0.3]
            index.apply_events(name, make_batch([BlockRemovedEvent(ext(gone), MEDIUM_GPU, g)]))
        else:
            index.apply_events(name, make_batch([AllClearedEvent()]))
        _check_masks(index)
        keyed = {index.views[n].joint_key() for n in names if index.views[n].num_blocks()}
        assert len(keyed) <= 1 and None not in keyed  # every replica holding blocks is in the one joint group
        for _ in range(3):
            prompt = rng.choice(prompts)
            keys = RequestKeys(prompt[: rng.randrange(1, len(prompt) + 1)])
            assert index.lookup_keys(keys) == index.lookup_each(keys)

"""The hit rule's three forms give one answer: ``agreed_hit`` (with block ids), ``FastHits`` (the
length only) and ``hits_together`` (``FastHits`` for many caches at once, over bitmasks), on random
layouts and random sets of cached hashes; and the bitmask form's parts on their own."""

from __future__ import annotations

import random
from itertools import accumulate
from operator import and_

from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import KVCacheLayout
from hybridkv.core import FastHits, HitRules, KVCacheSpec, MambaSpec
from hybridkv.core import Sequence as KVSequence
from hybridkv.core.hits import agreed_hit, chain_ends, chain_reach, hits_together, last_window, settle_together
from hybridkv.core.specs import ChunkedLocalAttentionSpec

from helpers import chunked, full, layout, mamba, split_state, swa

MAX_MODEL_LEN = 4096


@st.composite
def layouts(draw: st.DrawFn) -> tuple[KVCacheSpec, ...]:
    """One to four groups of full attention, sliding window, chunked local attention, a recurrent
    state (align or all mode) or a recurrent state split over several pages."""
    specs: list[KVCacheSpec] = []
    for _ in range(draw(st.integers(1, 4))):
        bs = draw(st.sampled_from([16, 32]))
        kind = draw(st.sampled_from(["full", "full", "swa", "swa", "chunked", "mamba", "split"]))
        if kind == "full":
            specs.append(full(bs))
        elif kind == "swa":
            specs.append(swa(draw(st.integers(1, 5 * bs)), bs))
        elif kind == "chunked":
            specs.append(chunked(bs * draw(st.integers(1, 4)), bs))
        elif kind == "mamba":
            mode = draw(st.sampled_from(["align", "align", "all"]))
            specs.append(mamba(draw(st.sampled_from([16, 32, 64])), mode=mode))
        else:
            specs.extend(split_state(draw(st.integers(2, 3)), draw(st.sampled_from([16, 32, 64]))))
    return tuple(specs)


def _mirrored(specs: tuple[KVCacheSpec, ...]) -> bool:
    """Does the layout have only kinds whose hit the blocks before it alone decide (``hit_reads``)?"""
    return not any(isinstance(s, ChunkedLocalAttentionSpec) or (isinstance(s, MambaSpec) and s.mode != "align")
                   for s in specs)


def _caches(rng: random.Random, rules: HitRules, hashes: dict[int, list[bytes]], n: int
            ) -> list[dict[int, dict[bytes, int]]]:
    """``n`` caches, each holding per group a random subset of the request's hashes: all of them, most,
    half, or a prefix with holes; a group may hold what an earlier group of its block size holds
    (the pages of one state, a full-attention chain and its window)."""
    out = []
    for _ in range(n):
        held: dict[int, dict[bytes, int]] = {}
        for g in rules.caching_groups:
            hs = hashes[g]
            same = [p for p in held if rules.groups[p].block_size == rules.groups[g].block_size]
            if same and rng.random() < 0.6:
                held[g] = dict(held[rng.choice(same)])
                continue
            keep = rng.choice([1.0, 1.0, 0.97, 0.9, 0.6, 0.0])
            cut = rng.randrange(len(hs) + 1) if rng.random() < 0.2 else len(hs)
            held[g] = {h: 1 + i for i, h in enumerate(hs[:cut]) if rng.random() < keep}
        out.append(held)
    return out


@settings(max_examples=300, deadline=None)
@given(specs=layouts(), seed=st.integers(0, 1 << 30), replicas=st.integers(1, 6))
def test_the_fast_and_bitmask_forms_give_agreed_hits_answer(specs: tuple[KVCacheSpec, ...], seed: int,
                                                             replicas: int) -> None:
    rng = random.Random(seed)
    length = rng.randrange(1, 800)
    lay: KVCacheLayout = layout(2, *specs)
    rules = HitRules(lay, MAX_MODEL_LEN)
    fast = FastHits.for_rules(rules)
    assert (fast is not None) == (_mirrored(specs) and rules.hits_possible)
    seq = KVSequence("s", [rng.randrange(50) for _ in range(length)])
    hashes = {g.group: rules.block_hashes(seq, g.group) for g in rules.groups}
    caches = _caches(rng, rules, hashes, replicas)
    align = rules.hit_alignment
    cap = (length - 1) // align * align
    limit = rng.randrange(0, length + 1) if rng.random() < 0.25 else None
    if limit is not None:
        cap = min(cap, limit // align * align)
    empty: dict[bytes, int] = {}
    expect = [agreed_hit(rules.groups, lambda g: hashes[g.group], lambda g, c=c: c.get(g.group, empty),
                         cap, align)[0] for c in caches]
    assert [rules.longest_hit(seq, c, limit=limit) for c in caches] == expect
    if fast is None:
        return
    assert [fast.longest_hit(length, c, hashes.__getitem__, limit) for c in caches] == expect

    # The bitmask form: cache b is bit 1 << b, each group's bits shifted by a random amount.
    shifts = {g: rng.randrange(3) for g in hashes}

    def masks(g: int, n: int) -> tuple[list[int], int]:
        bits = [sum(1 << b for b, c in enumerate(caches) if h in c.get(g, empty)) << shifts[g] for h in hashes[g]]
        return bits[: n + rng.randrange(3)], shifts[g]  # a longer list is read only as far as asked

    got = [0] * replicas
    for q, bits in hits_together(fast, (1 << replicas) - 1, cap // align, masks).items():
        for b in range(replicas):
            if bits >> b & 1:
                assert not got[b], f"cache {b} has two hits"
                got[b] = q * align
    assert got == expect


def test_the_fast_forms_decline_a_kind_whose_hit_has_another_shape() -> None:
    for specs in [(full(16), chunked(64)), (full(16), mamba(16, mode="all")), (chunked(32),)]:
        assert FastHits.for_rules(HitRules(layout(2, *specs), MAX_MODEL_LEN)) is None
    assert FastHits.for_rules(HitRules(layout(2, full(16), mamba(16, mode="none")), MAX_MODEL_LEN)) is None  # no hits
    fast = FastHits.for_rules(HitRules(layout(2, full(16), swa(64), *split_state(2, 32)), MAX_MODEL_LEN))
    assert fast is not None
    assert (fast.chains, fast.spans) == ([(0, 16)], [(1, 16, 4), (2, 32, 1), (3, 32, 1)])


# ---------------------------------------------------------------------- the bitmask form's parts
def test_chain_reach_and_ends_group_replicas_by_how_far_they_hold_the_chain() -> None:
    # Masks of a 6-block chain: replica 1 holds all 6, replica 2 the first 3 and the 5th, replica 4
    # the 2nd on only.
    masks = [1 | 2, 1 | 2 | 4, 1 | 2 | 4, 1 | 4, 1 | 2 | 4, 1 | 4]
    assert chain_reach(masks, 1 | 2 | 4, 1) == [7, 3, 3, 3, 1, 1, 1]
    assert chain_ends(chain_reach(masks, 1 | 2 | 4, 1)) == {3: 2, 6: 1}
    assert chain_ends(chain_reach(masks[:4], 1 | 2 | 4, 1)) == {3: 2, 4: 1}
    # Points of two blocks: replica 2's 3 blocks reach point 1 only.
    assert chain_ends(chain_reach(masks, 1 | 2 | 4, 2)) == {1: 2, 3: 1}
    assert chain_ends(chain_reach(masks, 4, 1)) == {}


@given(masks=st.lists(st.integers(0, 255), max_size=40), replicas=st.integers(1, 255))
def test_chain_ends_are_the_last_point_each_replica_reaches(masks: list[int], replicas: int) -> None:
    reach = list(accumulate(masks, and_, initial=replicas))
    expect: dict[int, int] = {}
    for bit in (1 << b for b in range(8) if replicas >> b & 1):
        last = max(q for q, r in enumerate(reach) if r & bit)
        if last:
            expect[last] = expect.get(last, 0) | bit
    assert chain_ends(reach) == expect


@given(held=st.lists(st.booleans(), max_size=60), need=st.integers(1, 8), k=st.integers(1, 3), data=st.data())
def test_last_window_is_the_highest_aligned_end_with_every_needed_block_held(
        held: list[bool], need: int, k: int, data: st.DataObject) -> None:
    top = data.draw(st.integers(0, len(held)))
    valid = [e for e in range(k, top + 1, k) if all(held[max(0, e - need) : e])]
    assert last_window(bytes(held), top, need, k) == max(valid, default=0)


def test_settle_moves_a_replica_missing_a_window_block_below_the_block_it_lacks() -> None:
    # Windows of 3 blocks; replicas 1 and 2 start at point 6, replica 4 at point 4. Replica 2 lacks
    # block 4 (window of point 6: blocks 3-5), so it is checked again at point 4 (blocks 1-3),
    # where it lacks block 1 and moves to point 1 (block 0), which it holds.
    masks = [7, 5, 7, 7, 5, 7]
    assert settle_together({6: 1 | 2, 4: 4}, [(masks, 0, 1, 3)]) == {6: 1, 4: 4, 1: 2}
    # Points of two blocks: a block missing at 3 moves a replica to point 1 (blocks 0-1).
    assert settle_together({3: 1 | 2}, [([3, 3, 3, 1, 3, 3], 0, 2, 2)]) == {3: 1 | 2}
    assert settle_together({3: 1 | 2}, [([3, 3, 3, 1, 1, 3], 0, 2, 2)]) == {3: 1, 1: 2}
    # The same window group in the second place of each replica's bits (shift 1): replica 1's
    # bits 2, replica 2's bits 8.
    assert settle_together({3: 1 | 4}, [([10, 10, 10, 2, 2, 10], 1, 2, 2)]) == {3: 1, 1: 4}


"""FastHits: the hit length of HitRules.longest_hit for layouts of stock kinds, without block ids."""

from __future__ import annotations

import random

import pytest

from hybridkv import FullAttentionSpec, KVCacheGroup, KVCacheLayout, MambaSpec, SlidingWindowSpec
from hybridkv.core import HitRules
from hybridkv.core import Sequence as KVSequence
from hybridkv.core.hits import FastHits
from hybridkv.core.specs import ChunkedLocalAttentionSpec


def _layout(*specs: object) -> KVCacheLayout:
    return KVCacheLayout(2, tuple(KVCacheGroup(s) for s in specs))  # type: ignore[arg-type]


FULL = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=8)
SWA = SlidingWindowSpec(block_size=16, num_kv_heads=1, head_size=8, sliding_window=64)
MAMBA = MambaSpec(block_size=32, state_bytes=8, mode="align")


@pytest.mark.parametrize("layout", [_layout(FULL), _layout(FULL, SWA), _layout(FULL, MAMBA), _layout(FULL, SWA, MAMBA),
                                    _layout(SWA)], ids=["full", "full+swa", "full+mamba", "full+swa+mamba", "swa"])
def test_fast_hits_equal_the_hit_rules_on_random_caches(layout: KVCacheLayout) -> None:
    rules = HitRules(layout, 4096)
    fast = FastHits.for_rules(rules)
    assert fast is not None
    rng = random.Random(7)
    for trial in range(400):
        seq = KVSequence(f"s{trial}", [rng.randrange(50) for _ in range(rng.randrange(1, 400))])
        keep = rng.choice([0.5, 0.9, 1.0])
        held = {g: {h: 1 for h in rules.block_hashes(seq, g) if rng.random() < keep} for g in rules.caching_groups}
        limit = rng.choice([None, rng.randrange(0, 400)])
        expect = rules.longest_hit(seq, held, limit=limit)
        assert fast.longest_hit(seq.num_tokens, held, lambda g, s=seq: rules.block_hashes(s, g), limit) == expect


def test_fast_hits_decline_a_kind_they_do_not_mirror() -> None:
    chunked = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=1, head_size=8, attention_chunk_size=64)
    assert FastHits.for_rules(HitRules(_layout(FULL, chunked), 4096)) is None

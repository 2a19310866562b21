"""The admission bound: one per-request peak for pool sizing, the capacity report and admission.

``spec.blocks_for_tokens`` (``min(cdiv(n, block_size), spec.max_blocks_per_request(...))``, the
encoder size for cross attention) is the only formula. The manager admits with it, the capacity
report and the planner count with it, and no sequence ever holds more in a group.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hybridkv import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    InvalidInputError,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheManager,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    Sequence,
    SlidingWindowSpec,
    capacity_report,
)

from helpers import full, mamba, manager, swa, tokens


def _spec(kind: str, bs: int, k: int) -> KVCacheSpec:
    attn = {"block_size": bs, "num_kv_heads": 1, "head_size": 8}
    return {
        "full": lambda: FullAttentionSpec(**attn),
        "mla": lambda: MLAAttentionSpec(block_size=bs, head_size=8),
        "sliding": lambda: SlidingWindowSpec(**attn, sliding_window=3 * bs + 1),
        "chunked": lambda: ChunkedLocalAttentionSpec(**attn, attention_chunk_size=2 * bs),
        "mamba_none": lambda: MambaSpec(block_size=bs, state_bytes=64, mode="none"),
        "mamba_align": lambda: MambaSpec(block_size=bs, state_bytes=64, mode="align", checkpoint_blocks=k),
        "mamba_all": lambda: MambaSpec(block_size=bs, state_bytes=64, mode="all"),
        "cross": lambda: CrossAttentionSpec(**attn, max_encoder_len=5 * bs + 3),
        "encoder_only": lambda: EncoderOnlyAttentionSpec(**attn),
    }[kind]()


KINDS = ("full", "mla", "sliding", "chunked", "mamba_none", "mamba_align", "mamba_all", "cross", "encoder_only")


@given(kinds=st.lists(st.sampled_from(KINDS), min_size=1, max_size=4), bs=st.sampled_from((4, 8, 16)),
       k=st.integers(0, 3), max_model_len=st.integers(16, 400), batch=st.integers(1, 64))
def test_admission_capacity_and_pool_sizing_count_one_bound(kinds: list[str], bs: int, k: int,
                                                            max_model_len: int, batch: int) -> None:
    specs = [_spec(kind, bs, k) for kind in kinds]
    layout = KVCacheLayout(num_blocks=4096, groups=tuple(KVCacheGroup(s, (f"l{i}",)) for i, s in enumerate(specs)))
    mgr = KVCacheManager(layout, max_model_len, batch)
    rep = capacity_report(layout, max_model_len=max_model_len, max_num_batched_tokens=batch)
    for n in range(1, max_model_len + 1):
        per_group = rep.blocks_for(n)
        assert mgr.blocks_needed_when_empty(n) == sum(per_group), f"{kinds} at {n} tokens"
        for spec, blocks in zip(specs, per_group):
            assert blocks <= spec.max_blocks_per_request(batch, max_model_len)
    assert rep.blocks_per_request == rep.blocks_for(max_model_len)


def test_a_short_request_counts_the_same_at_admission_and_in_the_capacity_report() -> None:
    # Full attention + Mamba align, 4,096 blocks: 1, 10 or 16 tokens hold one block per group.
    mgr = manager(4096, full(), mamba(), max_model_len=8192, batch=2048)
    rep = capacity_report(mgr.layout, max_model_len=8192, max_num_batched_tokens=2048)
    for n in (1, 10, 16):
        assert mgr.blocks_needed_when_empty(n) == sum(rep.blocks_for(n)) == 2
    assert mgr.blocks_needed_when_empty(17) == sum(rep.blocks_for(17)) == 4  # 2 full, 2 states
    assert mgr.blocks_needed_when_empty(8192) == 512 + 3  # the state read, one checkpoint, the state written


def test_whole_sequence_admission_reserves_exactly_the_bound() -> None:
    # Full + SWA(64): a 1,000-token prompt in 128-token chunks needs 63 + cdiv(63 + 128, 16) + 1 = 76 blocks.
    layout_mgr = manager(77, full(), swa(64), max_model_len=1024, batch=128)
    seq = Sequence("s", tokens(0, 1000))
    assert layout_mgr.blocks_needed_when_empty(1000) == 63 + 13
    assert layout_mgr.allocate(seq, 128, whole_sequence_must_fit=True) is not None
    tight = manager(76, full(), swa(64), max_model_len=1024, batch=128)  # 75 usable blocks
    assert tight.allocate(Sequence("s", tokens(0, 1000)), 128, whole_sequence_must_fit=True) is None


def test_a_step_larger_than_max_num_batched_tokens_is_refused() -> None:
    mgr = manager(400, full(), swa(64), max_model_len=1024, batch=128)
    seq = Sequence("s", tokens(0, 1000))
    with pytest.raises(InvalidInputError, match="max_num_batched_tokens=128"):
        mgr.allocate(seq, 129)
    assert mgr.num_sequences == 0 and mgr.num_free_blocks == 399

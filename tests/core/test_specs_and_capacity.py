"""Specs, the per-request bound (the admission bound), the planner and the capacity report (growing-groups capacity)."""

from __future__ import annotations

import pytest

from hybridkv import (
    CrossAttentionSpec,
    DoesNotFitError,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    InvalidInputError,
    KVCacheGroup,
    KVCacheLayout,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    capacity_report,
    plan_layout,
)

from helpers import chunked, full, layout, mamba, swa


def test_page_sizes_per_kind() -> None:
    assert full(16).page_size_bytes == 2 * 16 * 8 * 128 * 2
    mla = MLAAttentionSpec(block_size=64, head_size=576, dtype_bytes=2)
    assert mla.page_size_bytes == 64 * 576 * 2  # latent only, no separate V
    assert MambaSpec(block_size=16, state_bytes=12345).page_size_bytes == 12345
    assert EncoderOnlyAttentionSpec(block_size=16, num_kv_heads=8, head_size=64).page_size_bytes == 0


def test_sliding_window_bound_is_seed_001_formula() -> None:
    spec = swa(window=64)
    # cdiv(min(63 + 128, 1024), 16) + 1 = 12 + 1
    assert spec.max_blocks_per_request(128, 1024) == 13
    # A window covering the whole context never drops a block: the bound is the whole sequence.
    assert swa(window=4096).max_blocks_per_request(8192, 2048) == 128
    assert swa(window=100).max_blocks_per_request(8192, 2048) == 128


def test_chunked_local_bound_is_seed_001_formula() -> None:
    spec = chunked(chunk=8192)
    assert spec.max_blocks_per_request(8192, 131072) == 1024  # cdiv(16384, 16)
    assert spec.max_blocks_per_request(8192, 4096) == 256


def test_bounds_of_other_kinds() -> None:
    assert full().max_blocks_per_request(128, 1000) == 63
    assert MambaSpec(block_size=16, state_bytes=1, mode="none").max_blocks_per_request(128, 4096) == 1
    # align: the state read, the state written, and up to ``checkpoint_blocks`` checkpoints of one step
    assert MambaSpec(block_size=16, state_bytes=1, mode="align").max_blocks_per_request(128, 4096) == 3
    assert MambaSpec(block_size=16, state_bytes=1, mode="align", checkpoint_blocks=0).max_blocks_per_request(
        128, 4096) == 2
    assert MambaSpec(block_size=16, state_bytes=1, mode="align").max_blocks_per_request(128, 32) == 2
    assert MambaSpec(block_size=16, state_bytes=1, mode="all").max_blocks_per_request(128, 4096) == 256
    cross = CrossAttentionSpec(block_size=16, num_kv_heads=8, head_size=64, max_encoder_len=1500)
    assert cross.max_blocks_per_request(128, 448) == 94


def test_grows_with_sequence_per_kind() -> None:
    assert full().grows_with_sequence
    assert MLAAttentionSpec(block_size=16, head_size=576).grows_with_sequence
    assert not swa(128).grows_with_sequence
    assert not chunked(8192).grows_with_sequence
    assert not mamba(mode="align").grows_with_sequence
    assert MambaSpec(block_size=16, state_bytes=1, mode="all").grows_with_sequence


def test_bad_specs_are_rejected_with_the_field_name() -> None:
    with pytest.raises(InvalidInputError, match="sliding_window"):
        SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, sliding_window=0)
    with pytest.raises(InvalidInputError, match="block_size"):
        FullAttentionSpec(block_size=-1, num_kv_heads=8, head_size=128)
    with pytest.raises(InvalidInputError, match="mode"):
        MambaSpec(block_size=16, state_bytes=10, mode="sometimes")  # type: ignore[arg-type]


def test_token_capacity_divides_only_by_growing_groups() -> None:
    # Growing-groups capacity: one full + one SWA group hold as many tokens as full attention alone.
    hybrid = capacity_report(layout(4097, full(), swa(1024)), max_model_len=32768, max_num_batched_tokens=8192)
    only_full = capacity_report(layout(4097, full()), max_model_len=32768, max_num_batched_tokens=8192)
    assert hybrid.token_capacity == only_full.token_capacity == 4096 * 16
    # 1 attention + 3 Mamba groups: 4x what the naive num_blocks // num_groups rule says.
    four = capacity_report(layout(4097, full(), mamba(), mamba(), mamba()), max_model_len=32768,
                           max_num_batched_tokens=8192)
    assert four.token_capacity == 4096 * 16
    assert four.growing_groups == (0,)


def test_token_capacity_falls_back_to_all_groups_when_none_grows() -> None:
    rep = capacity_report(layout(1001, swa(128), swa(256)), max_model_len=4096, max_num_batched_tokens=512)
    assert rep.growing_groups == (0, 1)
    assert rep.token_capacity == 1000 // 2 * 16


def test_max_concurrency_is_exact_with_per_group_bounds() -> None:
    rep = capacity_report(layout(4097, full(), swa(1024)), max_model_len=32768, max_num_batched_tokens=8192)
    per_request = 2048 + (((1023 + 8192) + 15) // 16 + 1)  # full + SWA bound
    assert rep.blocks_per_request == (2048, per_request - 2048)
    assert rep.max_concurrency == 4096 // per_request
    # 4096-token requests: the SWA bound does not apply (256 blocks < bound).
    assert rep.concurrency_for(4096) == 4096 // (256 + 256)
    assert rep.concurrency_for(100) == 4096 // (7 + 7)
    with pytest.raises(InvalidInputError, match="max_model_len"):
        rep.concurrency_for(40000)


def test_slot_address_space_is_num_blocks_times_block_size() -> None:
    rep = capacity_report(layout(1000, full(16), mamba(64)), max_model_len=4096, max_num_batched_tokens=512)
    assert rep.slot_address_space == (16000, 64000)


def test_planner_groups_gemma3_like_layers_into_equal_groups() -> None:
    # 15 sliding + 3 full layers: 15 > 1.5 x 3, so groups of 3 layers: 5 SWA groups + 1 full.
    specs = {f"l{i}": (full() if i % 6 == 5 else swa(512)) for i in range(18)}
    lay = plan_layout(specs, 1 << 30, max_model_len=32768, max_num_batched_tokens=2048)
    assert sorted(len(g.layer_names) for g in lay.groups) == [3] * 6
    assert sum(isinstance(g.spec, FullAttentionSpec) for g in lay.groups) == 1
    assert lay.num_blocks == (1 << 30) // (full().page_size_bytes * 3)


def test_planner_pads_groups_when_sizes_are_close() -> None:
    specs = {**{f"a{i}": full() for i in range(4)}, **{f"b{i}": swa(128) for i in range(3)}}
    lay = plan_layout(specs, 1 << 28, max_model_len=4096, max_num_batched_tokens=512)
    assert len(lay.groups) == 2
    assert lay.group_size == 4  # 4 < 1.5 x 3: one group per spec, the smaller padded to 4 layers
    # 3 full vs 2 SWA layers: 3 is not < 1.5 x 2, so groups of 2 and the full layers split.
    split = plan_layout({**{f"a{i}": full() for i in range(3)}, "b0": swa(128), "b1": swa(128)}, 1 << 28,
                        max_model_len=4096, max_num_batched_tokens=512)
    assert sorted(len(g.layer_names) for g in split.groups) == [1, 2, 2]


def test_unified_pages_enlarge_attention_blocks_to_fit_a_mamba_state() -> None:
    specs = {"attn": full(16), "m0": MambaSpec(block_size=16, state_bytes=200_000)}
    lay = plan_layout(specs, 1 << 30, max_model_len=8192, max_num_batched_tokens=2048,
                      recurrent_pages="unified")
    attn, state = lay.groups[0].spec, lay.groups[1].spec
    assert attn.page_size_bytes >= 200_000
    # A 16-token page is 64 KiB: 4 of them (64 tokens, 256 KiB) are the first to hold 200,000 bytes.
    assert attn.block_size == 64 and attn.page_size_bytes == 262144
    assert state.page_size_bytes == attn.page_size_bytes  # padded
    assert state.block_size == attn.block_size  # checkpoints at attention block boundaries


def test_split_pages_keep_attention_blocks_and_spread_a_state_over_pages() -> None:
    specs = {"a0": full(16), "a1": full(16), "m0": MambaSpec(block_size=16, state_bytes=200_000),
             "m1": MambaSpec(block_size=16, state_bytes=200_000)}
    lay = plan_layout(specs, 1 << 30, max_model_len=8192, max_num_batched_tokens=2048)
    attn = lay.groups[0].spec
    assert attn.block_size == 16 and attn.page_size_bytes == 65536
    # 200,000 bytes need 4 pages of 64 KiB: one group per page, the same layers in each.
    (state,) = lay.recurrent_states
    assert state.layer_names == ("m0", "m1") and len(state.groups) == 4
    assert state.part_bytes == 50_000 and state.state_bytes == 200_000
    for j, g in enumerate(state.groups):
        spec = lay.groups[g].spec
        assert isinstance(spec, MambaSpec) and (spec.state_part, spec.state_parts) == (j, 4)
        assert spec.block_size == 16 and spec.page_size_bytes == 65536  # padded from 50,000
        assert lay.groups[g].layer_names == ("m0", "m1")
    # The same bytes per request either way: the admission bound counts every page of a state.
    unified = plan_layout(specs, 1 << 30, max_model_len=8192, max_num_batched_tokens=2048,
                          recurrent_pages="unified")
    split_pages = sum(capacity_report(lay, max_model_len=8192, max_num_batched_tokens=2048).blocks_per_request[1:])
    unified_pages = capacity_report(unified, max_model_len=8192, max_num_batched_tokens=2048).blocks_per_request[1]
    assert split_pages * 65536 == unified_pages * 262144 == 3 * 4 * 65536  # read, checkpoint, write


def test_planner_raises_block_size_when_pages_divide() -> None:
    specs = {"big": FullAttentionSpec(block_size=16, num_kv_heads=8, head_size=128),
             "small": SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=128, sliding_window=256)}
    lay = plan_layout(specs, 1 << 28, max_model_len=4096, max_num_batched_tokens=512)
    small = next(g.spec for g in lay.groups if isinstance(g.spec, SlidingWindowSpec))
    assert small.block_size == 32 and small.page_size_padded is None


def test_planner_error_names_the_largest_max_model_len_that_fits() -> None:
    specs = {"l0": full(16)}
    budget = full(16).page_size_bytes * 101  # 100 usable blocks = 1600 tokens
    with pytest.raises(DoesNotFitError, match="largest max_model_len that fits is 1600") as err:
        plan_layout(specs, budget, max_model_len=4096, max_num_batched_tokens=512)
    assert err.value.max_model_len_that_fits == 1600


def test_layout_rejects_bad_input() -> None:
    with pytest.raises(InvalidInputError, match="num_blocks"):
        KVCacheLayout(num_blocks=1, groups=(KVCacheGroup(full()),))
    with pytest.raises(InvalidInputError, match="at least one"):
        KVCacheLayout(num_blocks=10, groups=())

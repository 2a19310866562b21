"""The engine's KV pool: the hybridkv layout planned for a model's layer specs and a memory budget,
where each layer's KV lives in it, and a one-line account of it for start-up logs."""

from __future__ import annotations

from collections.abc import Mapping

from hybridkv.core import (
    FullAttentionSpec,
    KVCacheLayout,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    capacity_report,
    plan_layout,
)
from hybridkv.engine.config import EngineConfig
from hybridkv.errors import InvalidInputError


def plan_kv_layout(specs: Mapping[str, KVCacheSpec], cfg: EngineConfig) -> KVCacheLayout:
    """The hybridkv layout of a model's layer specs for the config's budget (``ignore_sliding_window``:
    every sliding-window layer planned as full attention)."""
    if cfg.ignore_sliding_window:
        specs = {name: FullAttentionSpec(block_size=s.block_size, num_kv_heads=s.num_kv_heads, head_size=s.head_size,
                                         dtype_bytes=s.dtype_bytes) if isinstance(s, SlidingWindowSpec) else s
                 for name, s in specs.items()}
    layout = plan_layout(specs, cfg.kv_cache_memory, max_model_len=cfg.max_model_len,
                         max_num_batched_tokens=cfg.max_num_batched_tokens)
    sizes = {g.spec.block_size for g in layout.groups}
    attention = [g.spec for g in layout.groups if not isinstance(g.spec, MambaSpec)]
    if len(sizes) != 1 or any(s.page_size_padded for s in attention):
        raise InvalidInputError(f"the engine needs one block size and unpadded attention pages, the layout has "
                                f"{sizes}")
    return layout


def state_groups(layout: KVCacheLayout) -> frozenset[int]:
    """The groups holding recurrent states (no per-token slots)."""
    return frozenset(g for state in layout.recurrent_states for g in state.groups)


def group_windows(layout: KVCacheLayout) -> list[int | None]:
    """Per group, the window its attention layers see (``None``: every previous token, or a state group)."""
    return [g.spec.sliding_window if isinstance(g.spec, SlidingWindowSpec) else None for g in layout.groups]


def layer_slots(layout: KVCacheLayout, num_layers: int) -> list[tuple[int, int]]:
    """Per attention layer ``layers.<i>``, its ``(group, slot)``: the layer is KV tensor ``slot`` of the
    group; ``(-1, -1)`` for a layer without one (a recurrent layer: ``layout.recurrent_states``)."""
    out = [(-1, -1)] * num_layers
    states = state_groups(layout)
    for g, group in enumerate(layout.groups):
        if g not in states:
            for j, name in enumerate(group.layer_names):
                out[int(name.rsplit(".", 1)[1])] = (g, j)
    return out


def pool_summary(layout: KVCacheLayout, cfg: EngineConfig, nbytes: int) -> str:
    """Blocks, groups, bytes, and how many tokens and requests the pool holds."""
    report = capacity_report(layout, max_model_len=cfg.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens)
    states = state_groups(layout)
    windows_by_group = [w for g, w in enumerate(group_windows(layout)) if g not in states]
    windows = sorted({w for w in windows_by_group if w is not None})
    full = windows_by_group.count(None)
    kinds = f"{full} full-attention" + (f" + {len(windows_by_group) - full} sliding-window (W={windows[0]})"
                                        if windows else "")
    if states:
        parts = layout.recurrent_states[0].groups
        kinds += f" + {len(states)} recurrent-state ({len(layout.recurrent_states)} states of {len(parts)} pages)"
    block_size = layout.groups[0].spec.block_size
    return (f"{layout.num_blocks - 1} blocks x {block_size} tokens in {len(layout.groups)} groups ({kinds}), "
            f"{nbytes / (1 << 20):.0f} MiB: {report.token_capacity} tokens of context, {report.max_concurrency} "
            f"request(s) of max_model_len={cfg.max_model_len} at once at their peak")

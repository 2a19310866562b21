"""The engine's KV pool: the hybridkv layout planned for the model and a memory budget, and a
one-line account of it for start-up logs."""

from __future__ import annotations

import torch

from hybridkv.core import FullAttentionSpec, KVCacheLayout, KVCacheSpec, capacity_report, plan_layout
from hybridkv.engine.config import EngineConfig
from hybridkv.engine.weights import Gemma3Config
from hybridkv.errors import InvalidInputError
from hybridkv.planning.hf_config import layer_specs, parse_config


def plan_kv_layout(mcfg: Gemma3Config, cfg: EngineConfig, dtype: torch.dtype) -> KVCacheLayout:
    """The hybridkv layout for this model and budget: its layer specs through the planner."""
    kv_bytes = torch.tensor([], dtype=dtype).element_size()
    specs: dict[str, KVCacheSpec] = dict(layer_specs(parse_config(mcfg.hf_config()), block_size=cfg.block_size,
                                                     kv_dtype_bytes=kv_bytes))
    if cfg.ignore_sliding_window:
        specs = {name: FullAttentionSpec(block_size=cfg.block_size, num_kv_heads=mcfg.num_kv_heads,
                                         head_size=mcfg.head_dim, dtype_bytes=kv_bytes) for name in specs}
    layout = plan_layout(specs, cfg.kv_cache_memory, max_model_len=cfg.max_model_len,
                         max_num_batched_tokens=cfg.max_num_batched_tokens)
    sizes = {g.spec.block_size for g in layout.groups}
    if len(sizes) != 1 or any(g.spec.page_size_padded for g in layout.groups):
        raise InvalidInputError(f"the engine needs one block size and unpadded pages, the layout has {sizes}")
    return layout


def pool_summary(layout: KVCacheLayout, cfg: EngineConfig, group_windows: list[int | None], nbytes: int) -> str:
    """Blocks, groups, bytes, and how many tokens and requests the pool holds."""
    report = capacity_report(layout, max_model_len=cfg.max_model_len, max_num_batched_tokens=cfg.max_num_batched_tokens)
    windows = sorted({w for w in group_windows if w is not None})
    full = group_windows.count(None)
    kinds = f"{full} full-attention" + (f" + {len(group_windows) - full} sliding-window (W={windows[0]})"
                                        if windows else "")
    block_size = layout.groups[0].spec.block_size
    return (f"{layout.num_blocks - 1} blocks x {block_size} tokens in {len(layout.groups)} groups ({kinds}), "
            f"{nbytes / (1 << 20):.0f} MiB: {report.token_capacity} tokens of context, {report.max_concurrency} "
            f"request(s) of max_model_len={cfg.max_model_len} at once at their peak")

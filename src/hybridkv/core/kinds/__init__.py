"""Per-kind managers: one class per layer kind behind one interface (``KindManager``).

``kind_manager_for`` picks the class for a spec; the coordinator and the manager never ask a
group which kind it is.
"""

from __future__ import annotations

from hybridkv.core.block_pool import BlockPool
from hybridkv.core.kinds.base import NEVER, KindManager
from hybridkv.core.kinds.chunked_local import ChunkedLocalAttentionManager
from hybridkv.core.kinds.encoder import CrossAttentionManager, EncoderOnlyManager
from hybridkv.core.kinds.full import FullAttentionManager
from hybridkv.core.kinds.mamba import MambaManager, MambaNoCacheManager
from hybridkv.core.kinds.sliding_window import SlidingWindowManager
from hybridkv.core.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

NoCacheManager = EncoderOnlyManager
"""The earlier name of ``EncoderOnlyManager``."""

__all__ = [
    "NEVER",
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "EncoderOnlyManager",
    "FullAttentionManager",
    "KindManager",
    "MambaManager",
    "MambaNoCacheManager",
    "NoCacheManager",
    "SlidingWindowManager",
    "kind_manager_for",
]


def kind_manager_for(spec: KVCacheSpec, group: int, pool: BlockPool | None, *, max_num_batched_tokens: int,
                     max_model_len: int, enable_caching: bool) -> KindManager:
    """The manager of ``spec``'s kind for one group (``pool`` None: hit rules only, no tables)."""
    bound = spec.max_blocks_per_request(max_num_batched_tokens, max_model_len)
    if isinstance(spec, FullAttentionSpec):  # MLA included
        return FullAttentionManager(spec, group, pool, bound=bound, enable_caching=enable_caching)
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, group, pool, bound=bound, enable_caching=enable_caching)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalAttentionManager(spec, group, pool, bound=bound, enable_caching=enable_caching)
    if isinstance(spec, MambaSpec):
        if spec.mode == "none":
            return MambaNoCacheManager(spec, group, pool, bound=bound, enable_caching=enable_caching)
        return MambaManager(spec, group, pool, bound=bound, enable_caching=enable_caching)
    if isinstance(spec, CrossAttentionSpec):
        return CrossAttentionManager(spec, group, pool, bound=bound, enable_caching=enable_caching)
    if isinstance(spec, EncoderOnlyAttentionSpec):
        return EncoderOnlyManager(spec, group, pool, bound=bound, enable_caching=enable_caching)
    raise TypeError(f"no manager for spec type {type(spec).__name__}")

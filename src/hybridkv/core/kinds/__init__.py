"""Per-kind managers: one class per layer kind behind one interface (``KindManager``)."""

from __future__ import annotations

from hybridkv.core.block_pool import BlockPool
from hybridkv.core.kinds.base import KindManager
from hybridkv.core.kinds.kinds import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    MambaManager,
    MambaNoCacheManager,
    NoCacheManager,
    SlidingWindowManager,
)
from hybridkv.core.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

__all__ = [
    "ChunkedLocalAttentionManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "KindManager",
    "MambaManager",
    "MambaNoCacheManager",
    "NoCacheManager",
    "SlidingWindowManager",
    "manager_for",
]


def manager_for(
    spec: KVCacheSpec, group: int, pool: BlockPool, *, bound: int, enable_caching: bool
) -> KindManager:
    """The manager class for ``spec``'s kind, built for one group."""
    cls: type[KindManager]
    if isinstance(spec, FullAttentionSpec):  # MLA included
        cls = FullAttentionManager
    elif isinstance(spec, SlidingWindowSpec):
        cls = SlidingWindowManager
    elif isinstance(spec, ChunkedLocalAttentionSpec):
        cls = ChunkedLocalAttentionManager
    elif isinstance(spec, MambaSpec):
        cls = MambaNoCacheManager if spec.mode == "none" else MambaManager
    elif isinstance(spec, CrossAttentionSpec):
        cls = CrossAttentionManager
    elif isinstance(spec, EncoderOnlyAttentionSpec):
        cls = NoCacheManager
    else:
        raise TypeError(f"no manager for spec type {type(spec).__name__}")
    return cls(spec, group, pool, bound=bound, enable_caching=enable_caching)


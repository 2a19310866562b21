"""hybridkv: a paged KV-cache manager for hybrid-attention models."""

from __future__ import annotations

from hybridkv.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored, KVCacheEvent
from hybridkv.coordinator import CacheHit
from hybridkv.errors import (
    DoesNotFitError,
    HybridKVError,
    InvalidInputError,
    LayoutError,
    SequenceTooLongError,
    UnknownSequenceError,
)
from hybridkv.hashing import BlockHasher
from hybridkv.layout import CapacityReport, KVCacheGroup, KVCacheLayout, capacity_report, plan_layout
from hybridkv.manager import KVCacheManager, KVCacheStats
from hybridkv.retention import NoRetention, WindowRetention
from hybridkv.sequence import Sequence
from hybridkv.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__version__ = "0.1.0"

__all__ = [
    "AllBlocksCleared",
    "AttentionSpec",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheHit",
    "CapacityReport",
    "ChunkedLocalAttentionSpec",
    "CrossAttentionSpec",
    "DoesNotFitError",
    "EncoderOnlyAttentionSpec",
    "FullAttentionSpec",
    "HybridKVError",
    "InvalidInputError",
    "KVCacheEvent",
    "KVCacheGroup",
    "KVCacheLayout",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheStats",
    "LayoutError",
    "MLAAttentionSpec",
    "MambaSpec",
    "NoRetention",
    "Sequence",
    "SequenceTooLongError",
    "SlidingWindowSpec",
    "UnknownSequenceError",
    "WindowRetention",
    "capacity_report",
    "plan_layout",
]

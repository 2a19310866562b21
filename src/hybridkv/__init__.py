"""hybridkv: a paged KV-cache manager for hybrid-attention models."""

from __future__ import annotations

from hybridkv import _moved
from hybridkv.core import (
    NULL_BLOCK,
    AllBlocksCleared,
    AttentionSpec,
    BlockHasher,
    BlockPool,
    BlockRemoved,
    BlockStored,
    CacheHit,
    CapacityReport,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    HitRules,
    KVCacheEvent,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheManager,
    KVCacheSpec,
    KVCacheStats,
    MambaSpec,
    MLAAttentionSpec,
    NoRetention,
    RetentionPolicy,
    Sequence,
    SlidingWindowSpec,
    WindowRetention,
    capacity_report,
    plan_layout,
)
from hybridkv.errors import (
    DoesNotFitError,
    HybridKVError,
    InvalidInputError,
    LayoutError,
    SequenceTooLongError,
    UnknownSequenceError,
)
from hybridkv.scheduling import Scheduler, SchedulerConfig

__version__ = "0.1.0"

_moved.install()

__all__ = [
    "NULL_BLOCK",
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
    "HitRules",
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
    "RetentionPolicy",
    "Sequence",
    "Scheduler",
    "SchedulerConfig",
    "SequenceTooLongError",
    "SlidingWindowSpec",
    "UnknownSequenceError",
    "WindowRetention",
    "capacity_report",
    "plan_layout",
]

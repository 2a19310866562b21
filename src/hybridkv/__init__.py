"""hybridkv: a paged KV-cache manager for hybrid-attention models."""

from __future__ import annotations

from hybridkv import _moved
from hybridkv.core.block_pool import AllBlocksCleared, BlockPool, BlockRemoved, BlockStored, KVCacheEvent
from hybridkv.core.hashing import BlockHasher
from hybridkv.core.hits import CacheHit
from hybridkv.core.layout import CapacityReport, KVCacheGroup, KVCacheLayout, capacity_report, plan_layout
from hybridkv.core.manager import KVCacheManager, KVCacheStats
from hybridkv.core.retention import NoRetention, WindowRetention
from hybridkv.core.sequence import Sequence
from hybridkv.core.specs import (
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
    "Scheduler",
    "SchedulerConfig",
    "SequenceTooLongError",
    "SlidingWindowSpec",
    "UnknownSequenceError",
    "WindowRetention",
    "capacity_report",
    "plan_layout",
]

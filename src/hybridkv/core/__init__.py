"""The KV-cache manager core: specs, layout, hashing, sequences, the block pool, per-kind rules,
retention and the manager facade. Standard library only.

Code outside the core imports from here (or from ``hybridkv``), never from the core's modules:
these names are the core's public surface.
"""

from hybridkv.core.block_pool import NULL_BLOCK, AllBlocksCleared, BlockPool, BlockRemoved, BlockStored, KVCacheEvent
from hybridkv.core.hashing import HASH_ALGORITHMS, BlockHasher, HashAlgorithm
from hybridkv.core.hits import CacheHit, FastHits, HitRules, hits_together
from hybridkv.core.layout import (
    CapacityReport,
    KVCacheGroup,
    KVCacheLayout,
    RecurrentPages,
    RecurrentState,
    capacity_report,
    plan_layout,
)
from hybridkv.core.manager import KVCacheManager, KVCacheStats, StateStep
from hybridkv.core.retention import NoRetention, RetentionPolicy, WindowRetention
from hybridkv.core.sequence import KVSequence, Sequence
from hybridkv.core.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaMode,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

__all__ = [
    "HASH_ALGORITHMS",
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
    "EncoderOnlyAttentionSpec",
    "FastHits",
    "FullAttentionSpec",
    "HashAlgorithm",
    "HitRules",
    "KVCacheEvent",
    "KVCacheGroup",
    "KVCacheLayout",
    "KVCacheManager",
    "KVCacheSpec",
    "KVCacheStats",
    "KVSequence",
    "MLAAttentionSpec",
    "MambaMode",
    "MambaSpec",
    "NoRetention",
    "RecurrentPages",
    "RecurrentState",
    "RetentionPolicy",
    "Sequence",
    "SlidingWindowSpec",
    "StateStep",
    "WindowRetention",
    "capacity_report",
    "hits_together",
    "plan_layout",
]

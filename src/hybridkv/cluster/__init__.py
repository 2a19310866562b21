"""A cluster of engines: vLLM-format KV events, a global index with the core's hybrid hit rules,
and a KV-aware router.

The index (``ClusterIndex``) and the event model need only the standard library. The ZMQ publisher
and subscriber (``hybridkv.cluster.publisher``, ``hybridkv.cluster.subscriber``) and the router
(``hybridkv.cluster.router``) need the ``cluster`` extra: ``pip install 'hybridkv[cluster]'``.
"""

from hybridkv.cluster.events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllClearedEvent,
    BlockRemovedEvent,
    BlockStoredEvent,
    EventBatch,
    EventDecodeError,
    from_core_events,
    group_metadata,
    make_batch,
)
from hybridkv.cluster.hashes import HashScheme, HybridkvHashes, VllmHashes, scheme_named
from hybridkv.cluster.index import ClusterIndex, StreamStats
from hybridkv.cluster.layouts import GroupDescription, ReplicaLayout
from hybridkv.cluster.replica import Prediction, RequestKeys

__all__ = [
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllClearedEvent",
    "BlockRemovedEvent",
    "BlockStoredEvent",
    "ClusterIndex",
    "EventBatch",
    "EventDecodeError",
    "GroupDescription",
    "HashScheme",
    "HybridkvHashes",
    "Prediction",
    "ReplicaLayout",
    "RequestKeys",
    "StreamStats",
    "VllmHashes",
    "from_core_events",
    "group_metadata",
    "make_batch",
    "scheme_named",
]

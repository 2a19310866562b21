"""External KV tiers behind one interface: the connector, the tiers, keys and frames.

Standard library only; ``RedisTier`` imports the optional ``redis`` package when built.
"""

from __future__ import annotations

from hybridkv.connectors.auth import KEY_ENV, KEY_FILE_ENV
from hybridkv.connectors.base import KVTier, TierError, TierStats, TierTimeout
from hybridkv.connectors.connector import ConnectorStats, FetchedKV, KVConnector
from hybridkv.connectors.disk import DiskTier
from hybridkv.connectors.faulty import FaultyTier
from hybridkv.connectors.frame import FrameError, decode_frame, encode_frame, namespace_id, tier_key
from hybridkv.connectors.host import HostTier
from hybridkv.connectors.redis_tier import RedisTier

__all__ = [
    "KEY_ENV",
    "KEY_FILE_ENV",
    "ConnectorStats",
    "DiskTier",
    "FaultyTier",
    "FetchedKV",
    "FrameError",
    "HostTier",
    "KVConnector",
    "KVTier",
    "RedisTier",
    "TierError",
    "TierStats",
    "TierTimeout",
    "decode_frame",
    "encode_frame",
    "namespace_id",
    "tier_key",
]

"""External KV tiers of an engine from their command-line specs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridkv.connectors import DiskTier, HostTier, KVConnector, KVTier, RedisTier
from hybridkv.connectors.loads import BackgroundLoads
from hybridkv.core import KVCacheManager
from hybridkv.errors import InvalidInputError
from hybridkv.sizes import parse_bytes

if TYPE_CHECKING:
    from hybridkv.engine.engine import EngineConfig


def build_connector(cfg: EngineConfig, manager: KVCacheManager) -> KVConnector:
    """The connector of ``cfg.kv_tiers`` (see ``parse_tier``), namespaced by model, dtype and weights format;
    tier loads run on background threads (a request waits for its load while the others run)."""
    from hybridkv.engine.config import parse_dtype, weights_format

    model = NAMESPACES.get(cfg.model, cfg.model)
    return KVConnector([parse_tier(spec) for spec in cfg.kv_tiers], manager,
                       namespace=f"{model}/{parse_dtype(cfg.dtype)}/{weights_format(cfg)}", loads=BackgroundLoads())


NAMESPACES = {"gemma-3-270m": "gemma-3-270m-q4_k_m"}
"""A model's name in tier keys where it is not ``EngineConfig.model`` (Gemma's, as tiers already hold it)."""


def tier_parts(spec: str) -> tuple[str, str, int]:
    """``(kind, path, size)`` of a tier spec, checked without building the tier: kind ``host`` (path ``""``),
    ``disk``, or ``redis`` (path the URL, size 0). ``InvalidInputError`` naming the spec otherwise."""
    def size(text: str) -> int:
        try:
            value = parse_bytes(text)
        except InvalidInputError:
            value = 0
        if value <= 0:
            raise InvalidInputError(f"KV tier {spec!r}: {text!r} is not a positive size (e.g. 512MiB, 4GiB)")
        return value

    if spec.startswith(("redis://", "rediss://")):
        return "redis", spec, 0
    kind, _, rest = spec.partition(":")
    if kind == "host" and rest:
        return kind, "", size(rest)
    if kind == "disk" and ":" in rest:
        path, _, budget = rest.rpartition(":")
        if path:
            return kind, path, size(budget)
    raise InvalidInputError(f"KV tier {spec!r}: expected host:SIZE, disk:PATH:SIZE or redis://HOST:PORT[/DB]")


def parse_tier(spec: str) -> KVTier:
    """``host:SIZE``, ``disk:PATH:SIZE`` or ``redis://HOST:PORT[/DB]`` (SIZE like 512MiB, 4GiB)."""
    kind, path, size = tier_parts(spec)
    if kind == "redis":
        return RedisTier(spec)
    if kind == "host":
        return HostTier(size)
    return DiskTier(path, size)



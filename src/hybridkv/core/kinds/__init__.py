"""Per-kind rules and tables: one class pair per layer kind behind two interfaces, the stateless
hit rule (``KindRule``) and the block tables that follow it (``KindManager``).

``kind_rule_for`` picks the rule for a spec and ``kind_manager_for`` the tables for a rule; the
coordinator and the manager never ask a group which kind it is.
"""

from __future__ import annotations

from hybridkv.core.block_pool import BlockPool
from hybridkv.core.kinds.base import NEVER, KindManager, KindRule
from hybridkv.core.kinds.chunked_local import ChunkedLocalAttentionManager, ChunkedLocalAttentionRule
from hybridkv.core.kinds.encoder import CrossAttentionManager, EncoderOnlyManager, EncoderRule
from hybridkv.core.kinds.full import FullAttentionManager, FullAttentionRule
from hybridkv.core.kinds.mamba import MambaManager, MambaNoCacheManager, MambaNoCacheRule, MambaRule
from hybridkv.core.kinds.sliding_window import SlidingWindowManager, SlidingWindowRule
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
    "ChunkedLocalAttentionRule",
    "CrossAttentionManager",
    "EncoderOnlyManager",
    "EncoderRule",
    "FullAttentionManager",
    "FullAttentionRule",
    "KindManager",
    "KindRule",
    "MambaManager",
    "MambaNoCacheManager",
    "MambaNoCacheRule",
    "MambaRule",
    "NoCacheManager",
    "SlidingWindowManager",
    "SlidingWindowRule",
    "kind_manager_for",
    "kind_rule_for",
]


def kind_rule_for(spec: KVCacheSpec, group: int, *, enable_caching: bool) -> KindRule:
    """The hit rule of ``spec``'s kind for one group."""
    if isinstance(spec, FullAttentionSpec):  # MLA included
        return FullAttentionRule(spec, group, enable_caching=enable_caching)
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowRule(spec, group, enable_caching=enable_caching)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalAttentionRule(spec, group, enable_caching=enable_caching)
    if isinstance(spec, MambaSpec):
        if spec.mode == "none":
            return MambaNoCacheRule(spec, group, enable_caching=enable_caching)
        return MambaRule(spec, group, enable_caching=enable_caching)
    if isinstance(spec, (CrossAttentionSpec, EncoderOnlyAttentionSpec)):
        return EncoderRule(spec, group, enable_caching=enable_caching)
    raise TypeError(f"no manager for spec type {type(spec).__name__}")


def kind_manager_for(rule: KindRule, pool: BlockPool, *, max_num_batched_tokens: int,
                     max_model_len: int) -> KindManager:
    """The tables of one group that follow ``rule`` (from ``kind_rule_for``), over ``pool``."""
    spec = rule.spec
    bound = spec.max_blocks_per_request(max_num_batched_tokens, max_model_len)
    if isinstance(rule, MambaRule):
        return MambaManager(rule, pool, bound=bound)
    if isinstance(spec, FullAttentionSpec):
        return FullAttentionManager(rule, pool, bound=bound)
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(rule, pool, bound=bound)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return ChunkedLocalAttentionManager(rule, pool, bound=bound)
    if isinstance(spec, MambaSpec):
        return MambaNoCacheManager(rule, pool, bound=bound)
    if isinstance(spec, CrossAttentionSpec):
        return CrossAttentionManager(rule, pool, bound=bound)
    if isinstance(spec, EncoderOnlyAttentionSpec):
        return EncoderOnlyManager(rule, pool, bound=bound)
    raise TypeError(f"no manager for spec type {type(spec).__name__}")

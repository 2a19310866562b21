"""The hit rule: the longest prompt prefix every KV-cache group can serve, in three forms.

``agreed_hit`` (``rule.py``) with block ids, ``FastHits`` (``fast.py``) the length only, and
``hits_together`` (``masks.py``) for many caches at once over bitmasks; ``tests/core/test_hit_rule_forms.py``
checks that they agree. See docs/ARCHITECTURE.md, "The hit rule and its forms".
"""

from hybridkv.core.hits.fast import FastHits
from hybridkv.core.hits.masks import chain_ends, chain_reach, hits_together, last_window, settle_together
from hybridkv.core.hits.rule import LOSS_CAUSES, CacheHit, HitRules, agreed_hit, hit_losses, verify_group_hit

__all__ = [
    "LOSS_CAUSES",
    "CacheHit",
    "FastHits",
    "HitRules",
    "agreed_hit",
    "chain_ends",
    "chain_reach",
    "hit_losses",
    "hits_together",
    "last_window",
    "settle_together",
    "verify_group_hit",
]

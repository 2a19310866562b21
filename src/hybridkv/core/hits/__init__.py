"""The hit rule: the longest prompt prefix every KV-cache group can serve. One rule, three forms:

* ``agreed_hit`` (``rule.py``): the rule itself, over the kinds' ``find_longest_cache_hit``, with
  the block ids a pool adopts. ``HitRules`` runs it without a pool (what a cache holding given
  hashes would serve); the manager runs it against its pool.
* ``FastHits`` (``fast.py``): the same length without block ids, for layouts whose kinds say
  which blocks decide a hit (``KindRule.hit_reads``): an index's hot path.
* ``hits_together`` (``masks.py``): ``FastHits`` for many caches at once, one bit per cache.

``tests/test_hit_rule_forms.py`` checks that the three give the same hit on random layouts and caches.
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

"""Why a hit was lost: the tokens the full-attention groups held but the agreed hit did not serve,
attributed to the group kind that cut it (``KVCacheManager.lost_hit_tokens`` per sequence,
``KVCacheStats.lost_hit_tokens`` in all).

Each eviction test sizes the pool for one 80-token prompt and its states, then admits a small
sequence that evicts the blocks the first group freed (a sequence frees group by group, last block
first: the first group's blocks head the eviction order).
"""

from __future__ import annotations

from hybridkv import KVCacheManager, Sequence

from helpers import full, mamba, manager, run_prefill, swa, tokens


def _computed_and_freed(mgr: KVCacheManager, seq: Sequence) -> None:
    run_prefill(mgr, seq, 256)
    mgr.free(seq)


def _admit(mgr: KVCacheManager, seq: Sequence) -> int:
    hit = mgr.lookup(seq)
    assert mgr.allocate(seq, seq.num_tokens - hit.num_tokens, hit=hit) is not None
    return hit.num_tokens


def test_a_window_evicted_under_the_full_attention_prefix_is_attributed_to_the_window() -> None:
    mgr = manager(1 + 5 + 5 + 2, swa(32), full(), max_model_len=512, batch=256, retention="none")
    _computed_and_freed(mgr, Sequence("a", tokens(0, 80)))
    _admit(mgr, Sequence("filler", tokens(9000, 32)))  # 4 blocks: 2 fresh, then the window's 4 and 3
    probe = Sequence("b", tokens(0, 64) + tokens(500, 4))
    hit = mgr.lookup(probe)
    assert (hit.full_hit_tokens, hit.num_tokens) == (64, 48)  # block 3 (tokens 48..64) is gone
    mgr.free("filler")
    assert _admit(mgr, probe) == 48
    assert mgr.lost_hit_tokens("b") == {"window_evicted": 16}
    assert mgr.stats.lost_hit_tokens == {"window_evicted": 16, "state_evicted": 0, "state_not_checkpointed": 0}
    mgr.check_invariants()


def test_an_evicted_recurrent_state_is_attributed_to_eviction() -> None:
    # 80 tokens: states at 64 (the last aligned boundary before the prompt's last token) and 80
    mgr = manager(1 + 2 + 5 + 3, mamba(), full(), max_model_len=512, batch=256)
    _computed_and_freed(mgr, Sequence("a", tokens(0, 80)))
    assert mgr.lookup(Sequence("again", tokens(0, 64) + [1])).num_tokens == 64
    _admit(mgr, Sequence("filler", tokens(9000, 64)))  # 5 blocks: 3 fresh, then both states
    probe = Sequence("b", tokens(0, 64) + tokens(500, 4))
    hit = mgr.lookup(probe)
    assert (hit.full_hit_tokens, hit.num_tokens) == (64, 0)
    mgr.free("filler")
    assert _admit(mgr, probe) == 0
    assert mgr.lost_hit_tokens("b") == {"state_evicted": 64}
    mgr.check_invariants()


def test_a_state_never_checkpointed_at_the_junction_is_attributed_to_the_checkpoints() -> None:
    mgr = manager(64, mamba(), full(), max_model_len=512, batch=256)
    _computed_and_freed(mgr, Sequence("a", tokens(0, 100)))  # a checkpoint at 96 only
    probe = Sequence("b", tokens(0, 64) + tokens(500, 20))
    hit = mgr.lookup(probe)
    assert (hit.full_hit_tokens, hit.num_tokens) == (64, 0)
    _admit(mgr, probe)
    assert mgr.lost_hit_tokens("b") == {"state_not_checkpointed": 64}
    assert mgr.stats.lost_hit_tokens == {"window_evicted": 0, "state_evicted": 0, "state_not_checkpointed": 64}
    probe.num_computed_tokens = probe.num_tokens
    mgr.free(probe)
    # b's admission checkpointed the junction at 64: the next request sharing it loses nothing
    c = Sequence("c", tokens(0, 64) + tokens(700, 20))
    assert _admit(mgr, c) == 64 and mgr.lost_hit_tokens("c") == {}
    assert mgr.stats.lost_hit_tokens["state_not_checkpointed"] == 64


def test_a_full_hit_loses_nothing() -> None:
    mgr = manager(64, swa(32), mamba(), full(), max_model_len=512, batch=256)
    _computed_and_freed(mgr, Sequence("a", tokens(0, 80)))
    again = Sequence("again", tokens(0, 80))
    assert _admit(mgr, again) == 64 and mgr.lost_hit_tokens("again") == {}
    assert sum(mgr.stats.lost_hit_tokens.values()) == 0


def test_the_engine_metrics_export_lost_hit_tokens_by_cause() -> None:
    from hybridkv.engine.metrics import EngineMetrics

    metrics = EngineMetrics()
    metrics.on_admitted(0.1, 100, 48, None, {"window_evicted": 16})
    metrics.on_admitted(0.1, 100, 0, None, {"state_not_checkpointed": 64, "window_evicted": 16})
    text = metrics.render({}, "vllm")
    assert 'hybridkv_prefix_cache_lost_tokens_total{model_name="",cause="window_evicted"} 32' in text
    assert 'hybridkv_prefix_cache_lost_tokens_total{model_name="",cause="state_not_checkpointed"} 64' in text
    assert 'hybridkv_prefix_cache_lost_tokens_total{model_name="",cause="state_evicted"} 0' in text

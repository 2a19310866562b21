"""Prefix caching over recurrent state (Mamba, linear attention).

A recurrent group can resume only from a state checkpoint: the state after exactly a block
boundary. The manager writes checkpoints inside prefills where later requests are known or likely
to resume (the shared-prefix junction a lookup found, junctions remembered from earlier requests,
the prompt's end), registers them only once their tokens are computed, and with window retention
keeps a junction state as long as the full-attention block that anchors it.
"""

from __future__ import annotations

import pytest

from hybridkv import KVCacheManager, Sequence
from hybridkv.errors import InvalidInputError

from helpers import full, mamba, manager, run_prefill, split_state, tokens

SYSTEM = tokens(0, 1024)  # a shared prefix of 64 blocks


def run(mgr: KVCacheManager, seq: Sequence, chunk: int = 4096) -> int:
    """Admit with the hit, prefill in chunks, free; returns the hit tokens."""
    hit = run_prefill(mgr, seq, chunk)
    mgr.free(seq)
    mgr.check_invariants()
    return hit


def hybrid(num_blocks: int = 2000, retention: str = "none", pages: int = 1, **kw: int) -> KVCacheManager:
    """Full attention + a recurrent state of ``pages`` pages (``plan_layout``'s split), ``num_blocks``
    usable blocks besides the state's extra pages (a request holds up to 3 states)."""
    state = (mamba(**kw),) if pages == 1 else split_state(pages)
    return manager(num_blocks + 3 * (pages - 1), full(), *state, max_model_len=4096, batch=4096,
                   retention=retention)


def test_the_third_request_of_a_fan_out_resumes_from_the_junction() -> None:
    mgr = hybrid()
    assert run(mgr, Sequence("a", SYSTEM + tokens(10_000, 200))) == 0
    b = Sequence("b", SYSTEM + tokens(20_000, 200))
    hit = mgr.lookup(b)
    # Full attention matches the system prompt; the recurrent group has no state there.
    assert (hit.num_tokens, hit.full_hit_tokens) == (0, 1024)
    assert run(mgr, b) == 0  # b's one-step prefill writes the state after 1,024 tokens
    assert run(mgr, Sequence("c", SYSTEM + tokens(30_000, 200))) == 1024
    assert run(mgr, Sequence("d", SYSTEM + tokens(40_000, 7))) == 1024


def test_the_junction_checkpoint_is_written_inside_a_one_step_prefill() -> None:
    mgr = hybrid()
    run(mgr, Sequence("a", SYSTEM + tokens(10_000, 200)))
    b = Sequence("b", SYSTEM + tokens(20_000, 200))
    hit = mgr.lookup(b)
    new = mgr.allocate(b, b.num_tokens, hit=hit)
    assert new is not None
    # Recurrent table: the junction state (entry 63, after 1,024 tokens), the state at the prompt's
    # last boundary is not written (one checkpoint per step, junction first), the running state at 1,224.
    table = mgr.block_table("b")[1]
    assert [i for i, blk in enumerate(table) if blk] == [63, 76]
    assert len(new[1]) == 2


def test_a_second_checkpoint_per_step_also_keeps_the_prompt_end() -> None:
    mgr = hybrid(checkpoint_blocks=2)
    run(mgr, Sequence("a", SYSTEM + tokens(10_000, 200)))
    b = Sequence("b", SYSTEM + tokens(20_000, 200))
    assert mgr.allocate(b, b.num_tokens, hit=mgr.lookup(b)) is not None
    assert [i for i, blk in enumerate(mgr.block_table("b")[1]) if blk] == [63, 75, 76]  # 1,024, 1,216, 1,224
    b.num_computed_tokens = b.num_tokens
    mgr.free(b)
    assert mgr.lookup(Sequence("b2", b.token_ids)).num_tokens == 1216


def test_a_one_step_prefill_keeps_the_state_at_the_prompts_last_boundary() -> None:
    mgr = hybrid()
    prompt = tokens(0, 1000)
    assert run(mgr, Sequence("a", prompt)) == 0
    assert run(mgr, Sequence("again", prompt)) == 992  # (1000 - 1) // 16 * 16


def test_the_first_checkpoint_serves_a_hit() -> None:
    mgr = hybrid()
    run(mgr, Sequence("a", tokens(0, 20)))  # the prompt's last boundary is the first block
    assert run(mgr, Sequence("b", tokens(0, 20))) == 16


def test_no_checkpoints_without_prefix_caching_or_with_none_allowed() -> None:
    off = KVCacheManager(hybrid().layout, 4096, 4096, enable_prefix_caching=False)
    seq = Sequence("a", SYSTEM + tokens(10_000, 200))
    assert off.allocate(seq, seq.num_tokens) is not None
    assert sum(1 for blk in off.block_table("a")[1] if blk) == 1  # only the running state
    mgr = hybrid(checkpoint_blocks=0)
    run(mgr, Sequence("a", SYSTEM + tokens(10_000, 200)))
    run(mgr, Sequence("b", SYSTEM + tokens(20_000, 200)))
    assert run(mgr, Sequence("c", SYSTEM + tokens(30_000, 200))) == 0


def test_a_state_is_not_hit_before_its_tokens_are_computed() -> None:
    mgr = hybrid()
    a = Sequence("a", tokens(0, 1000))
    assert mgr.allocate(a, 1000) is not None  # the step is allocated, not run
    assert mgr.lookup(Sequence("same-step", tokens(0, 1000))).num_tokens == 0
    a.num_computed_tokens = 1000  # the step ran; the manager learns it at a's next call
    mgr.free(a)
    assert mgr.lookup(Sequence("later", tokens(0, 1000))).num_tokens == 992


def test_attention_blocks_are_hit_in_the_step_that_computes_them() -> None:
    # Contrast: attention KV is written for every layer before any token of the step reads it.
    mgr = manager(200, full(), max_model_len=4096, batch=4096)
    a = Sequence("a", tokens(0, 1000))
    assert mgr.allocate(a, 1000) is not None
    assert mgr.lookup(Sequence("same-step", tokens(0, 1000))).num_tokens == 992


def test_blocks_of_a_step_that_never_ran_are_uncached_at_free() -> None:
    mgr = manager(200, full(), max_model_len=4096, batch=4096)
    a = Sequence("a", tokens(0, 1000))
    assert mgr.allocate(a, 1000) is not None
    mgr.free(a)  # preempted before its step ran: num_computed_tokens is still 0
    assert mgr.lookup(Sequence("b", tokens(0, 1000))).num_tokens == 0
    mgr.check_invariants()


def serve(mgr: KVCacheManager, seq: Sequence, decode: int = 0) -> int:
    """Prefill in one step, decode ``decode`` tokens, free; returns the hit tokens."""
    hit = run_prefill(mgr, seq, 4096)
    for _ in range(decode):
        seq.append_token_ids([5])
        assert mgr.allocate(seq, 1) is not None
        seq.num_computed_tokens += 1
    mgr.free(seq)
    mgr.check_invariants()
    return hit


@pytest.mark.parametrize("pages", [1, 3])
def test_window_retention_keeps_the_junction_state_as_long_as_its_anchor(pages: int) -> None:
    lost_under_lru = False
    for retention in ("window", "none"):
        mgr = hybrid(num_blocks=200, retention=retention, pages=pages)
        # b writes the junction state, then decodes: the state is dropped long before b's chain is freed.
        serve(mgr, Sequence("a", SYSTEM + tokens(10_000, 100)), decode=20)
        serve(mgr, Sequence("b", SYSTEM + tokens(20_000, 100)), decode=20)
        for i in range(24):  # pressure, one small unrelated request at a time
            serve(mgr, Sequence(f"x{i}", tokens(100_000 * (i + 1), 100)))
            hit = mgr.lookup(Sequence("c", SYSTEM + tokens(30_000, 100)))
            if retention == "window":
                assert hit.full_hit_tokens < 1024 or hit.num_tokens == 1024, f"after {i + 1}: {hit}"
            elif hit.full_hit_tokens == 1024 and hit.num_tokens == 0:
                lost_under_lru = True  # plain LRU evicted the state while its prefix was cached
    assert lost_under_lru


@pytest.mark.parametrize("pages", [1, 3])
def test_a_remembered_junction_is_checkpointed_when_the_prefix_is_recomputed(pages: int) -> None:
    for retention, expected in (("window", 1024), ("none", 0)):
        mgr = hybrid(num_blocks=200, retention=retention, pages=pages)
        run(mgr, Sequence("a", SYSTEM + tokens(10_000, 100)))
        run(mgr, Sequence("b", SYSTEM + tokens(20_000, 100)))  # the junction is found here
        for i in range(6):  # pressure evicts the whole system prompt
            run(mgr, Sequence(f"x{i}", tokens(100_000 * (i + 1), 900)))
        assert mgr.lookup(Sequence("probe", SYSTEM + tokens(5, 100))).full_hit_tokens == 0
        run(mgr, Sequence("a2", SYSTEM + tokens(50_000, 100)))  # recomputes the prefix
        assert run(mgr, Sequence("b2", SYSTEM + tokens(60_000, 100))) == expected, retention


@pytest.mark.parametrize("pages", [1, 3])
def test_the_junction_fan_out_resumes_with_a_state_of_several_pages(pages: int) -> None:
    mgr = hybrid(pages=pages)
    assert run(mgr, Sequence("a", SYSTEM + tokens(10_000, 200))) == 0
    assert run(mgr, Sequence("b", SYSTEM + tokens(20_000, 200))) == 0  # finds the junction, writes its state
    assert run(mgr, Sequence("c", SYSTEM + tokens(30_000, 200))) == 1024


@pytest.mark.parametrize("checkpoint_blocks", [0, 1, 2])
def test_a_sequence_never_holds_more_recurrent_states_than_the_bound(checkpoint_blocks: int) -> None:
    mgr = hybrid(checkpoint_blocks=checkpoint_blocks, retention="window")
    bound = mgr.layout.groups[1].spec.max_blocks_per_request(4096, 4096)
    assert bound == 2 + checkpoint_blocks
    run(mgr, Sequence("a", SYSTEM + tokens(10_000, 300)))
    run(mgr, Sequence("b", SYSTEM + tokens(20_000, 300)))
    seq = Sequence("c", tokens(0, 512) + tokens(77_777, 1100))  # a junction at 512, the prompt end
    hit = mgr.lookup(seq)
    assert mgr.allocate(seq, seq.num_tokens - hit.num_tokens, hit=hit) is not None
    held = sum(1 for blk in mgr.block_table("c")[1] if blk)
    assert held <= bound and held == 1 + min(checkpoint_blocks, 2)
    mgr.check_invariants()


def test_interval_checkpoints_when_the_spec_asks_for_them() -> None:
    mgr = manager(2000, full(), mamba(checkpoint_blocks=8, checkpoint_interval=256), max_model_len=4096,
                  batch=4096, retention="none")
    run(mgr, Sequence("a", tokens(0, 1100)))
    for n in (256, 512, 768, 1024):
        assert mgr.lookup(Sequence(f"p{n}", tokens(0, n) + [9] * 20)).num_tokens == n


def test_a_failed_step_leaves_no_block_it_should_have_computed_in_the_cache() -> None:
    mgr = manager(200, full(), max_model_len=4096, batch=4096)
    a = Sequence("a", tokens(0, 1000))
    assert mgr.allocate(a, 1000) is not None
    b = Sequence("b", tokens(0, 1000) + tokens(5000, 50))  # admitted in the same step on a's blocks
    hit = mgr.lookup(b)
    assert hit.num_tokens == 992 and mgr.allocate(b, 58, hit=hit) is not None
    mgr.free(a)  # the step failed: both are freed without advancing their computed counts
    mgr.free(b)
    assert mgr.lookup(Sequence("c", tokens(0, 1000))).num_tokens == 0
    mgr.check_invariants()


def test_a_checkpoint_hint_lets_the_second_request_of_a_fan_out_resume() -> None:
    """A client-marked message boundary (the system prompt's end) is checkpointed by the first
    request, so the second hits it; without the hint only the third does."""
    mgr = hybrid()
    assert run(mgr, Sequence("a", SYSTEM + tokens(10_000, 200), checkpoint_hints=[1024])) == 0
    assert run(mgr, Sequence("b", SYSTEM + tokens(20_000, 200))) == 1024


def test_a_hint_off_the_alignment_checkpoints_the_boundary_before_it() -> None:
    mgr = hybrid()
    prompt = SYSTEM + tokens(10_000, 200)
    run(mgr, Sequence("a", prompt, checkpoint_hints=[1030]))  # 1,030 -> 1,024
    assert run(mgr, Sequence("b", prompt[:1030] + tokens(20_000, 200))) == 1024


def test_a_hint_takes_the_step_checkpoint_a_junction_would() -> None:
    """Hints rank with junctions: in a one-step prefill with one checkpoint per step, the hint is
    written and the prompt's end is not."""
    mgr = hybrid()
    a = Sequence("a", SYSTEM + tokens(10_000, 200), checkpoint_hints=[512])
    assert mgr.allocate(a, a.num_tokens, hit=mgr.lookup(a)) is not None
    assert [i for i, blk in enumerate(mgr.block_table("a")[1]) if blk] == [31, 76]  # 512, 1,224


@pytest.mark.parametrize("hints", [[0], [1225], [-3], ["16"], [True], "16", 16])
def test_a_hint_outside_the_prompt_is_refused_by_name(hints: object) -> None:
    with pytest.raises(InvalidInputError, match="checkpoint hint"):
        Sequence("x", SYSTEM + tokens(10_000, 200), checkpoint_hints=hints)  # type: ignore[arg-type]


@pytest.mark.parametrize("hints, queue", [((130,), "lru"), ((), None)])
def test_a_state_checkpointed_at_a_hint_is_dropped_to_the_lru_not_evicted_first(hints: tuple[int, ...],
                                                                                 queue: str | None) -> None:
    # Steps of 100 tokens: the second checkpoints the state at the hint (130 -> 128), the third
    # moves on and drops it. A state written to be found goes to the LRU, with the prefix, not to
    # ``low`` (the blocks no hit needs, evicted first), where pressure would take it before the
    # next turn parts there. Without the hint no state is left at 128.
    mgr = manager(60, full(16), mamba(16), retention="window", max_model_len=1024, batch=1024)
    a = Sequence("a", tokens(0, 256), checkpoint_hints=hints)
    run_prefill(mgr, a, 100)
    state = mgr.pool.get_cached_block(1, mgr.block_hashes(a, 1)[7])
    assert (mgr.pool.queue_of(state) if state is not None else None) == queue
    mgr.free(a)
    mgr.check_invariants()
    assert mgr.lookup(Sequence("b", tokens(0, 128) + tokens(5000, 40))).num_tokens == (128 if hints else 0)

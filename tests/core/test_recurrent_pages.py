"""A recurrent state spread over several pages of the pool, at attention granularity.

The engine-facing contract: ``layout.recurrent_states`` says which groups hold the parts of each
state; ``mgr.state_steps(seq, c, t)`` says which pages a step over tokens ``[c, t)`` reads the state
from and which pages it writes the state into (checkpoints, then the running state). These tests
run a stand-in recurrence (the state after ``p`` tokens is a fingerprint of those tokens, one
piece per page) through admissions, chunked prefills, decodes, preemptions and evictions, and check
that every step reads exactly the state of the tokens before it, from every page of the state.
"""

from __future__ import annotations

import random

import pytest

from hybridkv import (
    BlockStored,
    DoesNotFitError,
    FullAttentionSpec,
    InvalidInputError,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheManager,
    LayoutError,
    MambaSpec,
    Sequence,
    SlidingWindowSpec,
    capacity_report,
    plan_layout,
)

from helpers import full

STATE_BYTES = 200_000  # four 64 KiB pages at 16-token attention blocks


def specs(mode: str = "align", **kw: int) -> dict[str, object]:
    window = SlidingWindowSpec(block_size=16, num_kv_heads=8, head_size=128, sliding_window=64)
    return {"a0": full(16), "a1": full(16), "w0": window, "w1": window,
            "m0": MambaSpec(block_size=16, state_bytes=STATE_BYTES, mode=mode, **kw),  # type: ignore[arg-type]
            "m1": MambaSpec(block_size=16, state_bytes=STATE_BYTES, mode=mode, **kw)}  # type: ignore[arg-type]


def hybrid_manager(num_blocks: int, mode: str = "align", **kw: int) -> KVCacheManager:
    page = full(16).page_size_bytes
    layout = plan_layout(specs(mode, **kw), num_blocks * page * 2, max_model_len=1024,  # type: ignore[arg-type]
                         max_num_batched_tokens=256)
    return KVCacheManager(layout, 1024, 256)


class PageStore:
    """What an engine's state tensors would hold: per (group, block), one piece of a state."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr = mgr
        self.pages: dict[tuple[int, int], tuple[int, int]] = {}

    def step(self, seq: Sequence, num_new: int) -> None:
        """Run a step over ``[c, c + num_new)`` after its allocation: check the read, write the states."""
        c, t = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        tokens = seq.token_ids
        for state, step in zip(self.mgr.layout.recurrent_states, self.mgr.state_steps(seq.seq_id, c, t),
                               strict=True):
            if step.read is None:
                assert c == 0
            else:
                want = hash(tuple(tokens[:c]))
                for j, (g, page) in enumerate(zip(state.groups, step.read, strict=True)):
                    assert self.pages.get((g, page)) == (want, j), f"{seq.seq_id}: wrong state at {c}"
            assert [p for p, _ in step.writes] == sorted({p for p, _ in step.writes})
            assert step.writes[-1][0] == t and all(c < p <= t for p, _ in step.writes)
            for p, pages in step.writes:
                for j, (g, page) in enumerate(zip(state.groups, pages, strict=True)):
                    assert page != 0
                    self.pages[(g, page)] = (hash(tuple(tokens[:p])), j)
        seq.num_computed_tokens = t


def test_the_planner_spreads_a_state_over_pages_and_the_manager_names_them() -> None:
    mgr = hybrid_manager(400)
    (state,) = mgr.layout.recurrent_states
    assert state.layer_names == ("m0", "m1") and len(state.groups) == 4
    assert {mgr.layout.groups[g].spec.block_size for g in range(len(mgr.layout.groups))} == {16}
    seq = Sequence("s", list(range(40)))
    assert mgr.allocate(seq, 40, hit=mgr.lookup(seq)) is not None
    (step,) = mgr.state_steps("s", 0, 40)
    tables = mgr.block_table("s")
    assert step.read is None
    # The prompt's end (32) is a checkpoint inside the step; the running state after 40 tokens.
    assert [p for p, _ in step.writes] == [32, 40]
    assert step.writes[-1][1] == tuple(tables[g][2] for g in state.groups)
    assert step.writes[0][1] == tuple(tables[g][1] for g in state.groups)


@pytest.mark.parametrize("mode,kw", [("align", {}), ("align", {"checkpoint_blocks": 0}),
                                     ("align", {"checkpoint_blocks": 3, "checkpoint_interval": 48}),
                                     ("all", {}), ("none", {})])
@pytest.mark.parametrize("seed", range(4))
def test_every_step_reads_the_state_of_exactly_its_prefix(mode: str, kw: dict[str, int], seed: int) -> None:
    rng = random.Random(seed)
    mgr = hybrid_manager(600 if mode == "all" else 160, mode, **kw)  # small: preemption and eviction happen
    store = PageStore(mgr)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice([20, 32, 100, 250]))] for _ in range(3)]
    running: list[Sequence] = []
    hits = 0
    for n in range(120):
        if len(running) < 4:
            prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 60))]
            seq = Sequence(f"s{n}", prompt)
            hit = mgr.lookup(seq)
            seq.num_computed_tokens = 0
            first = min(rng.choice([7, 16, 33, 256]), seq.num_tokens - hit.num_tokens)
            if mgr.allocate(seq, first, hit=hit) is None:
                continue
            hits += hit.num_tokens
            seq.num_computed_tokens = hit.num_tokens
            store.step(seq, first)
            running.append(seq)
        for seq in list(running):
            action = rng.random()
            if action < 0.1 or seq.num_tokens > 600:  # finished, aborted or preempted
                mgr.free(seq)
                running.remove(seq)
                continue
            if seq.num_computed_tokens == seq.num_tokens:
                seq.append_token_ids([rng.randrange(1000)])
            num_new = min(rng.choice([1, 5, 16, 40]), seq.num_tokens - seq.num_computed_tokens)
            if mgr.allocate(seq, num_new) is None:
                mgr.free(seq)  # preempted: it will not resume here
                running.remove(seq)
                continue
            store.step(seq, num_new)
        mgr.check_invariants()
    if mode != "none":
        assert hits > 0  # the shared prefixes were served from checkpoints


def test_a_short_shared_prefix_hits_below_the_old_block() -> None:
    # 100 shared tokens: the unified layout's 64-token blocks hit 64 of them, 16-token pages 96.
    def hit_of(mgr: KVCacheManager) -> int:
        system = list(range(100))
        for i in range(3):
            seq = Sequence(f"r{i}", system + [1000 + 100 * i + j for j in range(50)])
            hit = mgr.lookup(seq)
            assert mgr.allocate(seq, seq.num_tokens - hit.num_tokens, hit=hit) is not None
            seq.num_computed_tokens = seq.num_tokens
            mgr.free(seq)
        return hit.num_tokens

    split = plan_layout(specs(), 1 << 28, max_model_len=2048, max_num_batched_tokens=256)  # type: ignore[arg-type]
    unified = plan_layout(specs(), 1 << 28, max_model_len=2048, max_num_batched_tokens=256,  # type: ignore[arg-type]
                          recurrent_pages="unified")
    assert unified.groups[0].spec.block_size == 64
    assert hit_of(KVCacheManager(split, 2048, 256)) == 96
    assert hit_of(KVCacheManager(unified, 2048, 256)) == 64


def test_the_admission_bound_counts_every_page_of_a_state() -> None:
    mgr = hybrid_manager(400)
    rep = capacity_report(mgr.layout, max_model_len=1024, max_num_batched_tokens=256)
    (state,) = mgr.layout.recurrent_states
    # align: the state read, one checkpoint, the state written; each of them four pages.
    assert [rep.blocks_per_request[g] for g in state.groups] == [3, 3, 3, 3]
    assert mgr.blocks_needed_when_empty(1024) == sum(rep.blocks_per_request)


def test_bad_recurrent_layouts_are_one_clear_error() -> None:
    page = full(16).page_size_bytes
    with pytest.raises(DoesNotFitError, match="largest max_model_len that fits is 0"):
        plan_layout({"a": full(16), "m": MambaSpec(block_size=16, state_bytes=50 * page)}, 20 * page,
                    max_model_len=64, max_num_batched_tokens=64)
    with pytest.raises(InvalidInputError, match="checkpoint_interval=40 is not a multiple of block_size=16"):
        MambaSpec(block_size=16, state_bytes=1000, checkpoint_interval=40)
    with pytest.raises(InvalidInputError, match="checkpoint_interval=48 is not a multiple of block_size=32"):
        plan_layout({"a": full(32), "m": MambaSpec(block_size=16, state_bytes=1000, checkpoint_interval=48)},
                    1 << 28, max_model_len=256, max_num_batched_tokens=64)
    with pytest.raises(LayoutError, match="state page of 200000 bytes in a pool whose attention pages are 65536"):
        KVCacheLayout(100, (KVCacheGroup(full(16), ("a",)),
                            KVCacheGroup(MambaSpec(block_size=16, state_bytes=200_000), ("m",))))
    with pytest.raises(LayoutError, match=r"no group holds part\(s\) \[1\]"):
        KVCacheLayout(100, (KVCacheGroup(full(16), ("a",)),
                            KVCacheGroup(MambaSpec(block_size=16, state_bytes=100_000, state_parts=2,
                                                   page_size_padded=page), ("m",))))
    with pytest.raises(LayoutError, match="more than the limit of 255: a recurrent state spans 300 pages"):
        plan_layout({"a": FullAttentionSpec(block_size=1, num_kv_heads=1, head_size=8),
                     "m": MambaSpec(block_size=1, state_bytes=300 * 32)}, 1 << 28, max_model_len=64,
                    max_num_batched_tokens=64)
    with pytest.raises(InvalidInputError, match="the planner decides how many pages"):
        plan_layout({"m": MambaSpec(block_size=16, state_bytes=1000, state_parts=2)}, 1 << 20,
                    max_model_len=64, max_num_batched_tokens=64)
    mgr = hybrid_manager(400)
    seq = Sequence("s", list(range(40)))
    mgr.allocate(seq, 16, hit=mgr.lookup(seq))
    with pytest.raises(InvalidInputError, match="no blocks for a step over tokens"):
        mgr.state_steps("s", 0, 40)
    with pytest.raises(InvalidInputError, match="at least one token"):
        mgr.state_steps("s", 16, 16)


def test_a_tier_stores_a_split_state_only_at_checkpoints_and_a_hit_needs_every_page() -> None:
    from hybridkv.connectors import HostTier, KVConnector

    from helpers import layout, split_state

    def connector(host: HostTier) -> KVConnector:
        mgr = KVCacheManager(layout(400, full(16), *split_state(3)), 1024, 1024, retention="none")
        return KVConnector([host], mgr, namespace="split/bf16")

    host = HostTier(1 << 28)
    producer = connector(host)
    tokens = list(range(100))
    seq = Sequence("p", tokens)
    assert producer.manager.allocate(seq, 100) is not None  # one step: the prompt-end checkpoint at 96
    seq.num_computed_tokens = 100
    producer.store(seq, 100, lambda g, b: bytes(65536))
    producer.manager.free(seq)
    state_keys = [producer.keys(seq, g) for g in (1, 2, 3)]
    # Each page of the state is stored at the checkpoint (block 5, after 96 tokens), nowhere else.
    for keys in state_keys:
        assert host.exists_many(keys) == [i == 5 for i in range(len(keys))]
    assert connector(host).num_external_tokens(Sequence("c", tokens), 0) == 96
    host.delete(state_keys[2][5])  # one page of three gone: the state is gone
    assert connector(host).num_external_tokens(Sequence("c", tokens), 0) == 0


def test_kv_events_name_every_page_of_a_state() -> None:
    from helpers import manager, split_state

    mgr = manager(400, full(16), *split_state(3), max_model_len=1024, batch=1024, enable_events=True)
    seq = Sequence("s", list(range(40)))
    assert mgr.allocate(seq, 40, hit=mgr.lookup(seq)) is not None
    seq.num_computed_tokens = 40
    mgr.free(seq)  # the checkpoint at 32 enters the cache once computed
    stored = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
    by_group = {g: [e for e in stored if e.group == g] for g in (1, 2, 3)}
    checkpoint = mgr.block_hashes(seq, 1)[1]
    for events in by_group.values():
        # One state (after 32 tokens), announced on each of its pages, each under its own block id.
        assert [(e.block_hashes, e.block_size) for e in events] == [((checkpoint,), 16)]
    assert len({e.block_ids for events in by_group.values() for e in events}) == 3


def test_offering_a_steps_blocks_to_a_tier_vouches_that_its_checkpoints_were_computed() -> None:
    mgr = hybrid_manager(400)
    (state,) = mgr.layout.recurrent_states
    seq = Sequence("s", list(range(40)))
    assert mgr.allocate(seq, 40, hit=mgr.lookup(seq)) is not None
    g = state.groups[0]
    # Before the step is reported or offered, its checkpoint (after 32 tokens) is no one's to store.
    assert mgr.registered_blocks(seq, g, 0, 0) == []
    # Offering tokens beyond the slots the step was given vouches for nothing.
    assert mgr.registered_blocks(seq, g, 0, 48) == []
    # Offering the step's own tokens does: the checkpoint enters the cache, on every page.
    assert [i for i, _, _ in mgr.registered_blocks(seq, g, 0, 40)] == [1]
    assert all(mgr.registered_blocks(seq, p, 0, 40) for p in state.groups)
    mgr.check_invariants()

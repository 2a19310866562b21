"""Speculative decoding on recurrent state (Mamba + attention layouts): a step with drafts plans the
state's pages for every position its accepted tokens may end at; checkpoints are registered only at
verified positions, and no hit ever resumes from a state computed from rejected drafts.

The engine is simulated: every page of a state is labelled with the tokens the state it holds was
computed from, and written as ``StateStep`` says (``certain`` during the forward pass,
``after_acceptance`` once the drafts are verified). Pages a rejected draft's state would have gone
to are labelled with that draft-made state, so a manager that kept or registered one is caught."""

from __future__ import annotations

import random

import pytest

from hybridkv import InvalidInputError, KVCacheManager, Sequence
from hybridkv.core.block_pool import NULL_BLOCK
from hybridkv.scheduling.scheduler import Scheduler, SchedulerConfig

from helpers import full, mamba, manager, split_state, swa, tokens

VOCAB = 7


def oracle(prefix: list[int]) -> int:
    """The target model's greedy next token (deterministic in the prefix)."""
    return (prefix[-1] * 3 + len(prefix) + (prefix[-2] if len(prefix) > 1 else 0)) % VOCAB


class Engine:
    """The engine's half of the state contract, over labels instead of tensors."""

    def __init__(self, mgr: KVCacheManager) -> None:
        self.mgr = mgr
        self.labels: dict[int, tuple[int, ...]] = {}
        self.prefixes: dict[tuple[int, bytes], tuple[int, ...]] = {}  # (group, hash) -> the tokens it fingerprints
        self.state_groups = [g for st in mgr.layout.recurrent_states for g in st.groups]

    def learn(self, seq: Sequence) -> None:
        """Remember what each block hash of ``seq`` fingerprints (to check cached states against)."""
        for g in self.state_groups:
            bs = self.mgr.group_block_size(g)
            for i, h in enumerate(self.mgr.block_hashes(seq, g)):
                self.prefixes[(g, h)] = tuple(seq.token_ids[:(i + 1) * bs])

    def run(self, seq: Sequence, n: int, drafts: list[int], rng: random.Random) -> list[int]:
        """One step of ``seq``: ``n`` new tokens then ``drafts``; returns what it samples (the
        accepted drafts, then one token) when it ends at the sequence's last token."""
        c = seq.num_computed_tokens
        step = list(seq.token_ids[:c + n]) + drafts
        plans = self.mgr.state_steps(seq.seq_id, c, c + n + len(drafts))
        for st in plans:
            if st.read is None:
                assert c == 0, f"{seq.seq_id}: a step from {c} tokens reads the zero state"
            else:
                for page in st.read:
                    assert self.labels.get(page) == tuple(seq.token_ids[:c]), (
                        f"{seq.seq_id}: the state read after {c} tokens is {self.labels.get(page)}"
                    )
            assert (st.drafts_from is not None) == bool(drafts)
            for p, pages in st.certain:
                self._write(pages, step[:p])
        if c + n < seq.num_tokens:
            return []
        accepted: list[int] = []
        for d in drafts:
            if d != oracle(step[:c + n + len(accepted)]):
                break
            accepted.append(d)
        out = accepted + [oracle(step[:c + n + len(accepted)])]
        end = c + n + len(accepted)
        for st in plans if drafts else ():
            done = st.after_acceptance(end)
            for p, pages in done:
                assert p <= end
                self._write(pages, step[:p])
            written = {pages for _, pages in st.certain} | {pages for _, pages in done}
            for p, pages in st.writes:  # what a naive engine would leave: states made from rejected drafts
                if p > end and pages not in written:
                    self._write(pages, step[:p])
        return out

    def _write(self, pages: tuple[int, ...], prefix: list[int]) -> None:
        for page in pages:
            self.labels[page] = tuple(prefix)

    def check_cache(self) -> None:
        """Every cached state holds the state after exactly the tokens its hash fingerprints."""
        pool = self.mgr.pool
        for b in range(1, pool.num_blocks):
            h = pool.block_hash[b]
            g = pool.block_group[b]
            if h is not None and g in self.state_groups:
                assert self.labels.get(b) == self.prefixes[(g, h)], (
                    f"cached state block {b} (group {g}) holds {self.labels.get(b)}, its hash says "
                    f"{self.prefixes[(g, h)]}"
                )


def drafts_for(seq: Sequence, k: int, rng: random.Random, wrong: float) -> list[int]:
    """``k`` drafts: the true continuation, each wrong with probability ``wrong``."""
    out: list[int] = []
    ids = list(seq.token_ids)
    for _ in range(k):
        t = oracle(ids + out)
        if rng.random() < wrong:
            t = (t + 1 + rng.randrange(VOCAB - 1)) % VOCAB
        out.append(t)
    return out


def serve(mgr: KVCacheManager, seed: int, *, k: int, requests: int = 24, wrong: float = 0.3,
          preempt: bool = True) -> Engine:
    """Requests whose prompts reuse earlier requests' prompts and answers (so hits land on states
    decode steps with drafts left), decoded with ``k`` drafts a step; invariants after every step."""
    rng = random.Random(seed)
    sched = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=mgr.max_num_batched_tokens,
                                           num_speculative_tokens=k, max_num_seqs=4))
    eng = Engine(mgr)
    done: list[list[int]] = [[rng.randrange(VOCAB) for _ in range(rng.randrange(8, 40))]]
    seqs: dict[str, Sequence] = {}
    added = 0
    while added < requests or sched.has_unfinished:
        if added < requests and rng.random() < 0.4:
            base = rng.choice(done)
            prompt = base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
            seq = Sequence(f"r{added}", prompt)
            seqs[seq.seq_id] = seq
            sched.add(seq, max_new_tokens=rng.randrange(1, 40))
            added += 1
        for req in sched.running:
            s = req.seq
            if s.num_computed_tokens + 1 == s.num_tokens and s.num_computed_tokens >= s.num_prompt_tokens:
                room = min(k, mgr.max_draft_tokens(1))
                sched.set_draft_tokens(s.seq_id, drafts_for(s, rng.randrange(room + 1), rng, wrong))
        out = sched.schedule()
        mgr.check_invariants()
        sampled = {}
        for sid, n in out.num_scheduled_tokens.items():
            seq = seqs[sid]
            eng.learn(seq)
            got = eng.run(seq, n, out.draft_tokens.get(sid, []), rng)
            if got:
                sampled[sid] = got
        for seq in sched.update(out, sampled):
            done.append(list(seq.seq.token_ids))
        for sid in list(seqs):
            eng.learn(seqs[sid])
        mgr.check_invariants()
        eng.check_cache()
        if preempt and sched.running and rng.random() < 0.05:
            sched.preempt(rng.choice(sched.running).seq_id)
            mgr.check_invariants()
    return eng


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("bs", [4, 16])
def test_drafts_on_a_mamba_layout_never_leave_a_rejected_state(seed: int, bs: int) -> None:
    mgr = manager(48, full(bs), mamba(bs, state_bytes=64 * bs * 1024 // 16), max_model_len=256, batch=64)
    eng = serve(mgr, seed, k=min(6, bs - 1))
    assert mgr.stats.hit_tokens > 0 and any(g in eng.state_groups for g in range(len(mgr.groups)))


@pytest.mark.parametrize("seed", range(3))
def test_drafts_on_a_split_state_with_a_window_and_interval_checkpoints(seed: int) -> None:
    specs = (full(16), swa(32, 16), *split_state(2), mamba(16, checkpoint_interval=32))
    mgr = manager(64, *specs, max_model_len=256, batch=64)
    serve(mgr, seed, k=8, wrong=0.5)
    assert mgr.stats.hit_tokens > 0


def test_drafts_without_prefix_caching_and_with_an_uncached_state() -> None:
    for specs, caching in (((full(16), mamba(16)), False), ((full(16), mamba(16, mode="none")), True)):
        mgr = manager(48, *specs, max_model_len=256, batch=64, enable_prefix_caching=caching)
        serve(mgr, 1, k=8)


def decoded(mgr: KVCacheManager, n: int) -> Sequence:
    """A sequence of ``n`` prompt tokens, prefilled, with its first sampled token appended."""
    seq = Sequence("a", tokens(0, n))
    assert mgr.allocate(seq, n) is not None
    seq.num_computed_tokens = n
    seq.append_token_ids([1000])
    return seq


def test_a_boundary_among_the_drafts_is_registered_only_when_accepted() -> None:
    for accepted, cached in ((0, False), (1, True), (2, True), (4, True)):
        mgr = manager(32, full(16), mamba(16), max_model_len=256, batch=64)
        seq = decoded(mgr, 14)  # 15 tokens; the step computes token 14, drafts at 15..18 (boundary 16)
        assert mgr.allocate(seq, 1, num_lookahead_tokens=4) is not None
        (st,) = mgr.state_steps("a", 14, 19)
        table = mgr.block_table("a")[1]
        assert len(table) == 2 and st.drafts_from == 15 and st.read == (table[0],)
        assert st.writes == ((16, (table[0],)), (19, (table[1],))) and st.certain == ()
        end = 15 + accepted
        assert st.after_acceptance(end) == (((end, (table[0],)),) if end <= 16 else
                                            ((16, (table[0],)), (end, (table[1],))))
        seq.num_computed_tokens = end
        seq.append_token_ids(tokens(2000, accepted + 1))
        freed = mgr.release_lookahead(seq)
        # Past a boundary the accepted end keeps the state's second block (and the full group's).
        assert len(mgr.block_table("a")[1]) == (1 if end <= 16 else 2) and freed == (2 if end <= 16 else 0)
        assert (mgr.pool.block_hash[table[0]] is not None) == cached  # the state after 16 tokens
        mgr.check_invariants()
        probe = Sequence("p", seq.token_ids[:16] + [5, 6, 7])
        assert mgr.lookup(probe).num_tokens == (16 if cached else 0)


def test_the_running_state_ends_where_the_accepted_tokens_do() -> None:
    mgr = manager(32, full(16), mamba(16), max_model_len=256, batch=64)
    seq = decoded(mgr, 16)  # the state after 16 is a checkpoint; drafts at 17..20 stay in block 1
    assert mgr.allocate(seq, 1, num_lookahead_tokens=4) is not None
    (st,) = mgr.state_steps("a", 16, 21)
    table = mgr.block_table("a")[1]
    assert st.read == (table[0],) and st.writes == ((21, (table[1],)),)
    assert st.after_acceptance(17) == ((17, (table[1],)),) and st.after_acceptance(21) == ((21, (table[1],)),)
    with pytest.raises(InvalidInputError, match="outside"):
        st.after_acceptance(22)
    seq.num_computed_tokens = 19
    seq.append_token_ids([1, 2, 3])
    assert mgr.release_lookahead(seq) == 0
    mgr.check_invariants()
    # The next step reads the running state the engine wrote at 19, in the same block.
    assert mgr.allocate(seq, 1) is not None
    (st,) = mgr.state_steps("a", 19, 20)
    assert st.read == (table[1],) and st.writes == ((20, (table[1],)),) and st.drafts_from is None


def test_a_step_with_drafts_stays_within_one_state_block() -> None:
    mgr = manager(32, full(16), mamba(16), max_model_len=256, batch=64)
    seq = decoded(mgr, 30)
    assert mgr.max_draft_tokens(1) == 15 and mgr.max_draft_tokens(16) == 0
    before = (mgr.block_table("a"), mgr.num_free_blocks)
    with pytest.raises(InvalidInputError, match="one block of the recurrent state"):
        mgr.allocate(seq, 1, num_lookahead_tokens=16)
    assert (mgr.block_table("a"), mgr.num_free_blocks) == before
    # Held states stay within the admission bound (2 + checkpoint_blocks): the one read, the one written.
    assert mgr.allocate(seq, 1, num_lookahead_tokens=15) is not None
    assert mgr.num_held_blocks("a") - len(mgr.block_table("a")[0]) <= 2
    mgr.check_invariants()
    assert manager(32, full(16), swa(32, 16), max_model_len=256, batch=64).max_draft_tokens(1) == 63


def test_a_finished_request_registers_only_the_accepted_boundaries() -> None:
    # The request ends on a step whose accepted drafts cross the boundary at 16: free registers it.
    for accepted, cached in ((0, False), (3, True)):
        mgr = manager(32, full(16), mamba(16), max_model_len=256, batch=64)
        seq = decoded(mgr, 14)
        assert mgr.allocate(seq, 1, num_lookahead_tokens=4) is not None
        table = mgr.block_table("a")[1]
        seq.num_computed_tokens = 15 + accepted
        seq.append_token_ids(tokens(2000, accepted + 1))
        mgr.free(seq)
        assert (mgr.pool.block_hash[table[0]] is not None) == cached
        assert table[1] != NULL_BLOCK and mgr.pool.block_hash[table[1]] is None
        mgr.check_invariants()


def test_drafts_never_released_are_settled_by_the_next_step() -> None:
    # A caller that keeps the draft slots (no release_lookahead): the next step first frees the
    # state's entries past the verified tokens, so it stays within the admission bound.
    mgr = manager(32, full(16), mamba(16), max_model_len=256, batch=64)
    seq = Sequence("a", tokens(0, 60))
    assert mgr.allocate(seq, 20) is not None
    seq.num_computed_tokens = 20
    assert mgr.allocate(seq, 1, num_lookahead_tokens=15) is not None  # the state's entries 1 and 2
    assert len(mgr.block_table("a")[1]) == 3
    seq.num_computed_tokens = 21  # no draft accepted, nothing released
    assert mgr.allocate(seq, 39) is not None
    mgr.check_invariants()
    assert mgr.block_table("a")[1][2] != NULL_BLOCK and mgr.num_held_blocks("a") - 4 <= mgr.groups[1].bound


def test_drafts_never_released_are_settled_without_prefix_caching() -> None:
    mgr = manager(32, full(16), mamba(16), max_model_len=256, batch=64, enable_prefix_caching=False)
    seq = Sequence("a", tokens(0, 60))
    assert mgr.allocate(seq, 20) is not None
    seq.num_computed_tokens = 20
    assert mgr.allocate(seq, 1, num_lookahead_tokens=15) is not None
    seq.num_computed_tokens = 21
    assert mgr.allocate(seq, 1) is not None  # entry 2 (the drafts' only) is freed first
    assert len(mgr.block_table("a")[1]) == 2
    mgr.check_invariants()

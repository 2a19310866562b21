"""The engine's second built-in model, ``hybrid-tiny`` (attention and Mamba-2 layers, seeded weights):
its recurrent states are computed for real, checkpointed into the pool's pages, restored from
prefix hits, chunk boundaries, preemption and external tiers, and greedy outputs (tokens and
their log-probabilities) stay bitwise those of an uncached one-chunk run.

A negative control restores a state one block off and sees the output change: the states are read.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hybridkv.connectors import FaultyTier, HostTier, KVConnector  # noqa: E402
from hybridkv.core import StateStep  # noqa: E402
from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.engine.hybrid import ByteTokenizer, HybridWeights  # noqa: E402
from hybridkv.engine.sampling import SamplingParams  # noqa: E402

Output = list[tuple[int, float]]
"""Greedy tokens, each with its log-probability."""

TOK = ByteTokenizer()
PAGE = 2 * 16 * 1 * 32 * 2
"""Bytes of one block: a bfloat16 K and V page of one layer (one KV head of 32); a state spans 5."""
SHARED = ("The harbour committee met on Thursday to review the budget for dredging, lighting and the new "
          "ferry pier; members asked about the yearly maintenance costs of it all.")
TAILS = (" Question: what was reviewed?", " Summary of the meeting:", " The treasurer said that")
FILLERS = tuple(f"Filler {i}: " + " ".join(f"item{i}-{j}" for j in range(24)) for i in range(2))


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: the toy's many small ops spin badly on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def weights() -> HybridWeights:
    return HybridWeights.generate()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """Three prompts sharing 166 tokens (not a block multiple), one sharing exactly 160 with them."""
    shared = TOK.encode(SHARED)
    assert len(shared) == 166, len(shared)
    out = [shared + TOK.encode(t, add_bos=False) for t in TAILS]
    return [*out, shared[:160] + TOK.encode("!! and then something else entirely.", add_bos=False)]


@pytest.fixture(scope="module")
def fillers() -> list[list[int]]:
    return [TOK.encode(f) for f in FILLERS]


def engine(weights: HybridWeights, **kw: Any) -> LLMEngine:
    return LLMEngine(weights, TOK, EngineConfig(**{"model": "hybrid-tiny", "max_model_len": 256,
                                                   "kv_cache_memory": 8 << 20, **kw}))


def small_engine(weights: HybridWeights, **kw: Any) -> LLMEngine:
    """120 usable blocks: one ~200-token request holds ~80 at its peak, so two fillers evict a prefix."""
    return engine(weights, kv_cache_memory=121 * PAGE, max_num_batched_tokens=64, **kw)


def generate(eng: LLMEngine, prompts: list[list[int]], max_tokens: int = 8) -> list[Output]:
    """Greedy outputs of ``prompts`` run together."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outs = eng.generate(prompts, params)
    eng.manager.check_invariants()
    return [[(lp.token_id, lp.logprob) for lp in o.logprobs or []] for o in outs]


def run(eng: LLMEngine, prompt: list[int]) -> tuple[Output, int, int]:
    """One request alone: its output, prefix-cache hit tokens and tier-loaded tokens."""
    (o,) = eng.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0))
    eng.manager.check_invariants()
    return [(lp.token_id, lp.logprob) for lp in o.logprobs or []], o.num_cached_tokens, o.num_external_tokens


@pytest.fixture(scope="module")
def reference(weights: HybridWeights, prompts: list[list[int]], fillers: list[list[int]]) -> list[Output]:
    """Each prompt uncached, in one chunk, alone (the fillers too, last)."""
    eng = engine(weights, enable_prefix_caching=False, max_num_batched_tokens=256)
    return [generate(eng, [p])[0] for p in [*prompts, *fillers]]


def test_the_model_is_not_degenerate(reference: list[Output]) -> None:
    tokens = [[t for t, _ in out] for out in reference]
    assert len({tuple(t) for t in tokens}) == len(tokens)  # the output depends on the prompt
    assert all(len(set(t)) > 2 for t in tokens), tokens  # and is not one token repeated


@pytest.mark.parametrize("threads", [1, 3])
def test_logits_are_bitwise_the_same_however_the_prompt_is_split(weights: HybridWeights, prompts: list[list[int]],
                                                                 threads: int) -> None:
    """Every position's logits of a 389-token prompt, computed in one chunk, in chunks of 16, 24, 37
    and 200, and beside another request's decodes: bitwise equal (the recurrence and every matmul
    are row-invariant; elementwise calls stay on one thread, so 3 threads change nothing either)."""
    prompt = prompts[0] + prompts[1][1:]
    torch.set_num_threads(threads)

    def logits(chunk: int, other: list[int] | None = None) -> torch.Tensor:
        eng = engine(weights, enable_prefix_caching=False, max_num_batched_tokens=chunk, max_model_len=512)
        rows: dict[int, torch.Tensor] = {}

        def sink(position: int, block: torch.Tensor) -> None:
            for i, row in enumerate(block):
                rows[position + i] = row.clone()

        if other is not None:
            eng.add_request("other", other, SamplingParams(max_tokens=20, ignore_eos=True))
            eng.step()
        eng.add_request("scored", prompt, SamplingParams(max_tokens=1), logits_sink=sink)
        while eng.has_unfinished:
            eng.step()
        return torch.stack([rows[p] for p in range(len(prompt))])

    try:
        whole = logits(512)
        assert torch.isfinite(whole).all()
        for chunk in (16, 24, 37, 200):
            assert torch.equal(logits(chunk), whole), chunk
        assert torch.equal(logits(40, other=prompts[1][:50]), whole)
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("chunk", [256, 32, 24])
def test_prefix_caching_restores_states_exactly(weights: HybridWeights, prompts: list[list[int]],
                                                reference: list[Output], chunk: int) -> None:
    """Prefixes hit at the states the manager checkpointed: the prompt's end re-sent, a shared prefix
    (166 tokens, a checkpoint at its last block boundary, the junction) and one of exactly 160.
    Chunks of 32 end on block boundaries; chunks of 24 do only every other time, so checkpoints
    fall inside chunks; one chunk writes every checkpoint mid-chunk."""
    eng = engine(weights, max_num_batched_tokens=chunk)
    order = [0, 1, 2, 0, 3, 1]
    hits = []
    for i in order:
        out, cached, _ = run(eng, prompts[i])
        assert out == reference[i], (chunk, i)
        hits.append(cached)
    assert hits[0] == 0
    assert hits[2] >= 160 and hits[4] >= 160  # the 166-token junction (160) and the exact 160-token prefix
    assert hits[3] == len(prompts[0]) // 16 * 16  # the re-sent prompt resumes at its last boundary
    assert hits[5] >= 160


def test_a_checkpoint_hint_lets_the_second_request_resume_exactly(weights: HybridWeights, prompts: list[list[int]],
                                                                   reference: list[Output]) -> None:
    """The first request marks the shared 166-token prefix's end (a system prompt's end): its state is
    checkpointed at 160 in its one-chunk prefill, so the second request already resumes there (without
    the hint it computes everything: the junction is only learnt from it) with identical outputs."""
    for hint, second_hit in ((166, 160), (None, 0)):
        eng = engine(weights, max_num_batched_tokens=256)
        params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)
        eng.add_request("a", prompts[0], params, checkpoint_hints=() if hint is None else (hint,))
        while eng.has_unfinished:
            eng.step()
        out, cached, _ = run(eng, prompts[1])
        assert (out, cached) == (reference[1], second_hit), hint


def test_float32_pages_hold_a_state_in_three_parts(weights: HybridWeights, prompts: list[list[int]]) -> None:
    """With float32 KV a page is 4 KiB: a state is 3 parts of 3,243 bytes (not whole floats), and
    restoring them is as exact as with bfloat16's 5 parts."""
    alone = engine(weights, dtype="float32", enable_prefix_caching=False, max_num_batched_tokens=256)
    expected = [generate(alone, [p])[0] for p in prompts]
    eng = engine(weights, dtype="float32", max_num_batched_tokens=24)
    assert [len(s.groups) for s in eng.layout.recurrent_states] == [3, 3, 3]
    assert {s.part_bytes for s in eng.layout.recurrent_states} == {3243}
    hits = []
    for i in (0, 1, 2, 0, 3):
        out, cached, _ = run(eng, prompts[i])
        assert out == expected[i], i
        hits.append(cached)
    assert min(hits[2:]) >= 160, hits


def test_batched_requests_with_shared_prefixes(weights: HybridWeights, prompts: list[list[int]],
                                               reference: list[Output]) -> None:
    eng = engine(weights, max_num_batched_tokens=48)
    assert generate(eng, prompts[:1]) == reference[:1]
    assert generate(eng, prompts) == reference[:4]


def test_requests_preempted_by_a_full_pool_resume_with_identical_outputs(
        weights: HybridWeights, prompts: list[list[int]], fillers: list[list[int]]) -> None:
    """Ten requests decoding 60 tokens each outgrow a 120-block pool: the newest are preempted and
    recomputed, resuming from the states their prefixes left in the cache."""
    every = [*prompts, *fillers]
    every = [p[:150] if i % 2 else p[:120] for i, p in enumerate(every + [p[::-1] for p in every])]
    alone = engine(weights, enable_prefix_caching=False, max_num_batched_tokens=256)
    expected = [generate(alone, [p], max_tokens=60)[0] for p in every]
    eng = engine(weights, kv_cache_memory=120 * PAGE, max_num_batched_tokens=128)
    assert generate(eng, every, max_tokens=60) == expected
    assert eng.metrics.preemptions > 0


@pytest.mark.parametrize("caching", [True, False])
def test_a_request_preempted_mid_prompt_and_mid_decode_resumes_exactly(
        weights: HybridWeights, prompts: list[list[int]], reference: list[Output], caching: bool) -> None:
    """Preempted inside its prompt (chunk 5 of 7), then while decoding: it resumes from its cached
    states (caching on) or recomputes from the start (off), and its output is the reference."""
    eng = engine(weights, max_num_batched_tokens=32, enable_prefix_caching=caching)
    eng.add_request("r", prompts[2], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0))
    done: list[Any] = []
    steps = 0
    while eng.has_unfinished:
        done += [o for o in eng.step() if o.finished]
        steps += 1
        if steps in (5, 9):
            assert eng.preempt("r")
    assert [(lp.token_id, lp.logprob) for lp in done[0].logprobs] == reference[2]
    assert eng.metrics.preemptions == 2
    eng.manager.check_invariants()


def run_evicting(eng: LLMEngine, prompts: list[list[int]], fillers: list[list[int]]) -> list[tuple[Output, int, int]]:
    """Prompt 0, the fillers (its prefix leaves the device pool), then prompts 1 and 2."""
    run(eng, prompts[0])
    for f in fillers:
        run(eng, f)
    return [run(eng, p) for p in prompts[1:3]]


def test_states_and_blocks_load_from_host_and_disk_tiers(weights: HybridWeights, prompts: list[list[int]],
                                                         fillers: list[list[int]], reference: list[Output],
                                                         tmp_path: Path) -> None:
    plain = run_evicting(small_engine(weights), prompts, fillers)
    assert [o for o, _, _ in plain] == reference[1:3]
    assert plain[0][1] < 160  # the fillers evicted the prefix from the device pool
    for tiers in (("host:64MiB",), (f"disk:{tmp_path / 'kv'}:64MiB",)):
        eng = small_engine(weights, kv_tiers=tiers)
        later = run_evicting(eng, prompts, fillers)
        assert [o for o, _, _ in later] == reference[1:3], tiers
        # The first request left states at its step ends (64, 128): the others resume at 128 from the tier.
        assert all(external >= 128 for _, _, external in later), (tiers, [o[1:] for o in later])
        assert eng.connector is not None and sum(eng.connector.stats.faults.values()) == 0
        loaded = eng.connector.stats.loaded_blocks_per_group
        states = {g for s in eng.layout.recurrent_states for g in s.groups}
        assert states <= set(loaded), loaded  # every part of the states came from the tier
    # A new engine on the same directory resumes from the disk tier at once.
    out, cached, external = run(small_engine(weights, kv_tiers=(f"disk:{tmp_path / 'kv'}:64MiB",)), prompts[2])
    assert out == reference[2] and cached == 0 and external >= 128


class StateLosingTier(HostTier):
    """A host tier that has lost (or corrupted) every block of the given groups: attention blocks
    load, their states do not."""

    def __init__(self, connector_prefixes: list[bytes], corrupt: bool) -> None:
        super().__init__(64 << 20)
        self.prefixes = tuple(connector_prefixes)
        self.corrupt = corrupt

    def get_many(self, keys: Any) -> list[bytes | None]:
        values = super().get_many(keys)
        out: list[bytes | None] = []
        for key, value in zip(keys, values):
            if value is not None and key.startswith(self.prefixes):
                value = value[:-1] + bytes([value[-1] ^ 1]) if self.corrupt else None
            out.append(value)
        return out


@pytest.mark.parametrize("kind", ["faulty", "states lost", "states corrupt"])
def test_a_tier_fault_is_a_miss(weights: HybridWeights, prompts: list[list[int]], fillers: list[list[int]],
                                reference: list[Output], kind: str) -> None:
    """Faults of every kind, or a tier holding the attention blocks but not the states: the load
    is cut or dropped, the rest recomputed, the output identical."""
    eng = small_engine(weights)
    if kind == "faulty":
        tier: HostTier | FaultyTier = FaultyTier(HostTier(64 << 20), rate=0.3, seed=5,
                                                 kinds=("error", "timeout", "short", "corrupt", "lose"))
    else:
        probe = KVConnector([HostTier(1 << 20)], eng.manager, namespace="test")
        states = sorted({g for s in eng.layout.recurrent_states for g in s.groups})
        tier = StateLosingTier([probe.key(g, b"")for g in states], corrupt=kind == "states corrupt")
    eng.connector = eng.scheduler.connector = KVConnector([tier], eng.manager, namespace="test")
    later = run_evicting(eng, prompts, fillers)
    assert [o for o, _, _ in later] == reference[1:3]
    if kind == "faulty":
        assert sum(eng.connector.stats.faults.values()) > 0
    else:
        assert all(external == 0 for _, _, external in later)  # no state: nothing of the prefix to resume


class OneBlockOff:
    """``KVCacheManager.state_steps`` that records where the states of the first request's steps are
    written (``recording``), then, if ``patched``, gives a step starting on a block boundary the
    state of one block earlier to read."""

    def __init__(self, eng: LLMEngine, patched: bool) -> None:
        self.real = eng.manager.state_steps
        self.patched = patched
        self.recording = True
        self.pages_at: dict[int, list[tuple[int, ...]]] = {}
        """Per position, the pages of each recurrent state after it (of the recorded request)."""

    def __call__(self, seq_id: str, num_computed: int, num_tokens: int) -> tuple[StateStep, ...]:
        steps = self.real(seq_id, num_computed, num_tokens)
        if self.recording:
            for s, step in enumerate(steps):
                for p, pages in step.writes:
                    self.pages_at.setdefault(p, [()] * len(steps))[s] = pages
        elif self.patched and num_computed % 16 == 0 and num_computed - 16 in self.pages_at:
            earlier = self.pages_at[num_computed - 16]
            return tuple(StateStep(earlier[s], step.writes) for s, step in enumerate(steps))
        return steps


def test_a_state_restored_one_block_off_changes_the_output(weights: HybridWeights, prompts: list[list[int]],
                                                           reference: list[Output]) -> None:
    """The negative control: the second request resumes from the state after 144 tokens instead of
    160 (its attention blocks are right): the output changes. Unpatched, it is the reference."""
    for patched in (False, True):
        eng = engine(weights, max_num_batched_tokens=16)  # the first request leaves a state every block
        wrapper = OneBlockOff(eng, patched)
        eng.manager.state_steps = wrapper  # type: ignore[method-assign]
        run(eng, prompts[0])
        wrapper.recording = False
        out, cached, _ = run(eng, prompts[1])
        assert cached == 160
        if patched:
            assert [t for t, _ in out] != [t for t, _ in reference[1]]
        else:
            assert out == reference[1]


# ---------------------------------------------------------------------- Redis

def test_two_engines_share_states_through_redis(weights: HybridWeights, prompts: list[list[int]],
                                                reference: list[Output], redis_tier_url: str) -> None:
    """A shared tier keeps the states where a hit can end on another instance (the prompt's end,
    with the window's blocks before it): the second engine resumes the re-sent prompt there."""
    first = small_engine(weights, kv_tiers=(redis_tier_url,))
    assert run(first, prompts[0])[0] == reference[0]
    second = small_engine(weights, kv_tiers=(redis_tier_url,))
    out, cached, external = run(second, prompts[0])
    assert out == reference[0] and cached == 0 and external == len(prompts[0]) // 16 * 16


# ---------------------------------------------------------------------- selecting the model
def test_generate_and_serve_take_the_model_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    from hybridkv.cli import main

    assert main(["generate", "--model", "no-such-model", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown model 'no-such-model'" in err and "hybrid-tiny" in err
    assert main(["serve", "--port", "0", "--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err
    assert main(["generate", "--model", "hybrid-tiny", "--max-tokens", "4", "--ignore-eos", "Hello"]) == 0
    err = capsys.readouterr().err
    assert "[loaded hybrid-tiny" in err and "4 generated" in err


def test_the_server_serves_the_hybrid_model(weights: HybridWeights) -> None:
    """The OpenAI-compatible app on the hybrid engine: a greedy completion, twice (the second on a
    cached prefix), the same."""
    from fastapi.testclient import TestClient

    from hybridkv.server.app import build_app
    from hybridkv.server.async_engine import AsyncEngine

    async_engine = AsyncEngine(engine(weights), "hybrid-tiny")
    body = {"model": "hybrid-tiny", "prompt": SHARED, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    with TestClient(build_app(async_engine, "hybrid-tiny")) as client:
        first, again = (client.post("/v1/completions", json=body).json() for _ in range(2))
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    assert len(first["choices"][0]["token_ids"]) == 5

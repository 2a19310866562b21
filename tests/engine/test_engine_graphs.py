"""Decode steps as graphs (``hybridkv.engine.graphs``): the padded inputs a CUDA graph replays give
every request the tokens, and the log-probabilities, the eager path gives.

Here the graph path runs with ``capture=False`` (the same packed, padded inputs, the masks and key
slots computed from them, run eagerly): what a graph replays, minus the capture, which needs a GPU
(``tests/engine/test_engine_cuda.py`` runs it there). A small Gemma 3 with random weights keeps it fast and
needs no model package.
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hybridkv.engine.config import EngineConfig  # noqa: E402
from hybridkv.engine.engine import LLMEngine  # noqa: E402
from hybridkv.engine.graphs import DecodeGraphs, buckets  # noqa: E402
from hybridkv.engine.hybrid import ByteTokenizer  # noqa: E402
from hybridkv.engine.sampling import SamplingParams  # noqa: E402
from hybridkv.engine.weights import GEMMA3_270M, Gemma3Config, Gemma3Weights  # noqa: E402

SMALL = Gemma3Config(num_layers=6, hidden_size=64, intermediate_size=128, num_heads=4, num_kv_heads=1, head_dim=32,
                     vocab_size=512, max_position_embeddings=4096, rms_norm_eps=1e-6, sliding_window=48,
                     rope_theta_global=1e6)
"""Gemma 3's layout (five sliding-window layers, then a global one) at toy size; a window shorter
than a key tile so windows start mid-tile, and prompts longer than several tiles."""


@pytest.fixture(scope="module")
def tiny() -> Gemma3Weights:
    return Gemma3Weights.generate(SMALL, torch.float32, seed=3)


def engine(tiny: Gemma3Weights, graphs: bool, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"dtype": "float32", "weights": "dense", "max_model_len": 1024, "block_size": 16,
                          "kv_cache_memory": 4 << 20, "max_num_seqs": 8, **kw})
    eng = LLMEngine(tiny, ByteTokenizer(), cfg)
    if graphs:
        eng.graphs = DecodeGraphs(eng.model, eng.block_size, eng.group_windows, cfg.max_num_seqs, cfg.max_model_len,
                                  eng.device, capture=False)
    return eng


def outputs(eng: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[tuple[list[int], list[float]]]:
    done = eng.generate(prompts, params)
    return [(o.token_ids, [lp.logprob for lp in o.logprobs or []]) for o in done]


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [[256] + torch.randint(0, 256, (n - 1,), generator=gen).tolist() for n in lengths]


GREEDY = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=0)


@pytest.mark.parametrize("lengths", [[5], [3, 130, 47], [17, 200, 64, 1, 300]])
def test_padded_decode_steps_give_the_eager_tokens_and_logprobs(tiny: Gemma3Weights, lengths: list[int]) -> None:
    # Batches of 1, 3 and 5 (padded to 1, 4 and 8 rows), contexts crossing key tiles (128) and the
    # window (48) while they decode.
    batch = prompts(lengths, seed=len(lengths))
    eager = outputs(engine(tiny, graphs=False), batch, GREEDY)
    graphed_engine = engine(tiny, graphs=True)
    graphed = outputs(graphed_engine, batch, GREEDY)
    assert graphed_engine.graphs is not None and graphed_engine.graphs.replays >= 39  # every decode step
    widths = graphed_engine.graphs.width_buckets
    longest = [max(lengths) + k for k in range(1, 40)]  # the context of each decode step
    assert {w for _, w in graphed_engine.graphs.graphs} == {next(w for w in widths if w >= n) for n in longest}
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(graphed, eager):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-4)


def test_prefix_hits_and_mixed_steps_keep_the_graph_path_exact(tiny: Gemma3Weights) -> None:
    # A shared prefix served from the cache, and requests arriving while another decodes: steps that
    # mix a prefill chunk with decodes run eagerly, the decode-only ones replay; tokens unchanged.
    shared = prompts([150], seed=9)[0]
    batch = [shared + p for p in prompts([20, 33, 70], seed=10)]
    runs = []
    for graphs in (False, True):
        eng = engine(tiny, graphs=graphs)
        first = eng.generate(batch[:1], GREEDY)
        eng.add_request("late", batch[1], GREEDY)
        for _ in range(5):
            eng.step()
        rest = eng.generate(batch[2:], GREEDY)  # "late" decodes beside them, then alone
        late = eng.step() if eng.has_unfinished else []
        while eng.has_unfinished:
            late += eng.step()
        assert rest[0].num_cached_tokens >= 144  # the shared prefix was a hit
        runs.append([o.token_ids for o in first + rest])
        assert graphs is False or (eng.graphs is not None and eng.graphs.replays > 40)
    assert runs[1] == runs[0]


def test_steps_the_graphs_do_not_take_run_eagerly(tiny: Gemma3Weights) -> None:
    eng = engine(tiny, graphs=True, max_num_seqs=2)
    assert eng.graphs is not None
    eng.graphs.row_buckets = [1]  # a step of two decodes no longer fits a bucket
    scored = SamplingParams(max_tokens=3, prompt_logprobs=1)  # every prompt row: eager
    done = eng.generate(prompts([30, 40], seed=4), [GREEDY, scored])
    assert len(done[0].token_ids) == 40 and done[1].prompt_logprobs is not None
    assert eng.graphs.replays >= 37  # the decodes of the first once the second finished


def test_buckets() -> None:
    assert buckets(1) == [1]
    assert buckets(32) == [1, 2, 4, 8, 16, 32]
    assert buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert buckets(8192, 128) == [128, 256, 512, 1024, 2048, 4096, 8192]


def test_the_random_model_has_gemma_3_270m_shapes() -> None:
    small = Gemma3Weights.generate(SMALL, torch.bfloat16, seed=1)
    assert small.layers[0].qkv.weight.shape == ((4 + 2) * 32, 64) and small.layers[0].qkv.weight.dtype == torch.bfloat16
    assert GEMMA3_270M.num_layers == 18 and GEMMA3_270M.vocab_size == 262_144
    again = Gemma3Weights.generate(SMALL, torch.bfloat16, seed=1)
    assert torch.equal(again.embed.weight, small.embed.weight)  # a seed gives the same weights


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_decode_attention_computes_what_tiled_attention_does(kv_heads: int) -> None:
    # The GPU's few-kernel attention for one query per row against the CPU's tiled one, on windows
    # that start mid-tile and rows of different lengths (masked keys, some in a tile of their own).
    from hybridkv.engine.model import AttentionPart, decode_attention, tiled_attention

    gen = torch.Generator().manual_seed(kv_heads)
    rows, heads, dim, length = 5, 4, 32, 384
    q = torch.randn(rows, 1, heads, dim, generator=gen)
    k, v = (torch.randn(rows, length, kv_heads, dim, generator=gen) for _ in range(2))
    positions = torch.tensor([0, 40, 127, 128, 383])
    keys = torch.arange(length)
    mask = (keys[None, None, :] <= positions[:, None, None]) & (keys[None, None, :] > positions[:, None, None] - 100)
    part = AttentionPart(query_rows=torch.arange(rows)[:, None], mask=mask)
    assert torch.equal(part.bias == 0, mask) and bool(torch.isinf(part.bias[~mask]).all())
    got = decode_attention(q, k, v, part.bias, 0.125)
    assert torch.allclose(got, tiled_attention(q, k, v, mask, 0.125), atol=1e-5)

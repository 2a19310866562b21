"""The engine on a CUDA GPU (skipped where torch sees none): `--device cuda` starts, and greedy
outputs equal the CPU's on the exact float32 path, with prefix caching off and on, batched.

Run on a machine with a GPU: ``.venv/bin/pytest tests/test_engine_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import LLMEngine
from hybridkv.engine.sampling import SamplingParams

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"), pytest.mark.model]

SHARED = "The history of the printing press begins in the fifteenth century, when " * 6
PROMPTS = [SHARED + "a goldsmith in Mainz", SHARED + "paper mills in Italy", "Water boils at"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def _outputs(device: str, caching: bool) -> list[list[int]]:
    engine = LLMEngine.from_package(EngineConfig(device=device, dtype="float32", weights="dense",
                                                 enable_prefix_caching=caching, kv_cache_memory=64 << 20))
    try:
        first = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
        again = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]  # warm cache when caching
        assert again == first
        return first
    finally:
        engine.close()


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_the_engine_starts_on_cuda_as_named_and_decodes_like_the_cpu(device: str) -> None:
    assert _outputs(device, caching=True) == _outputs("cpu", caching=True)


def test_caching_does_not_change_greedy_output_on_cuda() -> None:
    assert _outputs("cuda", caching=False) == _outputs("cuda", caching=True)

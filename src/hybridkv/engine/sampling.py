"""Sampling parameters and the sampler: penalties, logit bias, greedy, temperature, top-k, top-p,
per-request seeds, and the log-probabilities a request asks for.

Every value is checked when ``SamplingParams`` is built, so nothing a request carries can make
the sampler fail later (``SamplingParamError.param`` names the offending field).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.engine import cpu_kernels
from hybridkv.errors import InvalidInputError

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily (as vLLM does): dividing by them overflows the logits."""
MAX_LOGPROBS = 20
"""Most top log-probabilities per position a request may ask for."""
MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
"""Characters in one stop string (the stream holds back that many characters minus one)."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""Seeds torch's generator accepts."""
MAX_LOGIT_BIAS = 100.0


class SamplingParamError(InvalidInputError):
    """A bad sampling parameter; ``param`` is the field's name."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates. ``temperature`` below ``GREEDY_TEMPERATURE`` is greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    """0 (or -1): no top-k cut."""
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings: generation ends before the first occurrence; the text excludes it."""
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    """Subtracted once from the logit of every token already generated (OpenAI semantics, -2..2)."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per time it was generated (-2..2)."""
    repetition_penalty: float = 1.0
    """Divides positive and multiplies negative logits of tokens in the prompt or output (> 0)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias in -100..100) pairs added to the logits before sampling; a mapping is accepted."""
    logprobs: int | None = None
    """Log-probabilities of each generated token plus this many top alternatives (0..20); None: none."""
    prompt_logprobs: int | None = None
    """The same for every prompt token after the first."""

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> SamplingParamError:
            return SamplingParamError(f"{name} must be {rule}, got {getattr(self, name)!r}", name)

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "a positive integer")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "an integer >= -1 (0 and -1: no cut)")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise bad("seed", f"None or an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (tuple, list)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "a string or a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamError(f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
                                     "stop")
        if any(len(s) > MAX_STOP_LENGTH for s in self.stop):
            longest = max(len(s) for s in self.stop)
            raise SamplingParamError(f"a stop string has {longest} characters; at most {MAX_STOP_LENGTH} are "
                                     f"allowed", "stop")
        object.__setattr__(self, "stop", tuple(self.stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or any(not _is_int(t) or t < 0 for t in ids):
            raise bad("stop_token_ids", "a list of non-negative integers")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        if not isinstance(self.ignore_eos, bool):
            raise bad("ignore_eos", "a boolean")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, "a number in [-2, 2]")
        if not _is_number(self.repetition_penalty) or not 0 < self.repetition_penalty <= 100:
            raise bad("repetition_penalty", "a number in (0, 100]")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise bad(name, f"None or an integer in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


def _bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    items = bias.items() if isinstance(bias, Mapping) else bias
    if not isinstance(items, (tuple, list)) and not isinstance(bias, Mapping):
        raise SamplingParamError(f"logit_bias must map token ids to numbers, got {bias!r}", "logit_bias")
    pairs = []
    for item in items:
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            raise SamplingParamError(f"logit_bias must map token ids to numbers, got {bias!r}", "logit_bias")
        token, value = item
        if not _is_int(token) or token < 0:
            raise SamplingParamError(f"logit_bias keys must be token ids (integers >= 0), got {token!r}",
                                     "logit_bias")
        if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise SamplingParamError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token "
                                     f"{token}", "logit_bias")
        pairs.append((token, float(value)))
    return tuple(pairs)


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probability (of the model's raw distribution) and its top alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """(token id, log-probability) pairs, most likely first."""


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: list[int],
                    output_ids: list[int]) -> torch.Tensor:
    """``logits [vocab]`` after the logit bias and the repetition, frequency and presence penalties."""
    if not params.has_penalties:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    if params.logit_bias:
        ids = torch.tensor([t for t, _ in params.logit_bias], dtype=torch.long)
        logits.index_add_(0, ids, torch.tensor([b for _, b in params.logit_bias], dtype=logits.dtype))
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long)
        values = logits[seen]
        p = params.repetition_penalty
        logits[seen] = torch.where(values > 0, values / p, values * p)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = torch.bincount(torch.tensor(output_ids, dtype=torch.long), minlength=vocab)[:vocab]
        counts = counts.to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token from float32 ``logits [vocab]`` (penalties already applied)."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = distribution(logits, params)
    if probs is None:
        return int(torch.argmax(logits))  # a degenerate distribution (NaN logits): fall back to greedy
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """The probabilities ``sample`` draws from (temperature, top-k, top-p applied to ``logits``,
    penalties already applied); None for a degenerate one (NaN logits). Not for greedy params."""
    scaled = logits / params.temperature
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, descending=True)
        probs_sorted = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p (the first always stays).
        drop = (probs_sorted.cumsum(-1) - probs_sorted) >= params.top_p
        scaled = scaled.index_put((order[drop],), torch.tensor(float("-inf")))
    probs = torch.softmax(scaled, dim=-1)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        return None
    return probs


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """For each row of float32 ``logits [n, vocab]``, the log-probability of ``token_ids[row]`` and the top ``k``.

    A log-probability is the logit minus the row's log-sum-exp: no ``[n, vocab]`` log-softmax is
    materialized, and the top ``k`` are taken on the logits (the same order)."""
    lse = cpu_kernels.logsumexp(logits)
    if lse is None:
        lse = torch.logsumexp(logits, dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)[:, None]
    chosen = (logits.gather(1, ids)[:, 0] - lse).tolist()
    if k:
        values, indices = logits.topk(k, dim=-1)
        values -= lse[:, None]
        tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        tops = [()] * len(token_ids)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids, chosen, tops)]

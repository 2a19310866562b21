"""Speculative decoding: n-gram (prompt-lookup) drafts and their verification.

Drafts are accepted left to right while each is what the target model chooses there (greedy: the
argmax; sampling: with probability ``p(d)``, else resampled without ``d``). The manager never
registers a draft. See docs/ENGINE.md, "Speculative decoding (``--speculative ngram``)".
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

MAX_SPECULATIVE_TOKENS = 8
"""Most draft tokens per step the engine proposes (``--num-speculative-tokens``)."""
SPECULATIVE_METHODS = ("ngram",)


class NgramProposer:
    """Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of the sequence's
    last ``n`` tokens (``n`` from ``max_n`` down to ``min_n``), at most ``k`` of them.

    ``min_n`` is 3: shorter recurring runs predict the next tokens too rarely to pay for their
    verification (``bench/spec_decode.py``, free continuation: ``min_n=1`` drafted on nearly every
    step, 9% accepted, 0.75x the decode speed; ``min_n=2`` with the backoff 0.93x; ``min_n=3``
    0.96x; a copied document is drafted as well by all three). The engine also backs off a request
    whose drafts were all rejected (``Backoff``)."""

    def __init__(self, k: int, min_n: int = 3, max_n: int = 4) -> None:
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def propose(self, tokens: Seq[int]) -> list[int]:
        """Up to ``k`` draft tokens to follow ``tokens`` (empty when no n-gram recurs)."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            pattern = list(tokens[length - n:])
            last = pattern[-1]
            for j in range(length - 2, n - 2, -1):  # where an earlier occurrence ends, latest first
                if tokens[j] == last and list(tokens[j - n + 1:j + 1]) == pattern:
                    return list(tokens[j + 1:j + 1 + self.k])
        return []


class Backoff:
    """When to propose drafts for one request: after a step whose drafts were all rejected it skips
    1, then 2, 4, ... up to ``MAX_SKIP`` decode steps; any accepted draft resets it. Drafts that keep
    failing (text with nothing to look up) then cost almost nothing."""

    MAX_SKIP = 16

    __slots__ = ("misses", "skip")

    def __init__(self) -> None:
        self.misses = 0
        self.skip = 0

    def ready(self) -> bool:
        """Whether to propose for this step (counts a skipped step)."""
        if self.skip:
            self.skip -= 1
            return False
        return True

    def verified(self, accepted: int) -> None:
        if accepted:
            self.misses = 0
        else:
            self.misses += 1
            self.skip = min(1 << (self.misses - 1), self.MAX_SKIP)


def accept_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
    """The tokens a greedy step emits: drafts while they equal the row's argmax, then the argmax of
    the first row that differs (or of the row after the last draft)."""
    out: list[int] = []
    for d, best in zip(drafts, argmax):
        if d != best:
            break
        out.append(d)
    out.append(argmax[len(out)])
    return out


def accept_or_resample(probs: torch.Tensor, draft: int, generator: torch.Generator) -> tuple[bool, int]:
    """Speculative sampling for a draft proposed with certainty: ``(True, draft)`` with probability
    ``probs[draft]``, else ``(False, t)`` with ``t`` drawn from ``probs`` without ``draft``."""
    p = probs.double().cpu()
    if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(p[draft]):
        return True, draft
    rest = p.clone()
    rest[draft] = 0.0
    if float(rest.sum()) <= 0:  # the draft had all the mass (and lost to rounding): it stands
        return True, draft
    return False, int(torch.multinomial(rest / rest.sum(), 1, generator=generator))

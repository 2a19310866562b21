"""Which backend serves a request: predicted cache hits against load (pure; no I/O).

A policy ranks the healthy backends (all of them when none is healthy) and the router tries them
in that order, the next one only when a backend dies before answering:

* ``hybrid_exact`` (default) and ``prefix``: the least estimated work, in prompt tokens::

      cost(b) = (prompt_tokens - credited_hit(b)) + prompt_tokens * (load_weight * load(b) + kv_weight * kv_usage(b))

  where the hit comes from the index (``hybrid_exact``: the hybrid rule; ``prefix``: the
  full-attention chain alone, what deployed prefix-aware routers use), each medium's tokens credited
  at its ``medium_weights`` (below), or, where more, the prefix the requests the router has in
  flight at ``b`` will leave there (``inflight``: a document's second request follows its first
  before any KV event names it, instead of placing a second copy), ``load`` is
  the larger of the requests this router has in flight there and the running + waiting requests
  the backend last reported, ``kv_usage`` its KV-cache usage (0..1). The weights are fractions of
  the request's own prompt, so the balance does not depend on prompt lengths: with the default
  ``load_weight`` 0.25 a backend holding the whole prompt wins until it has four more requests
  queued than one holding nothing (a request ahead costs about a quarter of a prompt's prefill).
  ``kv_weight`` is 0 by default: the queue already counts the requests that hold a backend's KV
  (measured on ``bench/cluster_serve.py``, a KV term steered prefixes off the replica that held
  them); set it to steer away from backends whose cache is nearly full of long sequences;
* ``least_loaded``: the same cost without the hit term;
* ``round_robin``: in turn.

A hit in an external tier saves the prefill of its tokens but costs their load, so the index's
prediction per medium (``Prediction.by_medium``) is credited at a weight per medium: 1 for the
device (``GPU``), ``MEDIUM_WEIGHTS`` by default for host memory (``CPU``: 0.8) and a disk
(``STORAGE``: 0.5), ``OTHER_MEDIUM_WEIGHT`` (0.5) for any other (a shared tier). A weight is
``1 - load time / prefill time`` per token: a Llama-3-8B-class model on an H100 prefills a token in
about 30 us and loads its 128 KiB of KV from host memory (PCIe 5, 25 GB/s) in 5 us (0.8), from a
5 GB/s NVMe drive in 26 us (about 0.1); a 70B model over eight GPUs loads 40 KiB per GPU (host 0.95,
disk 0.75). So a device hit beats an equal host hit, and a host hit beats a device hit less than 0.8
as long. Set them for the deployment (``--medium-weight MEDIUM=FRACTION``).

Ties go to the backend with fewer requests in flight, then rotate from one request to the next.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridkv.cluster.events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE
from hybridkv.cluster.replica import Prediction
from hybridkv.cluster.scrape import BackendLoad
from hybridkv.errors import InvalidInputError

POLICIES = ("hybrid_exact", "prefix", "least_loaded", "round_robin")
MEDIUM_WEIGHTS: dict[str, float] = {MEDIUM_GPU: 1.0, MEDIUM_CPU: 0.8, MEDIUM_STORAGE: 0.5}
"""What a predicted hit token on each medium is worth against one on the device (see above)."""
OTHER_MEDIUM_WEIGHT = 0.5
"""The worth of a hit token on a medium ``MEDIUM_WEIGHTS`` does not name."""


@dataclass
class BackendState:
    """What the router knows about one backend right now."""

    name: str
    url: str
    healthy: bool = True
    load: BackendLoad = field(default_factory=BackendLoad)
    inflight: int = 0
    failures: int = 0
    """Consecutive failed attempts (requests or scrapes); reset by a success."""
    down_since: float | None = None

    def mark_failed(self) -> None:
        """A request or scrape failed: out of rotation until a scrape succeeds."""
        self.failures += 1
        if self.healthy:
            self.healthy = False
            self.down_since = time.monotonic()

    def mark_ok(self, load: BackendLoad | None = None) -> None:
        """A scrape or request succeeded."""
        self.failures = 0
        self.healthy = True
        self.down_since = None
        if load is not None:
            self.load = load

    @property
    def queue(self) -> float:
        """Requests ahead of a new one here: the router's own or the reported ones, whichever is more."""
        return max(float(self.inflight), self.load.running + self.load.waiting)


@dataclass(frozen=True, slots=True)
class Decision:
    """The backends to try in order, each with its predicted hit and cost."""

    order: tuple[str, ...]
    predicted: dict[str, int]
    costs: dict[str, float]
    reason: str
    """``hit`` when a hit is predicted on the chosen backend, ``load`` when none is (load or turn
    decided), ``round_robin`` for that policy."""


class Policy:
    """Ranks backends for one request."""

    def __init__(self, name: str = "hybrid_exact", *, load_weight: float = 0.25, kv_weight: float = 0.0,
                 medium_weights: Mapping[str, float] | None = None) -> None:
        if name not in POLICIES:
            raise InvalidInputError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
        if load_weight < 0 or kv_weight < 0:
            raise InvalidInputError(f"load_weight and kv_weight must be >= 0, got {load_weight}, {kv_weight}")
        weights = dict(MEDIUM_WEIGHTS)
        for medium, weight in (medium_weights or {}).items():
            if not isinstance(medium, str) or not medium:
                raise InvalidInputError(f"a medium weight needs a medium name, got {medium!r}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 1:
                raise InvalidInputError(f"the weight of medium {medium} must be a fraction in [0, 1], got {weight!r}")
            weights[medium] = float(weight)
        self.name = name
        self.load_weight = load_weight
        self.kv_weight = kv_weight
        self.medium_weights = weights
        """Per medium, what one predicted hit token there is worth against one on the device."""
        self._turn = 0

    @property
    def uses_hits(self) -> bool:
        return self.name in ("hybrid_exact", "prefix")

    def credit(self, prediction: Prediction) -> float:
        """The prompt tokens a predicted hit saves, each medium's at its weight (``medium_weights``)."""
        weights = self.medium_weights
        return math.fsum(weights.get(m, OTHER_MEDIUM_WEIGHT) * n for m, n in prediction.by_medium)

    def rank(self, backends: list[BackendState], predicted: Mapping[str, int], prompt_tokens: int, *,
             credited: Mapping[str, float] | None = None) -> Decision:
        """The order to try ``backends`` in (healthy ones first) for a prompt of ``prompt_tokens``.
        ``predicted``: each backend's predicted hit tokens; ``credited``: what they are worth
        (``credit``; default: ``predicted``, as if every token were on the device)."""
        if not backends:
            raise InvalidInputError("no backends to route to")
        healthy = [b for b in backends if b.healthy]
        pool = healthy or backends
        rest = [b for b in backends if b not in pool]
        if self.name == "round_robin":
            start = self._turn % len(pool)
            self._turn += 1
            order = pool[start:] + pool[:start] + rest
            return Decision(tuple(b.name for b in order), dict(predicted), {}, "round_robin")
        hits: Mapping[str, float] = (predicted if credited is None else credited) if self.uses_hits else {}
        scale = max(prompt_tokens, 1)
        costs = {b.name: (prompt_tokens - hits.get(b.name, 0))
                 + scale * (self.load_weight * b.queue + self.kv_weight * b.load.kv_usage) for b in backends}
        # Equal costs (an idle cluster, a prompt nobody holds) rotate, so new prefixes spread out.
        turn = self._turn
        self._turn += 1
        position = {b.name: (i - turn) % len(backends) for i, b in enumerate(backends)}
        ranked = sorted(pool, key=lambda b: (costs[b.name], b.inflight, position[b.name]))
        ranked += sorted(rest, key=lambda b: (costs[b.name], position[b.name]))
        reason = "hit" if self.uses_hits and predicted.get(ranked[0].name, 0) > 0 else "load"
        return Decision(tuple(b.name for b in ranked), dict(predicted), costs, reason)

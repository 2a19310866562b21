"""Which backend serves a request: predicted cache hits against load (pure; no I/O).

What it models, in full: ``docs/SIMULATOR.md``, "Routing policies".
"""

from __future__ import annotations

import bisect
import hashlib
import math
import time
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from hybridkv.cluster.events import MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE
from hybridkv.cluster.inflight import InFlightPrefixes
from hybridkv.cluster.replica import Prediction, RequestKeys
from hybridkv.cluster.scrape import BackendLoad
from hybridkv.errors import InvalidInputError

if TYPE_CHECKING:
    from hybridkv.cluster.index import ClusterIndex

POLICIES = ("hybrid_exact", "prefix", "least_loaded", "round_robin")
MEDIUM_WEIGHTS: dict[str, float] = {MEDIUM_GPU: 1.0, MEDIUM_CPU: 0.8, MEDIUM_STORAGE: 0.5}
"""What a predicted hit token on each medium is worth against one on the device (see above)."""
OTHER_MEDIUM_WEIGHT = 0.5
"""The worth of a hit token on a medium ``MEDIUM_WEIGHTS`` does not name."""
BALANCE = 1.5
"""``hybrid_exact``'s load bound: at most this many times the mean requests in flight (plus ``SLACK``)."""
SLACK = 4
"""Requests a backend may have in flight above ``BALANCE`` times the mean before it is overloaded."""
MISS_WEIGHT = 6.0
"""``hybrid_exact``: what a prompt token the request must compute weighs against one queued ahead of it."""
DECODE_WEIGHT = 0.1
"""``hybrid_exact``: what a running request weighs, as a fraction of the prompt (its decode steps are
shared with this request's prefill)."""
JUNCTION_WEIGHT = 0.5
"""``hybrid_exact``: what a token of the request's full-attention chain a backend's tiers hold past its
hit (a shared-prefix junction) is worth against a hit token: computed there, the request leaves the
window a later request needs at the junction in that tier (docs/CLUSTER.md, "Routing")."""
HOME_TOKENS = 1024
"""The prompt tokens whose hash places a new prefix on the ring (``home_key``)."""
RING_POINTS = 64
"""Points per backend on the consistent-hash ring."""


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
    sent_tokens: float = 0.0
    """Prompt tokens this router expects the backend to prefill for the requests it sent since the
    backend last reported its load (they are in the next report)."""

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
            self.sent_tokens = 0.0

    @property
    def prefill_ahead(self) -> float | None:
        """Prompt tokens the backend will prefill before a new request's: what it reported and what
        this router sent since; None when the backend does not report them."""
        pending = self.load.prefill_tokens
        return None if pending is None else pending + self.sent_tokens

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
    """What decided (``docs/SIMULATOR.md``): ``hit``, ``load``, ``home``, ``tie`` or ``round_robin``."""
    bound: float | None = None
    """``hybrid_exact``'s load bound for this request (requests in flight a backend may reach)."""


class Policy:
    """Ranks backends for one request."""

    def __init__(self, name: str = "hybrid_exact", *, load_weight: float = 0.25, kv_weight: float = 0.0,
                 medium_weights: Mapping[str, float] | None = None, balance: float = BALANCE,
                 slack: int = SLACK, home_tokens: int = HOME_TOKENS, miss_weight: float = MISS_WEIGHT,
                 junction_weight: float = JUNCTION_WEIGHT) -> None:
        if name not in POLICIES:
            raise InvalidInputError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
        if load_weight < 0 or kv_weight < 0:
            raise InvalidInputError(f"load_weight and kv_weight must be >= 0, got {load_weight}, {kv_weight}")
        if isinstance(balance, bool) or not isinstance(balance, (int, float)) or not 1 <= balance < math.inf:
            raise InvalidInputError(f"balance must be a number >= 1 (a multiple of the mean load), got {balance!r}")
        if type(slack) is not int or slack < 0:
            raise InvalidInputError(f"slack must be a whole number of requests >= 0, got {slack!r}")
        if isinstance(miss_weight, bool) or not isinstance(miss_weight, (int, float)) or not 0 < miss_weight < math.inf:
            raise InvalidInputError(f"miss_weight must be a positive number, got {miss_weight!r}")
        if isinstance(junction_weight, bool) or not isinstance(junction_weight, (int, float)) \
                or not 0 <= junction_weight <= 1:
            raise InvalidInputError(f"junction_weight must be a fraction in [0, 1], got {junction_weight!r}")
        if type(home_tokens) is not int or home_tokens < 1:
            raise InvalidInputError(f"home_tokens must be a positive number of tokens, got {home_tokens!r}")
        self.balance = float(balance)
        self.slack = slack
        self.home_tokens = home_tokens
        self.miss_weight = float(miss_weight)
        self.junction_weight = float(junction_weight)
        self._ring: tuple[tuple[str, ...], list[tuple[bytes, str]]] | None = None
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

    def junction(self, chain: Prediction, hit_tokens: int) -> float:
        """What the tokens of ``chain`` (a full-attention chain's prediction, ``chain_only``) past
        ``hit_tokens`` that a backend holds in its tiers (any medium but the device's) are worth, each
        medium's at its weight: where a request that hits ``hit_tokens`` there would meet a
        shared-prefix junction its computation stores a window for."""
        weights = self.medium_weights
        worth = 0.0
        start = 0
        for medium, n in chain.by_medium:
            past = start + n - max(start, hit_tokens)
            if medium != MEDIUM_GPU and past > 0:
                worth += weights.get(medium, OTHER_MEDIUM_WEIGHT) * past
            start += n
        return worth

    def home_key(self, token_ids: Sequence[int], cache_salt: str | bytes | None = None) -> bytes | None:
        """The ring key of a prompt: a sha256 of its first ``home_tokens`` token ids (and its cache
        salt). A conversation's turns extend its first prompt, so they share the key once the first
        prompt is ``home_tokens`` long. None for an empty prompt."""
        if not token_ids:
            return None
        head = array("q", token_ids[: self.home_tokens]).tobytes()
        salt = cache_salt or b""
        return hashlib.sha256((salt.encode() if isinstance(salt, str) else salt) + b"\0" + head).digest()

    def ring_order(self, names: Sequence[str], key: bytes) -> list[str]:
        """``names`` in the order the consistent-hash ring meets them walking from ``key``."""
        ring = self._ring
        if ring is None or ring[0] != tuple(names):
            points = sorted((hashlib.sha256(f"{n}#{i}".encode()).digest(), n)
                            for n in names for i in range(RING_POINTS))
            ring = self._ring = (tuple(names), points)
        points = ring[1]
        start = bisect.bisect_left(points, (key, ""))
        order: dict[str, None] = {}
        for i in range(len(points)):
            order.setdefault(points[(start + i) % len(points)][1])
            if len(order) == len(names):
                break
        return list(order)

    def rank(self, backends: list[BackendState], predicted: Mapping[str, int], prompt_tokens: int, *,
             credited: Mapping[str, float] | None = None, home: bytes | None = None,
             junctions: Mapping[str, float] | None = None) -> Decision:
        """The order to try ``backends`` in (healthy ones first) for a prompt of ``prompt_tokens``.
        ``predicted``: each backend's predicted hit tokens; ``credited``: what they are worth
        (``credit``; default: ``predicted``, as if every token were on the device); ``home``: the
        prompt's ring key (``home_key``; ``hybrid_exact`` rotates new prefixes without one);
        ``junctions``: what each backend's tiers hold of the prompt's chain past its hit
        (``junction``; ``hybrid_exact`` credits it at ``junction_weight``)."""
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
        turn = self._turn
        self._turn += 1
        position = {b.name: (i - turn) % len(backends) for i, b in enumerate(backends)}
        if self.name == "hybrid_exact":
            return self._rank_local(pool, rest, predicted, hits, junctions or {}, position, home, prompt_tokens)
        scale = max(prompt_tokens, 1)
        costs = {b.name: (prompt_tokens - hits.get(b.name, 0))
                 + scale * (self.load_weight * b.queue + self.kv_weight * b.load.kv_usage) for b in backends}
        # Equal costs (an idle cluster, a prompt nobody holds) rotate, so new prefixes spread out.
        ranked = sorted(pool, key=lambda b: (costs[b.name], b.inflight, position[b.name]))
        ranked += sorted(rest, key=lambda b: (costs[b.name], position[b.name]))
        reason = _reason(ranked[0].name, pool, hits, "tie") if self.uses_hits else "load"
        return Decision(tuple(b.name for b in ranked), dict(predicted), costs, reason)

    def _rank_local(self, pool: list[BackendState], rest: list[BackendState], predicted: Mapping[str, int],
                    hits: Mapping[str, float], junctions: Mapping[str, float], position: Mapping[str, int],
                    home: bytes | None, prompt_tokens: int) -> Decision:
        """``hybrid_exact``'s order: backends within the load bound by least work before the first
        token (``prefill_ahead`` and the tokens the request itself must prefill, less
        ``junction_weight`` of its chain the backend's tiers hold past its hit), then ring order from
        ``home`` (turn order without one), then fewer in flight; the overloaded ones after them, the
        least loaded first."""
        in_flight = sum(b.queue for b in pool)
        bound = math.ceil(self.balance * (in_flight + 1) / len(pool)) + self.slack
        if home is not None:
            ring = {n: i for i, n in enumerate(self.ring_order([b.name for b in pool], home))}
        else:
            ring = dict(position)
        scale = max(prompt_tokens, 1) * self.load_weight

        def ahead(b: BackendState) -> float:
            pending = b.prefill_ahead
            if pending is None:
                return scale * b.queue
            return pending + DECODE_WEIGHT * max(prompt_tokens, 1) * b.load.running

        jw = self.junction_weight
        costs = {b.name: self.miss_weight * (prompt_tokens - hits.get(b.name, 0) - jw * junctions.get(b.name, 0.0))
                 + ahead(b) for b in pool + rest}
        fits = [b for b in pool if b.queue + 1 <= bound]
        over = [b for b in pool if b.queue + 1 > bound]
        ranked = sorted(fits, key=lambda b: (costs[b.name], ring.get(b.name, 0), b.queue))
        ranked += sorted(over, key=lambda b: (b.queue, costs[b.name], ring.get(b.name, 0)))
        ranked += sorted(rest, key=lambda b: (costs[b.name], position[b.name]))
        tied = "tie"
        if home is not None and len(ranked) > 1 and costs[ranked[0].name] == costs[ranked[1].name]:
            tied = "home"  # the ring chose between equal costs
        reason = _reason(ranked[0].name, pool, hits, tied)
        if reason in ("tie", "home") and jw and _alone_largest(ranked[0].name, pool, junctions):
            reason = "junction"
        return Decision(tuple(b.name for b in ranked), dict(predicted), costs, reason, float(bound))


def _reason(chosen: str, pool: list[BackendState], hits: Mapping[str, float], tied: str) -> str:
    """What decided for ``chosen`` (``docs/SIMULATOR.md``): ``load`` when another backend had a larger
    hit, ``hit`` when ``chosen`` alone has the largest (above 0), else ``tied`` (``hybrid_exact``
    then says ``junction`` when ``chosen`` alone holds the largest junction)."""
    mine = hits.get(chosen, 0)
    best = max((hits.get(b.name, 0) for b in pool), default=0)
    if mine < best:
        return "load"
    if _alone_largest(chosen, pool, hits):
        return "hit"
    return tied


def _alone_largest(chosen: str, pool: list[BackendState], values: Mapping[str, float]) -> bool:
    """``chosen`` alone has the largest of ``values`` in ``pool``, above 0."""
    mine = values.get(chosen, 0)
    return mine > 0 and all(values.get(b.name, 0) < mine for b in pool if b.name != chosen)


@dataclass(frozen=True, slots=True)
class HitEstimate:
    """What a router knows of one request's hits before ranking (``estimate_hits``)."""

    predicted: dict[str, int]
    """Per backend, the hit tokens predicted: the index's, or the in-flight prefix's where more."""
    credited: dict[str, float]
    """Per backend, what the predicted hit is worth (``Policy.credit``)."""
    chains: dict[str, tuple[list[bytes], int]]
    """Per backend the index can hash for, the request's full-attention chain and its block size."""
    found: dict[str, Prediction]
    """Per backend, the index's own prediction (by medium)."""
    home: bytes | None
    """The request's ring key (``RequestKeys.home_key``)."""
    chain_found: dict[str, Prediction] = field(default_factory=dict)
    """Per backend, the index's prediction of the full-attention chain alone (``chain_only``): ``found``
    itself for ``prefix``; for ``hybrid_exact`` the backends with a tier (none with ``junction_weight`` 0)."""
    junctions: dict[str, float] = field(default_factory=dict)
    """Per backend, what its tiers hold of the chain past the predicted hit (``Policy.junction``)."""


def estimate_hits(policy: Policy, index: ClusterIndex, keys: RequestKeys, names: Sequence[str],
                  inflight: InFlightPrefixes, prompt_tokens: int) -> HitEstimate:
    """The hits ``policy`` ranks ``names`` by for the request ``keys``: the index's prediction per
    backend (the hybrid rule, or the full-attention chain alone for ``prefix``), credited per
    medium, raised to what the requests the router has in flight at a backend will leave there; for
    ``hybrid_exact``, the chain alone too, for its junctions."""
    found = index.lookup_keys(keys, chain_only=policy.name == "prefix")
    chains = {}
    for name in names:
        chain = index.chain_hashes(name, keys)
        if chain is not None:
            chains[name] = chain
    predicted = {name: p.tokens for name, p in found.items()}
    credited = {name: policy.credit(p) for name, p in found.items()}
    for name, (hashes, size) in chains.items():  # what requests in flight there will leave
        coming = inflight.predict(name, hashes, size, prompt_tokens)
        if coming > predicted.get(name, 0):
            predicted[name] = coming
            credited[name] = max(credited.get(name, 0.0), float(coming))
    chain_found: dict[str, Prediction] = {}
    junctions: dict[str, float] = {}
    if policy.name == "prefix":
        chain_found = found
    elif policy.name == "hybrid_exact" and policy.junction_weight > 0:
        # Only a tier holds a junction: replicas that publish no medium but the device's are skipped.
        tiered = [name for name, view in index.views.items()
                  if index.shared or any(medium != MEDIUM_GPU for medium in view.media)]
        chain_found = index.lookup_keys(keys, tiered, chain_only=True) if tiered else {}
        junctions = {name: worth for name, chain in chain_found.items()
                     if (worth := policy.junction(chain, predicted.get(name, 0))) > 0}
    return HitEstimate(predicted, credited, chains, found, keys.home_key(policy), chain_found, junctions)

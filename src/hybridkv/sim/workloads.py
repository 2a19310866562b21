"""Synthetic workloads for the simulator: requests as runs of content, arrival processes, length distributions.

What it models, in full: ``docs/SIMULATOR.md``, "Workloads".
"""

from __future__ import annotations

import math
import random
import zlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Literal

from hybridkv.core.sequence import checked_hints
from hybridkv.errors import InvalidInputError

__all__ = [
    "AZURE_CODE_INPUT",
    "AZURE_CODE_OUTPUT",
    "AZURE_CONV_INPUT",
    "AZURE_CONV_OUTPUT",
    "DEFAULT_ARRIVALS",
    "SHAREGPT_INPUT",
    "SHAREGPT_OUTPUT",
    "Arrivals",
    "Bursty",
    "ClosedLoop",
    "LengthDist",
    "Poisson",
    "SimRequest",
    "Workload",
    "chat_lengths",
    "multi_turn_chat",
    "output_key",
    "release_time",
    "shared_prefix",
    "SIM_ANSWER_TOKEN",
    "with_token_ids",
]

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(name: str, value: object, minimum: int) -> int:
    if not _is_int(value):
        raise InvalidInputError(f"{name} must be an integer; got {value!r}")
    assert isinstance(value, int)
    if value < minimum:
        raise InvalidInputError(f"{name} must be >= {minimum}; got {value}")
    return value


def _require_float(name: str, value: object, minimum: float, *, strict: bool = False) -> float:
    if not (_is_int(value) or isinstance(value, float)):
        raise InvalidInputError(f"{name} must be a number; got {value!r}")
    assert isinstance(value, (int, float))
    if not math.isfinite(value) or value < minimum or (strict and value == minimum):
        bound = f"> {minimum}" if strict else f">= {minimum}"
        raise InvalidInputError(f"{name} must be a finite number {bound}; got {value}")
    return float(value)


def _run_token_ids(key: str, num_tokens: int, vocab_size: int) -> list[int]:
    """Token ids of a run: splitmix64 of ``crc32(key) * GOLDEN + p * MIX1``, mod ``vocab_size - 1``, plus 1."""
    base = (zlib.crc32(key.encode()) * _GOLDEN) & _M64
    xs = [(base + p * _MIX1) & _M64 for p in range(num_tokens)]
    xs = [((x ^ (x >> 31)) * _MIX2) & _M64 for x in xs]
    mod = vocab_size - 1
    return [(x ^ (x >> 29)) % mod + 1 for x in xs]


SIM_ANSWER_TOKEN = 1
"""The token id the simulator samples at every decode step (its answers, as a later turn's prompt holds them)."""


def output_key(request_id: str) -> str:
    """The content key of the tokens a simulator generates for ``request_id``."""
    return f"out:{request_id}"


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One request of a workload; the prompt is ``segments``, runs of ``(content key, num tokens)``.

    ``arrival_time`` is in seconds from the start (0.0 for closed-loop workloads). ``token_ids`` is set only for
    traces that carry explicit ids; then ``segments`` is ``(("ids:<request_id>", len(token_ids)),)``.
    ``conversation_id``/``turn`` mark the turns of one conversation (see :func:`release_time`).
    ``checkpoint_hints`` are prompt positions the client marks as message boundaries later requests
    are expected to part at (the end of a system prompt; ``hybridkv.KVSequence``).
    """

    request_id: str
    arrival_time: float
    segments: tuple[tuple[str, int], ...]
    max_new_tokens: int
    prefix_group: int | None = None
    conversation_id: str | None = None
    turn: int = 0
    cache_salt: str | None = None
    token_ids: tuple[int, ...] | None = None
    checkpoint_hints: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidInputError(f"request_id must be a non-empty string; got {self.request_id!r}")
        rid = self.request_id
        _require_float(f"request {rid}: arrival_time", self.arrival_time, 0.0)
        if not isinstance(self.segments, tuple) or not self.segments:
            raise InvalidInputError(f"request {rid}: segments must be a non-empty tuple; got {self.segments!r}")
        for seg in self.segments:
            if (
                not isinstance(seg, tuple)
                or len(seg) != 2
                or not isinstance(seg[0], str)
                or not seg[0]
                or not _is_int(seg[1])
                or seg[1] < 1
            ):
                raise InvalidInputError(
                    f"request {rid}: each segment must be (non-empty key, num_tokens >= 1); got {seg!r}"
                )
        _require_int(f"request {rid}: max_new_tokens", self.max_new_tokens, 1)
        _require_int(f"request {rid}: turn", self.turn, 0)
        if self.prefix_group is not None:
            _require_int(f"request {rid}: prefix_group", self.prefix_group, 0)
        if self.token_ids is not None:
            expected = ((f"ids:{rid}", len(self.token_ids)),)
            if self.segments != expected:
                raise InvalidInputError(
                    f"request {rid}: with token_ids, segments must be {expected!r}; got {self.segments!r}"
                )
            if not all(_is_int(t) and t >= 0 for t in self.token_ids):
                raise InvalidInputError(f"request {rid}: token_ids must be integers >= 0")
        checked_hints(rid, self.checkpoint_hints, self.prompt_len)

    @property
    def prompt_len(self) -> int:
        """Number of prompt tokens (the sum of the segment lengths)."""
        return sum(n for _, n in self.segments)

    def prompt_token_ids(self, vocab_size: int = 32000) -> list[int]:
        """The prompt's token ids: ``token_ids`` if set, else each run's ids, all in ``1 .. vocab_size - 1``.

        Deterministic across processes: the token at position ``p`` of a run with key ``k`` depends only on
        ``(crc32(k), p)``, so runs with the same key give the same ids (a shorter run is a prefix of a longer one).
        Costs well under 1 us per token; meant for short prompts (engine runs, tests).
        """
        if self.token_ids is not None:
            return list(self.token_ids)
        _require_int("vocab_size", vocab_size, 2)
        out: list[int] = []
        for key, n in self.segments:
            out.extend(_run_token_ids(key, n, vocab_size))
        return out


@dataclass(frozen=True, slots=True)
class Workload:
    """Requests sorted by arrival time, plus how a simulator must drive them.

    ``concurrency`` is ``None`` for an open loop (requests arrive at ``arrival_time``) and the number of requests
    kept in flight for a closed loop (every ``arrival_time`` is 0.0; the next request in list order that
    :func:`release_time` allows starts when one finishes). ``think_time_s`` is the pause between a turn's finish
    and the next turn of the same conversation. Treat ``requests`` as read-only.

    ``content_block_size`` is set when the workload knows its requests' content only in blocks of that many
    tokens (a Mooncake trace: 512): two requests share a prefix in whole blocks, so a later request can resume
    from an earlier one only at a multiple of it. External tiers place their prompt-end checkpoints there.
    """

    requests: list[SimRequest]
    concurrency: int | None = None
    name: str = ""
    think_time_s: float = 0.0
    content_block_size: int | None = None

    def __post_init__(self) -> None:
        if self.concurrency is not None:
            _require_int("concurrency", self.concurrency, 1)
        if self.content_block_size is not None:
            _require_int("content_block_size", self.content_block_size, 1)
        _require_float("think_time_s", self.think_time_s, 0.0)
        seen: set[str] = set()
        last = 0.0
        for r in self.requests:
            if r.request_id in seen:
                raise InvalidInputError(f"workload {self.name!r}: request id {r.request_id!r} appears twice")
            seen.add(r.request_id)
            if r.arrival_time < last:
                raise InvalidInputError(
                    f"workload {self.name!r}: request {r.request_id!r} arrives at {r.arrival_time}, before the "
                    f"previous request ({last}); requests must be sorted by arrival_time"
                )
            last = r.arrival_time
            if self.concurrency is not None and r.arrival_time != 0.0:
                raise InvalidInputError(
                    f"workload {self.name!r}: closed loop (concurrency {self.concurrency}) needs arrival_time 0.0; "
                    f"request {r.request_id!r} has {r.arrival_time}"
                )


def release_time(request: SimRequest, previous_turn_finish: float | None, think_time_s: float) -> float:
    """Earliest time a simulator may start ``request``: its arrival, and for a turn > 0 not before the previous
    turn of its conversation finished plus ``think_time_s`` (``previous_turn_finish`` None means turn 0)."""
    if previous_turn_finish is None:
        return request.arrival_time
    return max(request.arrival_time, previous_turn_finish + think_time_s)


# --- lengths -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Log-normal token lengths with the given ``median`` and log-space ``sigma``, rounded and clamped.

    ``median * exp(sigma**2 / 2)`` is the mean; ``sigma = 0`` gives the median every time. ``min_len <= median
    <= max_len`` so that clamping keeps the median.
    """

    median: float
    sigma: float
    min_len: int = 1
    max_len: int | None = None

    def __post_init__(self) -> None:
        _require_float("LengthDist.median", self.median, 0.0, strict=True)
        _require_float("LengthDist.sigma", self.sigma, 0.0)
        _require_int("LengthDist.min_len", self.min_len, 1)
        if self.max_len is not None:
            _require_int("LengthDist.max_len", self.max_len, self.min_len)
        if self.median < self.min_len or (self.max_len is not None and self.median > self.max_len):
            raise InvalidInputError(
                f"LengthDist.median {self.median} must lie within [min_len, max_len] = [{self.min_len}, {self.max_len}]"
            )

    def sample(self, rng: random.Random) -> int:
        """One length drawn with ``rng``: ``round(median * exp(sigma * N(0, 1)))`` clamped to the limits."""
        n = max(self.min_len, round(self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))))
        return n if self.max_len is None else min(n, self.max_len)


# Presets. All approximate: medians are set from published summary statistics, sigmas are guesses of the spread.
# ShareGPT (as used by vLLM's benchmarks): the vLLM paper (Kwon et al., SOSP 2023) reports mean lengths of about
# 161 input and 338 output tokens; with sigma 1.0 a log-normal's mean is 1.65x its median, hence medians ~100/~200.
# Clamps follow vLLM's ShareGPT filter (drop prompts or outputs under 4 tokens, prompts over 1024).
SHAREGPT_INPUT = LengthDist(median=100, sigma=1.0, min_len=4, max_len=1024)
SHAREGPT_OUTPUT = LengthDist(median=200, sigma=1.0, min_len=4, max_len=2048)
# Azure LLM inference trace 2023 (Splitwise, Patel et al., ISCA 2024), approximate medians:
# conversation ~1020 prompt / ~129 output tokens, coding ~1500 prompt / ~13 output tokens.
AZURE_CONV_INPUT = LengthDist(median=1020, sigma=1.0, min_len=1, max_len=8192)
AZURE_CONV_OUTPUT = LengthDist(median=129, sigma=0.8, min_len=1, max_len=4096)
AZURE_CODE_INPUT = LengthDist(median=1500, sigma=1.0, min_len=1, max_len=8192)
AZURE_CODE_OUTPUT = LengthDist(median=13, sigma=1.2, min_len=1, max_len=4096)

Length = int | LengthDist


def _lengths(name: str, spec: Length, count: int, rng: random.Random, minimum: int) -> list[int]:
    """``count`` lengths: ``spec`` repeated if it is an int (checked ``>= minimum``), else samples of it."""
    if isinstance(spec, LengthDist):
        return [spec.sample(rng) for _ in range(count)]
    return [_require_int(name, spec, minimum)] * count


# --- arrivals ------------------------------------------------------------------------------------------------


class Arrivals(ABC):
    """An arrival process: the arrival times of ``n`` requests, and whether it is a closed loop."""

    __slots__ = ()

    @abstractmethod
    def arrival_times(self, n: int, rng: random.Random) -> list[float]:
        """``n`` non-decreasing arrival times in seconds, drawn with ``rng``."""

    def concurrency_limit(self) -> int | None:
        """Requests kept in flight by a closed loop; None for an open-loop process."""
        return None


@dataclass(frozen=True, slots=True)
class Poisson(Arrivals):
    """Open loop: exponential inter-arrival gaps with mean ``1 / rate`` (rate in requests per second)."""

    rate: float

    def __post_init__(self) -> None:
        _require_float("Poisson.rate", self.rate, 0.0, strict=True)

    def arrival_times(self, n: int, rng: random.Random) -> list[float]:
        t, out = 0.0, []
        for _ in range(n):
            t += rng.expovariate(self.rate)
            out.append(t)
        return out


@dataclass(frozen=True, slots=True)
class Bursty(Arrivals):
    """Open loop with Gamma inter-arrival gaps: mean ``1 / rate``, shape ``burstiness`` (vLLM's convention).

    The gaps' coefficient of variation is ``1 / sqrt(burstiness)``: ``burstiness = 1`` is Poisson, smaller values
    give clusters of near-simultaneous arrivals separated by long pauses, at the same average rate.
    """

    rate: float
    burstiness: float = 0.25

    def __post_init__(self) -> None:
        _require_float("Bursty.rate", self.rate, 0.0, strict=True)
        _require_float("Bursty.burstiness", self.burstiness, 0.0, strict=True)

    def arrival_times(self, n: int, rng: random.Random) -> list[float]:
        scale = 1.0 / (self.rate * self.burstiness)
        t, out = 0.0, []
        for _ in range(n):
            t += rng.gammavariate(self.burstiness, scale)
            out.append(t)
        return out


@dataclass(frozen=True, slots=True)
class ClosedLoop(Arrivals):
    """Closed loop: every arrival time is 0.0 and the simulator keeps ``concurrency`` requests in flight."""

    concurrency: int

    def __post_init__(self) -> None:
        _require_int("ClosedLoop.concurrency", self.concurrency, 1)

    def arrival_times(self, n: int, rng: random.Random) -> list[float]:
        return [0.0] * n

    def concurrency_limit(self) -> int | None:
        return self.concurrency


DEFAULT_ARRIVALS: Arrivals = Poisson(rate=10.0)


def _rng(seed: int, stream: str) -> random.Random:
    """An independent, process-stable random stream per (seed, aspect)."""
    return random.Random(f"hybridkv:{_require_int('seed', seed, 0)}:{stream}")


def _check_arrivals(arrivals: object) -> Arrivals:
    if not isinstance(arrivals, Arrivals):
        raise InvalidInputError(f"arrivals must be Poisson, Bursty or ClosedLoop; got {arrivals!r}")
    return arrivals


# --- generators ----------------------------------------------------------------------------------------------


def shared_prefix(
    num_requests: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: Length,
    *,
    max_new_tokens: Length,
    popularity: Literal["uniform", "zipf"] = "uniform",
    zipf_s: float = 1.0,
    arrivals: Arrivals = DEFAULT_ARRIVALS,
    seed: int = 0,
) -> Workload:
    """Requests that each start with one of ``num_prefixes`` shared prefixes and end with a unique suffix.

    Request ``i`` is ``req-{i}`` (in arrival order); its prompt is ``("prefix-{g}", prefix_len)`` then
    ``("suffix-req-{i}", suffix_len)`` (left out when the suffix length is 0), with ``prefix_group = g`` and
    the prefix's end as its checkpoint hint (a system prompt's end, as a chat server marks it). Groups
    are drawn uniformly or by Zipf popularity: group ``g`` has weight ``1 / (g + 1) ** zipf_s``, so group 0 is the
    most popular.
    """
    _require_int("num_requests", num_requests, 1)
    _require_int("num_prefixes", num_prefixes, 1)
    _require_int("prefix_len", prefix_len, 1)
    arrivals = _check_arrivals(arrivals)
    rng = _rng(seed, "prefix")
    if popularity == "uniform":
        groups = rng.choices(range(num_prefixes), k=num_requests)
    elif popularity == "zipf":
        s = _require_float("zipf_s", zipf_s, 0.0)
        cum, acc = [], 0.0
        for g in range(num_prefixes):
            acc += 1.0 / (g + 1) ** s
            cum.append(acc)
        groups = rng.choices(range(num_prefixes), cum_weights=cum, k=num_requests)
    else:
        raise InvalidInputError(f"popularity must be 'uniform' or 'zipf'; got {popularity!r}")
    len_rng = _rng(seed, "lengths")
    suffixes = _lengths("suffix_len", suffix_len, num_requests, len_rng, 0)
    outputs = _lengths("max_new_tokens", max_new_tokens, num_requests, len_rng, 1)
    times = arrivals.arrival_times(num_requests, _rng(seed, "arrivals"))
    requests = []
    for i in range(num_requests):
        rid, g = f"req-{i}", groups[i]
        prefix = (f"prefix-{g}", prefix_len)
        segments = (prefix, (f"suffix-{rid}", suffixes[i])) if suffixes[i] else (prefix,)
        requests.append(SimRequest(rid, times[i], segments, outputs[i], prefix_group=g,
                                   checkpoint_hints=(prefix_len,)))
    return Workload(requests, arrivals.concurrency_limit(), "shared_prefix")


def multi_turn_chat(
    num_conversations: int,
    turns: int,
    *,
    system_prompt_len: int,
    user_len: Length,
    max_new_tokens: Length,
    arrivals: Arrivals = DEFAULT_ARRIVALS,
    think_time_s: float = 0.0,
    shared_system_prompt: bool = True,
    tpot_estimate_s: float = 0.02,
    seed: int = 0,
) -> Workload:
    """Conversations of ``turns`` turns; each turn's prompt extends the previous turn's prompt and output.

    Conversation ``c`` is ``conv-{c}``, its turn ``t`` the request ``conv-{c}-turn-{t}``. Turn 0 is
    ``("system", system_prompt_len)`` (key ``system-conv-{c}`` when not shared; left out when the length is 0)
    and a user message ``("user-<request id>", n)``; turn ``t`` is turn ``t-1``'s segments, then
    ``(output_key(turn t-1's id), turn t-1's max_new_tokens)``, then a new user message. The system prompt's
    end is every turn's checkpoint hint.

    ``arrivals`` gives each conversation's start. In an open loop, turn ``t`` arrives at turn ``t-1``'s arrival
    plus an estimate of its duration, ``max_new_tokens * tpot_estimate_s`` (prefill ignored), plus
    ``think_time_s``; a simulator must still hold it until :func:`release_time` allows (the previous turn
    finished plus ``think_time_s``). In a closed loop all arrivals are 0.0 and only that rule applies.
    """
    _require_int("num_conversations", num_conversations, 1)
    _require_int("turns", turns, 1)
    _require_int("system_prompt_len", system_prompt_len, 0)
    think = _require_float("think_time_s", think_time_s, 0.0)
    tpot = _require_float("tpot_estimate_s", tpot_estimate_s, 0.0)
    arrivals = _check_arrivals(arrivals)
    count = num_conversations * turns
    len_rng = _rng(seed, "lengths")
    users = _lengths("user_len", user_len, count, len_rng, 1)
    outputs = _lengths("max_new_tokens", max_new_tokens, count, len_rng, 1)
    starts = arrivals.arrival_times(num_conversations, _rng(seed, "arrivals"))
    closed = arrivals.concurrency_limit() is not None
    requests: list[SimRequest] = []
    for c in range(num_conversations):
        conv = f"conv-{c}"
        system_key = "system" if shared_system_prompt else f"system-{conv}"
        segments: tuple[tuple[str, int], ...] = ((system_key, system_prompt_len),) if system_prompt_len else ()
        t_arrival = starts[c]
        prev: SimRequest | None = None
        for t in range(turns):
            rid = f"{conv}-turn-{t}"
            k = c * turns + t
            if prev is not None:
                segments = (*segments, (output_key(prev.request_id), prev.max_new_tokens))
                if not closed:
                    t_arrival = prev.arrival_time + prev.max_new_tokens * tpot + think
            segments = (*segments, (f"user-{rid}", users[k]))
            prev = SimRequest(rid, t_arrival, segments, outputs[k], conversation_id=conv, turn=t,
                              checkpoint_hints=(system_prompt_len,) if system_prompt_len else ())
            requests.append(prev)
    requests.sort(key=lambda r: r.arrival_time)  # stable: ties stay in (conversation, turn) order
    return Workload(requests, arrivals.concurrency_limit(), "multi_turn_chat", think)


def chat_lengths(
    num_requests: int,
    input: Length = SHAREGPT_INPUT,
    output: Length = SHAREGPT_OUTPUT,
    *,
    arrivals: Arrivals = DEFAULT_ARRIVALS,
    seed: int = 0,
) -> Workload:
    """Independent prompts (``chat-{i}``, one unique run ``prompt-chat-{i}`` each) with chat-like lengths."""
    _require_int("num_requests", num_requests, 1)
    arrivals = _check_arrivals(arrivals)
    len_rng = _rng(seed, "lengths")
    inputs = _lengths("input", input, num_requests, len_rng, 1)
    outputs = _lengths("output", output, num_requests, len_rng, 1)
    times = arrivals.arrival_times(num_requests, _rng(seed, "arrivals"))
    requests = [
        SimRequest(f"chat-{i}", times[i], ((f"prompt-chat-{i}", inputs[i]),), outputs[i]) for i in range(num_requests)
    ]
    return Workload(requests, arrivals.concurrency_limit(), "chat_lengths")


def with_token_ids(workload: Workload, *, vocab_size: int = 32000, answer_token: int = SIM_ANSWER_TOKEN) -> Workload:
    """The same workload as a token-level trace: every request with explicit ``token_ids``.

    A run is :meth:`SimRequest.prompt_token_ids`' ids, except a run that is the output of a request of the
    workload (key :func:`output_key` of its id): ``answer_token`` repeated, what the simulator generates, so a
    conversation's next turn holds its previous turn's answer token for token.
    """
    outputs = {output_key(r.request_id) for r in workload.requests}
    requests = []
    for r in workload.requests:
        ids: list[int] = []
        for key, n in r.segments:
            ids += [answer_token] * n if key in outputs else _run_token_ids(key, n, vocab_size)
        requests.append(SimRequest(r.request_id, r.arrival_time, ((f"ids:{r.request_id}", len(ids)),),
                                   r.max_new_tokens, r.prefix_group, r.conversation_id, r.turn, r.cache_salt,
                                   tuple(ids), r.checkpoint_hints))
    return Workload(requests, workload.concurrency, f"{workload.name}-tokens", workload.think_time_s,
                    workload.content_block_size)

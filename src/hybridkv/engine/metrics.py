"""Engine counters and histograms, rendered in the Prometheus text format under vLLM's names.

``names="vllm"`` writes vLLM's names exactly, ``names="hybridkv"`` with ``hybridkv_`` for ``vllm:``;
metrics vLLM has no name for are always ``hybridkv_*``. See docs/ENGINE.md, "The reference engine".
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from hybridkv.core.hits import LOSS_CAUSES

REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
REQUEST_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
FINISH_REASONS = ("stop", "length", "abort", "error")
"""vLLM's ``finished_reason`` label values (a rejected request counts as ``abort``)."""
MetricNames = Literal["vllm", "hybridkv"]
VLLM_METRICS = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prompt_tokens_total",
    "prompt_tokens_cached_total", "prompt_tokens_by_source_total", "generation_tokens_total",
    "prefix_cache_queries_total", "prefix_cache_hits_total", "external_prefix_cache_queries_total",
    "external_prefix_cache_hits_total", "num_preemptions_total", "request_success_total",
    "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
    "request_queue_time_seconds", "request_inference_time_seconds", "request_prefill_time_seconds",
    "request_decode_time_seconds", "request_prompt_tokens", "request_generation_tokens",
    "request_params_max_tokens", "request_params_n", "iteration_tokens_total",
    "spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_accepted_tokens_per_pos_total",
})
"""The metrics vLLM exports under ``vllm:<name>`` (the name as rendered, counters with ``_total``)."""


def metric_name(name: str, names: MetricNames) -> str:
    """The exported name of metric ``name``: ``vllm:name`` for vLLM's metrics under ``names="vllm"``,
    else ``hybridkv_name``."""
    return f"vllm:{name}" if names == "vllm" and name in VLLM_METRICS else f"hybridkv_{name}"


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """1-2-5 series up to ``max_model_len`` (vLLM's buckets for tokens per request)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


def _number(value: float) -> str:
    return repr(float(value))


@dataclass
class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: ``le`` upper bounds, plus ``+Inf``)."""

    buckets: tuple[float, ...] = STEP_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        """Count ``value``; a value that is not finite is ignored (it would poison the sum)."""
        if not math.isfinite(value):
            return
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str, labels: str = "") -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        sep = "," if labels else ""
        running = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            le = "+Inf" if bound == float("inf") else _number(bound)
            lines.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {_number(running)}')
        suffix = f"{{{labels}}}" if labels else ""
        lines += [f"{name}_sum{suffix} {_number(self.total)}", f"{name}_count{suffix} {_number(self.count)}"]
        return lines


@dataclass
class EngineMetrics:
    """What the engine counts; ``render`` writes it (plus the caller's gauges) as Prometheus text."""

    max_model_len: int = 8192
    requests_received: int = 0
    prompt_tokens: int = 0
    """Prompt tokens of every request whose prefill completed, cached ones included (vLLM's rule)."""
    prompt_tokens_by_source: Counter[str] = field(default_factory=Counter)
    """``local_compute``, ``local_cache_hit``, ``external_kv_transfer``; they sum to ``prompt_tokens``."""
    computed_tokens: int = 0
    """Tokens the model ran (prompt chunks, recomputation after preemption and decodes)."""
    generation_tokens: int = 0
    prefix_queries: int = 0
    """Prompt tokens looked up in the device prefix cache at first admission."""
    prefix_hits: int = 0
    external_queries: int = 0
    """Prompt tokens looked up in the external KV tiers (those the device cache did not have)."""
    external_hits: int = 0
    """Prompt tokens loaded from external KV tiers instead of computed."""
    lost_hits: Counter[str] = field(default_factory=Counter)
    """Prompt tokens the full-attention layers held but the hit did not serve, by cause
    (``hybridkv.core.hits.LOSS_CAUSES``), at first admission."""
    preemptions: int = 0
    steps: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    """Finished requests by vLLM's ``finished_reason`` (``FINISH_REASONS``)."""
    ttft_seconds: Histogram = field(default_factory=lambda: Histogram(TIME_TO_FIRST_TOKEN_BUCKETS))
    inter_token_seconds: Histogram = field(default_factory=lambda: Histogram(INTER_TOKEN_LATENCY_BUCKETS))
    e2e_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    queue_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    inference_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    prefill_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    decode_seconds: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    request_prompt_tokens: Histogram = field(default_factory=Histogram)
    request_generation_tokens: Histogram = field(default_factory=Histogram)
    request_max_tokens: Histogram = field(default_factory=Histogram)
    request_n: Histogram = field(default_factory=lambda: Histogram(REQUEST_PARAMS_N_BUCKETS))
    iteration_tokens: Histogram = field(default_factory=lambda: Histogram(ITERATION_TOKENS_BUCKETS))
    step_seconds: Histogram = field(default_factory=Histogram)
    spec_drafts: int = 0
    """Decode steps of a request that verified drafts (speculative decoding)."""
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: Counter[int] = field(default_factory=Counter)
    """Accepted drafts by their position in the step's drafts (0: the first)."""

    def __post_init__(self) -> None:
        buckets = token_buckets(self.max_model_len)
        for h in (self.request_prompt_tokens, self.request_generation_tokens, self.request_max_tokens):
            if h.count == 0:
                h.buckets = buckets
                h.counts = [0] * (len(buckets) + 1)

    def on_admitted(self, queued: float, num_prompt: int, num_hit: int, num_external: int | None,
                    lost: dict[str, int] | None = None) -> None:
        """A request's first admission after ``queued`` seconds (``num_external`` None: no external
        tiers; ``lost``: hit tokens lost against the full-attention prefix, by cause)."""
        self.queue_seconds.observe(queued)
        self.prefix_queries += num_prompt
        self.prefix_hits += num_hit
        if lost:
            self.lost_hits.update(lost)
        if num_external is not None:
            self.external_queries += num_prompt - num_hit
            self.external_hits += num_external

    def on_first_token(self, ttft: float, prefill: float, num_prompt: int, num_cached: int, num_external: int) -> None:
        """A request's first token: its prompt counts now, cached tokens included (vLLM's rule)."""
        self.ttft_seconds.observe(ttft)
        self.prefill_seconds.observe(prefill)
        self.prompt_tokens += num_prompt
        self.prompt_tokens_by_source["local_cache_hit"] += num_cached
        self.prompt_tokens_by_source["external_kv_transfer"] += num_external
        self.prompt_tokens_by_source["local_compute"] += num_prompt - num_cached - num_external

    def on_finished(self, reason: str, e2e: float, inference: float | None, decode: float | None,
                    num_prompt: int, num_generated: int) -> None:
        """A finished request (``inference``/``decode`` None: it never ran / never produced a token)."""
        self.finished[reason] += 1
        self.e2e_seconds.observe(e2e)
        if inference is not None:
            self.inference_seconds.observe(inference)
        if decode is not None:
            self.decode_seconds.observe(decode)
            self.request_prompt_tokens.observe(num_prompt)
            self.request_generation_tokens.observe(num_generated)

    def on_drafts(self, drafted: int, accepted: int) -> None:
        """One request's step verified ``drafted`` draft tokens and accepted the first ``accepted``."""
        self.spec_drafts += 1
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted
        for position in range(accepted):
            self.spec_accepted_per_position[position] += 1

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def render(self, gauges: dict[str, tuple[float, str]], names: MetricNames = "hybridkv", *,
               counters: dict[str, tuple[float, str]] | None = None, model_name: str = "") -> str:
        """Prometheus text: ``gauges`` and extra ``counters`` map name -> (value, help); an extra
        counter name may carry labels (``name{kind="x"}``; the help text of its first sample counts)."""
        label = f'model_name="{_escape(model_name)}"'
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            full = metric_name(name, names)
            lines.extend((f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"))
            for extra, value in samples:
                lines.append(f"{full}{{{label}{',' + extra if extra else ''}}} {_number(value)}")

        for name, (value, help_text) in gauges.items():
            family(name, "gauge", help_text, [("", value)])
        grouped: dict[str, tuple[str, list[tuple[str, float]]]] = {}
        for name, (value, help_text) in (counters or {}).items():
            base, _, extra = name.partition("{")
            entry = grouped.setdefault(base, (help_text, []))
            entry[1].append((extra.rstrip("}"), value))
        for base, (help_text, samples) in grouped.items():
            family(base, "counter", help_text, samples)
        for name, (value, help_text) in self._plain_counters().items():
            family(name, "counter", help_text, [("", value)])
        family("prompt_tokens_by_source_total", "counter", "Number of prompt tokens by source.",
               [(f'source="{s}"', self.prompt_tokens_by_source[s]) for s in PROMPT_SOURCES])
        family("prefix_cache_lost_tokens_total", "counter",
               "Prompt tokens the full-attention layers held but the prefix hit did not serve, by the cause "
               "that cut the hit.", [(f'cause="{c}"', self.lost_hits[c]) for c in LOSS_CAUSES])
        if self.spec_accepted_per_position:
            family("spec_decode_num_accepted_tokens_per_pos_total", "counter", "Accepted tokens per draft position.",
                   [(f'position="{p}"', self.spec_accepted_per_position[p])
                    for p in range(max(self.spec_accepted_per_position) + 1)])
        family("request_success_total", "counter", "Count of successfully processed requests.",
               [(f'finished_reason="{r}"', self.finished[r]) for r in FINISH_REASONS])
        for name, hist, help_text in self._histograms():
            lines += hist.render(metric_name(name, names), help_text, label)
        return "\n".join(lines) + "\n"

    def _plain_counters(self) -> dict[str, tuple[float, str]]:
        """The unlabelled counters: name -> (value, help)."""
        return {
            "prompt_tokens_total": (self.prompt_tokens, "Number of prefill tokens processed."),
            "prompt_tokens_cached_total": (self.prompt_tokens_by_source["local_cache_hit"]
                                           + self.prompt_tokens_by_source["external_kv_transfer"],
                                           "Number of cached prompt tokens (local + external)."),
            "generation_tokens_total": (self.generation_tokens, "Number of generation tokens processed."),
            "prefix_cache_queries_total": (self.prefix_queries,
                                           "Prefix cache queries, in terms of number of queried tokens."),
            "prefix_cache_hits_total": (self.prefix_hits, "Prefix cache hits, in terms of number of cached tokens."),
            "external_prefix_cache_queries_total": (self.external_queries,
                                                    "External prefix cache (KV tier) queries, in queried tokens."),
            "external_prefix_cache_hits_total": (self.external_hits,
                                                 "External prefix cache (KV tier) hits, in loaded tokens."),
            "num_preemptions_total": (self.preemptions, "Cumulative number of preemption from the engine."),
            "requests_received_total": (self.requests_received, "Requests accepted by the engine."),
            "computed_tokens_total": (self.computed_tokens,
                                      "Tokens the model ran (prompt chunks, recomputation, decodes)."),
            "engine_steps_total": (self.steps, "Engine steps run."),
            "spec_decode_num_drafts_total": (self.spec_drafts, "Number of spec decoding drafts."),
            "spec_decode_num_draft_tokens_total": (self.spec_draft_tokens, "Number of draft tokens."),
            "spec_decode_num_accepted_tokens_total": (self.spec_accepted_tokens, "Number of accepted tokens."),
        }

    def _histograms(self) -> tuple[tuple[str, Histogram, str], ...]:
        """The histograms: (name, histogram, help)."""
        return (
            ("time_to_first_token_seconds", self.ttft_seconds, "Histogram of time to first token in seconds."),
            ("inter_token_latency_seconds", self.inter_token_seconds, "Histogram of inter-token latency in seconds."),
            ("e2e_request_latency_seconds", self.e2e_seconds, "Histogram of e2e request latency in seconds."),
            ("request_queue_time_seconds", self.queue_seconds,
             "Histogram of time spent in WAITING phase for request."),
            ("request_inference_time_seconds", self.inference_seconds,
             "Histogram of time spent in RUNNING phase for request."),
            ("request_prefill_time_seconds", self.prefill_seconds,
             "Histogram of time spent in PREFILL phase for request."),
            ("request_decode_time_seconds", self.decode_seconds,
             "Histogram of time spent in DECODE phase for request."),
            ("request_prompt_tokens", self.request_prompt_tokens, "Number of prefill tokens processed."),
            ("request_generation_tokens", self.request_generation_tokens, "Number of generation tokens processed."),
            ("request_params_max_tokens", self.request_max_tokens, "Histogram of the max_tokens request parameter."),
            ("request_params_n", self.request_n, "Histogram of the n request parameter."),
            ("iteration_tokens_total", self.iteration_tokens, "Histogram of number of tokens per engine_step."),
            ("step_seconds", self.step_seconds, "Wall time of one engine step."),
        )


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

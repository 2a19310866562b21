"""Engine counters and latency histograms, rendered in the Prometheus text format."""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class Histogram:
    """Cumulative-bucket histogram (Prometheus semantics: ``le`` upper bounds, plus ``+Inf``)."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        running = 0
        for bound, n in zip((*self.buckets, float("inf")), self.counts):
            running += n
            le = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{name}_bucket{{le="{le}"}} {running}')
        lines += [f"{name}_sum {self.total}", f"{name}_count {self.count}"]
        return lines


@dataclass
class EngineMetrics:
    requests_received: int = 0
    prompt_tokens: int = 0
    """Prompt (and recomputed) tokens the model ran."""
    generation_tokens: int = 0
    prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache at first admission."""
    prefix_hits: int = 0
    preemptions: int = 0
    external_tokens: int = 0
    """Prompt tokens loaded from external KV tiers instead of computed."""
    steps: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    ttft_seconds: Histogram = field(default_factory=Histogram)
    latency_seconds: Histogram = field(default_factory=Histogram)
    step_seconds: Histogram = field(default_factory=Histogram)

    def render(self, gauges: dict[str, tuple[float, str]], prefix: str = "hybridkv", *,
               counters: dict[str, tuple[float, str]] | None = None) -> str:
        """Prometheus exposition: ``gauges`` maps name -> (value, help) for point-in-time values;
        extra ``counters`` may carry labels (``name{label="x"}``; help text on the first of a name)."""
        lines: list[str] = []
        for name, (value, help_text) in gauges.items():
            lines += [f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} gauge",
                      f"{prefix}_{name} {value}"]
        seen: set[str] = set()
        for name, (value, help_text) in (counters or {}).items():
            base = name.split("{", 1)[0]
            if base not in seen:
                seen.add(base)
                lines += [f"# HELP {prefix}_{base} {help_text or 'External KV tier faults, by kind.'}",
                          f"# TYPE {prefix}_{base} counter"]
            lines.append(f"{prefix}_{name} {value}")
        counters = {
            "requests_received_total": (self.requests_received, "Requests accepted."),
            "prompt_tokens_total": (self.prompt_tokens, "Prompt tokens computed (cache hits excluded)."),
            "generation_tokens_total": (self.generation_tokens, "Tokens generated."),
            "prefix_cache_queries_total": (self.prefix_queries, "Prompt tokens looked up in the prefix cache."),
            "prefix_cache_hits_total": (self.prefix_hits, "Prompt tokens served from the prefix cache."),
            "preemptions_total": (self.preemptions, "Sequences preempted (recomputed later)."),
            "external_kv_tokens_total": (self.external_tokens, "Prompt tokens loaded from external KV tiers."),
            "engine_steps_total": (self.steps, "Engine steps run."),
        }
        for name, (value, help_text) in counters.items():
            lines += [f"# HELP {prefix}_{name} {help_text}", f"# TYPE {prefix}_{name} counter",
                      f"{prefix}_{name} {value}"]
        name = f"{prefix}_requests_finished_total"
        lines += [f"# HELP {name} Requests finished, by reason.", f"# TYPE {name} counter"]
        lines += [f'{name}{{reason="{reason}"}} {n}' for reason, n in sorted(self.finished.items())]
        lines += self.ttft_seconds.render(f"{prefix}_time_to_first_token_seconds", "Arrival to first token.")
        lines += self.latency_seconds.render(f"{prefix}_request_latency_seconds", "Arrival to finish.")
        lines += self.step_seconds.render(f"{prefix}_step_seconds", "Wall time of one engine step.")
        return "\n".join(lines) + "\n"

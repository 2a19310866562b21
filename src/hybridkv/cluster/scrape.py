"""A backend's load from its Prometheus ``/metrics``: requests running and waiting, KV-cache usage,
and (a hybridkv backend) the prompt tokens it has still to prefill.

hybridkv's and vLLM's metric names are both read. See docs/CLUSTER.md, "The router's request".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_RUNNING = ("hybridkv_num_requests_running", "vllm:num_requests_running")
_WAITING = ("hybridkv_num_requests_waiting", "vllm:num_requests_waiting")
_PENDING = ("hybridkv_num_prefill_tokens_pending",)
_USAGE = ("hybridkv_kv_cache_usage_perc", "hybridkv_kv_cache_usage", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc")


@dataclass(frozen=True, slots=True)
class BackendLoad:
    """What a backend reported: requests running and waiting, the fraction of KV blocks in use."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefill_tokens: float | None = None
    """Prompt tokens the backend has still to prefill (waiting requests' and running ones' rest),
    when it reports them (``hybridkv_num_prefill_tokens_pending``; vLLM does not)."""


def parse_samples(text: str) -> dict[str, list[float]]:
    """Every sample of a Prometheus text exposition, by metric name (labels dropped); malformed
    lines are skipped."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            _, _, rest = rest.rpartition("}")
        else:
            name, _, rest = line.partition(" ")
        fields = rest.split()
        if not name or not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isfinite(value):
            out.setdefault(name.strip(), []).append(value)
    return out


def parse_load(text: str) -> BackendLoad | None:
    """The load in a ``/metrics`` page, or None when it has none of the known names."""
    samples = parse_samples(text)

    def first(names: tuple[str, ...]) -> list[float] | None:
        return next((samples[n] for n in names if n in samples), None)

    running, waiting, usage, pending = first(_RUNNING), first(_WAITING), first(_USAGE), first(_PENDING)
    if running is None and waiting is None and usage is None:
        return None
    return BackendLoad(sum(running or ()), sum(waiting or ()), sum(usage) / len(usage) if usage else 0.0,
                       sum(pending) if pending is not None else None)

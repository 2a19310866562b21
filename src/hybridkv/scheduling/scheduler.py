"""A continuous-batching scheduler on the manager that never deadlocks.

Each step: running sequences first (preempting the lowest-priority, newest when blocks run out),
then waiting ones admitted under the admission bound (``max_utilization`` or
``guaranteed_no_preemption``); requests that can never fit are rejected with a reason, and tier
loads run while the queue moves on. See docs/ARCHITECTURE.md, "The scheduler".
"""

from __future__ import annotations

import math
from bisect import insort
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from hybridkv.core import KVCacheManager, KVSequence
from hybridkv.errors import InvalidInputError, SequenceTooLongError

if TYPE_CHECKING:
    from hybridkv.connectors import KVConnector

_LOADING = object()
"""``_fetch_external``'s answer while a request's tier load is in flight."""

MAX_DRAFT_TOKENS = 16
"""Most draft tokens per sequence and step (``SchedulerConfig.num_speculative_tokens``)."""

Policy = Literal["fcfs", "priority"]
Admission = Literal["max_utilization", "guaranteed_no_preemption"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of the scheduler."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0
    """Most prompt tokens one sequence gets per step (0: the whole budget)."""
    policy: Policy = "fcfs"
    """``fcfs``, or ``priority`` (lower value first; ties by arrival)."""
    admission: Admission = "max_utilization"
    max_self_preemptions: int = 3
    """A sequence preempting itself this many times is rejected (a self-preemption in a step where
    other sequences hold draft slots does not count: without their drafts it may well fit)."""
    num_speculative_tokens: int = 0
    """Most draft tokens a decode step verifies (``set_draft_tokens``); 0: no speculation. Admission
    counts that many draft slots past each sequence (``reserve_lookahead_tokens``; fewer for one that
    may generate fewer tokens or reaches ``max_model_len``). A step's drafts never pass a request's
    final length, so ``guaranteed_no_preemption`` needs no more room."""
    defer_shared_prefills: bool = True
    """Leave a waiting sequence queued for a step when a sequence scheduled in this step computes the
    block its own computation would start with (the same prefix, not yet cached): the next step it
    hits what that step computes instead of computing it twice (requests behind it may go first).
    It waits at most as many steps as that prefix has blocks; a request of a burst sharing a
    system prompt then waits one step and hits it."""
    prefill_context_cost: float = 0.0
    """Extra step-budget tokens a prompt token takes per token of context before it: the attention it
    pays over them, relative to the rest of its computation (hybridkv's engine derives it from the
    model: about 1e-4 for Gemma 3 270M). A long prompt's later chunks then get fewer tokens, so that
    no step costs more than a plain chunk at the start of a prompt. 0: every prompt token costs the
    same. A chunk always gets at least one token when it is alone in a step."""
    keep_finished: bool = False
    """Keep finished, rejected and aborted requests in ``requests`` (until ``forget``). By default the
    scheduler forgets a request once it has told the caller it ended (``update``'s return value,
    ``SchedulerOutput.rejected``), so a long-running engine holds nothing of past requests."""

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_self_preemptions"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise InvalidInputError(f"SchedulerConfig.{name} must be a positive integer, got {value!r}")
        if type(self.num_speculative_tokens) is not int or not 0 <= self.num_speculative_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidInputError(f"SchedulerConfig.num_speculative_tokens must be an integer in "
                                    f"0..{MAX_DRAFT_TOKENS}, got {self.num_speculative_tokens!r}")
        if type(self.long_prefill_token_threshold) is not int or self.long_prefill_token_threshold < 0:
            raise InvalidInputError(
                f"SchedulerConfig.long_prefill_token_threshold must be a non-negative integer, "
                f"got {self.long_prefill_token_threshold!r}"
            )
        cost = self.prefill_context_cost
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost < 1:
            raise InvalidInputError(f"SchedulerConfig.prefill_context_cost must be a number in [0, 1), got {cost!r}")
        if self.policy not in ("fcfs", "priority"):
            raise InvalidInputError(f"SchedulerConfig.policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if self.admission not in ("max_utilization", "guaranteed_no_preemption"):
            raise InvalidInputError(
                f"SchedulerConfig.admission must be 'max_utilization' or 'guaranteed_no_preemption', "
                f"got {self.admission!r}"
            )


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"


@runtime_checkable
class ScheduledSequence(KVSequence, Protocol):
    """A sequence the scheduler runs: what the manager reads, and the tokens it generates."""

    @property
    def num_output_tokens(self) -> int: ...

    def append_token_ids(self, token_ids: Iterable[int]) -> None: ...


@dataclass(eq=False)
class Request:
    """The scheduler's view of one sequence."""

    seq: ScheduledSequence
    max_new_tokens: int
    priority: int
    arrival: int
    stop_token_ids: frozenset[int]
    status: Status = Status.WAITING
    num_preemptions: int = 0
    num_self_preemptions: int = 0
    finish_reason: str | None = None
    num_hit_tokens: int = 0
    """Prefix-hit tokens at the latest admission."""
    lost_hit_tokens: dict[str, int] = field(default_factory=dict)
    """Prompt tokens the full-attention groups held but the hit did not serve, by cause (first admission)."""
    num_external_tokens: int = 0
    """Tokens an external KV tier supplied at the latest admission (after the local hit)."""
    prefill_weight: int = 1
    """Step-budget tokens each of its prompt tokens takes: above 1 for a sequence whose prompt tokens
    cost more than a plain prefill's (prompt scoring), so a step never costs more than a plain chunk."""
    draft_token_ids: list[int] = field(default_factory=list)
    """Draft tokens proposed for its next decode step (``Scheduler.set_draft_tokens``), used once."""
    load: Any = None
    """The external tier load of a waiting request (``connectors.loads.PendingLoad``): in flight, or
    done for an admission that did not fit yet, reused while the local hit is unchanged."""

    @property
    def seq_id(self) -> str:
        return self.seq.seq_id

    @property
    def final_len(self) -> int:
        """Tokens the sequence has when it stops at ``max_new_tokens``."""
        return self.seq.num_prompt_tokens + self.max_new_tokens

    def order_key(self, policy: Policy) -> tuple[int, int]:
        return (self.priority, self.arrival) if policy == "priority" else (0, self.arrival)


@dataclass
class SchedulerOutput:
    """What one step runs."""

    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    """Tokens each scheduled sequence computes this step, in schedule order."""
    new_block_ids: dict[str, tuple[list[int], ...]] = field(default_factory=dict)
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    rejected: list[tuple[str, str]] = field(default_factory=list)
    external: dict[str, Any] = field(default_factory=dict)
    """Per admitted sequence, the connector's ``FetchedKV`` to write into its new blocks before the step runs."""
    draft_tokens: dict[str, list[int]] = field(default_factory=dict)
    """Per decoding sequence with drafts this step: the draft tokens the step computes after its one
    scheduled token (they hold lookahead slots and take step budget; ``update`` takes the tokens
    the verification accepted)."""

    @property
    def total_tokens(self) -> int:
        """Tokens the step computes, drafts included."""
        return sum(self.num_scheduled_tokens.values()) + sum(map(len, self.draft_tokens.values()))


@dataclass
class SchedulerStats:
    steps: int = 0
    admissions: int = 0
    preemptions: int = 0
    rejections: int = 0
    finished: int = 0
    deferrals: int = 0
    """Admissions put off one step because another sequence was computing the same prefix."""


class Scheduler:
    """Continuous batching with chunked prefill, preemption and admission on a ``KVCacheManager``."""

    def __init__(self, manager: KVCacheManager, config: SchedulerConfig | None = None, *,
                 connector: KVConnector | None = None) -> None:
        self.manager = manager
        self.connector = connector
        """External KV tiers: at admission, tokens past the local hit they can supply are loaded, not computed."""
        self.config = config or SchedulerConfig(max_num_batched_tokens=manager.max_num_batched_tokens)
        if self.config.max_num_batched_tokens > manager.max_num_batched_tokens:
            raise InvalidInputError(
                f"scheduler max_num_batched_tokens={self.config.max_num_batched_tokens} exceeds the manager's "
                f"{manager.max_num_batched_tokens}: the manager's per-request bounds would not hold"
            )
        k = self.config.num_speculative_tokens
        if k and k > manager.max_draft_tokens(1):
            raise InvalidInputError(
                f"num_speculative_tokens={k}, but a decode step of this layout takes at most "
                f"{manager.max_draft_tokens(1)} draft tokens (a step with drafts stays within one block of a "
                f"recurrent state that checkpoints)"
            )
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.stats = SchedulerStats()
        self._arrivals = 0
        self._pending_rejections: list[tuple[str, str]] = []
        self._unapplied: SchedulerOutput | None = None  # the latest schedule() until update() applies it

    # ------------------------------------------------------------------ add
    def add(self, seq: ScheduledSequence, max_new_tokens: int, priority: int = 0,
            stop_token_ids: Iterable[int] | None = (), *, prefill_weight: int = 1) -> Request:
        """Queue a sequence; refuse one longer than ``max_model_len``; reject one that can never fit.

        Each of its prompt tokens takes ``prefill_weight`` tokens of a step's budget (2 for a token
        that costs up to twice a plain prefill token's time, as prompt scoring does).
        Every argument is checked before anything is recorded: a refused ``add`` leaves no trace.
        """
        if not isinstance(seq, ScheduledSequence):
            raise InvalidInputError(f"expected a sequence (hybridkv.Sequence or another ScheduledSequence), "
                                    f"got {type(seq).__name__}")
        if seq.seq_id in self.requests and self.requests[seq.seq_id].status in (Status.WAITING, Status.RUNNING):
            raise InvalidInputError(f"sequence {seq.seq_id!r} is already scheduled")
        if type(max_new_tokens) is not int or max_new_tokens <= 0:
            raise InvalidInputError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        if type(priority) is not int:
            raise InvalidInputError(f"priority must be an integer (lower runs first), got {priority!r}")
        stops = _stop_tokens(stop_token_ids)
        if type(prefill_weight) is not int or prefill_weight < 1:
            raise InvalidInputError(f"prefill_weight must be a positive integer, got {prefill_weight!r}")
        limit = self.manager.max_model_len
        if seq.num_tokens > limit:
            raise SequenceTooLongError(
                f"sequence {seq.seq_id!r} has {seq.num_tokens} tokens; max_model_len is {limit}"
            )
        if seq.num_computed_tokens:
            raise InvalidInputError(f"sequence {seq.seq_id!r} already has computed tokens")
        # Generation stops when the sequence reaches max_model_len tokens (a prompt of exactly
        # max_model_len tokens still gets its one token: it is sampled, never computed).
        max_new = min(max_new_tokens, max(1, limit - seq.num_tokens))
        req = Request(seq, max_new, priority, self._arrivals, stops, prefill_weight=prefill_weight)
        self._arrivals += 1
        self.requests[seq.seq_id] = req
        need = self.manager.blocks_needed_when_empty(min(req.final_len, limit))
        usable = self.manager.layout.num_blocks - 1
        if need > usable:
            self._reject(req, f"needs {need} blocks at its full length of {req.final_len} tokens; "
                              f"the pool has {usable}")
            return req
        self._enqueue(req, front=False)
        return req

    def _enqueue(self, req: Request, *, front: bool) -> None:
        """Queue ``req``: by (priority, arrival) under ``priority``, else at the back or the front."""
        req.status = Status.WAITING
        if self.config.policy == "priority":
            insort(self.waiting, req, key=lambda r: r.order_key("priority"))
        elif front:
            self.waiting.insert(0, req)
        else:
            self.waiting.append(req)

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        """Pick the sequences and token counts of the next step (a previous one that scheduled tokens
        is applied first: its sequences' allocations stand until their step is reported)."""
        if self._unapplied is not None and self._unapplied.num_scheduled_tokens:
            raise InvalidInputError(
                "the previous schedule() has not been applied: update() it first (with no sampled tokens, "
                "after aborting its requests, if its step failed)"
            )
        cfg = self.config
        out = SchedulerOutput(rejected=self._pending_rejections)
        self._pending_rejections = []
        budget = cfg.max_num_batched_tokens
        mgr = self.manager
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            seq = req.seq
            n = self._chunk(req, seq.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            drafts = self._drafts(req, n, budget)
            new = mgr.allocate(seq, n, num_lookahead_tokens=len(drafts))
            if new is None and drafts:  # drafts yield before anything is preempted
                drafts = []
                new = mgr.allocate(seq, n)
            while new is None:
                victim = self._victim()
                idx = self.running.index(victim)
                budget += self._preempt(victim, out, itself=victim is req)
                if victim is req:
                    break
                if idx < i:  # a sequence already scheduled this step: the list shifted left
                    i -= 1
                new = mgr.allocate(seq, n)
            if new is None:  # req preempted itself: the next sequence now sits at index i
                continue
            out.num_scheduled_tokens[seq.seq_id] = n
            out.new_block_ids[seq.seq_id] = new
            if drafts:
                out.draft_tokens[seq.seq_id] = drafts
            budget -= self._cost(req, seq.num_computed_tokens, n) + len(drafts)
            i += 1
        if not out.preempted:
            self._admit(out, budget, self._computing(out) if cfg.defer_shared_prefills and self.waiting else None)
        self.stats.steps += 1
        for sid, _ in out.rejected:  # the caller learns of them now
            self._forget_ended(sid)
        self._unapplied = out
        return out

    def _drafts(self, req: Request, n: int, budget: int) -> list[int]:
        """The draft tokens ``req`` verifies this step (taken off it: drafts are used once): only on a
        decode, within the step budget, ``max_model_len`` and the tokens it may still generate."""
        drafts, req.draft_token_ids = req.draft_token_ids, []
        seq = req.seq
        if not drafts or n != 1 or seq.num_computed_tokens + 1 != seq.num_tokens:
            return []
        k = min(len(drafts), budget - n, self._draft_room(req))
        return drafts[:k] if k > 0 else []

    def _draft_room(self, req: Request) -> int:
        """Draft slots a decode step of ``req`` may hold at its current length: what admission reserves
        (``num_speculative_tokens``, less when the request may generate fewer tokens or reaches
        ``max_model_len``; ``_drafts`` caps each step's drafts with it)."""
        seq = req.seq
        return max(0, min(self.config.num_speculative_tokens, self.manager.max_model_len - seq.num_tokens,
                          req.max_new_tokens - seq.num_output_tokens - 1))

    def set_draft_tokens(self, seq_id: str, token_ids: Iterable[int]) -> None:
        """Propose draft tokens for the next decode step of running sequence ``seq_id`` (at most
        ``num_speculative_tokens``; replaces any earlier proposal). The step computes them after the
        sequence's last token and ``update`` takes the accepted ones with the token sampled after."""
        req = self.requests.get(seq_id)
        if req is None or req.status is not Status.RUNNING:
            raise InvalidInputError(f"sequence {seq_id!r} is not running: drafts are for running sequences")
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
            raise InvalidInputError(f"draft tokens must be an iterable of token ids, got {token_ids!r}")
        drafts = list(token_ids)
        limit = self.config.num_speculative_tokens
        if len(drafts) > limit:
            raise InvalidInputError(f"sequence {seq_id!r}: {len(drafts)} draft tokens; num_speculative_tokens "
                                    f"is {limit}")
        for t in drafts:
            if type(t) is not int or t < 0:
                raise InvalidInputError(f"sequence {seq_id!r}: draft token {t!r} is not a non-negative integer")
        req.draft_token_ids = drafts

    def _chunk(self, req: Request, start: int, budget: int) -> int:
        """Tokens ``req`` computes this step from token ``start`` on (prompt chunks capped and weighted)."""
        seq = req.seq
        n = min(seq.num_tokens - start, budget)
        if start < seq.num_prompt_tokens:
            threshold = self.config.long_prefill_token_threshold
            if threshold:
                n = min(n, threshold)
            n = min(n, budget // req.prefill_weight)
            if self.config.prefill_context_cost and n > 0 and self._cost(req, start, n) > budget:
                lo, hi = 0, n  # the most tokens whose cost fits: cost(lo) fits, cost(hi) does not
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if self._cost(req, start, mid) <= budget else (lo, mid)
                n = max(lo, 1) if budget == self.config.max_num_batched_tokens else lo
        return n

    def _cost(self, req: Request, start: int, n: int) -> int:
        """The step budget ``n`` tokens of ``req`` from token ``start`` on take."""
        if start >= req.seq.num_prompt_tokens:
            return n
        context = self.config.prefill_context_cost * (n * start + n * (n - 1) / 2)  # sum of their positions
        return n * req.prefill_weight + math.ceil(context * req.prefill_weight)

    def _first_block(self, seq: ScheduledSequence, start: int) -> bytes | None:
        """The hash of the prompt block holding token ``start`` (None past the last full one)."""
        mgr = self.manager
        if start >= seq.num_prompt_tokens:
            return None
        hashes = seq.block_hashes(mgr.hasher, mgr.hash_block_size)
        i = start // mgr.hash_block_size
        return hashes[i] if i < len(hashes) else None

    def _computing(self, out: SchedulerOutput) -> set[bytes] | None:
        """The first prompt block each prefill scheduled so far in ``out`` computes (None without
        prefix caching: nothing to wait for)."""
        if not self.manager.enable_prefix_caching:
            return None
        scheduled = out.num_scheduled_tokens
        keys = (self._first_block(r.seq, r.seq.num_computed_tokens) for r in self.running if r.seq_id in scheduled)
        return {k for k in keys if k is not None}

    def _admit(self, out: SchedulerOutput, budget: int, computing: set[bytes] | None) -> None:
        """Admit waiting sequences while the step's budget, ``max_num_seqs`` and the pool allow;
        with ``computing`` (``defer_shared_prefills``), one whose first block to compute is in it waits."""
        cfg = self.config
        mgr = self.manager
        i = 0
        while i < len(self.waiting) and budget > 0 and len(self.running) < cfg.max_num_seqs:
            req = self.waiting[i]
            seq = req.seq
            hit = mgr.lookup(seq)
            fetched = self._fetch_external(req, hit.num_tokens)
            if fetched is _LOADING:  # its tier load is in flight: the requests behind it go first
                i += 1
                continue
            external = fetched.num_tokens if fetched is not None else 0
            key = None
            if computing is not None:
                key = self._first_block(seq, hit.num_tokens + external)
                if key in computing:
                    self.stats.deferrals += 1
                    i += 1
                    continue
            n = self._chunk(req, hit.num_tokens + external, budget)
            if n <= 0:  # its weighted chunk does not fit the rest of this step's budget
                break
            if cfg.admission == "guaranteed_no_preemption" and not self._growth_fits(req, hit.num_blocks):
                break
            new = mgr.allocate(seq, n, hit=hit, num_external_tokens=external, whole_sequence_must_fit=True,
                               reserve_lookahead_tokens=self._draft_room(req))
            if new is None:
                break
            self.waiting.pop(i)
            seq.num_computed_tokens = hit.num_tokens + external
            req.status = Status.RUNNING
            req.num_hit_tokens = hit.num_tokens
            if hit.full_hit_tokens > hit.num_tokens:
                req.lost_hit_tokens = mgr.lost_hit_tokens(seq.seq_id)
            req.num_external_tokens = external
            req.load = None
            if external:
                out.external[seq.seq_id] = fetched
            self.running.append(req)
            out.admitted.append(seq.seq_id)
            out.num_scheduled_tokens[seq.seq_id] = n
            out.new_block_ids[seq.seq_id] = new
            self.stats.admissions += 1
            budget -= self._cost(req, seq.num_computed_tokens, n)
            if computing is not None and key is not None:
                computing.add(key)

    def _fetch_external(self, req: Request, local_hit: int) -> Any:
        """The connector's verified payloads for the tokens after ``local_hit`` (None without a
        connector), or ``_LOADING`` while the tier load is still in flight.

        The load starts at the request's first visit and is kept on the request, so a queue head
        is not looked up in the tiers every step; it starts again only when the local hit changed
        (its payloads would start at the wrong token). Fetched before ``allocate`` so a tier fault
        only shortens what is allocated as external.
        """
        if self.connector is None:
            return None
        load = req.load
        if load is not None and load.start_token != local_hit:
            if load.done() and local_hit >= load.start_token + load.result().num_tokens:
                return None  # the device cache now holds all the load brought (another request computed it)
            load.cancel()
            load = None
        if load is None:
            load = req.load = self.connector.start_load(req.seq, local_hit)
        if not load.done():
            return _LOADING
        return load.result()

    def _growth_fits(self, req: Request, hit_blocks: int) -> bool:
        """Whether every admitted sequence can grow to its final length once ``req`` joins."""
        mgr = self.manager
        need = mgr.blocks_needed_when_empty(req.final_len) - hit_blocks
        for r in self.running:
            held = mgr.num_held_blocks(r.seq_id)
            need += max(0, mgr.blocks_needed_when_empty(r.final_len) - held)
        return need <= mgr.num_admissible_blocks

    def _victim(self) -> Request:
        """The running sequence to preempt: lowest priority, then newest."""
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: r.order_key("priority"))
        return self.running[-1]

    def _preempt(self, victim: Request, out: SchedulerOutput, *, itself: bool) -> int:
        """Free ``victim`` and queue it again; returns the step budget its tokens (drafts included)
        this step had taken."""
        returned = self._cost(victim, victim.seq.num_computed_tokens, out.num_scheduled_tokens.pop(victim.seq_id, 0))
        returned += len(out.draft_tokens.pop(victim.seq_id, ()))
        self.running.remove(victim)
        self.manager.free(victim.seq, preempted=True)
        victim.seq.num_computed_tokens = 0
        if victim.load is not None:
            victim.load.cancel()
        victim.load = None
        victim.num_preemptions += 1
        self.stats.preemptions += 1
        out.new_block_ids.pop(victim.seq_id, None)
        out.preempted.append(victim.seq_id)
        if itself and not out.draft_tokens:  # others' drafts took the room: it may well fit without them
            victim.num_self_preemptions += 1
        if victim.num_self_preemptions >= self.config.max_self_preemptions:
            usable = self.manager.layout.num_blocks - 1
            self._reject(victim, f"preempted itself {victim.num_self_preemptions} times: at "
                                 f"{victim.seq.num_tokens} tokens it does not fit next to the other sequences "
                                 f"in {usable} blocks")
            out.rejected.extend(self._pending_rejections)
            self._pending_rejections = []
            return returned
        self._enqueue(victim, front=True)
        return returned

    def _reject(self, req: Request, reason: str) -> None:
        req.status = Status.REJECTED
        req.finish_reason = f"rejected: {reason}"
        self.manager.free(req.seq)
        self.stats.rejections += 1
        self._pending_rejections.append((req.seq_id, req.finish_reason))

    # ------------------------------------------------------------------ update
    def update(self, out: SchedulerOutput, sampled: Mapping[str, Iterable[int]] | None = None) -> list[Request]:
        """Advance the sequences a step ran; append sampled tokens; finish and free the done ones.

        ``out`` must be the latest ``schedule()``'s output, applied once. ``sampled[seq_id]`` holds
        the tokens sampled for a sequence whose step reached the end of its known tokens (a decode
        or a final prefill chunk); other sequences are ignored. Everything is checked before any
        sequence advances: a refused ``update`` changes nothing and can be retried.
        """
        if out is not self._unapplied:
            raise InvalidInputError(
                "update() takes the output of the latest schedule(), once (this one is stale or applied already)"
            )
        if sampled is None:
            sampled = {}
        elif not isinstance(sampled, Mapping):
            raise InvalidInputError(f"sampled must map sequence ids to token lists, got {type(sampled).__name__}")
        steps = self._validated(out, sampled)
        self._unapplied = None
        return self._apply(out, steps)

    def _validated(self, out: SchedulerOutput,
                   sampled: Mapping[str, Iterable[int]]) -> list[tuple[Request, int, list[int] | None]]:
        """``update``'s check: each running sequence the step ran, its scheduled tokens and the sampled
        tokens it keeps (None: its step did not reach the end of its tokens); raises on bad samples."""
        steps: list[tuple[Request, int, list[int] | None]] = []
        for req in self.running:
            n = out.num_scheduled_tokens.get(req.seq_id)
            if n is None:
                continue
            seq = req.seq
            tokens: list[int] | None = None
            if seq.num_computed_tokens + n == seq.num_tokens:
                tokens = _sampled_tokens(seq.seq_id, sampled.get(seq.seq_id))
                drafts = out.draft_tokens.get(seq.seq_id, [])
                if len(tokens) > 1 + len(drafts) or tokens[:-1] != drafts[:len(tokens) - 1]:
                    raise InvalidInputError(
                        f"sequence {seq.seq_id!r}: sampled {tokens} after drafts {drafts}: a step samples one "
                        f"token after the accepted drafts, which lead it"
                    )
                tokens = self._kept(req, tokens)
                if seq.num_tokens + len(tokens) > self.manager.max_model_len + 1:
                    raise InvalidInputError(
                        f"sequence {seq.seq_id!r}: {len(tokens)} sampled tokens would pass max_model_len "
                        f"{self.manager.max_model_len}"
                    )
            steps.append((req, n, tokens))
        return steps

    def _apply(self, out: SchedulerOutput, steps: list[tuple[Request, int, list[int] | None]]) -> list[Request]:
        """``update``'s change: advance and extend the ``_validated`` sequences; finish and free the done ones."""
        finished: list[Request] = []
        for req, n, tokens in steps:
            seq = req.seq
            seq.num_computed_tokens += n
            if tokens is None:
                continue
            seq.num_computed_tokens += len(tokens) - 1  # the accepted drafts (a step samples one more)
            seq.append_token_ids(tokens)
            reason = self._finish_reason(req, tokens)
            if reason:
                req.status = Status.FINISHED
                req.finish_reason = reason
                self.manager.free(seq)
                self.stats.finished += 1
                finished.append(req)
            elif seq.seq_id in out.draft_tokens:
                self.manager.release_lookahead(seq)  # the rejected drafts' blocks
        if finished:
            done = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in done]
            for req in finished:
                self._forget_ended(req.seq_id)
        return finished

    def _kept(self, req: Request, tokens: list[int]) -> list[int]:
        """``tokens`` up to the first stop token and the request's ``max_new_tokens``."""
        room = req.max_new_tokens - req.seq.num_output_tokens
        kept = tokens[:max(1, room)]
        for i, t in enumerate(kept):
            if t in req.stop_token_ids:
                return kept[:i + 1]
        return kept

    def _finish_reason(self, req: Request, tokens: list[int]) -> str | None:
        seq = req.seq
        if any(t in req.stop_token_ids for t in tokens):
            return "stop"
        if seq.num_output_tokens >= req.max_new_tokens:
            return "length"
        if seq.num_tokens >= self.manager.max_model_len and seq.num_output_tokens:
            return "max_model_len"
        return None

    # ------------------------------------------------------------------ queries
    @property
    def has_unfinished(self) -> bool:
        """Whether any sequence waits or runs."""
        return bool(self.waiting or self.running or self._pending_rejections)

    @property
    def prefill_tokens_pending(self) -> int:
        """Prompt tokens still to prefill: every waiting sequence's whole prompt (its hit is not known
        until it is admitted) and the rest of each running one's. What a request arriving now waits
        behind before its own prefill (a router's estimate of the work ahead of its first token)."""
        pending = sum(r.seq.num_tokens for r in list(self.waiting))
        for r in list(self.running):
            seq = r.seq
            rest = seq.num_prompt_tokens - seq.num_computed_tokens
            if rest > 0:
                pending += rest
        return pending

    def preempt(self, seq_id: str) -> bool:
        """Preempt a running sequence between steps (freed, queued at the front, recomputed later).

        For engines that must make room outside ``schedule`` (and for tests); returns False when
        ``seq_id`` is not running. Counts towards nothing but ``stats.preemptions``.
        """
        req = self.requests.get(seq_id)
        if req is None or req not in self.running:
            return False
        self._preempt(req, SchedulerOutput(), itself=False)
        return True

    def forget(self, seq_id: str) -> None:
        """Drop the record of a finished or rejected request (needed only with ``keep_finished``)."""
        req = self.requests.get(seq_id)
        if req is not None and req.status in (Status.FINISHED, Status.REJECTED):
            del self.requests[seq_id]

    def _forget_ended(self, seq_id: str) -> None:
        if not self.config.keep_finished:
            self.forget(seq_id)

    def abort(self, seq_id: str) -> None:
        """Drop a sequence wherever it is, freeing its blocks."""
        req = self.requests.get(seq_id)
        if req is None or req.status in (Status.FINISHED, Status.REJECTED):
            return
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        if req.load is not None:
            req.load.cancel()
            req.load = None
        self.manager.free(req.seq)
        req.status = Status.FINISHED
        req.finish_reason = "abort"
        self._forget_ended(seq_id)


def _stop_tokens(stop_token_ids: Iterable[int] | None) -> frozenset[int]:
    """Stop token ids as a set (None: none); each a non-negative integer."""
    if stop_token_ids is None:
        return frozenset()
    if isinstance(stop_token_ids, (str, bytes)) or not isinstance(stop_token_ids, Iterable):
        raise InvalidInputError(f"stop_token_ids must be an iterable of token ids, got {stop_token_ids!r}")
    stops = list(stop_token_ids)
    for t in stops:
        if type(t) is not int or t < 0:
            raise InvalidInputError(f"stop_token_ids must be non-negative integers, found {t!r}")
    return frozenset(stops)


def _sampled_tokens(seq_id: str, tokens: object) -> list[int]:
    """The tokens sampled for a sequence whose step reached its last token, checked."""
    if tokens is None:
        raise InvalidInputError(f"sequence {seq_id!r} computed all its tokens this step: pass its sampled token")
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Iterable):
        raise InvalidInputError(f"sequence {seq_id!r}: sampled tokens must be a list of token ids, got {tokens!r}")
    out = list(tokens)
    if not out:
        raise InvalidInputError(f"sequence {seq_id!r} computed all its tokens this step: pass its sampled token")
    for t in out:
        if type(t) is not int or t < 0:
            raise InvalidInputError(f"sequence {seq_id!r}: sampled token {t!r} is not a non-negative integer")
    return out

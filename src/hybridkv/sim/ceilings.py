"""Hit-rate ceilings of an external tier of a given size on a trace: idealised LRU caches to compare with.

What it models, in full: ``docs/SIMULATOR.md``, "Hit-rate ceilings".
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass

from hybridkv.core import BlockHasher
from hybridkv.errors import InvalidInputError
from hybridkv.sim.synthetic import SyntheticSequence
from hybridkv.sim.workloads import SIM_ANSWER_TOKEN, SimRequest

MODELS = ("growing", "end-checkpoint", "junctions", "infinite")
TURN_MODELS = ("growing", "prompt-end", "turn-end", "infinite")


@dataclass(frozen=True)
class CeilingResult:
    """One ceiling: hit tokens over prompt tokens of the requests replayed."""

    model: str
    hit_tokens: int
    prompt_tokens: int
    requests: int
    evicted_bytes: int
    checkpoints_stored: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def _chain_keys(req: SimRequest) -> list[tuple[object, int]]:
    """Per content block of the prompt: a key naming the whole prefix up to the block's end, and its tokens."""
    out: list[tuple[object, int]] = []
    parent: object = req.cache_salt
    for key, n in req.segments:
        parent = hash((parent, key, n))
        out.append((parent, n))
    return out


def _servable(requests: Sequence[SimRequest], max_prompt_tokens: int | None) -> list[SimRequest]:
    """The requests an engine would serve: those whose prompt fits ``max_prompt_tokens`` (None: all)."""
    return [r for r in requests if max_prompt_tokens is None or r.prompt_len <= max_prompt_tokens]


def _held_run(chain: list[tuple[object, int]], held_keys: Container[object], lru: Container[object],
              checkpoints: bool) -> tuple[int, int, object]:
    """The hit: the run of leading blocks of ``chain`` in ``held_keys`` (its length), and the position
    and key of its last block the model can resume at (one with a checkpoint when ``checkpoints``)."""
    held = pos = resume = 0
    resume_key: object = None
    for key, tokens in chain:
        if key not in held_keys:
            break
        held += 1
        pos += tokens
        if not checkpoints or ("cp", key) in lru:
            resume, resume_key = pos, key
    return held, resume, resume_key


def lru_ceiling(requests: Sequence[SimRequest], capacity_bytes: float, *, model: str, growing_bytes_per_token: float,
                checkpoint_bytes: Callable[[int], float], block_size: int, alignment: int = 16,
                max_prompt_tokens: int | None = None, interval_blocks: int = 0) -> CeilingResult:
    """The hit rate of the cache ``model`` (``docs/SIMULATOR.md``) of ``capacity_bytes`` on ``requests``, whose
    segments are content blocks of ``block_size`` tokens (the last one of a prompt partial).

    ``checkpoint_bytes(p)`` is the size of a checkpoint at token ``p``; requests longer than
    ``max_prompt_tokens`` are skipped (an engine rejects them).
    """
    if model not in MODELS:
        raise InvalidInputError(f"model must be one of {', '.join(MODELS)}, got {model!r}")
    lru: OrderedDict[object, float] = OrderedDict()  # entry -> bytes, least recently used first
    used = 0.0
    evicted = 0.0
    stored_checkpoints = 0
    hit_total = 0
    seen: set[object] = set()
    checkpoints = model in ("end-checkpoint", "junctions")
    served = _servable(requests, max_prompt_tokens)
    for req in served:
        length = req.prompt_len
        chain = _chain_keys(req)
        cap = (length - 1) // alignment * alignment
        held, resume, resume_key = _held_run(chain, seen if model == "infinite" else lru, lru, checkpoints)
        hit_total += min(resume, cap) // alignment * alignment
        if model == "infinite":
            seen.update(key for key, _ in chain)
            continue
        # What the request touches, least recent first: its checkpoints, then its blocks tail to head.
        touched: list[tuple[object, float]] = []
        if checkpoints:
            full = length // block_size
            end_points = {full} if full else set()
            if model == "junctions" and held and chain[held - 1][0] != resume_key:
                end_points.add(held)
            if interval_blocks:
                end_points.update(range(interval_blocks, len(chain) + 1, interval_blocks))
                end_points.discard(len(chain) if length % block_size else -1)
            for m in sorted(end_points):
                p = sum(t for _, t in chain[:m])
                if ("cp", chain[m - 1][0]) not in lru:
                    stored_checkpoints += 1
                touched.append((("cp", chain[m - 1][0]), checkpoint_bytes(p)))
            if resume_key is not None:
                touched.append((("cp", resume_key), 0.0))
        touched += [(key, tokens * growing_bytes_per_token) for key, tokens in reversed(chain)]
        used, dropped = _touch_lru(lru, touched, used, capacity_bytes)
        evicted += dropped
    return CeilingResult(model, hit_total, sum(r.prompt_len for r in served), len(served), int(evicted),
                         stored_checkpoints)


def block_chain(req: SimRequest, block_size: int, answer_token: int = SIM_ANSWER_TOKEN) -> list[object]:
    """Keys of the full blocks of ``req``'s prompt and answer (``max_new_tokens`` tokens, as the simulator
    generates them); each names the whole prefix up to the block's end."""
    if req.token_ids is None:
        seq = SyntheticSequence(req.request_id, req.segments, req.cache_salt)
        seq.append_token_ids([answer_token] * req.max_new_tokens)
        return list(seq.block_hashes(BlockHasher(), block_size))
    ids = [*req.token_ids, *[answer_token] * req.max_new_tokens]
    parent: object = req.cache_salt
    keys: list[object] = []
    for i in range(0, len(ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(ids[i : i + block_size])))
        keys.append(parent)
    return keys


def turn_ceiling(requests: Sequence[SimRequest], capacity: float, *, model: str, growing_per_token: float,
                 span: Callable[[int], Sequence[tuple[int, int, float]]], alignment: int,
                 max_prompt_tokens: int | None = None) -> CeilingResult:
    """The hit rate of an LRU cache of ``capacity`` (bytes, or blocks: any unit the sizes share) holding
    ``requests``' prompts and answers, replayed one at a time; ``model`` is one of ``TURN_MODELS``
    (``docs/SIMULATOR.md``). Entries are blocks of ``alignment`` tokens: a growing block
    (``alignment * growing_per_token``) and the blocks of the other groups a hit at token ``p`` reads,
    ``span(p)``: ``(group, block index, size)`` (a window's blocks, a state), shared by the
    checkpoints whose spans overlap."""
    if model not in TURN_MODELS:
        raise InvalidInputError(f"model must be one of {', '.join(TURN_MODELS)}, got {model!r}")
    bs = alignment
    lru: OrderedDict[object, float] = OrderedDict()
    used = evicted = 0.0
    seen: set[object] = set()
    hit_total = stored = 0
    anywhere = model in ("growing", "infinite")
    served = _servable(requests, max_prompt_tokens)
    for req in served:
        length = req.prompt_len
        keys = block_chain(req, bs)

        def entries(m: int) -> list[tuple[object, float]]:
            """The non-growing blocks a hit after ``m`` blocks reads."""
            return [(("w", g, keys[i]), size) for g, i, size in span(m * bs)]  # noqa: B023

        cap = (length - 1) // bs
        held = 0
        for key in keys[:cap]:
            if key not in (seen if model == "infinite" else lru):
                break
            held += 1
        resume = held  # the longest held run, back to where the other groups' blocks are held too
        while resume and not anywhere and not all(e in lru for e, _ in entries(resume)):
            resume -= 1
        hit_total += resume * bs
        computed = (length + req.max_new_tokens - 1) // bs
        if model == "infinite":
            seen.update(keys[:computed])
            continue
        touched: list[tuple[object, float]] = []
        if not anywhere:
            points = {cap}  # the prompt's end
            if held > resume:  # a junction: the chain ran past the last checkpoint on it
                points.add(held)
            if model == "turn-end":
                points.add(computed)
            for m in sorted(p for p in points if p > 0):
                stored += 1
                touched += entries(m)
            if resume and resume not in points:  # the checkpoint this request resumed from served it:
                live = {e for e, _ in touched}  # evicted first, as a device drops what a window moved past
                for e, _ in entries(resume):
                    if e in lru and e not in live:
                        lru.move_to_end(e, last=False)
        touched += [(key, bs * growing_per_token) for key in reversed(keys[:computed])]
        used, dropped = _touch_lru(lru, touched, used, capacity)
        evicted += dropped
    return CeilingResult(model, hit_total, sum(r.prompt_len for r in served), len(served), int(evicted), stored)


def _touch_lru(lru: OrderedDict[object, float], touched: list[tuple[object, float]], used: float, capacity: float
               ) -> tuple[float, float]:
    """Move ``touched`` keys to the LRU's most recent end (a new key enters with its size; one of size 0,
    or larger than the whole capacity, is not stored), then evict from the least recent end until
    ``used`` fits ``capacity``. Returns the new ``used`` and the bytes evicted."""
    evicted = 0.0
    for key, size in touched:
        old = lru.pop(key, None)
        if old is not None:
            size = old
        elif not size or size > capacity:
            continue
        lru[key] = size
        if old is None:
            used += size
    while used > capacity:
        _, size = lru.popitem(last=False)
        used -= size
        evicted += size
    return used, evicted

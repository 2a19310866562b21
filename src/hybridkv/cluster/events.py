"""KV-cache events in vLLM's wire model, as plain data (standard library only).

vLLM's ``KVEventBatch`` and its ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` events as
frozen dataclasses, converted from the core's events and to and from the lists and maps msgpack
carries (``wire.py`` does the bytes); ``batch_from_obj`` also reads older vLLM's array events.
See docs/CLUSTER.md, "Events on the wire".
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.core import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVCacheLayout, KVCacheSpec
from hybridkv.errors import InvalidInputError

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

ExternalHash = bytes | int
"""A block hash on the wire: the digest, or (vLLM's default) its low 64 bits as an integer."""

# The core's kind names and vLLM's ``KVCacheSpecKind`` values.
_VLLM_KINDS = {
    "full": "full_attention",
    "mla": "mla_attention",
    "sliding_window": "sliding_window",
    "chunked_local": "chunked_local_attention",
    "cross_attention": "cross_attention",
    "encoder_only": "encoder_only_attention",
}


class EventDecodeError(InvalidInputError):
    """A received batch is not a KV-event batch (names the field that is wrong)."""


@dataclass(frozen=True, slots=True)
class BlockStoredEvent:
    """Full blocks entered a cache. ``group_idx``, ``kind`` and ``sliding_window`` describe the group
    (None from publishers that do not say); ``medium`` names where the blocks live."""

    block_hashes: tuple[ExternalHash, ...]
    parent_block_hash: ExternalHash | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None
    kind: str | None = None
    sliding_window: int | None = None
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemovedEvent:
    """Blocks left a cache."""

    block_hashes: tuple[ExternalHash, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllClearedEvent:
    """The publisher's whole prefix cache was reset."""


WireEvent = BlockStoredEvent | BlockRemovedEvent | AllClearedEvent


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The events of one engine step, stamped with the wall-clock time they were taken."""

    ts: float
    events: tuple[WireEvent, ...]
    data_parallel_rank: int | None = None


# ---------------------------------------------------------------------- from the core
def vllm_kind(spec: KVCacheSpec) -> str:
    """vLLM's ``kv_cache_spec_kind`` for a core spec (``mamba`` for every recurrent mode)."""
    kind = spec.kind
    if kind.startswith("mamba"):
        return "mamba"
    return _VLLM_KINDS.get(kind, "unknown")


def group_metadata(layout: KVCacheLayout) -> tuple[tuple[str, int | None], ...]:
    """Per group of ``layout``: its vLLM kind and sliding window (None for other kinds)."""
    return tuple((vllm_kind(g.spec), getattr(g.spec, "sliding_window", None)) for g in layout.groups)


def _external(h: bytes, int_hashes: bool) -> ExternalHash:
    return int.from_bytes(h[-8:], "big") if int_hashes else h


def from_core_events(events: Sequence[KVCacheEvent], metadata: Sequence[tuple[str, int | None]], *,
                     medium: str = MEDIUM_GPU, int_hashes: bool = False) -> list[WireEvent]:
    """The core's events (``KVCacheManager.take_events()``) as wire events of ``medium``, each store
    tagged with its group's kind and window from ``metadata`` (``group_metadata(layout)``).
    ``int_hashes`` sends hashes as their low 64 bits, as vLLM does by default. A run of removals from
    one group becomes one event (an engine evicting many blocks in a step sends them together)."""
    out: list[WireEvent] = []
    run: list[bytes] = []
    run_group = -1

    def hashes(hs: Sequence[bytes]) -> tuple[ExternalHash, ...]:
        return tuple(int.from_bytes(h[-8:], "big") for h in hs) if int_hashes else tuple(hs)

    def flush() -> None:
        if run:
            out.append(BlockRemovedEvent(hashes(run), medium, run_group))
            run.clear()

    for e in events:
        if type(e) is BlockRemoved:
            if e.group != run_group:
                flush()
                run_group = e.group
            run.extend(e.block_hashes)
            continue
        flush()
        if isinstance(e, BlockStored):
            kind, window = metadata[e.group]
            parent = None if e.parent_block_hash is None else _external(e.parent_block_hash, int_hashes)
            out.append(BlockStoredEvent(
                block_hashes=hashes(e.block_hashes), parent_block_hash=parent,
                token_ids=tuple(e.token_ids), block_size=e.block_size, medium=medium, group_idx=e.group,
                kind=kind, sliding_window=window))
        elif isinstance(e, AllBlocksCleared):
            out.append(AllClearedEvent())
        else:
            raise InvalidInputError(f"not a KV-cache event: {type(e).__name__}")
    flush()
    return out


def make_batch(events: Sequence[WireEvent], *, ts: float | None = None,
               data_parallel_rank: int | None = None) -> EventBatch:
    """A batch of ``events`` stamped now (or at ``ts``)."""
    return EventBatch(time.time() if ts is None else ts, tuple(events), data_parallel_rank)


# ---------------------------------------------------------------------- to and from msgpack objects
def batch_to_obj(batch: EventBatch) -> list[Any]:
    """The msgpack object of ``batch``: what vLLM's msgspec ``KVEventBatch`` encodes to."""
    obj: list[Any] = [batch.ts, [event_to_obj(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        obj.append(batch.data_parallel_rank)
    return obj


def event_to_obj(e: WireEvent) -> dict[str, Any]:
    """One event as vLLM's tagged map (required fields always, optional ones when set)."""
    if isinstance(e, BlockStoredEvent):
        obj: dict[str, Any] = {
            "type": "BlockStored", "block_hashes": list(e.block_hashes), "parent_block_hash": e.parent_block_hash,
            "token_ids": list(e.token_ids), "block_size": e.block_size, "lora_id": e.lora_id,
            "medium": e.medium, "lora_name": e.lora_name,
        }
        for key, value in (("extra_keys", None if e.extra_keys is None else list(e.extra_keys)),
                           ("group_idx", e.group_idx), ("kv_cache_spec_kind", e.kind),
                           ("kv_cache_spec_sliding_window", e.sliding_window)):
            if value is not None:
                obj[key] = value
        return obj
    if isinstance(e, BlockRemovedEvent):
        obj = {"type": "BlockRemoved", "block_hashes": list(e.block_hashes), "medium": e.medium}
        if e.group_idx is not None:
            obj["group_idx"] = e.group_idx
        return obj
    return {"type": "AllBlocksCleared"}


# Field order of the array form (older vLLM releases; fields were only ever appended).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


def batch_from_obj(obj: object) -> EventBatch:
    """An ``EventBatch`` from a decoded msgpack object; ``EventDecodeError`` names what is wrong."""
    if not isinstance(obj, (list, tuple)) or not 2 <= len(obj) <= 3:
        raise EventDecodeError(f"an event batch is an array [ts, events, rank?], got {_short(obj)}")
    ts, events = obj[0], obj[1]
    rank = obj[2] if len(obj) == 3 else None
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise EventDecodeError(f"batch ts must be a number, got {_short(ts)}")
    if not isinstance(events, (list, tuple)):
        raise EventDecodeError(f"batch events must be an array, got {_short(events)}")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise EventDecodeError(f"batch data_parallel_rank must be an integer, got {_short(rank)}")
    return EventBatch(float(ts), tuple(event_from_obj(e, i) for i, e in enumerate(events)), rank)


def event_from_obj(obj: object, index: int = 0) -> WireEvent:
    """One event from its tagged map (or the older tagged array)."""
    where = f"event {index}"
    tag: object
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], str):
        tag, rest = obj[0], obj[1:]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
        fields: Mapping[Any, Any] = dict(zip(names, rest))
    elif isinstance(obj, Mapping):
        tag, fields = obj.get("type"), obj
    else:
        raise EventDecodeError(f"{where} must be a tagged map or array, got {_short(obj)}")
    if tag == "AllBlocksCleared":
        return AllClearedEvent()
    if tag == "BlockRemoved":
        return BlockRemovedEvent(_hashes(fields, where), _opt_str(fields, "medium", where),
                                 _opt_int(fields, "group_idx", where))
    if tag != "BlockStored":
        raise EventDecodeError(f"{where} has unknown type {tag!r}")
    tokens = fields.get("token_ids", ())
    if not isinstance(tokens, (list, tuple)) or not all(type(t) is int and t >= 0 for t in tokens):
        raise EventDecodeError(f"{where}: token_ids must be an array of non-negative integers")
    block_size = fields.get("block_size", 0)
    if type(block_size) is not int or block_size < 0:
        raise EventDecodeError(f"{where}: block_size must be a non-negative integer, got {_short(block_size)}")
    parent = fields.get("parent_block_hash")
    if parent is not None and not _is_hash(parent):
        raise EventDecodeError(f"{where}: parent_block_hash must be bytes or an integer, got {_short(parent)}")
    extra = fields.get("extra_keys")
    return BlockStoredEvent(
        block_hashes=_hashes(fields, where), parent_block_hash=parent, token_ids=tuple(tokens),
        block_size=block_size, medium=_opt_str(fields, "medium", where),
        group_idx=_opt_int(fields, "group_idx", where), kind=_opt_str(fields, "kv_cache_spec_kind", where),
        sliding_window=_opt_int(fields, "kv_cache_spec_sliding_window", where),
        lora_id=_opt_int(fields, "lora_id", where), lora_name=_opt_str(fields, "lora_name", where),
        extra_keys=tuple(extra) if isinstance(extra, (list, tuple)) else None,
    )


def _is_hash(h: object) -> bool:
    return isinstance(h, bytes) or (type(h) is int and h >= 0)


def _hashes(fields: Mapping[Any, Any], where: str) -> tuple[ExternalHash, ...]:
    hashes = fields.get("block_hashes")
    if not isinstance(hashes, (list, tuple)) or not all(_is_hash(h) for h in hashes):
        raise EventDecodeError(f"{where}: block_hashes must be an array of bytes or integers")
    return tuple(hashes)


def _opt_int(fields: Mapping[Any, Any], key: str, where: str) -> int | None:
    value = fields.get(key)
    if value is not None and (type(value) is not int or value < 0):
        raise EventDecodeError(f"{where}: {key} must be a non-negative integer, got {_short(value)}")
    return value


def _opt_str(fields: Mapping[Any, Any], key: str, where: str) -> str | None:
    value = fields.get(key)
    if value is not None and not isinstance(value, str):
        raise EventDecodeError(f"{where}: {key} must be a string, got {_short(value)}")
    return value


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."

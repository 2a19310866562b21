"""Mooncake traces: the request logs of the Mooncake FAST'25 trace release, read as a workload.

What it models, in full: ``docs/SIMULATOR.md``, "Mooncake traces".
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from itertools import islice
from pathlib import Path

from hybridkv.errors import InvalidInputError
from hybridkv.sim.trace import numbered_lines
from hybridkv.sim.workloads import SimRequest, Workload

__all__ = ["MOONCAKE_BLOCK_SIZE", "read_mooncake"]

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per ``hash_ids`` entry in the Mooncake traces."""

_KEYS = frozenset({"timestamp", "input_length", "output_length", "hash_ids"})


def _int_field(obj: dict[str, object], key: str, minimum: int, where: str) -> int:
    value = obj.get(key)
    if value is None:
        raise InvalidInputError(f"{where}: missing required field '{key}'")
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidInputError(f"{where}: field '{key}' must be an integer >= {minimum}; got {value!r}")
    return value


def _request(obj: object, index: int, where: str, block_size: int, time_scale: float | None,
             mark_last_block: bool) -> SimRequest:
    if not isinstance(obj, dict):
        raise InvalidInputError(f"{where}: expected a JSON object; got {type(obj).__name__}")
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise InvalidInputError(f"{where}: unknown field '{unknown[0]}'; a Mooncake request has "
                                f"{', '.join(sorted(_KEYS))}")
    stamp = obj.get("timestamp")
    if (not isinstance(stamp, (int, float)) or isinstance(stamp, bool) or not math.isfinite(stamp)
            or stamp < 0):
        raise InvalidInputError(f"{where}: field 'timestamp' must be a finite number of ms >= 0; got {stamp!r}")
    length = _int_field(obj, "input_length", 1, where)
    output = _int_field(obj, "output_length", 0, where)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise InvalidInputError(f"{where}: field 'hash_ids' must be a non-empty list of integers; got {ids!r}")
    if any(not isinstance(h, int) or isinstance(h, bool) for h in ids):
        raise InvalidInputError(f"{where}: field 'hash_ids' must hold integers; found "
                                f"{next(h for h in ids if not isinstance(h, int) or isinstance(h, bool))!r}")
    blocks = -(-length // block_size)
    if len(ids) != blocks:
        raise InvalidInputError(f"{where}: {len(ids)} hash_ids for input_length {length}; blocks of {block_size} "
                                f"tokens need {blocks}")
    last = length - block_size * (blocks - 1)
    segments = tuple((f"mooncake:{h}", block_size) for h in ids[:-1]) + ((f"mooncake:{ids[-1]}", last),)
    arrival = stamp / 1000.0 * time_scale if time_scale is not None else 0.0
    # A longer prompt holds a full block where this one's last block is partial, so it parts from
    # this one at the latest where that block starts: the junction of a conversation's next turn.
    hints = (block_size * (blocks - 1),) if mark_last_block and blocks > 1 and last < block_size else ()
    # A request with no output in the log still samples its first token.
    return SimRequest(f"mooncake-{index}", arrival, segments, max(1, output), checkpoint_hints=hints)


def read_mooncake(path: str | os.PathLike[str], *, time_scale: float = 1.0, concurrency: int | None = None,
                  limit: int | None = None, skip: int = 0, block_size: int = MOONCAKE_BLOCK_SIZE,
                  mark_last_block: bool = False) -> Workload:
    """The workload of a Mooncake trace file (gzip when the name ends with '.gz'): its first ``limit``
    requests (all by default) after the first ``skip`` in file order, open loop at ``time_scale`` times
    the logged arrivals (counted from the first request read), or a closed loop of ``concurrency``
    requests in flight. Requests are named by their place among those read (``mooncake-0`` first).
    ``mark_last_block``: a prompt whose last block is partial has that block's start as checkpoint
    hint, where a longer prompt that continues it parts from it (docs/SIMULATOR.md, "Mooncake
    traces"). Errors name ``path:line`` and the field."""
    if concurrency is not None and (not isinstance(concurrency, int) or concurrency < 1):
        raise InvalidInputError(f"concurrency must be a positive integer, got {concurrency!r}")
    if not isinstance(time_scale, (int, float)) or not math.isfinite(time_scale) or time_scale <= 0:
        raise InvalidInputError(f"time_scale must be a positive number, got {time_scale!r}")
    if limit is not None and (not isinstance(limit, int) or limit < 1):
        raise InvalidInputError(f"limit must be a positive integer, got {limit!r}")
    if not isinstance(skip, int) or isinstance(skip, bool) or skip < 0:
        raise InvalidInputError(f"skip must be a whole number of requests >= 0, got {skip!r}")
    if not isinstance(mark_last_block, bool):
        raise InvalidInputError(f"mark_last_block must be True or False, got {mark_last_block!r}")
    p = os.fspath(path)
    scale = None if concurrency is not None else float(time_scale)
    requests: list[SimRequest] = []
    for lineno, text in islice(numbered_lines(p), skip, None):
        if limit is not None and len(requests) >= limit:
            break
        where = f"{p}:{lineno}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        requests.append(_request(obj, len(requests), where, block_size, scale, mark_last_block))
    if not requests:
        raise InvalidInputError(f"{p}: no requests after the first {skip:,}" if skip
                                else f"{p}: no requests in the file")
    requests.sort(key=lambda r: r.arrival_time)  # stable: the file order breaks ties
    if skip and scale is not None:
        start = requests[0].arrival_time
        requests = [replace(r, arrival_time=r.arrival_time - start) for r in requests]
    name = Path(p).name.removesuffix(".gz").removesuffix(".jsonl")
    return Workload(requests, concurrency, name, 0.0, content_block_size=block_size)

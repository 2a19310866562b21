"""Trace files: a workload as JSON Lines, one request per line (gzip-compressed when the path ends with ``.gz``).

What it models, in full: ``docs/SIMULATOR.md``, "Trace files".
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from hybridkv.errors import InvalidInputError
from hybridkv.sim.workloads import SimRequest, Workload

__all__ = ["TRACE_VERSION", "read_trace", "replay", "write_trace"]

TRACE_VERSION = 1

_HEADER_KEYS = frozenset({"hybridkv_trace", "name", "concurrency", "think_time_s"})
_REQUEST_KEYS = frozenset(
    {
        "request_id", "timestamp", "prompt_token_ids", "prompt_len", "segments", "max_new_tokens", "output_len",
        "prefix_group", "prefix_len", "conversation_id", "turn", "cache_salt", "checkpoint_hints",
    }
)  # fmt: skip


@contextmanager
def _open_text(path: str, mode: str) -> Iterator[IO[str]]:
    """A text stream on ``path`` (``mode`` 'r' or 'w'), gzip when it ends with '.gz' (written with mtime 0)."""
    if not path.endswith(".gz"):
        with open(path, mode, encoding="utf-8", newline="\n" if mode == "w" else None) as f:
            yield f
        return
    with open(path, mode + "b") as raw, gzip.GzipFile(fileobj=raw, mode=mode + "b", filename="", mtime=0) as gz:
        text = io.TextIOWrapper(gz, encoding="utf-8", newline="\n" if mode == "w" else None)
        try:
            yield text
        finally:
            text.flush()
            text.detach()


def _request_to_json(r: SimRequest) -> dict[str, Any]:
    obj: dict[str, Any] = {"request_id": r.request_id, "timestamp": r.arrival_time}
    if r.token_ids is not None:
        obj["prompt_token_ids"] = list(r.token_ids)
    else:
        obj["prompt_len"] = r.prompt_len
        obj["segments"] = [[key, n] for key, n in r.segments]
    obj["max_new_tokens"] = r.max_new_tokens
    if r.prefix_group is not None:
        obj["prefix_group"] = r.prefix_group
    if r.conversation_id is not None:
        obj["conversation_id"] = r.conversation_id
    if r.turn:
        obj["turn"] = r.turn
    if r.cache_salt is not None:
        obj["cache_salt"] = r.cache_salt
    if r.checkpoint_hints:
        obj["checkpoint_hints"] = list(r.checkpoint_hints)
    return obj


def write_trace(path: str | os.PathLike[str], workload: Workload) -> None:
    """Write ``workload`` to ``path`` as a header line and one JSON line per request (gzip for '.gz')."""
    header = {
        "hybridkv_trace": TRACE_VERSION,
        "name": workload.name,
        "concurrency": workload.concurrency,
        "think_time_s": workload.think_time_s,
    }
    with _open_text(os.fspath(path), "w") as f:
        f.write(json.dumps(header) + "\n")
        for r in workload.requests:
            f.write(json.dumps(_request_to_json(r)) + "\n")


# --- reading -------------------------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _Line:
    """Typed access to the fields of one parsed line; errors start with ``path:lineno`` and name the field."""

    __slots__ = ("obj", "where")

    def __init__(self, obj: dict[str, Any], where: str) -> None:
        self.obj = obj
        self.where = where

    def error(self, message: str) -> InvalidInputError:
        return InvalidInputError(f"{self.where}: {message}")

    def has(self, key: str) -> bool:
        return key in self.obj

    def get_int(self, key: str, minimum: int, default: int | None = None) -> int:
        value = self.obj.get(key, default)
        if value is None:
            raise self.error(f"missing required field '{key}'")
        if not _is_int(value) or value < minimum:
            raise self.error(f"field '{key}' must be an integer >= {minimum}; got {value!r}")
        assert isinstance(value, int)
        return value

    def opt_int(self, key: str, minimum: int) -> int | None:
        return self.get_int(key, minimum) if self.obj.get(key) is not None else None

    def number(self, key: str, minimum: float, default: float | None = None) -> float:
        value = self.obj.get(key, default)
        if value is None:
            raise self.error(f"missing required field '{key}'")
        if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value) or value < minimum:
            raise self.error(f"field '{key}' must be a finite number >= {minimum}; got {value!r}")
        return float(value)

    def opt_str(self, key: str) -> str | None:
        value = self.obj.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise self.error(f"field '{key}' must be a non-empty string; got {value!r}")
        return value

    def get_str(self, key: str) -> str:
        value = self.opt_str(key)
        if value is None:
            raise self.error(f"missing required field '{key}'")
        return value

    def unknown_keys(self, allowed: frozenset[str]) -> None:
        unknown = sorted(set(self.obj) - allowed)
        if unknown:
            raise self.error(f"unknown field '{unknown[0]}'; allowed fields: {', '.join(sorted(allowed))}")


def _parse_header(line: _Line, default_name: str) -> tuple[int | None, str, float]:
    line.unknown_keys(_HEADER_KEYS)
    version = line.obj["hybridkv_trace"]
    if version != TRACE_VERSION or not _is_int(version):
        raise line.error(f"field 'hybridkv_trace' is {version!r}; this reader knows version {TRACE_VERSION}")
    concurrency = line.opt_int("concurrency", 1)
    name = line.obj.get("name", default_name)
    if not isinstance(name, str):
        raise line.error(f"field 'name' must be a string; got {name!r}")
    return concurrency, name, line.number("think_time_s", 0.0, default=0.0)


def _parse_segments(line: _Line) -> tuple[tuple[str, int], ...]:
    raw = line.obj["segments"]
    if not isinstance(raw, list) or not raw:
        raise line.error(f"field 'segments' must be a non-empty list of [key, num_tokens]; got {raw!r}")
    segments = []
    for i, seg in enumerate(raw):
        if (
            not isinstance(seg, list)
            or len(seg) != 2
            or not isinstance(seg[0], str)
            or not seg[0]
            or not _is_int(seg[1])
            or seg[1] < 1
        ):
            raise line.error(f"field 'segments' item {i} must be [non-empty key, num_tokens >= 1]; got {seg!r}")
        segments.append((seg[0], seg[1]))
    return tuple(segments)


def _parse_prompt(line: _Line, rid: str) -> tuple[tuple[tuple[str, int], ...], tuple[int, ...] | None]:
    """The prompt of a request line as (segments, token_ids or None), by the rules of ``docs/SIMULATOR.md``."""
    prompt_len = line.opt_int("prompt_len", 1)
    prefix_group = line.opt_int("prefix_group", 0)
    if line.has("prompt_token_ids"):
        for other in ("segments", "prefix_len"):
            if line.has(other):
                raise line.error(f"field '{other}' cannot be combined with 'prompt_token_ids'")
        ids = line.obj["prompt_token_ids"]
        if not isinstance(ids, list) or not ids:
            raise line.error(f"field 'prompt_token_ids' must be a non-empty list of integers; got {ids!r}")
        bad = next((t for t in ids if not _is_int(t) or t < 0), None)
        if bad is not None:
            raise line.error(f"field 'prompt_token_ids' must hold integers >= 0; found {bad!r}")
        if prompt_len is not None and prompt_len != len(ids):
            raise line.error(f"field 'prompt_len' is {prompt_len} but 'prompt_token_ids' has {len(ids)} ids")
        return ((f"ids:{rid}", len(ids)),), tuple(ids)
    if line.has("segments"):
        if line.has("prefix_len"):
            raise line.error("field 'prefix_len' cannot be combined with 'segments'")
        segments = _parse_segments(line)
        total = sum(n for _, n in segments)
        if prompt_len is not None and prompt_len != total:
            raise line.error(f"field 'prompt_len' is {prompt_len} but 'segments' hold {total} tokens")
        return segments, None
    if prompt_len is None:
        raise line.error("missing the prompt: give 'prompt_token_ids', 'segments' or 'prompt_len'")
    if line.has("prefix_len"):
        if prefix_group is None:
            raise line.error("field 'prefix_len' needs 'prefix_group'")
        prefix_len = line.get_int("prefix_len", 1)
        if prefix_len > prompt_len:
            raise line.error(f"field 'prefix_len' is {prefix_len}, more than prompt_len {prompt_len}")
        prefix = (f"prefix-{prefix_group}", prefix_len)
        rest = prompt_len - prefix_len
        return ((prefix, (f"suffix-{rid}", rest)) if rest else (prefix,)), None
    return ((f"prompt-{rid}", prompt_len),), None


def _parse_request(line: _Line) -> SimRequest:
    line.unknown_keys(_REQUEST_KEYS)
    rid = line.get_str("request_id")
    timestamp = line.number("timestamp", 0.0)
    if line.has("max_new_tokens") and line.has("output_len"):
        raise line.error("give 'max_new_tokens' or its alias 'output_len', not both")
    max_new = line.get_int("output_len" if line.has("output_len") else "max_new_tokens", 1)
    segments, token_ids = _parse_prompt(line, rid)
    prefix_group = line.opt_int("prefix_group", 0)
    conversation_id = line.opt_str("conversation_id")
    turn = line.get_int("turn", 0, default=0)
    cache_salt = line.opt_str("cache_salt")
    hints = line.obj.get("checkpoint_hints")
    if hints is None:  # a prefix the trace names (``prefix_len``) is a system prompt: its end is a hint
        hints = [segments[0][1]] if line.has("prefix_len") and not line.has("segments") else []
    if not isinstance(hints, list) or not all(_is_int(h) for h in hints):
        raise line.error(f"field 'checkpoint_hints' must be a list of integers; got {hints!r}")
    try:
        return SimRequest(
            rid, timestamp, segments, max_new, prefix_group=prefix_group, conversation_id=conversation_id,
            turn=turn, cache_salt=cache_salt, token_ids=token_ids, checkpoint_hints=tuple(hints),
        )  # fmt: skip
    except InvalidInputError as exc:  # the checks above should have caught it; keep the line number anyway
        raise line.error(str(exc)) from None


def numbered_lines(path: str) -> Iterator[tuple[int, str]]:
    """The non-blank lines of ``path`` with their 1-based numbers; undecodable bytes raise InvalidInputError."""
    lineno = 0
    try:
        with _open_text(path, "r") as f:
            for lineno, text in enumerate(f, 1):
                if text.strip():
                    yield lineno, text
    except (gzip.BadGzipFile, EOFError, zlib.error, UnicodeDecodeError) as exc:
        raise InvalidInputError(f"{path}:{lineno + 1}: cannot read the file: {exc}") from None


def read_trace(path: str | os.PathLike[str]) -> Workload:
    """The workload in a trace file (gzip for '.gz'); every line is validated, errors name ``path:line`` and field."""
    p = os.fspath(path)
    default_name = Path(p).name.removesuffix(".gz").removesuffix(".jsonl")
    concurrency: int | None = None
    name, think_time_s = default_name, 0.0
    requests: list[SimRequest] = []
    first_line: dict[str, int] = {}
    saw_content = False
    for lineno, text in numbered_lines(p):
        where = f"{p}:{lineno}"
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise InvalidInputError(f"{where}: expected a JSON object; got {type(obj).__name__}")
        line = _Line(obj, where)
        if "hybridkv_trace" in obj:
            if saw_content:
                raise line.error("the header ('hybridkv_trace') must be the first line")
            concurrency, name, think_time_s = _parse_header(line, default_name)
            saw_content = True
            continue
        saw_content = True
        request = _parse_request(line)
        if request.request_id in first_line:
            raise line.error(f"request_id {request.request_id!r} already used on line {first_line[request.request_id]}")
        first_line[request.request_id] = lineno
        if concurrency is not None and request.arrival_time != 0.0:
            raise line.error(
                f"field 'timestamp' is {request.arrival_time}; a closed-loop trace (concurrency {concurrency}) needs 0"
            )
        requests.append(request)
    requests.sort(key=lambda r: r.arrival_time)
    return Workload(requests, concurrency, name, think_time_s)


def replay(workload: Workload, *, limit: int | None = None, time_scale: float | None = None,
           concurrency: int | None = None) -> Workload:
    """``workload`` replayed differently: its first ``limit`` requests, arrivals multiplied by ``time_scale``
    (an open loop), or a closed loop of ``concurrency`` requests in flight (arrivals ignored)."""
    if time_scale is not None and concurrency is not None:
        raise InvalidInputError("give time_scale (open loop) or concurrency (closed loop), not both")
    if time_scale is not None and (not math.isfinite(time_scale) or time_scale <= 0):
        raise InvalidInputError(f"time_scale must be a positive number, got {time_scale!r}")
    if time_scale is not None and workload.concurrency is not None:
        raise InvalidInputError(f"workload {workload.name!r} is a closed loop (concurrency {workload.concurrency}): "
                                f"it has no arrival times to scale")
    requests = workload.requests[:limit] if limit is not None else list(workload.requests)
    loop = workload.concurrency
    if concurrency is not None:
        requests = [replace(r, arrival_time=0.0) for r in requests]
        loop = concurrency
    elif time_scale is not None:
        requests = [replace(r, arrival_time=r.arrival_time * time_scale) for r in requests]
    return Workload(requests, loop, workload.name, workload.think_time_s, workload.content_block_size)

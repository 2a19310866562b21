"""Byte sizes written by people: ``268435456``, ``1.5GiB``, ``512M``, ``500MB``, ``1TiB``.

One parser for every command line and spec string (``--kv-cache-memory``, ``--gpu-memory``,
``--tier host:64GiB@25GB/s``, ``--kv-tier disk:PATH:4GiB``). ``KiB``/``MiB``/``GiB``/``TiB`` and the
bare ``K``/``M``/``G``/``T`` are binary, ``KB``/``MB``/``GB``/``TB`` decimal, ``B`` or nothing bytes.
"""

from __future__ import annotations

import argparse
import re

from hybridkv.errors import InvalidInputError

MAX_BYTES = 1 << 60
"""The largest size accepted (1 EiB): beyond it a number is a typo, and ``1e400`` is not finite."""
_NUMBER = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?\s*", re.IGNORECASE)
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS.update({_p: 1 << 10 * _i, f"{_p}ib": 1 << 10 * _i, f"{_p}b": 10 ** (3 * _i)})


def split_number(text: str) -> tuple[float, str] | None:
    """``(number, lower-case unit)`` of ``"1.5 GiB"``-like text, or None without a leading number."""
    m = _NUMBER.match(text)
    if m is None:
        return None
    return float(m.group(0)), text[m.end():].strip().lower()


def parse_bytes(text: str) -> int:
    """Bytes (>= 0) of ``text``; ``InvalidInputError`` (a ``ValueError``) naming it when it is not a size."""
    got = split_number(text)
    if got is not None and got[1] in _UNITS:
        value = got[0] * _UNITS[got[1]]
        if value > MAX_BYTES:
            raise InvalidInputError(f"{text!r} is more than {MAX_BYTES >> 50} PiB: not a size this can use")
        return int(value)
    raise InvalidInputError(f"expected a size such as 268435456, 512MiB, 1GiB or 500MB, got {text!r}")


def size_arg(text: str) -> int:
    """``argparse`` type for a positive size (argparse prints the message)."""
    try:
        value = parse_bytes(text)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"the size must be > 0 bytes, got {text!r}")
    return value

"""Small integer and list helpers shared by the core modules."""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import chain
from operator import itemgetter
from typing import TypeVar

_T = TypeVar("_T")


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def lcm_all(values: list[int]) -> int:
    """Least common multiple of positive integers (1 for an empty list)."""
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


def gcd_all(values: list[int]) -> int:
    """Greatest common divisor of positive integers (0 for an empty list)."""
    out = 0
    for v in values:
        out = math.gcd(out, v)
    return out


def gather(values: Sequence[_T], indices: Sequence[int]) -> tuple[_T, ...]:
    """``values[i]`` for each of ``indices``, in one pass in C (``operator.itemgetter``): a hot path's
    check over a run of blocks costs a fraction of a Python loop's."""
    if len(indices) == 1:
        return (values[indices[0]],)
    return itemgetter(*indices)(values) if indices else ()


def page_by_page(first: list[tuple[int, int]], others: list[list[tuple[int, int]]]) -> list[tuple[int, int]]:
    """The ``(index, block)`` lists of a recurrent state's pages (each last index first) as one list,
    last index first, each index's pages together in page order."""
    if all(len(o) == len(first) for o in others):
        return [entry for entries in zip(first, *others) for entry in entries]
    return sorted(chain(first, *others), key=lambda e: -e[0])  # stable: page order within an index

"""Small integer helpers shared by the core modules."""

from __future__ import annotations

import math


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

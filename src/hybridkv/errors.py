"""Exceptions raised by hybridkv.

Wrong input raises a subclass of ``ValueError`` so callers that already guard against bad
arguments keep working; every message names the input and the limit it broke.
"""

from __future__ import annotations


class HybridKVError(Exception):
    """Base class of every hybridkv exception."""


class InvalidInputError(HybridKVError, ValueError):
    """An argument is malformed (wrong type, empty, negative, inconsistent)."""


class SequenceTooLongError(InvalidInputError):
    """A sequence has more tokens than ``max_model_len`` allows."""


class UnknownSequenceError(InvalidInputError, KeyError):
    """A sequence id the manager does not know."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown sequence"


class LayoutError(InvalidInputError):
    """A layout cannot be built: the specs are incompatible or the memory budget too small."""


class DoesNotFitError(LayoutError):
    """One request of ``max_model_len`` tokens does not fit in the memory budget.

    ``max_model_len_that_fits`` is the largest length that would fit (0 if none does).
    """

    def __init__(self, message: str, max_model_len_that_fits: int) -> None:
        super().__init__(message)
        self.max_model_len_that_fits = max_model_len_that_fits

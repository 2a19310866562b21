"""Prompts on their way into a backend: the prefix it will hold before its events say so.

The router remembers the full-attention chain of each request in flight at each backend and
predicts, per backend, the longest prefix of a new request's chain one of them shares (an upper
estimate for window and recurrent layers). See docs/CLUSTER.md, "Routing" (requests in flight).
"""

from __future__ import annotations

from collections.abc import Sequence


class InFlightPrefixes:
    """Per backend, the chain hashes of the requests the router has in flight there (counted: two
    requests may share blocks)."""

    def __init__(self) -> None:
        self._held: dict[str, dict[bytes, int]] = {}
        self._tickets: dict[int, tuple[str, Sequence[bytes]]] = {}
        self._next = 0

    def add(self, backend: str, chain: Sequence[bytes]) -> int:
        """A request with full-attention chain ``chain`` went to ``backend``; returns its ticket."""
        held = self._held.setdefault(backend, {})
        for h in chain:
            held[h] = held.get(h, 0) + 1
        ticket = self._next
        self._next += 1
        self._tickets[ticket] = (backend, chain)
        return ticket

    def remove(self, ticket: int) -> None:
        """The request of ``ticket`` ended (answered or failed); unknown tickets are ignored."""
        entry = self._tickets.pop(ticket, None)
        if entry is None:
            return
        backend, chain = entry
        held = self._held[backend]
        for h in chain:
            n = held[h]
            if n > 1:
                held[h] = n - 1
            else:
                del held[h]

    def predict(self, backend: str, chain: Sequence[bytes], block_size: int, prompt_tokens: int) -> int:
        """Prompt tokens ``backend`` will hold for a request with ``chain`` (blocks of ``block_size``
        tokens) once its requests in flight are computed: whole blocks, below the last prompt token.
        A chain hash names its whole prefix, so the walk stops at the first block none of them has."""
        held = self._held.get(backend)
        if not held or prompt_tokens <= 1:
            return 0
        n = 0
        for h in chain:
            if h not in held:
                break
            n += 1
        return min(n * block_size, (prompt_tokens - 1) // block_size * block_size)

    def __len__(self) -> int:
        """Requests in flight."""
        return len(self._tickets)

"""Sequences without token ids, for simulations where only block ids move.

A ``SyntheticSequence`` describes its prompt as runs of content (``segments``: ``(key, n)``; runs
with one key hold the same tokens in every request) and counts its generated tokens as the run
``out:<request id>``. Its block hashes are chained like real ones -- a block's hash fingerprints
the content of the whole prefix up to the block's end -- but computed from the run keys instead
of token ids, so a 100k-token prompt costs a few microseconds per *new* block and nothing for
blocks of a prefix another request already hashed (a memo keyed by the runs).

The hashes are Python ``hash()`` values of tuples: stable within one process (a simulation),
not across processes, and not for real KV caches.
"""

from __future__ import annotations

from collections import OrderedDict

from hybridkv.core import BlockHasher, Sequence

Segments = tuple[tuple[str, int], ...]


class _ChainMemo:
    """Block hashes of run prefixes, shared by every sequence starting with the same runs."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._memo: OrderedDict[tuple[object, ...], list[int]] = OrderedDict()

    def get(self, key: tuple[object, ...]) -> list[int] | None:
        hit = self._memo.get(key)
        if hit is not None:
            self._memo.move_to_end(key)
        return hit

    def put(self, key: tuple[object, ...], hashes: list[int]) -> None:
        self._memo[key] = hashes
        if len(self._memo) > self.capacity:
            self._memo.popitem(last=False)


_MEMO = _ChainMemo()


def _extend(hashes: list[int], runs: list[tuple[str, int]], root: int, block_size: int, total: int) -> None:
    """Append the hashes of the full blocks of the first ``total`` tokens that ``hashes`` lacks.

    ``root`` is the parent of the first block (it carries the cache salt)."""
    # Walk runs to find the run containing each block's span; a block's content is the list
    # of (key, offset, length) pieces it covers.
    num_blocks = total // block_size
    i = len(hashes)
    if i >= num_blocks:
        return
    parent = hashes[-1] if hashes else root
    pos = i * block_size
    run_idx, run_start = 0, 0
    while run_idx < len(runs) and run_start + runs[run_idx][1] <= pos:
        run_start += runs[run_idx][1]
        run_idx += 1
    while i < num_blocks:
        end = pos + block_size
        key, n = runs[run_idx]
        if end <= run_start + n:  # the common case: the block lies inside one run
            parent = hash((parent, key, pos - run_start))
        else:
            pieces: list[object] = [parent]
            p, r, rs = pos, run_idx, run_start
            while p < end:
                k, m = runs[r]
                take = min(end, rs + m) - p
                pieces += [k, p - rs, take]
                p += take
                if p >= rs + m:
                    rs += m
                    r += 1
            parent = hash(tuple(pieces))
        hashes.append(parent)
        i += 1
        pos = end
        while run_idx < len(runs) and run_start + runs[run_idx][1] <= pos:
            run_start += runs[run_idx][1]
            run_idx += 1


class SyntheticSequence(Sequence):
    """A sequence known by its content runs and length; see the module docstring."""

    __slots__ = ("segments", "_hashes", "_hash_bs", "_runs_key", "_root")

    def __init__(self, seq_id: str, segments: Segments, cache_salt: str | None = None) -> None:
        if not segments or any(n <= 0 for _, n in segments):
            raise ValueError(f"sequence {seq_id!r}: segments must be non-empty runs of positive length")
        super().__init__(seq_id, [0], cache_salt)  # the base keeps no token list beyond a stub
        self.segments = tuple(segments)
        self.num_tokens = sum(n for _, n in segments)
        self.num_prompt_tokens = self.num_tokens
        self._hashes: list[int] = []
        self._hash_bs = 0
        self._runs_key: tuple[object, ...] = (cache_salt, *self.segments)
        self._root = hash(("hybridkv-salt", cache_salt)) if cache_salt is not None else 0

    @property
    def token_ids(self) -> list[int]:
        raise TypeError(f"synthetic sequence {self.seq_id!r} has no token ids")

    def append_token_ids(self, token_ids: object) -> None:
        self.num_tokens += len(token_ids)  # type: ignore[arg-type]

    def block_hashes(self, hasher: BlockHasher, block_size: int) -> list[bytes]:
        if self._hash_bs != block_size:
            self._hash_bs = block_size
            self._hashes = self._prompt_hashes(block_size)
        total = self.num_tokens
        if len(self._hashes) < total // block_size:
            runs = [*self.segments, (f"out:{self.seq_id}", total - self.num_prompt_tokens)]
            _extend(self._hashes, runs, self._root, block_size, total)
        return self._hashes  # type: ignore[return-value]

    def _prompt_hashes(self, block_size: int) -> list[int]:
        """Prompt block hashes, reusing and extending the memo of every proper run prefix."""
        segs = self.segments
        salt = self._runs_key[0]
        hashes: list[int] = []
        start = 1  # run prefixes of length start .. len(segs) - 1 are memoized
        for m in range(len(segs) - 1, 0, -1):
            memo = _MEMO.get((block_size, salt, *segs[:m]))
            if memo is not None:
                hashes = list(memo)
                start = m + 1
                break
        runs = list(segs)
        covered = 0
        for m in range(1, len(segs)):
            covered += segs[m - 1][1]
            if m >= start:
                _extend(hashes, runs, self._root, block_size, covered)
                _MEMO.put((block_size, salt, *segs[:m]), list(hashes))
        _extend(hashes, runs, self._root, block_size, self.num_prompt_tokens)
        return hashes


class TierKeyedSequence(SyntheticSequence):
    """A ``SyntheticSequence`` whose block hashes are bytes, for simulations with external KV tiers.

    The connector names a block by ``tier_key(namespace, group, block_hash)``, which hex-encodes
    a ``bytes`` hash; a synthetic hash is a Python ``int``. This subclass hands out each int hash
    as its 8-byte signed big-endian encoding (one-to-one, so hits and evictions are unchanged),
    converted once per block and kept. Sim-only: the keys are as process-local as the hashes.
    Simulations without tiers keep the plain int hashes (no conversion on the hot path).
    """

    __slots__ = ("_bytes_hashes", "_bytes_bs")

    def __init__(self, seq_id: str, segments: Segments, cache_salt: str | None = None) -> None:
        super().__init__(seq_id, segments, cache_salt)
        self._bytes_hashes: list[bytes] = []
        self._bytes_bs = 0

    def block_hashes(self, hasher: BlockHasher, block_size: int) -> list[bytes]:
        out = self._bytes_hashes
        if self._bytes_bs == block_size == self._hash_bs and len(out) == self.num_tokens // block_size:
            return out  # nothing new since the last call (most calls)
        ints: list[int] = super().block_hashes(hasher, block_size)  # type: ignore[assignment]
        if self._bytes_bs != block_size:
            self._bytes_bs = block_size
            out.clear()
        if len(out) < len(ints):
            out.extend(h.to_bytes(8, "big", signed=True) for h in ints[len(out):])
        return out

"""Sequences without token ids, for simulations where only block ids move.

A ``SyntheticSequence`` describes its prompt as runs of content (``segments``: ``(key, n)``; runs
with one key hold the same tokens in every request) and counts its generated tokens as the run
``out:<request id>``. Its block hashes chain like real ones (a block's hash fingerprints the whole
prefix up to its end) but come from the run keys, memoized per run prefix: a 100k-token prompt
costs a few microseconds per *new* block. They are 8-byte encodings of Python ``hash()`` values:
stable within one process (a simulation), not across processes, and not for real KV caches.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from hybridkv.core import BlockHasher

Segments = tuple[tuple[str, int], ...]
Chain = tuple[list[bytes], int]
"""Block hashes of a run prefix and the last one as the ``int`` the next block chains from."""


class _ChainMemo:
    """Block hashes of run prefixes, shared by every sequence starting with the same runs."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._memo: OrderedDict[tuple[object, ...], Chain] = OrderedDict()

    def get(self, key: tuple[object, ...]) -> Chain | None:
        hit = self._memo.get(key)
        if hit is not None:
            self._memo.move_to_end(key)
        return hit

    def put(self, key: tuple[object, ...], chain: Chain) -> None:
        self._memo[key] = chain
        if len(self._memo) > self.capacity:
            self._memo.popitem(last=False)


_MEMO = _ChainMemo()


def _extend(hashes: list[bytes], parent: int, runs: list[tuple[str, int]], block_size: int, total: int) -> int:
    """Append the hashes of the full blocks of the first ``total`` tokens that ``hashes`` lacks;
    ``parent`` chains into the first missing block (the root, which carries the cache salt, for
    the first block of all). Returns the last block's hash as the ``int`` to chain from."""
    num_blocks = total // block_size
    i = len(hashes)
    if i >= num_blocks:
        return parent
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
        else:  # the block's content: the (key, offset, length) pieces of the runs it covers
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
        hashes.append(parent.to_bytes(8, "big", signed=True))
        i += 1
        pos = end
        while run_idx < len(runs) and run_start + runs[run_idx][1] <= pos:
            run_start += runs[run_idx][1]
            run_idx += 1
    return parent


class SyntheticSequence:
    """A simulated request known by its content runs and its counts: what the manager and the
    scheduler read from a sequence (``hybridkv.scheduling.ScheduledSequence``), without token ids."""

    __slots__ = ("seq_id", "segments", "cache_salt", "num_tokens", "num_prompt_tokens", "num_computed_tokens",
                 "checkpoint_hints", "_hashes", "_last", "_hash_bs", "_root")

    token_ids = None
    """A simulated sequence has no token ids (the manager's events then carry none)."""
    num_encoder_tokens = 0

    def __init__(self, seq_id: str, segments: Segments, cache_salt: str | None = None,
                 checkpoint_hints: tuple[int, ...] = ()) -> None:
        if not segments or any(n <= 0 for _, n in segments):
            raise ValueError(f"sequence {seq_id!r}: segments must be non-empty runs of positive length")
        self.seq_id = seq_id
        self.segments = tuple(segments)
        self.cache_salt = cache_salt
        self.num_tokens = self.num_prompt_tokens = sum(n for _, n in segments)
        self.num_computed_tokens = 0
        self.checkpoint_hints = checkpoint_hints
        self._hashes: list[bytes] = []
        self._last = 0
        self._hash_bs = 0
        self._root = hash(("hybridkv-salt", cache_salt)) if cache_salt is not None else 0

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def append_token_ids(self, token_ids: Iterable[int]) -> None:
        """Count generated tokens (their values do not matter here)."""
        self.num_tokens += len(token_ids) if isinstance(token_ids, (list, tuple)) else sum(1 for _ in token_ids)

    def block_hashes(self, hasher: BlockHasher, block_size: int) -> list[bytes]:
        """The hashes of every full block at the current length (``hasher`` is not used: the hashes
        come from the runs)."""
        if self._hash_bs != block_size:
            self._hash_bs = block_size
            self._hashes, self._last = self._prompt_hashes(block_size)
        total = self.num_tokens
        if len(self._hashes) < total // block_size:
            runs = [*self.segments, (f"out:{self.seq_id}", total - self.num_prompt_tokens)]
            self._last = _extend(self._hashes, self._last, runs, block_size, total)
        return self._hashes

    def _prompt_hashes(self, block_size: int) -> Chain:
        """Prompt block hashes, reusing and extending the memo of every proper run prefix."""
        segs = self.segments
        salt = self.cache_salt
        hashes: list[bytes] = []
        last = self._root
        start = 1  # run prefixes of length start .. len(segs) - 1 are memoized
        for m in range(len(segs) - 1, 0, -1):
            memo = _MEMO.get((block_size, salt, *segs[:m]))
            if memo is not None:
                hashes, last = list(memo[0]), memo[1]
                start = m + 1
                break
        runs = list(segs)
        covered = 0
        for m in range(1, len(segs)):
            covered += segs[m - 1][1]
            if m >= start:
                last = _extend(hashes, last, runs, block_size, covered)
                _MEMO.put((block_size, salt, *segs[:m]), (list(hashes), last))
        last = _extend(hashes, last, runs, block_size, self.num_prompt_tokens)
        return hashes, last

    def __repr__(self) -> str:
        return (f"SyntheticSequence({self.seq_id!r}, num_tokens={self.num_tokens}, "
                f"num_computed_tokens={self.num_computed_tokens})")

"""Small builders shared by the scenario tests."""

from __future__ import annotations

from hybridkv import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheManager,
    MambaSpec,
    Sequence,
    SlidingWindowSpec,
)


def full(bs: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype_bytes=2)


def swa(window: int, bs: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype_bytes=2, sliding_window=window)


def chunked(chunk: int, bs: int = 16) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype_bytes=2,
                                     attention_chunk_size=chunk)


def mamba(bs: int = 16, mode: str = "align", state_bytes: int = 65536, **kw: int) -> MambaSpec:
    # 65536: one page of ``full(16)`` (a layout with a state needs one page size).
    return MambaSpec(block_size=bs, state_bytes=state_bytes, mode=mode, **kw)  # type: ignore[arg-type]


def split_state(parts: int, bs: int = 16, mode: str = "align") -> tuple[MambaSpec, ...]:
    """A recurrent state of ``parts`` pages of ``full(16)``'s size, one spec per page (as ``plan_layout``
    spreads a state larger than a page)."""
    return tuple(MambaSpec(block_size=bs, state_bytes=65536 * parts, mode=mode, state_part=j,  # type: ignore[arg-type]
                           state_parts=parts) for j in range(parts))


def layout(num_blocks: int, *specs: object) -> KVCacheLayout:
    """One group per spec, one layer each; the pages of a split state (``split_state``) share their layer."""
    names: list[str] = []
    for i, s in enumerate(specs):
        part = s.state_part if isinstance(s, MambaSpec) else 0
        names.append(names[-1] if part else f"layers.{i}")
    return KVCacheLayout(num_blocks=num_blocks,
                         groups=tuple(KVCacheGroup(s, (n,)) for s, n in zip(specs, names)))  # type: ignore[arg-type]


def manager(num_blocks: int, *specs: object, max_model_len: int = 4096, batch: int = 4096,
            **kwargs: object) -> KVCacheManager:
    return KVCacheManager(layout(num_blocks, *specs), max_model_len, batch, **kwargs)  # type: ignore[arg-type]


def run_prefill(mgr: KVCacheManager, seq: Sequence, chunk: int, *, use_hit: bool = True,
                whole: bool = False) -> int:
    """Admit ``seq`` with its hit, then run its prompt in chunks; returns the hit tokens."""
    hit = mgr.lookup(seq) if use_hit else None
    start = hit.num_tokens if hit else 0
    n = min(chunk, seq.num_tokens - start)
    assert mgr.allocate(seq, n, hit=hit, whole_sequence_must_fit=whole) is not None
    seq.num_computed_tokens = start + n
    mgr.check_invariants()
    while seq.num_computed_tokens < seq.num_tokens:
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        assert mgr.allocate(seq, n) is not None, f"chunk at {seq.num_computed_tokens} did not fit"
        seq.num_computed_tokens += n
        mgr.check_invariants()
    return start


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def decoding_requests(layout: object, prompt_len: int, num_lookahead_tokens: int) -> int:
    """How many ``prompt_len``-token requests a fresh manager on ``layout`` (``max_model_len`` 4,096,
    8,192-token steps) admits and takes to their first decode step with that many draft slots."""
    mgr = KVCacheManager(layout, 4096, 8192)  # type: ignore[arg-type]
    count = 0
    while True:
        seq = Sequence(f"r{count}", tokens(count * 2000, prompt_len))
        if mgr.allocate(seq, prompt_len) is None:
            break
        seq.num_computed_tokens = prompt_len
        seq.append_token_ids([7])
        if mgr.allocate(seq, 1, num_lookahead_tokens=num_lookahead_tokens) is None:
            break
        count += 1
    mgr.check_invariants()
    return count

"""Layers whose KV does not come from the decoder's tokens: cross attention and encoder-only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridkv.core._util import cdiv
from hybridkv.core.block_pool import BlockPool
from hybridkv.core.kinds.base import NEVER, NOTHING, Indices, KindManager, KindRule
from hybridkv.core.sequence import KVSequence


class EncoderRule(KindRule):
    """Cross attention and encoder-only attention: their KV comes from the encoder pass (or there is
    none), so they do not constrain decoder-side hits and a hit reads none of their blocks."""

    constrains_hits = False
    __slots__ = ()

    def find_longest_cache_hit(self, hashes: list[bytes], cached: Mapping[bytes, int],
                               max_tokens: int) -> tuple[int, list[int]]:
        return max_tokens, []

    def hit_span(self, boundary: int) -> tuple[int, int]:
        return 0, 0


class CrossAttentionManager(KindManager):
    """Cross attention: blocks for the encoder tokens, allocated once, never prefix-cached."""

    holds_lookahead = False  # its table holds the encoder's tokens, not the decoder's
    prepares = True
    __slots__ = ("encoder_tokens",)

    def __init__(self, rule: KindRule, pool: BlockPool, *, bound: int) -> None:
        super().__init__(rule, pool, bound=bound)
        self.encoder_tokens: dict[str, int] = {}

    def prepare(self, seq: KVSequence, checkpoints: list[tuple[int, int]]) -> None:
        self.encoder_tokens[seq.seq_id] = seq.num_encoder_tokens

    def plan_indices(self, seq_id: str, hit_blocks: Sequence[int], num_computed: int, num_external: int,
                     num_tokens: int) -> Indices:
        if seq_id in self.tables:
            return NOTHING  # all blocks come with the first allocation
        return range(cdiv(self.encoder_tokens.get(seq_id, 0), self.block_size))

    def adopt(self, seq_id: str, blocks: list[int]) -> None:
        self.tables[seq_id] = []
        self.num_cached[seq_id] = 0

    def idle_limit(self, seq_id: str) -> int:
        return NEVER

    def pop_table(self, seq_id: str) -> tuple[int, list[int]]:
        self.encoder_tokens.pop(seq_id, None)
        return super().pop_table(seq_id)


class EncoderOnlyManager(KindManager):
    """Encoder-only attention: no KV cache, no blocks."""

    holds_lookahead = False
    __slots__ = ()

    def _new_indices(self, length: int, num_computed: int, num_tokens: int) -> Indices:
        return NOTHING

    def idle_limit(self, seq_id: str) -> int:
        return NEVER

"""Layer specs: one frozen dataclass per kind of KV memory.

A spec gives a layer's bytes per block (``page_size_bytes``), the admission bound
(``max_blocks_per_request``: the one number for pool sizing and admission) and whether its memory
grows with the sequence. See docs/ARCHITECTURE.md, "Layer specs".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridkv.core._util import cdiv
from hybridkv.errors import InvalidInputError

MambaMode = Literal["none", "align", "all"]


def _require_positive(owner: str, **values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidInputError(f"{owner}.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    """Base of all specs. ``block_size`` is the number of token positions one block covers."""

    block_size: int
    page_size_padded: int | None = None
    """Bytes of one block after the layout planner padded pages to a common size."""

    def __post_init__(self) -> None:
        _require_positive(type(self).__name__, block_size=self.block_size)
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise InvalidInputError(
                f"{type(self).__name__}.page_size_padded={self.page_size_padded} is smaller than "
                f"the unpadded page of {self.real_page_size_bytes} bytes"
            )

    @property
    def kind(self) -> str:
        """Short name of the layer kind, for reports."""
        return "base"

    @property
    def real_page_size_bytes(self) -> int:
        """Bytes of one block of one layer before padding."""
        raise NotImplementedError

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (after padding, when the planner padded it)."""
        return self.page_size_padded if self.page_size_padded is not None else self.real_page_size_bytes

    @property
    def grows_with_sequence(self) -> bool:
        """True when a request's blocks in this group grow with its length."""
        raise NotImplementedError

    @property
    def prefix_cacheable(self) -> bool:
        """True when full blocks of this kind can be shared through the prefix cache."""
        return True

    def max_blocks_per_request(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        """The most blocks one request can hold at once in a group of this spec."""
        raise NotImplementedError

    def blocks_for_tokens(self, num_tokens: int, max_num_batched_tokens: int, max_model_len: int) -> int:
        """Blocks one request of ``num_tokens`` tokens holds at its peak: the admission bound.

        Pool sizing, the capacity report and the manager's admission all use this one method: a
        request never holds more than one block per ``block_size`` tokens nor more than
        ``max_blocks_per_request``.
        """
        return min(cdiv(num_tokens, self.block_size),
                   self.max_blocks_per_request(max_num_batched_tokens, max_model_len))

    def max_memory_bytes_per_request(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        """Bytes one layer of this kind needs for one request at its peak."""
        return self.max_blocks_per_request(max_num_batched_tokens, max_model_len) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Common fields of the attention kinds: K and V pages of ``num_kv_heads x head_size``."""

    num_kv_heads: int
    head_size: int
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        _require_positive(
            type(self).__name__,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype_bytes=self.dtype_bytes,
        )
        super().__post_init__()

    @property
    def real_page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Global attention: every token attends to all earlier tokens."""

    @property
    def kind(self) -> str:
        return "full"

    @property
    def grows_with_sequence(self) -> bool:
        return True

    def max_blocks_per_request(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): one latent vector per token, no separate V.

    ``head_size`` is the latent width (``kv_lora_rank + qk_rope_head_dim``); ``num_kv_heads``
    is 1 for the usual layout.
    """

    num_kv_heads: int = 1

    @property
    def kind(self) -> str:
        return "mla"

    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Local attention over the last ``sliding_window`` tokens (the token itself included)."""

    sliding_window: int

    def __post_init__(self) -> None:
        _require_positive(type(self).__name__, sliding_window=self.sliding_window)
        super().__post_init__()

    @property
    def kind(self) -> str:
        return "sliding_window"

    @property
    def grows_with_sequence(self) -> bool:
        return False

    def max_blocks_per_request(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        # During a chunked prefill a request holds the last W - 1 computed tokens plus one batch
        # of new tokens; +1 because the window need not start on a block boundary (the admission bound).
        num_tokens = min(self.sliding_window - 1 + max_num_batched_tokens, max_model_len)
        # When the window covers the whole context nothing is ever dropped: the +1 cannot occur.
        return min(cdiv(num_tokens, self.block_size) + 1, cdiv(max_model_len, self.block_size))


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Local attention within fixed chunks of ``attention_chunk_size`` tokens (Llama 4)."""

    attention_chunk_size: int

    def __post_init__(self) -> None:
        _require_positive(type(self).__name__, attention_chunk_size=self.attention_chunk_size)
        super().__post_init__()

    @property
    def kind(self) -> str:
        return "chunked_local"

    @property
    def grows_with_sequence(self) -> bool:
        return False

    def max_blocks_per_request(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        # The current chunk plus one batch of new tokens (the admission bound).
        num_tokens = min(self.attention_chunk_size + max_num_batched_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size)


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Recurrent state (Mamba, linear attention): a constant-size state per request.

    ``state_bytes`` is the bytes of one layer's whole state (conv + SSM). ``mode``:

    * ``"none"`` -- one state per request, updated in place; never prefix-cached;
    * ``"align"`` -- state checkpoints at block boundaries: where a step ends on one, and inside a
      prefill at the positions later requests are known or likely to resume from (a shared-prefix
      junction, the prompt's end, every ``checkpoint_interval`` tokens), at most
      ``checkpoint_blocks`` per step; a request holds at most ``2 + checkpoint_blocks`` states at
      once (the one it reads, the checkpoints of the step, the one it writes);
    * ``"all"`` -- a checkpoint at every block boundary; memory grows with the sequence.

    ``block_size`` is the checkpoint granularity in tokens: a state can be checkpointed (and a
    hit can end) at every multiple of it. A state larger than one page of the pool is split into
    ``state_parts`` pages, each in its own group (``state_part`` says which): part ``j`` of a
    layer's state is bytes ``[j * part_bytes, (j + 1) * part_bytes)`` of it (``layout.RecurrentState``).
    """

    state_bytes: int
    mode: MambaMode = "align"
    checkpoint_blocks: int = 1
    """Mode ``align``: most checkpoints one step writes inside a prefill (0: only where steps end).
    Junctions go first, then the prompt's end, then interval checkpoints."""
    checkpoint_interval: int = 0
    """Mode ``align``: also checkpoint every this many tokens (0: off; a multiple of ``block_size``)."""
    state_part: int = 0
    state_parts: int = 1

    def __post_init__(self) -> None:
        _require_positive(type(self).__name__, state_bytes=self.state_bytes, state_parts=self.state_parts)
        for name in ("checkpoint_blocks", "checkpoint_interval", "state_part"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInputError(f"MambaSpec.{name} must be a non-negative integer, got {value!r}")
        if self.mode not in ("none", "align", "all"):
            raise InvalidInputError(
                f"MambaSpec.mode must be 'none', 'align' or 'all', got {self.mode!r}"
            )
        if self.state_part >= self.state_parts:
            raise InvalidInputError(
                f"MambaSpec.state_part={self.state_part} must be below state_parts={self.state_parts}"
            )
        if self.state_parts > self.state_bytes:
            raise InvalidInputError(
                f"MambaSpec.state_parts={self.state_parts} exceeds state_bytes={self.state_bytes}"
            )
        super().__post_init__()
        if self.checkpoint_interval % self.block_size:
            raise InvalidInputError(
                f"MambaSpec.checkpoint_interval={self.checkpoint_interval} is not a multiple of "
                f"block_size={self.block_size}: checkpoints can only be written at block boundaries"
            )

    @property
    def kind(self) -> str:
        return f"mamba_{self.mode}"

    @property
    def part_bytes(self) -> int:
        """Bytes of one layer's state each part holds (the last part may hold fewer)."""
        return cdiv(self.state_bytes, self.state_parts)

    @property
    def real_page_size_bytes(self) -> int:
        return self.part_bytes

    @property
    def grows_with_sequence(self) -> bool:
        return self.mode == "all"

    @property
    def prefix_cacheable(self) -> bool:
        return self.mode != "none"

    def max_blocks_per_request(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        if self.mode == "none":
            return 1
        if self.mode == "align":
            # The state a step reads, its checkpoints and the state it writes: every index from the
            # read state's to the written state's, so never more than one step's tokens span + 1.
            return min(2 + self.checkpoint_blocks, cdiv(max_num_batched_tokens, self.block_size) + 1,
                       cdiv(max_model_len, self.block_size))
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Decoder cross attention over encoder outputs: sized by the encoder input, never cached."""

    max_encoder_len: int

    def __post_init__(self) -> None:
        _require_positive(type(self).__name__, max_encoder_len=self.max_encoder_len)
        super().__post_init__()

    @property
    def kind(self) -> str:
        return "cross_attention"

    @property
    def grows_with_sequence(self) -> bool:
        return False

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def max_blocks_per_request(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        return cdiv(self.max_encoder_len, self.block_size)

    def blocks_for_tokens(self, num_tokens: int, max_num_batched_tokens: int, max_model_len: int) -> int:
        return self.max_blocks_per_request(max_num_batched_tokens, max_model_len)


@dataclass(frozen=True, kw_only=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Bidirectional encoder attention recomputed every step: it keeps no KV cache."""

    @property
    def kind(self) -> str:
        return "encoder_only"

    @property
    def real_page_size_bytes(self) -> int:
        return 0

    @property
    def grows_with_sequence(self) -> bool:
        return False

    @property
    def prefix_cacheable(self) -> bool:
        return False

    def max_blocks_per_request(self, max_num_batched_tokens: int, max_model_len: int) -> int:
        return 0

"""Packing one step: the scheduler's token counts become the forward pass's ``StepInputs``.

Each scheduled sequence contributes its next tokens as consecutive rows of one packed batch;
its K/V slots come from its block tables; attention runs per part (one per ``QUERY_TILE`` queries
of a prefill chunk, one for all single-token decodes), keys gathered in whole ``KEY_TILE`` s from
the tile that holds the first key the part's window needs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from hybridkv.core import Sequence, StateStep
from hybridkv.engine.model import KEY_TILE, AttentionPart, StateSpan, StepInputs

Tables = tuple[tuple[int, ...], ...]
StateSteps = Callable[[str, int, int], tuple[StateStep, ...]]
"""``KVCacheManager.state_steps``: the recurrent-state pages a step of a sequence reads and writes."""

QUERY_TILE = 128
"""Queries of a prefill chunk per attention part (bounds the ``[queries, keys]`` score tensor)."""


@dataclass
class Batch:
    """A packed step and where each request's logits rows are."""

    inputs: StepInputs
    sampling_rows: dict[str, int] = field(default_factory=dict)
    """Per request that samples this step: its row in the logits."""
    spans: dict[str, tuple[int, int, int]] = field(default_factory=dict)
    """Per request that needs every position's logits: (first logits row, rows, first position)."""
    num_prompt_tokens: int = 0
    """Prompt tokens (first computation or recomputation) in the step."""
    drafts: dict[str, tuple[int, list[int]]] = field(default_factory=dict)
    """Per request with draft tokens this step: (the logits row of its last token, its drafts); the
    drafts' rows follow it, each predicting the token after its draft."""

    @property
    def num_logits_rows(self) -> int:
        return len(self.inputs.logits_rows)


def key_start(position: int, window: int | None) -> tuple[int, int]:
    """The first key a query at ``position`` sees through ``window`` and the ``KEY_TILE`` -aligned
    position its gathered keys start at."""
    first = 0 if window is None else max(0, position - window + 1)
    return first, first // KEY_TILE * KEY_TILE


def key_blocks(table: tuple[int, ...], group: int, position: int, count: int, start: int, first: int,
               block_size: int, width: int) -> list[int]:
    """The ``width`` block ids holding keys ``start ..`` for ``count`` queries from ``position`` of one
    sequence of ``group`` (null blocks after its last), checking that none the window sees is null."""
    blocks = list(table[start // block_size:-(-(position + count) // block_size)])
    seen = blocks[first // block_size - start // block_size:]
    if 0 in seen:
        raise RuntimeError(
            f"group {group}: the manager gave the null block for a position the window still sees "
            f"(positions {first}..{position + count - 1}): {seen}"
        )
    return blocks + [0] * (width - len(blocks))


class BatchBuilder:
    """Builds ``Batch`` es for a model whose groups attend over ``group_windows`` (``None``: full);
    ``state_groups`` hold recurrent states (no per-token slots, no attention)."""

    def __init__(self, block_size: int, group_windows: list[int | None], device: torch.device,
                 state_groups: frozenset[int] = frozenset()) -> None:
        self.block_size = block_size
        self.group_windows = group_windows
        self.device = device
        self.state_groups = state_groups
        attention = [w for g, w in enumerate(group_windows) if g not in state_groups]
        self.windows: list[int | None] = [*sorted({w for w in attention if w is not None})]
        if None in attention:
            self.windows.append(None)

    def build(self, scheduled: Mapping[str, int], seqs: Mapping[str, Sequence], tables: Callable[[str], Tables],
              every_row: Callable[[str], bool], state_steps: StateSteps | None = None,
              drafts: Mapping[str, list[int]] | None = None) -> Batch:
        """The batch of ``scheduled`` (request -> tokens this step); ``every_row(request)`` asks for
        the logits of every position it computes, not only the one it samples from; ``state_steps``
        for a model with recurrent layers; ``drafts`` (request -> draft tokens after its last token,
        on the slots the manager gave its lookahead) for speculative decoding."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[list[int]] = [[] for _ in self.group_windows]
        logits_rows: list[int] = []
        sampling_rows: dict[str, int] = {}
        spans: dict[str, tuple[int, int, int]] = {}
        num_prompt_tokens = 0
        prefills: list[tuple[int, int, int, Tables]] = []  # (row, position, tokens, tables)
        decodes: list[tuple[int, int, Tables]] = []  # (row, position, tables)
        states: list[StateSpan] = []
        batch_drafts: dict[str, tuple[int, list[int]]] = {}
        for sid, n in scheduled.items():
            seq = seqs[sid]
            start = seq.num_computed_tokens
            num_prompt_tokens += max(0, min(start + n, seq.num_prompt_tokens) - start)
            row = len(ids)
            ids.extend(seq.token_ids[start:start + n])
            draft = drafts.get(sid) if drafts else None
            if draft:  # the step's token, then its drafts: each row's logits check the next draft
                batch_drafts[sid] = (len(logits_rows), draft)
                sampling_rows[sid] = len(logits_rows)
                ids.extend(draft)
                n += len(draft)
                logits_rows.extend(range(row, row + n))
            positions.extend(range(start, start + n))
            table = tables(sid)
            for g, group_table in enumerate(table):
                if g not in self.state_groups:
                    slots[g].extend(group_table[p // bs] * bs + p % bs for p in range(start, start + n))
            if state_steps is not None:
                states.append(StateSpan(row, start, n, state_steps(sid, start, start + n)))
            if draft:
                pass  # its rows are all logits rows already
            elif every_row(sid):
                spans[sid] = (len(logits_rows), n, start)
                logits_rows.extend(range(row, row + n))
                if start + n == seq.num_tokens:
                    sampling_rows[sid] = len(logits_rows) - 1
            elif start + n == seq.num_tokens:
                sampling_rows[sid] = len(logits_rows)
                logits_rows.append(row + n - 1)
            if n == 1:
                decodes.append((row, start, table))
            else:
                prefills.append((row, start, n, table))
        index = self._index
        inputs = StepInputs(input_ids=index(ids), positions=index(positions),
                            slot_mapping=[index(s) for s in slots], parts=self._attention_parts(prefills, decodes),
                            logits_rows=index(logits_rows), states=states)
        return Batch(inputs, sampling_rows, spans, num_prompt_tokens, batch_drafts)

    def _index(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _attention_parts(self, prefills: list[tuple[int, int, int, Tables]],
                         decodes: list[tuple[int, int, Tables]]) -> dict[int | None, list[AttentionPart]]:
        """The step's attention calls per window: each of ``prefills`` = (first row, first position, tokens,
        block tables) in ``QUERY_TILE`` tiles, then every decode (row, position, block tables) in one call."""
        parts: dict[int | None, list[AttentionPart]] = {w: [] for w in self.windows}
        for row, start, n, table in prefills:
            for lo in range(0, n, QUERY_TILE):
                tile = (row + lo, start + lo, min(QUERY_TILE, n - lo), table)
                for w in self.windows:
                    parts[w].append(self._part([tile], w))
        if decodes:
            for w in self.windows:
                parts[w].append(self._part([(row, pos, 1, table) for row, pos, table in decodes], w))
        return parts

    def _part(self, members: list[tuple[int, int, int, Tables]], window: int | None) -> AttentionPart:
        """One attention call for ``members`` = (first row, first position, tokens, block tables), all
        with the same number of tokens; keys in whole ``KEY_TILE`` s from the tile holding the first key
        the window needs to the end (null-block slots where a block is no longer held)."""
        bs = self.block_size
        tile = KEY_TILE
        if tile % bs:
            raise ValueError(f"the key tile ({tile}) must be a multiple of the block size ({bs})")
        q = members[0][2]
        firsts, key_starts = map(list, zip(*(key_start(pos, window) for _, pos, _, _ in members)))
        width = -(-max(pos + n - ks for (_, pos, n, _), ks in zip(members, key_starts)) // tile) * tile
        dev = self.device
        offs = torch.arange(width, device=dev)
        kpos = torch.tensor(key_starts, device=dev)[:, None] + offs[None, :]  # [B, L]
        qpos = torch.tensor([pos for _, pos, _, _ in members], device=dev)[:, None] + torch.arange(q, device=dev)
        mask = kpos[:, None, :] <= qpos[:, :, None]
        if window is not None:
            mask &= kpos[:, None, :] > qpos[:, :, None] - window
        rows = torch.tensor([row for row, _, _, _ in members], device=dev)[:, None] + torch.arange(q, device=dev)
        part = AttentionPart(query_rows=rows, mask=mask)
        nblocks = width // bs
        for g, w in enumerate(self.group_windows):
            if w != window or g in self.state_groups:
                continue
            table_rows = [key_blocks(tables[g], g, pos, n, ks, first, bs, nblocks)
                          for (_, pos, n, tables), ks, first in zip(members, key_starts, firsts)]
            block_ids = torch.tensor(table_rows, device=dev)
            part.key_slots[g] = (block_ids[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(len(members), -1)
        return part

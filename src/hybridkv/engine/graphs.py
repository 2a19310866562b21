"""Decode steps replayed as CUDA graphs.

``DecodeGraphs`` captures a decode-only step's forward pass once per bucket and replays it: one
copy of the step's integers in, one graph launch, one copy of each row's greedy token out. Other
steps run eagerly. See docs/ENGINE.md, "CUDA graphs".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.core import Sequence
from hybridkv.engine.batch import Batch, Tables, key_blocks, key_start
from hybridkv.engine.model import KEY_TILE, AttentionPart, EngineModel, StepInputs

logger = logging.getLogger(__name__)


def buckets(limit: int, first: int = 1) -> list[int]:
    """``first`` doubled until it reaches ``limit``; the last bucket is ``limit`` itself."""
    out = [first]
    while out[-1] < limit:
        out.append(min(out[-1] * 2, limit))
    return out


@dataclass
class Replayed:
    """A decode step's results: its rows as a ``Batch``, float32 logits ``[rows, vocab]`` and each
    row's greedy token (the argmax of its logits)."""

    batch: Batch
    logits: torch.Tensor
    argmax: list[int]


@dataclass
class _Graph:
    rows: int
    width: int
    host: torch.Tensor
    """The step's integers on the host (pinned where the graph is captured)."""
    device: torch.Tensor
    """Their copy on the model's device, which the graph reads."""
    run: Callable[[], tuple[StepInputs, torch.Tensor, torch.Tensor]]
    graph: Any = None
    """The captured ``torch.cuda.CUDAGraph`` (None: ``run`` eagerly at every step)."""
    outputs: tuple[StepInputs, torch.Tensor, torch.Tensor] | None = None


class DecodeGraphs:
    """Decode-only steps of ``model`` run as captured CUDA graphs (``capture=False``: the same padded
    inputs run eagerly, on any device; what the CPU tests check).

    ``group_windows`` per group as the engine plans it; ``max_rows`` sequences (``max_num_seqs``)
    and ``max_model_len`` bound the buckets."""

    def __init__(self, model: EngineModel, block_size: int, group_windows: list[int | None], max_rows: int,
                 max_model_len: int, device: torch.device, *, capture: bool = True) -> None:
        self.model = model
        self.block_size = block_size
        self.group_windows = group_windows
        self.windows: list[int | None] = sorted({w for w in group_windows if w is not None}) + (
            [None] if None in group_windows else [])
        self.device = device
        self.capture = capture
        self.row_buckets = buckets(max_rows)
        self.width_buckets = buckets(-(-max_model_len // KEY_TILE) * KEY_TILE, KEY_TILE)
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.pool: Any = torch.cuda.graph_pool_handle() if capture else None
        self.capture_seconds = 0.0
        self.replays = 0

    def window_width(self, window: int | None, width: int) -> int:
        """Keys gathered for ``window`` when the full-attention keys span ``width``: a window's decode
        never needs more than the tiles its ``window`` keys can touch."""
        if window is None:
            return width
        return min(width, -(-(window + KEY_TILE - 1) // KEY_TILE) * KEY_TILE)

    # ------------------------------------------------------------------ one step
    def replay(self, scheduled: Mapping[str, int], seqs: Mapping[str, Sequence], tables: Callable[[str], Tables],
               every_row: Callable[[str], bool]) -> Replayed | None:
        """Run ``scheduled`` as a graph when it is a decode-only step that fits a bucket; None otherwise
        (the caller runs it eagerly)."""
        if not self.row_buckets or len(scheduled) > self.row_buckets[-1]:
            return None
        rows: list[tuple[Sequence, Tables]] = []
        longest = 0
        for sid, n in scheduled.items():
            seq = seqs[sid]
            if n != 1 or seq.num_computed_tokens + 1 != seq.num_tokens or every_row(sid):
                return None
            rows.append((seq, tables(sid)))
            longest = max(longest, seq.num_tokens)
        width = next((w for w in self.width_buckets if w >= longest), None)
        if width is None:
            return None
        padded = next(b for b in self.row_buckets if b >= len(rows))
        graph = self.graphs.get((padded, width))
        if graph is None:
            try:
                graph = self._build(padded, width)
            except Exception:  # the warm-up and capture wrote the null block only: run eagerly from now on
                logger.exception("capturing a decode graph failed; decode steps run eagerly from now on")
                self.row_buckets = []
                return None
        values = self._pack(rows, padded, width)
        graph.host[:len(values)] = torch.tensor(values, dtype=torch.int64)
        graph.device.copy_(graph.host, non_blocking=True)
        if graph.graph is not None:
            graph.graph.replay()
        else:
            graph.outputs = graph.run()
        assert graph.outputs is not None
        inputs, logits, argmax = graph.outputs
        self.replays += 1
        batch = Batch(inputs, sampling_rows={sid: i for i, sid in enumerate(scheduled)})
        return Replayed(batch, logits[:len(rows)], argmax[:len(rows)].tolist())

    def _pack(self, rows: list[tuple[Sequence, Tables]], padded: int, width: int) -> list[int]:
        """The step's integers in ``_inputs``' order, padding rows zero."""
        bs = self.block_size
        pad = [0] * (padded - len(rows))
        positions = [seq.num_computed_tokens for seq, _ in rows]
        out = [seq.token_ids[p] for (seq, _), p in zip(rows, positions)] + pad + positions + pad
        for g in range(len(self.group_windows)):
            out += [table[g][p // bs] * bs + p % bs for (_, table), p in zip(rows, positions)] + pad
        starts = {w: [key_start(p, w) for p in positions] for w in self.windows}
        for w in self.windows:
            out += [start for _, start in starts[w]] + pad
        for g, w in enumerate(self.group_windows):
            nblocks = self.window_width(w, width) // bs
            for (_, table), p, (first, start) in zip(rows, positions, starts[w]):
                out += key_blocks(table[g], g, p, 1, start, first, bs, nblocks)
            out += [0] * (nblocks * len(pad))
        return out

    # ------------------------------------------------------------------ capture
    def _size(self, padded: int, width: int) -> int:
        blocks = sum(self.window_width(w, width) // self.block_size for w in self.group_windows)
        return padded * (2 + len(self.group_windows) + len(self.windows) + blocks)

    def _inputs(self, buffer: torch.Tensor, padded: int, width: int) -> StepInputs:
        """The ``StepInputs`` of a packed step, computed on the device from ``buffer``'s integers."""
        bs, dev = self.block_size, buffer.device
        at = 0

        def take(count: int) -> torch.Tensor:
            nonlocal at
            at += count * padded
            return buffer[at - count * padded:at].view(padded, count)

        ids, positions = take(1)[:, 0], take(1)[:, 0]
        slots = [take(1)[:, 0] for _ in self.group_windows]
        starts = {w: take(1) for w in self.windows}
        blocks = [take(self.window_width(w, width) // bs) for w in self.group_windows]
        rows = torch.arange(padded, device=dev)[:, None]
        parts: dict[int | None, list[AttentionPart]] = {}
        for w in self.windows:
            kpos = starts[w] + torch.arange(self.window_width(w, width), device=dev)[None, :]  # [B, L]
            qpos = positions[:, None, None]
            mask = kpos[:, None, :] <= qpos
            if w is not None:
                mask &= kpos[:, None, :] > qpos - w
            key_slots = {g: (blocks[g][:, :, None] * bs + torch.arange(bs, device=dev)).reshape(padded, -1)
                         for g, gw in enumerate(self.group_windows) if gw == w}
            parts[w] = [AttentionPart(query_rows=rows, mask=mask, key_slots=key_slots, every_row=True)]
        return StepInputs(input_ids=ids, positions=positions, slot_mapping=slots, parts=parts,
                          logits_rows=rows[:, 0])

    def _build(self, padded: int, width: int) -> _Graph:
        start = time.perf_counter()
        size = self._size(padded, width)
        host = torch.zeros(size, dtype=torch.int64)
        device = torch.zeros(size, dtype=torch.int64, device=self.device)

        def run() -> tuple[StepInputs, torch.Tensor, torch.Tensor]:
            inputs = self._inputs(device, padded, width)
            logits = self.model.forward(inputs)
            return inputs, logits, logits.argmax(-1)

        graph = _Graph(padded, width, host, device, run)
        if self.capture:
            graph.host = host.pin_memory()
            with torch.cuda.device(self.device):
                side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up: library handles and workspaces exist before capture
                    run()
                torch.cuda.current_stream().wait_stream(side)
                graph.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph.graph, pool=self.pool):
                    graph.outputs = run()
            self.capture_seconds += time.perf_counter() - start
            logger.info("captured the decode graph for %d rows, %d keys in %.0f ms", padded, width,
                        (time.perf_counter() - start) * 1e3)
        self.graphs[padded, width] = graph
        return graph

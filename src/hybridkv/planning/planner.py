"""Capacity planning: a model and a GPU in, the layout the manager would run on and its capacity out.

Everything is computed by the same code the manager runs on: the specs' per-request bounds,
``plan_layout`` and ``capacity_report``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridkv.core import (
    KVCacheLayout,
    KVCacheManager,
    MambaMode,
    MambaSpec,
    RecurrentPages,
    capacity_report,
    plan_layout,
)
from hybridkv.errors import DoesNotFitError, InvalidInputError
from hybridkv.planning import get_preset
from hybridkv.planning.hardware import GiB, Hardware, get_hardware
from hybridkv.planning.hf_config import layer_specs, load_config, parse_config
from hybridkv.scheduling.scheduler import MAX_DRAFT_TOKENS

DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int4": 0.5}


@dataclass(frozen=True)
class PlanInput:
    """What the operator asks about."""

    model: str
    """A preset id or a path to a ``config.json`` (or a directory holding one)."""
    gpu: str | None = "h100-80gb"
    gpu_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_num_batched_tokens: int = 8192
    request_lens: tuple[int, ...] = ()
    tensor_parallel_size: int = 1
    weights_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    gpu_memory_utilization: float = 0.9
    reserve_bytes: int = 2 * GiB
    """Activations, CUDA graphs and workspace, per GPU."""
    block_size: int = 16
    mamba_mode: MambaMode = "align"
    recurrent_pages: RecurrentPages = "split"
    """How a recurrent state shares the pool's pages (``hybridkv.core.layout.RecurrentPages``)."""
    num_params: int | None = None
    """Parameter count; required for a config path, taken from the preset otherwise."""
    num_speculative_tokens: int = 0
    """Draft tokens a decode step verifies (speculative decoding): the admission bound reserves their slots."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "max_num_batched_tokens", "block_size"):
            _require_int(name, getattr(self, name), minimum=1)
        _require_int("num_speculative_tokens", self.num_speculative_tokens, minimum=0)
        if self.num_speculative_tokens > MAX_DRAFT_TOKENS:
            raise InvalidInputError(f"num_speculative_tokens must be at most {MAX_DRAFT_TOKENS}, "
                                    f"got {self.num_speculative_tokens}")
        _require_int("reserve_bytes", self.reserve_bytes, minimum=0)
        for name in ("max_model_len", "num_params", "gpu_memory_bytes"):
            if getattr(self, name) is not None:
                _require_int(name, getattr(self, name), minimum=1)
        for n in self.request_lens:
            _require_int("request length", n, minimum=1)


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidInputError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass
class Plan:
    """The layout and capacity of one (model, GPU, settings) combination, per GPU."""

    input: PlanInput
    model_name: str
    hardware: Hardware | None
    gpu_memory_bytes: int
    weights_bytes: int
    kv_memory_bytes: int
    max_model_len: int
    layout: KVCacheLayout | None
    fits: bool
    max_model_len_that_fits: int
    report: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """A machine-readable document with stable keys (documented in docs/SIMULATOR.md)."""
        return self.report


def _dtype(name: str, what: str) -> float:
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise InvalidInputError(f"unknown {what} {name!r}; choose one of {', '.join(DTYPE_BYTES)}") from None


@dataclass(frozen=True)
class ModelSource:
    """A model as the planner and the simulator read it: a preset, or a ``config.json``."""

    name: str
    config: Mapping[str, Any]
    num_params: int | None
    """The preset's parameter count; None for a config file (the caller must give it)."""
    max_model_len: int | None
    """The default context length (a config's ``max_position_embeddings``)."""
    is_preset: bool


def looks_like_path(model: str) -> bool:
    """Whether ``model`` names a file or directory rather than a preset id."""
    return model.endswith(".json") or "/" in model or os.sep in model or model.startswith(".")


def load_model(model: str) -> ModelSource:
    """The preset ``model`` or the ``config.json`` at that path (a file or a directory holding one).

    Raises ``InvalidInputError`` naming the path for a config file that is not there, and listing
    the presets for an unknown preset id.
    """
    if Path(model).exists():
        cfg = load_config(model)
        max_len = cfg.get("max_position_embeddings")
        return ModelSource(str(model), cfg, None, max_len if isinstance(max_len, int) and max_len > 0 else None,
                           False)
    if looks_like_path(model):
        raise InvalidInputError(f"no config file at {model!r} (give a path to a config.json, or a preset id: "
                                f"see hybridkv plan --list-models)")
    preset = get_preset(model)
    return ModelSource(preset.id, preset.config, preset.num_params, preset.max_model_len, True)


def make_plan(inp: PlanInput) -> Plan:
    """Plan the KV cache for ``inp``; never raises for a request that does not fit (``fits`` says)."""
    source = load_model(inp.model)
    name, config, default_len = source.name, source.config, source.max_model_len
    num_params = inp.num_params or source.num_params
    if not num_params:
        raise InvalidInputError(f"{name}: a config.json does not say how many parameters the model has; pass "
                                f"num_params (--num-params, e.g. 27e9)")
    max_model_len = inp.max_model_len or default_len
    if not max_model_len:
        raise InvalidInputError(f"{name}: no default context length; pass max_model_len (--max-model-len)")
    hw, gpu_mem = _gpu(inp)
    weights, kv_bytes = _kv_budget(inp, name, num_params, gpu_mem)
    model = parse_config(config, tensor_parallel_size=inp.tensor_parallel_size)
    kv_dtype_bytes = _dtype(inp.kv_dtype, "KV dtype")
    if kv_dtype_bytes < 1:
        raise InvalidInputError("the KV cache dtype must be bf16, fp16 or fp8")
    specs = layer_specs(model, block_size=inp.block_size, kv_dtype_bytes=int(kv_dtype_bytes),
                        mamba_mode=inp.mamba_mode)
    batch = min(inp.max_num_batched_tokens, max_model_len)
    plan = Plan(inp, name, hw, gpu_mem, weights, kv_bytes, max_model_len, None, True, max_model_len)
    try:
        layout = plan_layout(specs, kv_bytes, max_model_len=max_model_len, max_num_batched_tokens=batch,
                             recurrent_pages=inp.recurrent_pages)
    except DoesNotFitError as exc:
        plan.fits = False
        plan.max_model_len_that_fits = exc.max_model_len_that_fits
        plan.report = _base_report(plan, model.num_layers) | {"fits": False,
                                                              "max_model_len_that_fits": exc.max_model_len_that_fits,
                                                              "error": str(exc)}
        return plan
    limit = draft_token_limit(KVCacheManager(layout, max_model_len, batch), inp.num_speculative_tokens, name)
    plan.layout = layout
    plan.report = _full_report(plan, layout, batch, model.num_layers, limit)
    return plan


def draft_token_limit(mgr: KVCacheManager, k: int, name: str, field: str = "num_speculative_tokens") -> int:
    """The most draft tokens a decode step on ``mgr`` verifies: ``MAX_DRAFT_TOKENS``, fewer where the
    manager's ``max_draft_tokens`` says so; raises ``InvalidInputError`` naming both when ``k`` (the
    setting ``field`` of model ``name``) is more."""
    limit, batch = mgr.max_draft_tokens(1), mgr.max_num_batched_tokens
    if k > limit:
        why = (f"one step computes at most max_num_batched_tokens={batch} tokens" if limit == batch - 1 else
               f"a step with drafts stays within one {limit + 1}-token block of a recurrent state that "
               f"checkpoints (a larger block_size allows more)")
        raise InvalidInputError(f"{name}: {field}={k}, but a decode step of this layout verifies at most {limit} "
                                f"draft tokens: {why}")
    return min(limit, MAX_DRAFT_TOKENS)


def _gpu(inp: PlanInput) -> tuple[Hardware | None, int]:
    """The GPU preset (None for a bare memory size) and its memory in bytes."""
    if inp.gpu_memory_bytes:
        return None, inp.gpu_memory_bytes
    if not inp.gpu:
        raise InvalidInputError("give a GPU preset (--gpu) or a memory size (--gpu-memory)")
    hw = get_hardware(inp.gpu)
    return hw, hw.memory_bytes


def _kv_budget(inp: PlanInput, name: str, num_params: int, gpu_mem: int) -> tuple[int, int]:
    """The weights' bytes per GPU and the bytes left for the KV cache; raises when nothing is left,
    naming the smallest tensor-parallel size whose weights would fit."""
    if not 0 < inp.gpu_memory_utilization <= 1:
        raise InvalidInputError(f"gpu_memory_utilization must be in (0, 1], got {inp.gpu_memory_utilization}")
    tp = inp.tensor_parallel_size
    weights = int(num_params * _dtype(inp.weights_dtype, "weights dtype") / tp)
    kv_bytes = int(gpu_mem * inp.gpu_memory_utilization) - weights - inp.reserve_bytes
    if kv_bytes <= 0:
        need = num_params * _dtype(inp.weights_dtype, "weights dtype")
        per_gpu = gpu_mem * inp.gpu_memory_utilization - inp.reserve_bytes
        if per_gpu <= 0:
            raise InvalidInputError(
                f"{name}: the {inp.reserve_bytes / GiB:.1f} GiB reserve takes all of the "
                f"{gpu_mem * inp.gpu_memory_utilization / GiB:.1f} GiB the engine may use ({gpu_mem / GiB:.1f} GiB "
                f"GPU x utilisation {inp.gpu_memory_utilization}): nothing is left for weights and KV cache; give a "
                f"smaller reserve (--reserve) or more GPU memory")
        min_tp = next((t for t in (1, 2, 4, 8, 16, 32, 64) if need / t < per_gpu), None)
        raise InvalidInputError(
            f"{name}: weights take {weights / GiB:.1f} GiB per GPU, more than the "
            f"{per_gpu / GiB:.1f} GiB available at utilisation {inp.gpu_memory_utilization} with a "
            f"{inp.reserve_bytes / GiB:.1f} GiB reserve"
            + (f"; the smallest tensor-parallel size that fits is {min_tp}" if min_tp else "")
        )
    return weights, kv_bytes


def _base_report(plan: Plan, num_layers: int) -> dict[str, Any]:
    inp = plan.input
    return {
        "model": plan.model_name,
        "gpu": plan.hardware.id if plan.hardware else None,
        "tensor_parallel_size": inp.tensor_parallel_size,
        "num_layers": num_layers,
        "max_model_len": plan.max_model_len,
        "max_num_batched_tokens": min(inp.max_num_batched_tokens, plan.max_model_len),
        "weights_dtype": inp.weights_dtype,
        "kv_dtype": inp.kv_dtype,
        "memory": {
            "gpu_bytes": plan.gpu_memory_bytes,
            "utilization": inp.gpu_memory_utilization,
            "weights_bytes": plan.weights_bytes,
            "reserve_bytes": inp.reserve_bytes,
            "kv_budget_bytes": plan.kv_memory_bytes,
        },
    }


def _full_report(plan: Plan, layout: KVCacheLayout, batch: int, num_layers: int, draft_limit: int) -> dict[str, Any]:
    inp = plan.input
    rep = capacity_report(layout, max_model_len=plan.max_model_len, max_num_batched_tokens=batch)
    bytes_per_block = layout.page_size_bytes * layout.group_size
    groups = []
    for i, g in enumerate(layout.groups):
        spec = g.spec
        groups.append({
            "kind": spec.kind,
            "layers": list(g.layer_names),
            "num_layers": len(g.layer_names),
            "block_size": spec.block_size,
            "page_size_bytes": spec.page_size_bytes,
            "grows_with_sequence": spec.grows_with_sequence,
            "blocks_per_request": rep.blocks_per_request[i],
            "max_blocks_per_request": spec.max_blocks_per_request(batch, plan.max_model_len),
            "slot_address_space": rep.slot_address_space[i],
            **({"sliding_window": spec.sliding_window} if hasattr(spec, "sliding_window") else {}),
            **({"attention_chunk_size": spec.attention_chunk_size}
               if hasattr(spec, "attention_chunk_size") else {}),
            **({"state_part": spec.state_part, "state_parts": spec.state_parts}
               if isinstance(spec, MambaSpec) else {}),
        })
    per_request = sum(rep.blocks_per_request)
    bounded = sum(n for g, n in zip(layout.groups, rep.blocks_per_request) if not g.spec.grows_with_sequence)
    min_block = min(g.spec.block_size for g in layout.groups)
    lens = sorted({*inp.request_lens})
    return _base_report(plan, num_layers) | {
        "fits": True,
        "num_blocks": layout.num_blocks,
        "block_size": min_block,
        "bytes_per_block": bytes_per_block,
        "kv_memory_bytes": layout.memory_bytes,
        "groups": groups,
        "kv_capacity_tokens": rep.token_capacity,
        "naive_capacity_tokens": layout.num_blocks // len(layout.groups) * min_block,
        "max_concurrency": rep.max_concurrency,
        "concurrency_at_request_len": {str(n): rep.concurrency_for(n) for n in lens if n <= plan.max_model_len},
        "blocks_per_request": per_request,
        "bounded_groups_share": bounded / per_request if per_request else 0.0,
        "padding_waste_bytes": layout.padding_bytes,
        "recurrent_states": [{"layers": list(st.layer_names), "groups": list(st.groups),
                              "state_bytes": st.state_bytes, "pages_per_state": len(st.groups),
                              "part_bytes": st.part_bytes} for st in layout.recurrent_states],
        "uncached_layers": list(layout.uncached_layers),
        "speculative": _speculative(layout, (inp.num_speculative_tokens, draft_limit), batch, plan.max_model_len,
                                    per_request, lens),
    }


def _speculative(layout: KVCacheLayout, drafts: tuple[int, int], batch: int, max_model_len: int, per_request: int,
                 lens: list[int]) -> dict[str, Any]:
    """What ``k`` draft slots per request cost (``drafts``: ``k`` and the most a step verifies; the
    scheduler's admission bound reserves the slots): the most blocks they add to one request, apart
    from those in recurrent states of a request shorter than their bound (``draft_state_blocks_*``);
    the concurrency of max-length requests each holding that many more; per request length ``n`` the
    concurrency with blocks for ``min(n + k, max_model_len)`` slots (drafts never pass ``max_model_len``)."""
    k, limit = drafts
    usable = layout.num_blocks - 1
    specs = [g.spec for g in layout.groups]
    # A recurrent state that does not grow holds at most its bound, drafts or not.
    bounded = {i for st in layout.recurrent_states for i in st.groups if not specs[i].grows_with_sequence}

    def blocks(n: int) -> int:
        return sum(s.blocks_for_tokens(n, batch, max_model_len) for s in specs)

    def added(i: int) -> int:
        # The most: the request ends on the group's first block boundary (below any window's bound).
        s = specs[i]
        return s.blocks_for_tokens(s.block_size + k, batch, max_model_len) - s.blocks_for_tokens(
            s.block_size, batch, max_model_len) if k else 0

    draft = sum(added(i) for i in range(len(specs)) if i not in bounded)
    short = max(((specs[i].max_blocks_per_request(batch, max_model_len) - 1) * specs[i].block_size
                 for i in bounded if added(i)), default=0)
    return {
        "num_speculative_tokens": k,
        "max_speculative_tokens": limit,
        "draft_blocks_per_request": draft,
        "draft_state_blocks_per_request": sum(added(i) for i in bounded),
        "draft_state_blocks_up_to_tokens": short,
        "max_concurrency": usable // (per_request + draft) if per_request + draft else 0,
        "concurrency_at_request_len": {str(n): usable // blocks(min(n + k, max_model_len))
                                       for n in lens if n <= max_model_len},
    }


def group_rows(report: Mapping[str, Any]) -> list[tuple[str, str, dict[str, Any], int, int]]:
    """The report's groups for a table: ``(label, kind, group, blocks per request, admission
    bound)``, one row per recurrent state however many pages (groups) it spans, counted in pages."""
    rows = []
    for i, g in enumerate(report["groups"]):
        parts = g.get("state_parts", 1)
        if g.get("state_part", 0):
            continue  # the other pages of a state: the same layers and counts as its first
        rows.append((str(i) if parts == 1 else f"{i}-{i + parts - 1}",
                     g["kind"] if parts == 1 else f"{g['kind']} ({parts} pages)", g,
                     g["blocks_per_request"] * parts, g["max_blocks_per_request"] * parts))
    return rows


def render_text(plan: Plan) -> str:
    """A plain-text report (the CLI uses rich tables when rich is installed)."""
    r = plan.report
    m = r["memory"]
    lines = [
        f"model {r['model']} on {r['gpu'] or 'custom GPU'} x{r['tensor_parallel_size']} (per GPU), "
        f"weights {r['weights_dtype']}, KV {r['kv_dtype']}, max_model_len {r['max_model_len']}, "
        f"max_num_batched_tokens {r['max_num_batched_tokens']}",
        f"memory: GPU {m['gpu_bytes'] / GiB:.1f} GiB x {m['utilization']} - weights {m['weights_bytes'] / GiB:.1f} GiB"
        f" - reserve {m['reserve_bytes'] / GiB:.1f} GiB = KV budget {m['kv_budget_bytes'] / GiB:.2f} GiB",
    ]
    if not r["fits"]:
        lines.append(f"DOES NOT FIT: {r['error']}")
        return "\n".join(lines)
    lines.append(f"{'group':>5} {'kind':<15} {'layers':>6} {'block':>6} {'page B':>9} {'grows':>5} "
                 f"{'blocks/req':>10} {'bound':>7} {'slots':>12}")
    for label, kind, g, blocks, bound in group_rows(r):
        lines.append(f"{label:>5} {kind:<15} {g['num_layers']:>6} {g['block_size']:>6} {g['page_size_bytes']:>9} "
                     f"{'yes' if g['grows_with_sequence'] else 'no':>5} {blocks:>10} "
                     f"{bound:>7} {g['slot_address_space']:>12}")
    lines += [
        f"blocks: {r['num_blocks']} of {r['bytes_per_block']} bytes = KV memory {r['kv_memory_bytes'] / GiB:.2f} GiB "
        f"(padding waste {r['padding_waste_bytes'] / GiB:.2f} GiB)",
        f"token capacity: {r['kv_capacity_tokens']} (naive num_blocks // num_groups * block_size: "
        f"{r['naive_capacity_tokens']})",
        f"max concurrency at {r['max_model_len']} tokens: {r['max_concurrency']} "
        f"({r['blocks_per_request']} blocks per request, {r['bounded_groups_share']:.1%} of them in bounded groups)",
    ]
    for n, c in r["concurrency_at_request_len"].items():
        lines.append(f"max concurrency at {n} tokens: {c}")
    spec = r["speculative"]
    if spec["num_speculative_tokens"]:
        states = spec["draft_state_blocks_per_request"]
        lines.append(f"speculative decoding, {spec['num_speculative_tokens']} draft tokens (at most "
                     f"{spec['max_speculative_tokens']} here): up to {spec['draft_blocks_per_request']} more blocks "
                     f"per request"
                     + (f" ({states} more in recurrent states up to {spec['draft_state_blocks_up_to_tokens']} "
                        f"tokens)" if states else "")
                     + f", max concurrency {spec['max_concurrency']}"
                     + "".join(f", {c} at {n} tokens" for n, c in spec["concurrency_at_request_len"].items()))
    for st in r["recurrent_states"]:
        if st["pages_per_state"] > 1:
            lines.append(f"recurrent state of {st['state_bytes']} bytes per layer: {st['pages_per_state']} pages "
                         f"(groups {st['groups'][0]}-{st['groups'][-1]}, one per page)")
    return "\n".join(lines)

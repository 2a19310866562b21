"""KV-cache groups, the pool layout, the planner and the capacity report.

All groups share one pool of ``num_blocks`` blocks. Memory is laid out as ``group_size``
tensors of ``num_blocks`` pages each; block ``b`` of a group with ``k`` layers is page ``b`` of
the first ``k`` tensors. Groups therefore need one page size (the planner raises block sizes
or pads pages to get it) and, to waste nothing, the same number of layers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Literal

from hybridkv.core._util import cdiv
from hybridkv.core.specs import AttentionSpec, EncoderOnlyAttentionSpec, KVCacheSpec, MambaSpec
from hybridkv.errors import DoesNotFitError, InvalidInputError, LayoutError

MAX_GROUPS = 255
"""Most groups a layout may have (a group index fits in one byte of a block's key)."""


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one spec and one block table per request."""

    spec: KVCacheSpec
    layer_names: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.spec, KVCacheSpec):
            raise InvalidInputError(f"KVCacheGroup.spec must be a KVCacheSpec, got {type(self.spec).__name__}")
        object.__setattr__(self, "layer_names", tuple(self.layer_names))


@dataclass(frozen=True)
class RecurrentState:
    """The state of one group of recurrent layers, spread over the pages of ``state_parts`` groups.

    The state at table index ``i`` is the pages ``tables[groups[j]][i]`` for ``j`` in part order
    (a page list per state, no contiguity needed): part ``j`` of layer ``layer_names[m]``'s state is
    bytes ``[j * part_bytes, (j + 1) * part_bytes)`` of it, in KV tensor ``m`` of group ``groups[j]``.
    """

    layer_names: tuple[str, ...]
    groups: tuple[int, ...]
    state_bytes: int
    """Bytes of one layer's whole state."""
    part_bytes: int
    """Bytes of one layer's state each page holds (the last part may hold fewer)."""


@dataclass(frozen=True)
class KVCacheLayout:
    """The pool size and its groups. ``num_blocks`` includes the null block 0."""

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]
    uncached_layers: tuple[str, ...] = field(default=())
    """Layers that keep no KV cache (encoder-only attention)."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise InvalidInputError(
                f"num_blocks must be an integer >= 2 (block 0 is the null block), got {self.num_blocks!r}"
            )
        object.__setattr__(self, "groups", tuple(self.groups))
        if not self.groups:
            raise InvalidInputError("a layout needs at least one KVCacheGroup")
        if len(self.groups) > MAX_GROUPS:
            raise InvalidInputError(f"at most {MAX_GROUPS} groups are supported, got {len(self.groups)}")
        for g in self.groups:
            if not isinstance(g, KVCacheGroup):
                raise InvalidInputError(f"layout groups must be KVCacheGroup, got {type(g).__name__}")
        self._check_state_pages()
        self.recurrent_states  # noqa: B018  (validates the parts of every state)

    def _check_state_pages(self) -> None:
        """A recurrent state's pages are the pool's pages. A hand-built layout may mix page sizes (the
        pool's page is the largest), but not with a state page larger than every attention page: that
        would silently make every attention page that large (coarse blocks in disguise)."""
        states = [g.spec for g in self.groups if isinstance(g.spec, MambaSpec)]
        pages = {g.spec.page_size_bytes for g in self.groups} - {0}
        if not states or len(pages) < 2:
            return
        largest = max(s.page_size_bytes for s in states)
        attention = max((g.spec.page_size_bytes for g in self.groups if not isinstance(g.spec, MambaSpec)),
                        default=0)
        if largest > attention:
            raise LayoutError(
                f"a recurrent state page of {largest} bytes in a pool whose attention pages are "
                f"{attention} bytes: every group needs the one page size ({', '.join(map(str, sorted(pages)))} "
                "given); plan_layout spreads a state over several pages (MambaSpec.state_parts) or pads"
            )

    @cached_property
    def recurrent_states(self) -> tuple[RecurrentState, ...]:
        """Each recurrent state with the groups holding its parts (in part order)."""
        parts: dict[tuple[KVCacheSpec, tuple[str, ...]], dict[int, int]] = {}
        for i, g in enumerate(self.groups):
            if isinstance(g.spec, MambaSpec):
                whole = replace(g.spec, state_part=0, page_size_padded=None)
                parts.setdefault((whole, g.layer_names), {})[g.spec.state_part] = i
        out = []
        for (spec, names), found in parts.items():
            assert isinstance(spec, MambaSpec)
            if sorted(found) != list(range(spec.state_parts)):
                missing = sorted(set(range(spec.state_parts)) - set(found))
                raise LayoutError(f"recurrent layers {', '.join(names) or '(unnamed)'}: the state has "
                                  f"{spec.state_parts} parts but no group holds part(s) {missing}")
            out.append(RecurrentState(names, tuple(found[j] for j in range(spec.state_parts)),
                                      spec.state_bytes, spec.part_bytes))
        return tuple(out)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of one layer (the largest page among the groups)."""
        return max(g.spec.page_size_bytes for g in self.groups)

    @property
    def group_size(self) -> int:
        """Layers per group after padding: the number of KV tensors."""
        return max(1, max(len(g.layer_names) for g in self.groups))

    @property
    def memory_bytes(self) -> int:
        """Bytes of all KV tensors."""
        return self.num_blocks * self.page_size_bytes * self.group_size

    @property
    def padding_bytes(self) -> int:
        """Bytes lost to padded pages and to groups with fewer layers than ``group_size``."""
        used = sum(len(g.layer_names) * g.spec.real_page_size_bytes for g in self.groups)
        return self.memory_bytes - self.num_blocks * used // max(1, len(self.groups))


# ---------------------------------------------------------------------- planner
RecurrentPages = Literal["split", "unified"]
"""How the planner gives recurrent states and attention one page size: ``split`` (default) keeps
attention blocks small and spreads a state over as many pages as its bytes need, one group per
page (hits and checkpoints at attention granularity); ``unified`` raises attention blocks until one
page holds a whole state (the reference engine's layout: hits only at multiples of that block)."""


def _unify_attention(attn: list[AttentionSpec]) -> dict[int, KVCacheSpec]:
    """Attention specs on one page size: raise the block size where pages divide, else pad."""
    out: dict[int, KVCacheSpec] = {}
    target = max((s.real_page_size_bytes for s in attn), default=0)
    for s in attn:
        page = s.real_page_size_bytes
        if page == target:
            out[id(s)] = s
        elif target % page == 0:
            out[id(s)] = replace(s, block_size=s.block_size * (target // page))
        else:
            out[id(s)] = replace(s, page_size_padded=target)
    return out


def _unify_page_sizes(specs: list[KVCacheSpec], recurrent_pages: RecurrentPages = "split"
                      ) -> list[tuple[KVCacheSpec, ...]]:
    """Per spec, the spec(s) its layers take so that every caching spec has one page size: one
    each, except a recurrent state split over several pages (``recurrent_pages="split"``)."""
    mamba = [s for s in specs if isinstance(s, MambaSpec)]
    attn = [s for s in specs if isinstance(s, AttentionSpec) and s.real_page_size_bytes > 0]
    if recurrent_pages not in ("split", "unified"):
        raise InvalidInputError(f"recurrent_pages must be 'split' or 'unified', got {recurrent_pages!r}")
    grown = attn
    if mamba and attn and recurrent_pages == "unified":
        # Attention blocks grow until one attention page holds a whole state.
        state_page = max(s.real_page_size_bytes for s in mamba)
        grown = [replace(s, block_size=s.block_size * cdiv(state_page, s.real_page_size_bytes)) for s in attn]
    unified = _unify_attention(grown)
    out: dict[int, tuple[KVCacheSpec, ...]] = {id(s): (unified[id(g)],) for s, g in zip(attn, grown)}
    if mamba:
        attn_page = max((s.real_page_size_bytes for s in unified.values()), default=0)
        attn_block = max((s.block_size for s in unified.values()), default=0)
        page = attn_page or max(s.state_bytes for s in mamba)
        for m in mamba:
            parts = cdiv(m.state_bytes, page)
            state = replace(m, block_size=attn_block) if attn_block and m.mode != "none" else m
            out[id(m)] = tuple(_padded(replace(state, state_part=j, state_parts=parts), page)
                               for j in range(parts))
    return [out.get(id(s), (s,)) for s in specs]


def _padded(spec: KVCacheSpec, page: int) -> KVCacheSpec:
    return spec if spec.real_page_size_bytes == page else replace(spec, page_size_padded=page)


def _group_layers(layer_specs: Mapping[str, tuple[KVCacheSpec, ...]]
                  ) -> tuple[list[KVCacheGroup], tuple[str, ...]]:
    """Layers of one spec together; equal-sized groups (the reference planner's rule).

    When the largest spec has fewer than 1.5x the layers of the smallest, every spec is one
    group, padded to the largest; otherwise groups have as many layers as the smallest spec
    and larger specs are split. A layer whose state spans several pages is in one group per page.
    """
    by_spec: dict[KVCacheSpec, list[str]] = {}
    uncached: list[str] = []
    for name, specs in layer_specs.items():  # specs checked by plan_layout
        for spec in specs:
            if isinstance(spec, EncoderOnlyAttentionSpec):
                uncached.append(name)
            else:
                by_spec.setdefault(spec, []).append(name)
    if not by_spec:
        raise LayoutError("no layer keeps a KV cache: nothing to plan")
    counts = [len(v) for v in by_spec.values()]
    lo, hi = min(counts), max(counts)
    group_size = hi if hi < 1.5 * lo else lo
    groups: list[KVCacheGroup] = []
    for spec, names in by_spec.items():
        for start in range(0, len(names), group_size):
            groups.append(KVCacheGroup(spec, tuple(names[start : start + group_size])))
    # The pages of one state in consecutive groups, in part order.
    first: dict[tuple[str, ...], int] = {}
    for i, g in enumerate(groups):
        first.setdefault(g.layer_names, i)
    groups.sort(key=lambda g: (first[g.layer_names], g.spec.state_part if isinstance(g.spec, MambaSpec) else 0))
    return groups, tuple(uncached)


def _request_blocks(groups: tuple[KVCacheGroup, ...], num_tokens: int, max_num_batched_tokens: int,
                    max_model_len: int) -> list[int]:
    """Blocks one request of ``num_tokens`` holds at its peak in each group."""
    return [g.spec.blocks_for_tokens(num_tokens, max_num_batched_tokens, max_model_len) for g in groups]


def max_model_len_that_fits(groups: tuple[KVCacheGroup, ...], usable_blocks: int,
                            max_num_batched_tokens: int, limit: int) -> int:
    """Largest ``n <= limit`` such that one request of ``n`` tokens fits in ``usable_blocks``."""
    lo, hi = 0, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(_request_blocks(groups, mid, max_num_batched_tokens, mid)) <= usable_blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def plan_layout(
    layer_specs: Mapping[str, KVCacheSpec],
    memory_bytes: int,
    *,
    max_model_len: int,
    max_num_batched_tokens: int,
    recurrent_pages: RecurrentPages = "split",
) -> KVCacheLayout:
    """Group layers, unify page sizes and size the pool for a memory budget.

    Raises ``DoesNotFitError`` (naming the largest ``max_model_len`` that fits) when one
    request of ``max_model_len`` tokens does not fit.
    """
    if not layer_specs:
        raise InvalidInputError("layer_specs is empty: give at least one layer")
    for name, value in (("memory_bytes", memory_bytes), ("max_model_len", max_model_len),
                        ("max_num_batched_tokens", max_num_batched_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise InvalidInputError(f"{name} must be a positive integer, got {value!r}")
    names = list(layer_specs)
    for name, spec in layer_specs.items():
        if not isinstance(spec, KVCacheSpec):
            raise InvalidInputError(f"layer {name!r}: expected a KVCacheSpec, got {type(spec).__name__}")
        if isinstance(spec, MambaSpec) and spec.state_parts != 1:
            raise InvalidInputError(f"layer {name!r}: state_parts={spec.state_parts}, but the planner "
                                    "decides how many pages a state spans: give the whole state (state_parts=1)")
    unified = _unify_page_sizes(list(layer_specs.values()), recurrent_pages)
    groups, uncached = _group_layers(dict(zip(names, unified)))
    if len(groups) > MAX_GROUPS:
        parts = max((g.spec.state_parts for g in groups if isinstance(g.spec, MambaSpec)), default=1)
        raise LayoutError(
            f"the layout needs {len(groups)} KV-cache groups, more than the limit of {MAX_GROUPS}"
            + (f": a recurrent state spans {parts} pages of {groups[0].spec.page_size_bytes} bytes; "
               "raise the attention block_size (larger pages, fewer per state) or use "
               "recurrent_pages='unified'" if parts > 1 else "")
        )
    group_size = max(len(g.layer_names) for g in groups)
    page = max(g.spec.page_size_bytes for g in groups)
    num_blocks = memory_bytes // (page * group_size)
    layout_groups = tuple(groups)
    need = sum(_request_blocks(layout_groups, max_model_len, max_num_batched_tokens, max_model_len))
    if num_blocks - 1 < need:
        fits = max_model_len_that_fits(layout_groups, max(0, num_blocks - 1), max_num_batched_tokens,
                                       max_model_len)
        raise DoesNotFitError(
            f"one request of max_model_len={max_model_len} tokens needs {need} blocks of "
            f"{page * group_size} bytes ({need * page * group_size} bytes) but the budget of "
            f"{memory_bytes} bytes holds {max(0, num_blocks - 1)} usable blocks; the largest "
            f"max_model_len that fits is {fits}",
            fits,
        )
    return KVCacheLayout(num_blocks=num_blocks, groups=layout_groups, uncached_layers=uncached)


# ---------------------------------------------------------------------- capacity
@dataclass(frozen=True)
class CapacityReport:
    """What a layout holds, computed from the same per-request bounds the manager admits with."""

    num_blocks: int
    usable_blocks: int
    max_model_len: int
    max_num_batched_tokens: int
    groups: tuple[KVCacheGroup, ...]
    token_capacity: int
    """Tokens the cache holds, dividing blocks only among groups that grow (growing-groups capacity)."""
    max_concurrency: int
    """Most sequences of ``max_model_len`` tokens that fit at once."""
    blocks_per_request: tuple[int, ...]
    """Per group, blocks one request of ``max_model_len`` tokens holds at its peak."""
    slot_address_space: tuple[int, ...]
    """Per group, ``num_blocks * block_size``: the size of any buffer indexed by its slot mapping."""
    growing_groups: tuple[int, ...]
    """Indices of the groups token capacity is divided among."""

    def concurrency_for(self, num_tokens: int) -> int:
        """Most sequences of ``num_tokens`` tokens that fit at once (per-group bounds applied)."""
        if not isinstance(num_tokens, int) or num_tokens <= 0:
            raise InvalidInputError(f"num_tokens must be a positive integer, got {num_tokens!r}")
        if num_tokens > self.max_model_len:
            raise InvalidInputError(
                f"num_tokens={num_tokens} exceeds max_model_len={self.max_model_len}"
            )
        per_request = sum(_request_blocks(self.groups, num_tokens, self.max_num_batched_tokens,
                                          self.max_model_len))
        return self.usable_blocks // per_request if per_request else 0

    def blocks_for(self, num_tokens: int) -> tuple[int, ...]:
        """Per group, blocks one request of ``num_tokens`` tokens holds at its peak."""
        return tuple(_request_blocks(self.groups, num_tokens, self.max_num_batched_tokens,
                                     self.max_model_len))


def capacity_report(layout: KVCacheLayout, *, max_model_len: int, max_num_batched_tokens: int) -> CapacityReport:
    """Token capacity, exact concurrency and per-group bounds of ``layout``."""
    usable = layout.num_blocks - 1
    growing = tuple(i for i, g in enumerate(layout.groups) if g.spec.grows_with_sequence)
    counted = growing or tuple(range(len(layout.groups)))  # none grows: fall back to all groups
    sizes = [layout.groups[i].spec.block_size for i in counted]
    # Largest T with sum over counted groups of cdiv(T, bs) <= usable blocks.
    lo, hi = 0, usable * max(sizes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(cdiv(mid, bs) for bs in sizes) <= usable:
            lo = mid
        else:
            hi = mid - 1
    per_request = _request_blocks(layout.groups, max_model_len, max_num_batched_tokens, max_model_len)
    total = sum(per_request)
    return CapacityReport(
        num_blocks=layout.num_blocks,
        usable_blocks=usable,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
        groups=layout.groups,
        token_capacity=lo,
        max_concurrency=usable // total if total else 0,
        blocks_per_request=tuple(per_request),
        slot_address_space=tuple(layout.num_blocks * g.spec.block_size for g in layout.groups),
        growing_groups=counted,
    )

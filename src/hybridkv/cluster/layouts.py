"""What an index knows about a replica's KV-cache groups, and the hit rules that follow from it.

Configured (a ``KVCacheLayout``) or learned from store events; a learned layout is used only once
complete, and until then the replica is predicted no hit. Chunked-local attention cannot be
learned. See docs/CLUSTER.md, "The index's guarantees" and "Following the streams".
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridkv.core import (
    FastHits,
    FullAttentionSpec,
    HitRules,
    KVCacheGroup,
    KVCacheLayout,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from hybridkv.errors import InvalidInputError

# vLLM kinds whose hit rule the index can rebuild from an event alone.
_FULL_KINDS = {"full_attention", "sink_full_attention"}
LEARNABLE_KINDS = _FULL_KINDS | {"mla_attention", "sliding_window", "sliding_window_mla", "mamba"}


@dataclass(frozen=True, slots=True)
class GroupDescription:
    """One group as a store event describes it."""

    kind: str
    block_size: int
    sliding_window: int | None = None


def spec_from_description(d: GroupDescription) -> KVCacheSpec:
    """A spec with ``d``'s hit rule (page sizes are irrelevant to hits and set to one byte's worth)."""
    if d.kind in _FULL_KINDS:
        return FullAttentionSpec(block_size=d.block_size, num_kv_heads=1, head_size=1)
    if d.kind == "mla_attention":
        return MLAAttentionSpec(block_size=d.block_size, num_kv_heads=1, head_size=1)
    if d.kind in ("sliding_window", "sliding_window_mla"):
        if not d.sliding_window:
            raise InvalidInputError(f"a {d.kind} group needs its window, the event carried none")
        return SlidingWindowSpec(block_size=d.block_size, num_kv_heads=1, head_size=1, sliding_window=d.sliding_window)
    if d.kind == "mamba":
        return MambaSpec(block_size=d.block_size, state_bytes=1, mode="align")
    raise InvalidInputError(
        f"group kind {d.kind!r} cannot be learned from events; configure the replica's layout"
    )


class ReplicaLayout:
    """A replica's groups (configured or learned) and the ``HitRules`` built from them."""

    __slots__ = ("configured", "learned", "expected_groups", "max_model_len", "_rules", "_problem", "block_sizes",
                 "chain_group", "chain_rules", "fast")

    def __init__(self, layout: KVCacheLayout | None = None, *, expected_groups: int | None = None,
                 max_model_len: int = 1 << 20) -> None:
        if expected_groups is not None and (type(expected_groups) is not int or expected_groups < 1):
            raise InvalidInputError(f"expected_groups must be a positive integer, got {expected_groups!r}")
        if layout is not None and expected_groups is not None and expected_groups != len(layout.groups):
            raise InvalidInputError(
                f"expected_groups={expected_groups} but the configured layout has {len(layout.groups)} groups"
            )
        self.configured = layout
        self.learned: dict[int, GroupDescription] = {}
        self.expected_groups = expected_groups
        self.max_model_len = max_model_len
        self._rules: HitRules | None = None
        self._problem = "no store event seen yet"
        self.block_sizes: dict[int, int] = {}
        """Per group, its block size (set with the rules)."""
        self.chain_group: int | None = None
        """The first caching full-attention (downward-closed) group, if the layout has one."""
        self.fast: FastHits | None = None
        """The rules as ``FastHits`` when every constraining group is a stock kind."""
        self.chain_rules: HitRules | None = None
        """The hit rules of that group alone (its only group is 0): what a prefix-only index predicts."""
        if layout is not None:
            self._set_rules(HitRules(layout, max_model_len))

    def _set_rules(self, rules: HitRules | None) -> None:
        self._rules = rules
        self.block_sizes = {g.group: g.block_size for g in rules.groups} if rules else {}
        self.chain_group = next((g.group for g in rules.groups if g.caching and g.downward_closed), None) if rules \
            else None
        self.chain_rules = None
        self.fast = FastHits.for_rules(rules) if rules is not None else None
        if rules is not None and self.chain_group is not None:
            spec = rules.layout.groups[self.chain_group].spec
            self.chain_rules = HitRules(KVCacheLayout(num_blocks=2, groups=(KVCacheGroup(spec),)), self.max_model_len)
        if rules is not None:
            self._problem = ""

    @property
    def rules(self) -> HitRules | None:
        """The hit rules, or None while the layout is unknown or incomplete (see ``problem``)."""
        return self._rules

    @property
    def problem(self) -> str:
        """Why there are no rules yet (empty when there are)."""
        return self._problem

    def learn(self, group: int, kind: str | None, sliding_window: int | None, block_size: int) -> None:
        """Note what a store event says about ``group``; rebuild the rules when it changes anything."""
        if self.configured is not None or kind is None or block_size <= 0:
            return
        old = self.learned.get(group)
        same = old is not None and old.kind == kind and old.sliding_window == sliding_window
        if same and old is not None and block_size <= old.block_size:
            return
        # A store of a partial (hash-sized) block reports a smaller size: keep the largest seen.
        size = block_size if old is None or old.kind != kind else max(block_size, old.block_size)
        self.learned[group] = GroupDescription(kind, size, sliding_window)
        self._rebuild()

    def _rebuild(self) -> None:
        self._set_rules(None)
        n = self.expected_groups if self.expected_groups is not None else max(self.learned) + 1
        missing = [g for g in range(n) if g not in self.learned]
        if missing:
            self._problem = f"groups {missing} not seen in any store event yet"
            return
        extra = [g for g in self.learned if g >= n]
        if extra:
            self._problem = f"store events name groups {extra}, beyond the {n} expected"
            return
        try:
            groups = [KVCacheGroup(spec_from_description(self.learned[g])) for g in range(n)]
        except InvalidInputError as exc:
            self._problem = str(exc)
            return
        self._set_rules(HitRules(KVCacheLayout(num_blocks=2, groups=tuple(groups)), self.max_model_len))

    def describe(self) -> list[str]:
        """One line per known group, for status pages."""
        if self.configured is not None:
            return [f"{i}: {g.spec.kind} block {g.spec.block_size} (configured)"
                    for i, g in enumerate(self.configured.groups)]
        return [f"{g}: {d.kind} block {d.block_size}" + (f" window {d.sliding_window}" if d.sliding_window else "")
                for g, d in sorted(self.learned.items())]

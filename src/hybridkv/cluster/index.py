"""The global index: many replicas' KV-event streams in, "what would replica r serve from its cache
for these tokens, per medium" out, with the core's hit rules (``HitRules``).

Batches are applied in order per replica; a gap is replayed or resynced, a number going back is a
restart. A view built from part of a stream only under-predicts. Pure Python and the standard
library: the ZMQ subscriber (``subscriber.py``) feeds it.
See docs/CLUSTER.md, "Following the streams" and "The index's guarantees".
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from hybridkv.cluster.events import EventBatch
from hybridkv.cluster.hashes import HashScheme, VllmHashes
from hybridkv.cluster.inverted import JointGroup, JointKey, ReplicaMasks, predict_together
from hybridkv.cluster.layouts import ReplicaLayout
from hybridkv.cluster.replica import Held, Prediction, ReplicaView, RequestKeys
from hybridkv.core import KVCacheLayout
from hybridkv.errors import InvalidInputError

Replay = Callable[[int], Iterable[tuple[int, EventBatch]]]
"""Asks a replica's replay buffer for its batches numbered from the argument on."""


@dataclass
class StreamStats:
    """Counters of one replica's event stream."""

    next_seq: int | None = None
    """The batch number expected next (None before the first batch or after a restart)."""
    batches: int = 0
    """Batches applied, live or replayed."""
    replayed: int = 0
    """Of those, the ones taken from the replay buffer to fill a gap."""
    gaps: int = 0
    resyncs: int = 0
    restarts: int = 0
    lost: list[int] = field(default_factory=list)
    """The last few batch numbers that could not be applied (lost in transit, undecodable)."""


@dataclass(frozen=True, slots=True)
class _Plan:
    """How ``lookup_keys`` predicts a set of replicas, valid while the masks' version is unchanged."""

    version: int
    order: list[str]
    alone: list[ReplicaView]
    together: list[JointGroup]
    reorder: bool


class ClusterIndex:
    """Replicas' cached blocks from their KV events, and the hit each would find for a request."""

    def __init__(self, *, shared_media: Iterable[str] = (), max_model_len: int = 1 << 20) -> None:
        self.views: dict[str, ReplicaView] = {}
        self.streams: dict[str, StreamStats] = {}
        self.shared: dict[str, Held] = {m: {} for m in shared_media}
        """Media every replica reads (a shared tier such as Redis), filled by any replica's events."""
        self.max_model_len = max_model_len
        self.masks = ReplicaMasks()
        """Per (medium, group), which replicas hold each hash: lookups walk a request's chain once."""
        self._plan: _Plan | None = None

    # ------------------------------------------------------------------ replicas
    def add_replica(self, name: str, *, scheme: HashScheme | None = None, layout: KVCacheLayout | None = None,
                    expected_groups: int | None = None) -> ReplicaView:
        """Follow a replica hashing with ``scheme`` (default: vLLM's sha256). Its layout is ``layout``,
        or learned from its store events (``expected_groups``: how many groups to wait for)."""
        if not name or not isinstance(name, str):
            raise InvalidInputError(f"a replica needs a non-empty name, got {name!r}")
        if name in self.views:
            raise InvalidInputError(f"replica {name!r} is already in the index")
        view = ReplicaView(name, scheme or VllmHashes(),
                           ReplicaLayout(layout, expected_groups=expected_groups, max_model_len=self.max_model_len))
        view.attach(self.masks, self.masks.allocate())
        self.views[name] = view
        self.streams[name] = StreamStats()
        return view

    def remove_replica(self, name: str) -> None:
        """Stop following ``name`` and forget what it held."""
        view = self._view(name)
        view.clear()
        self.masks.release(view.bit)
        del self.views[name]
        del self.streams[name]

    def _view(self, name: str) -> ReplicaView:
        view = self.views.get(name)
        if view is None:
            known = ", ".join(sorted(self.views)) or "none"
            raise InvalidInputError(f"unknown replica {name!r} (known: {known})")
        return view

    # ------------------------------------------------------------------ events
    def apply_events(self, name: str, batch: EventBatch) -> None:
        """Apply one batch outside any numbering (a stream the caller orders itself)."""
        self._view(name).apply(batch.events, self.shared)

    def deliver(self, name: str, seq: int, batch: EventBatch, replay: Replay | None = None) -> None:
        """Apply batch number ``seq`` of ``name``'s live stream, filling a gap from ``replay``."""
        view = self._view(name)
        st = self.streams[name]
        if type(seq) is not int or seq < 0:
            raise InvalidInputError(f"replica {name!r}: batch numbers are non-negative integers, got {seq!r}")
        if st.next_seq is not None and seq < st.next_seq:
            # The numbers went back: the publisher restarted with an empty cache.
            st.restarts += 1
            view.clear()
            st.next_seq = None
        expected = 0 if st.next_seq is None else st.next_seq
        if seq > expected:
            st.gaps += 1
            self._fill(view, st, expected, seq, replay)
        view.apply(batch.events, self.shared)
        st.batches += 1
        st.next_seq = seq + 1

    def _fill(self, view: ReplicaView, st: StreamStats, expected: int, seq: int, replay: Replay | None) -> None:
        got: dict[int, EventBatch] = {}
        if replay is not None:
            got = {s: b for s, b in replay(expected) if expected <= s < seq}
        if all(s in got for s in range(expected, seq)):
            for s in range(expected, seq):
                view.apply(got[s].events, self.shared)
            st.replayed += seq - expected
            st.batches += seq - expected
            return
        # Some batches are gone: what the view holds may be stale. Start over from the run of
        # replayed batches that ends right before ``seq`` (a partial view, never an over-prediction).
        if st.next_seq is not None:
            st.resyncs += 1
            view.clear()
        start = seq
        while start - 1 in got:
            start -= 1
        for s in range(start, seq):
            view.apply(got[s].events, self.shared)
        st.replayed += seq - start
        st.batches += seq - start
        st.lost = (st.lost + [s for s in range(expected, start)])[-16:]

    def lost(self, name: str, seq: int) -> None:
        """Batch ``seq`` arrived but could not be read: count it lost and resync the view."""
        view = self._view(name)
        st = self.streams[name]
        st.resyncs += 1
        st.lost = (st.lost + [seq])[-16:]
        view.clear()
        st.next_seq = seq + 1

    def resync(self, name: str) -> None:
        """Forget what ``name`` holds and its stream position (it restarted, or a caller knows better)."""
        self._view(name).clear()
        self.streams[name].next_seq = None

    # ------------------------------------------------------------------ queries
    def lookup(self, token_ids: list[int], *, cache_salt: str | None = None, replicas: Iterable[str] | None = None,
               chain_only: bool = False) -> dict[str, Prediction]:
        """Per replica (all, or ``replicas``): the prompt tokens it would serve from its caches.
        ``chain_only``: what an index of the full-attention chain alone predicts (as deployed
        prefix-aware routers do), for comparison."""
        return self.lookup_keys(RequestKeys(token_ids, cache_salt), replicas, chain_only=chain_only)

    def lookup_keys(self, keys: RequestKeys, replicas: Iterable[str] | None = None, *,
                    chain_only: bool = False) -> dict[str, Prediction]:
        """``lookup`` for a request whose hashes may already be computed (``RequestKeys``)."""
        if chain_only or self.shared:
            names = self.views if replicas is None else replicas
            return {name: self._view(name).predict(keys, self.shared, chain_only=chain_only) for name in names}
        cached = self._plan if replicas is None else None
        if cached is not None and cached.version == self.masks.version:
            plan = cached
        else:
            plan = self._make_plan(self.views if replicas is None else replicas)
            if replicas is None:
                self._plan = plan
        if not plan.alone and len(plan.together) == 1:  # the usual cluster: every replica alike
            return predict_together(keys, plan.together[0], self.masks)
        out = {view.name: view.predict(keys, self.shared) for view in plan.alone}
        for group in plan.together:
            out.update(predict_together(keys, group, self.masks))
        return {name: out[name] for name in plan.order} if plan.reorder else out

    def _make_plan(self, names: Iterable[str]) -> _Plan:
        """Which replicas are predicted together (one walk of a request's chain over the masks, per
        group of replicas that hash and lay out blocks alike) and which each by its own view."""
        version = self.masks.version
        order: list[str] = []
        alone: list[ReplicaView] = []
        together: dict[JointKey, list[ReplicaView]] = {}
        for name in names:
            view = self._view(name)
            order.append(name)
            key = view.joint_key()
            if key is None:
                alone.append(view)
            else:
                together.setdefault(key, []).append(view)
        groups = [JointGroup(views[0].media_in_order()[0], views) for views in together.values()]
        return _Plan(version, order, alone, groups, len(groups) + bool(alone) > 1)

    def lookup_each(self, keys: RequestKeys, replicas: Iterable[str] | None = None) -> dict[str, Prediction]:
        """``lookup_keys`` with every replica predicted by its own view (what the masks must agree with)."""
        names = self.views if replicas is None else replicas
        return {name: self._view(name).predict(keys, self.shared) for name in names}

    def chain_hashes(self, name: str, keys: RequestKeys) -> tuple[list[bytes], int] | None:
        """The request's full-attention chain as replica ``name`` hashes it, and that group's block
        size in tokens; None while its layout is unknown, it has no full-attention group or its
        hashes do not match the scheme."""
        view = self._view(name)
        rules, chain = view.layout.rules, view.layout.chain_group
        if rules is None or chain is None or view.hash_problem:
            return None
        size = view.layout.block_sizes[chain]
        return keys.hashes(view.scheme, rules.hash_block_size, size, bool(view.short_hashes)), size

    def num_blocks(self) -> dict[str, int]:
        """Hashes indexed per replica (and per shared medium, as ``shared:MEDIUM``)."""
        out = {name: view.num_blocks() for name, view in self.views.items()}
        for medium, held in self.shared.items():
            out[f"shared:{medium}"] = sum(len(g) for g in held.values())
        return out

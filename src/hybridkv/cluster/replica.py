"""One replica as an index sees it: the block hashes each of its caches holds, per medium and group.

A hash is held while more stores than removals named it (an engine may cache two blocks with the
same content, and removes each). Hashes sent as integers (vLLM's default: the digest's low 64 bits)
are kept as 8 bytes, and the request's hashes are cut to their last 8 bytes to match.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridkv.cluster.events import MEDIUM_GPU, AllClearedEvent, BlockRemovedEvent, BlockStoredEvent, WireEvent
from hybridkv.cluster.hashes import HashScheme
from hybridkv.cluster.layouts import ReplicaLayout
from hybridkv.core import KVSequence, Sequence

if TYPE_CHECKING:
    from hybridkv.cluster.inverted import JointKey, ReplicaMasks
    from hybridkv.cluster.routing import Policy

Held = dict[int, dict[bytes, int]]
"""Per group, hash -> how many cached blocks hold it (always >= 1)."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """The prompt tokens a replica would serve from its caches: ``tokens`` in all, ``by_medium`` what
    each medium adds in lookup order (device first). ``problem`` says why a replica is predicted no
    hit regardless of its caches (layout not known yet, hashes that do not match its scheme)."""

    replica: str
    tokens: int
    by_medium: tuple[tuple[str, int], ...] = ()
    problem: str = ""

    def medium_tokens(self, medium: str) -> int:
        """Tokens ``medium`` adds (0 if it adds none)."""
        return next((n for m, n in self.by_medium if m == medium), 0)


_MEDIA_RANK = {MEDIUM_GPU: 0, "CPU": 1, "DISK": 2, "STORAGE": 3}


def media_order(media: list[str]) -> list[str]:
    """The order a lookup walks media: GPU, CPU, DISK, STORAGE, then others by name."""
    return sorted(media, key=lambda m: (_MEDIA_RANK.get(m, 4), m))


def _key(h: bytes | int) -> bytes:
    return h if isinstance(h, bytes) else h.to_bytes(8, "big")


def _drop_bit(masks: dict[bytes, int], keys: Iterable[bytes], keep: int) -> None:
    """Clear a replica's bit (``keep`` is every other bit) from the masks of ``keys``; a mask left
    empty goes."""
    for k in keys:
        left = masks[k] & keep
        if left:
            masks[k] = left
        else:
            del masks[k]


def _keys(hashes: tuple[bytes | int, ...]) -> tuple[bytes, ...] | list[bytes]:
    """The index keys of an event's hashes (the hashes themselves when all are digests, checked in C)."""
    if type(hashes[0]) is bytes and len(set(map(type, hashes))) == 1:
        return hashes  # type: ignore[return-value]
    return [_key(h) for h in hashes]


class RequestKeys:
    """A request's tokens and, computed once per scheme and block size, its block hashes: every
    replica's prediction for one request shares them."""

    __slots__ = ("sequence", "token_ids", "cache_salt", "_chains", "_groups")

    def __init__(self, token_ids: list[int], cache_salt: str | None = None) -> None:
        seq = Sequence("request", token_ids, cache_salt=cache_salt)  # validates the token ids
        self.sequence: KVSequence = seq
        """The request as the core sees it (the simulator's requests have no token ids)."""
        self.token_ids = seq.token_ids
        self.cache_salt = cache_salt
        self._chains: dict[tuple[str, int], list[bytes]] = {}
        self._groups: dict[tuple[str, int, int, bool], list[bytes]] = {}

    def home_key(self, policy: Policy) -> bytes | None:
        """The request's key on ``policy``'s consistent-hash ring (``Policy.home_key``)."""
        return policy.home_key(self.token_ids, self.cache_salt)

    def hashes(self, scheme: HashScheme, hash_block_size: int, block_size: int, short: bool) -> list[bytes]:
        """The request's hashes at ``block_size`` (a multiple of ``hash_block_size``), cut to 8 bytes
        when ``short``."""
        key = (scheme.name, hash_block_size, block_size, short)
        found = self._groups.get(key)
        if found is not None:
            return found
        base = self._chain(scheme, hash_block_size)
        k = block_size // hash_block_size
        out = base if k == 1 else base[k - 1 :: k]
        if short:
            out = [h[-8:] for h in out]
        self._groups[key] = out
        return out

    def _chain(self, scheme: HashScheme, hash_block_size: int) -> list[bytes]:
        """The request's chain of ``hash_block_size`` hashes under ``scheme``, computed once."""
        chain_key = (scheme.name, hash_block_size)
        base = self._chains.get(chain_key)
        if base is None:
            base = scheme.chain(self.token_ids, hash_block_size, self.cache_salt)
            self._chains[chain_key] = base
        return base


class _PrefixOr(Mapping[bytes, int]):
    """A medium's hashes plus a prefix the lookup already serves (lookups only call ``get``)."""

    __slots__ = ("prefix", "held")

    def __init__(self, prefix: set[bytes], held: Mapping[bytes, int]) -> None:
        self.prefix = prefix
        self.held = held

    def get(self, key: bytes, default: Any = None) -> Any:
        return 1 if key in self.prefix else self.held.get(key, default)

    def __getitem__(self, key: bytes) -> int:
        found = self.get(key)
        if found is None:
            raise KeyError(key)
        return int(found)

    def __iter__(self) -> Any:
        yield from self.prefix
        yield from (h for h in self.held if h not in self.prefix)

    def __len__(self) -> int:
        return len(self.prefix) + sum(1 for h in self.held if h not in self.prefix)


class ReplicaView:
    """What one replica's events say it holds, and the hit it would find for a request."""

    __slots__ = ("name", "scheme", "layout", "media", "short_hashes", "verified", "hash_problem",
                 "unknown_removals", "candidate", "_order", "masks", "bit", "no_hit", "_joint")

    def __init__(self, name: str, scheme: HashScheme, layout: ReplicaLayout) -> None:
        self.name = name
        self.scheme = scheme
        self.layout = layout
        self.media: dict[str, Held] = {}
        self._order: list[tuple[str, Held]] = []
        """``media`` in lookup order."""
        self.short_hashes: bool | None = None
        """True when the replica sends integer (64-bit) hashes; None before its first hash."""
        self.verified = False
        """A stored block was recomputed from its event's tokens with ``scheme`` and matched."""
        self.hash_problem = ""
        self.candidate: BlockStoredEvent | None = None
        """A store event whose first block the scheme can recompute, kept until the layout is known."""
        self.unknown_removals = 0
        """Removals of hashes this view never saw stored (a view that joined late, or lost events)."""
        self.masks: ReplicaMasks | None = None
        self.bit = 0
        """This replica's bit in ``masks``, the index's map of who holds what (0: not in one)."""
        self.no_hit = Prediction(name, 0)
        self._joint: tuple[object, object, str, JointKey | None] | None = None

    def attach(self, masks: ReplicaMasks, bit: int) -> None:
        """Keep ``bit`` of ``masks`` equal to what this view holds on its own media (from now on:
        call before the first event)."""
        self.masks, self.bit = masks, bit
        self._joint = None
        self._regroup()

    def _regroup(self) -> None:
        """Something ``joint_key`` reads changed: the index's cached grouping is stale."""
        if self.masks is not None:
            self.masks.version += 1

    def media_in_order(self) -> list[str]:
        """The media this replica holds blocks on, in lookup order."""
        return [m for m, _ in self._order]

    def joint_key(self) -> JointKey | None:
        """What replicas predicted together by one walk of a request's chain share (hash scheme,
        hit rules, the one medium they hold blocks on), or None when this view's hits need its own
        ``predict``: no full-attention chain, kinds ``FastHits`` does not mirror, a hash problem,
        blocks on several media or on none, no bit in the index's masks."""
        fast, order = self.layout.fast, self._order
        cached = self._joint
        if cached is not None and cached[0] is fast and cached[1] is order and cached[2] == self.hash_problem:
            return cached[3]
        key: JointKey | None = None
        rules, chain = self.layout.rules, self.layout.chain_group
        if (fast is not None and rules is not None and not self.hash_problem and self.bit and len(order) == 1
                and chain is not None and any(g == chain for g, _ in fast.chains)):
            key = (self.scheme.name, rules.hash_block_size, bool(self.short_hashes), order[0][0], fast.alignment,
                   tuple(fast.chains), tuple(fast.spans), chain)
        self._joint = (fast, order, self.hash_problem, key)
        return key

    # ------------------------------------------------------------------ events
    def apply(self, events: tuple[WireEvent, ...] | list[WireEvent], shared: Mapping[str, Held]) -> None:
        """Apply one batch's events in order (media in ``shared`` go to those shared stores)."""
        for e in events:
            if isinstance(e, BlockStoredEvent):
                self._stored(e, shared)
            elif isinstance(e, BlockRemovedEvent):
                self._removed(e, shared)
            elif isinstance(e, AllClearedEvent):
                self.clear()
        if self.candidate is not None and self.layout.rules is not None:
            self._check(self.candidate)

    def _stored(self, e: BlockStoredEvent, shared: Mapping[str, Held]) -> None:
        if not e.block_hashes:
            return
        group_idx = e.group_idx or 0
        fast = self.layout.fast
        self.layout.learn(group_idx, e.kind, e.sliding_window, e.block_size)
        if self.layout.fast is not fast:
            self._regroup()
        if self.short_hashes is None:
            self.short_hashes = isinstance(e.block_hashes[0], int)
            self._regroup()
        medium = e.medium or MEDIUM_GPU
        held = shared[medium] if medium in shared else self._own(medium)
        group = held.setdefault(group_idx, {})
        get = group.get
        keys = _keys(e.block_hashes)
        if group.keys().isdisjoint(keys) and len(set(keys)) == len(keys):
            # The common store: keys this view does not hold yet, in bulk (as the loops below would).
            group.update(dict.fromkeys(keys, 1))
            if self.masks is not None and medium not in shared:
                masks, shift = self.masks.group(medium, group_idx)
                bit, holders = self.bit << shift, masks.get
                masks.update({k: holders(k, 0) | bit for k in keys})
        elif self.masks is None or medium in shared:
            for k in keys:
                group[k] = get(k, 0) + 1
        else:
            masks, shift = self.masks.group(medium, group_idx)
            bit, holders = self.bit << shift, masks.get
            for k in keys:
                n = get(k, 0)
                group[k] = n + 1
                if not n:
                    masks[k] = holders(k, 0) | bit
        # Checkable: the first block hashed without extra keys, after a digest (not 64 bits) or at
        # the start, and one block of tokens per hash (a recurrent store names one checkpoint after
        # the tokens of a whole run).
        plain = not e.extra_keys or e.extra_keys[0] is None
        if not self.verified and not self.hash_problem and plain and not isinstance(
                e.parent_block_hash, int) and len(e.token_ids) == len(e.block_hashes) * e.block_size:
            self.candidate = e  # checked once the layout (the hash block size) is known

    def _predict_chain(self, keys: RequestKeys, shared: Mapping[str, Held], hashes_of: Callable[[int], list[bytes]],
                       limit: int | None) -> Prediction:
        g0, rules = self.layout.chain_group, self.layout.chain_rules
        if g0 is None or rules is None:
            return Prediction(self.name, 0, (), "the layout has no full-attention group")
        media = self._order + [(m, shared[m]) for m in media_order(list(shared)) if m not in self.media]
        size = self.layout.block_sizes[g0]
        found: list[tuple[str, int]] = []
        tokens = 0
        for medium, held in media:
            have = held.get(g0, {})
            cached = {0: _PrefixOr(set(hashes_of(g0)[: tokens // size]), have) if tokens else have}
            n = rules.longest_hit(keys.sequence, cached, limit=limit, hashes=lambda _: hashes_of(g0))
            if n > tokens:
                found.append((medium, n - tokens))
                tokens = n
        return Prediction(self.name, tokens, tuple(found))

    def _own(self, medium: str) -> Held:
        held = self.media.get(medium)
        if held is None:
            held = self.media[medium] = {}
            self._order = [(m, self.media[m]) for m in media_order(list(self.media))]
            self._regroup()
        return held

    def _removed(self, e: BlockRemovedEvent, shared: Mapping[str, Held]) -> None:
        medium = e.medium or MEDIUM_GPU
        held = shared[medium] if medium in shared else self.media.get(medium)
        group = held.get(e.group_idx or 0) if held is not None else None
        if group is None:
            self.unknown_removals += len(e.block_hashes)
            return
        masks, keep = None, -1
        if self.masks is not None and medium not in shared:
            masks, shift = self.masks.group(medium, e.group_idx or 0)
            keep = ~(self.bit << shift)
        if not e.block_hashes:
            return
        keys = _keys(e.block_hashes)
        pop = group.pop
        counts = [pop(k, 0) for k in keys]
        if counts.count(1) == len(counts):  # the common removal: each the view's only copy
            if masks is not None:
                _drop_bit(masks, keys, keep)
            return
        for k, n in zip(keys, counts):  # put back what was popped, then one hash at a time
            if n:
                group[k] = n
        get = group.get
        gone: list[bytes] = []
        for k in keys:
            n = get(k, 0)
            if n > 1:
                group[k] = n - 1
            elif n == 1:
                del group[k]
                gone.append(k)
            else:
                self.unknown_removals += 1
        if masks is not None:
            _drop_bit(masks, gone, keep)

    def _check(self, e: BlockStoredEvent) -> None:
        """Recompute the event's first block with the scheme (its parent a digest or None: a 64-bit
        parent cannot seed the chain)."""
        self.candidate = None
        rules = self.layout.rules
        if rules is None or e.block_size != rules.hash_block_size or isinstance(e.parent_block_hash, int):
            return
        parent = e.parent_block_hash
        expect = self.scheme.check_block(parent, e.token_ids[: e.block_size])
        if expect is None:
            return
        got = _key(e.block_hashes[0])
        if (expect[-8:] if self.short_hashes else expect) == got:
            self.verified = True
        else:
            self.hash_problem = (f"stored block hashes do not match the {self.scheme.name} scheme "
                                 f"(another hash algorithm or seed?)")
            self._regroup()

    def clear(self) -> None:
        """Forget every held hash (a resync); what was learned about the layout stays."""
        if self.masks is not None:
            for medium, held in self.media.items():
                for g, group in held.items():
                    masks, shift = self.masks.group(medium, g)
                    _drop_bit(masks, group, ~(self.bit << shift))
        self.media.clear()
        self._order = []
        self._regroup()

    def num_blocks(self) -> int:
        """Hashes held over all media and groups."""
        return sum(len(g) for held in self.media.values() for g in held.values())

    # ------------------------------------------------------------------ predictions
    def predict(self, keys: RequestKeys, shared: Mapping[str, Held], *, limit: int | None = None,
                chain_only: bool = False) -> Prediction:
        """The hit this replica would find for ``keys``: its own media in lookup order, then the
        shared media, each extending the hit the earlier ones found. ``chain_only``: what an index
        of the full-attention chain alone would predict (windows and checkpoints ignored)."""
        rules = self.layout.rules
        problem = self.hash_problem or (self.layout.problem if rules is None else "")
        if rules is None or problem:
            return Prediction(self.name, 0, (), problem)
        scheme, hbs, short = self.scheme, rules.hash_block_size, bool(self.short_hashes)
        sizes = self.layout.block_sizes

        def hashes_of(group: int) -> list[bytes]:
            return keys.hashes(scheme, hbs, sizes[group], short)

        if chain_only:
            return self._predict_chain(keys, shared, hashes_of, limit)

        order = self._order
        if shared:
            order = order + [(m, shared[m]) for m in media_order(list(shared)) if m not in self.media]
        chain = self.layout.chain_group
        if chain is not None:
            # A shortcut, not a rule: no hit starts without the first block of the full-attention
            # chain, and most replicas do not hold a given prompt's first block at all.
            first = hashes_of(chain)[:1]
            if not first or not any(first[0] in held.get(chain, ()) for _, held in order):
                return Prediction(self.name, 0)
        seq = keys.sequence
        fast = self.layout.fast
        if fast is not None and len(order) == 1:  # one medium: the length alone, without block ids
            tokens = fast.longest_hit(seq.num_tokens, order[0][1], hashes_of, limit)
            return Prediction(self.name, tokens, ((order[0][0], tokens),) if tokens else ())
        tokens = 0
        found: list[tuple[str, int]] = []
        for medium, held in order:
            cached: Mapping[int, Mapping[bytes, int]] = held
            if tokens:
                cached = {g: _PrefixOr(set(hashes_of(g)[: tokens // sizes[g]]), held.get(g, {}))
                          for g in rules.caching_groups}
            n = rules.longest_hit(seq, cached, limit=limit, hashes=hashes_of)
            if n > tokens:
                found.append((medium, n - tokens))
                tokens = n
        return Prediction(self.name, tokens, tuple(found))

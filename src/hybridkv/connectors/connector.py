"""The connector: which tokens the external tiers can supply, loading them, storing blocks.

``KVConnector`` looks up (``connectors.lookup``), reads and verifies (its codec, ``connectors.codec``),
loads (``connectors.loads``) and stores (``KVTier.offer``) what its storage policy chooses
(``connectors.storage``), for real and simulated tiers alike; tier faults are counted misses.
The flow, stores and reads: docs/TIERS.md, "How the tiers work".
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from operator import itemgetter
from typing import Literal, TypeVar

from hybridkv.connectors.auth import resolve_auth_key
from hybridkv.connectors.base import FAILED, BlockOffer, Failed, KVTier, TierTimeout
from hybridkv.connectors.codec import BlockCodec, FrameCodec
from hybridkv.connectors.frame import FAULT_KINDS, FaultKind, namespace_id
from hybridkv.connectors.loads import BackgroundLoads, DoneLoad, PendingLoad
from hybridkv.connectors.lookup import by_position, positions, probe_hit
from hybridkv.connectors.storage import JunctionMemory, Offer, StoragePolicy, StoreSpansSpill
from hybridkv.connectors.tier_events import TierEvents
from hybridkv.core import NULL_BLOCK, KVCacheEvent, KVCacheLayout, KVCacheManager, KVSequence
from hybridkv.errors import InvalidInputError

logger = logging.getLogger(__name__)

BlockTables = Sequence[Sequence[int]]
WriteBlock = Callable[[int, int, bytes], None]
ReadBlock = Callable[[int, int], bytes]
_T = TypeVar("_T")
_A = TypeVar("_A")
_hash_of = itemgetter(2)


@dataclass(frozen=True)
class LoadRecord:
    """One loaded hit: the sequence, its tokens and the blocks each group's tiers served."""

    seq_id: str
    start_token: int
    num_tokens: int
    blocks_per_group: dict[int, int]


@dataclass
class ConnectorStats:
    """Counters since the connector was built."""

    lookups: int = 0
    external_hit_tokens: int = 0
    """Tokens ``num_external_tokens`` offered beyond the local hits."""
    fetched_tokens: int = 0
    loaded_tokens: int = 0
    loaded_blocks: int = 0
    loaded_blocks_per_group: dict[int, int] = field(default_factory=dict)
    """Blocks written into the device per group: which groups the loaded hits used."""
    recent_loads: deque[LoadRecord] = field(default_factory=lambda: deque(maxlen=256))
    """The latest loaded hits (``write``), each with its blocks per group."""
    stored_blocks: int = 0
    promoted_blocks: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    probes: int = 0
    """Batched existence checks lookups made (one per tier asked)."""
    probed_blocks: int = 0
    junctions: int = 0
    """Shared-prefix junctions lookups found in the tiers (the chain ran past the agreed hit)."""
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULT_KINDS, 0))


@dataclass(frozen=True)
class FetchedKV:
    """Verified payloads for tokens ``[start_token, start_token + num_tokens)`` of one sequence.

    ``payloads[(group, index)]`` is the block at table index ``index`` of group ``group``.
    """

    seq_id: str
    start_token: int
    num_tokens: int
    payloads: dict[tuple[int, int], bytes]

    @property
    def blocks_per_group(self) -> dict[int, int]:
        """How many blocks each group loads (the groups the hit uses)."""
        out: dict[int, int] = {}
        for g, _ in self.payloads:
            out[g] = out.get(g, 0) + 1
        return out


class KVConnector:
    """Stacked external tiers behind one interface, keyed by the manager's block hashes.

    Tiers are queried in order (e.g. host, then disk or Redis); a hit in a lower tier is copied
    into the tiers above it when ``promote``. ``store`` writes to every tier when
    ``write_through``, else to the first only; what it writes is ``storage``'s choice (default
    ``StoreSpansSpill()``: per group, what a hit can use, and the rest at low priority to the tiers
    that keep priorities). Tier faults never raise: they are counted
    in ``stats.faults`` and read as misses. ``loads``: ``BackgroundLoads`` runs ``start_load`` on
    worker threads (tiers are thread-safe); None runs it in the caller's.

    Frames are HMAC-signed with ``auth_key``, else, when a tier is shared, with the key from
    ``HYBRIDKV_TIER_KEY`` or ``HYBRIDKV_TIER_KEY_FILE`` (``connectors.auth``); a shared tier without
    a key is refused unless ``allow_unauthenticated``. ``payload_bytes[group]`` is the size of one block's payload; by
    default the group's layers times its page size (what ``PagedKVCache.read_block`` of the
    engine returns). A frame of another size is rejected as ``wrong_size``. ``enable_events`` makes the
    tiers with a medium log what enters and leaves them, for ``take_events`` (``connectors.tier_events``).
    """

    def __init__(self, tiers: Sequence[KVTier], manager: KVCacheManager, *, namespace: str,
                 promote: bool = True, write_through: bool = True, auth_key: bytes | None = None,
                 allow_unauthenticated: bool = False, payload_bytes: Mapping[int, int] | None = None,
                 batch_blocks: int = 64, storage: StoragePolicy | None = None,
                 loads: BackgroundLoads | None = None, fanout: int = 16, codec: BlockCodec | None = None) -> None:
        if not tiers:
            raise InvalidInputError("a KVConnector needs at least one tier")
        if not namespace:
            raise InvalidInputError("namespace must name the model (e.g. 'gemma-3-270m/bf16')")
        if batch_blocks <= 0:
            raise InvalidInputError(f"batch_blocks must be positive, got {batch_blocks!r}")
        if not isinstance(fanout, int) or fanout < 2:
            raise InvalidInputError(f"fanout must be an integer >= 2, got {fanout!r}")
        if storage is not None and not isinstance(storage, StoragePolicy):
            raise InvalidInputError(f"storage must be a StoragePolicy (StoreSpansSpill, StoreHitSpans, StoreAll), "
                                    f"got {storage!r}")
        hasher = manager.hasher
        shared = [t.name for t in tiers if t.shared]
        if shared and not hasher.cryptographic:
            raise InvalidInputError(
                f"tiers {', '.join(shared)} are shared between instances but the manager hashes blocks with "
                f"{hasher.algorithm!r}, which is not cryptographic (a client could forge collisions and read "
                f"another request's KV); build the KVCacheManager with hash_algorithm='sha256'"
            )
        self.tiers = list(tiers)
        self.manager = manager
        self.namespace_id = namespace_id(namespace, manager.layout, hasher.algorithm)
        self.promote = promote
        self.write_through = write_through
        self.auth_key = resolve_auth_key(auth_key, self.tiers, allow_unauthenticated=allow_unauthenticated)
        self.payload_bytes = _payload_sizes(manager.layout, payload_bytes)
        self._smallest_payload = min(self.payload_bytes.values())  # a frame is larger than its payload
        self.codec = codec if codec is not None else FrameCodec(self.auth_key, self.payload_bytes)
        self.batch_blocks = batch_blocks
        self.storage = storage if storage is not None else StoreSpansSpill()
        self.loads = loads
        self.fanout = fanout
        self.stats = ConnectorStats()
        self._rules = manager.rules
        self._align = manager.hit_alignment
        self._groups = manager.caching_groups
        self._block_size = {g: manager.group_block_size(g) for g in self._groups}
        self._prefix = {g: b"hkv1/%s/%d/" % (self.namespace_id.encode(), g) for g in self._groups}
        groups = manager.layout.groups
        self._growing = [g for g in self._groups if groups[g].spec.grows_with_sequence]
        # A group that bounds hits but keeps no cache (Mamba without checkpoints, caching off) can
        # never resume from an external prefix.
        self._possible = manager.hits_possible
        self._junctions = JunctionMemory()
        self.events: TierEvents | None = None
        """The tiers' KV events, once ``enable_events`` was called."""
        self._lock = threading.RLock()  # counters and junctions: a background load runs beside store()

    # ------------------------------------------------------------------ keys and windows
    def key(self, group: int, block_hash: bytes) -> bytes:
        """The tier key of one block of ``group`` (``frame.tier_key``, with the prefix built once)."""
        return self._prefix[group] + block_hash.hex().encode()

    def keys_of(self, group: int, block_hashes: Iterable[bytes]) -> list[bytes]:
        """The tier keys of blocks of ``group`` with these hashes (``key`` for many)."""
        prefix = self._prefix[group]
        return [prefix + h.hex().encode() for h in block_hashes]

    def keys(self, seq: KVSequence, group: int) -> list[bytes]:
        """Tier keys of every full block of ``seq`` in ``group`` (an index into the layout's groups)."""
        return self.keys_of(group, self.manager.block_hashes(seq, group))

    def _needed(self, group: int, start: int, end: int) -> range:
        """Table indices ``group`` must get from a tier to resume at ``end`` after a local hit of ``start``."""
        span = self.manager.hit_span(group, end)
        return range(max(span.start, start // self._block_size[group]), span.stop)

    def _check_range(self, seq: KVSequence, start: int, num_tokens: int) -> int:
        if not isinstance(seq, KVSequence):
            raise InvalidInputError(f"expected a sequence (hybridkv.Sequence or another KVSequence), "
                                    f"got {type(seq).__name__}")
        for name, value in (("start_token", start), ("num_tokens", num_tokens)):
            if not isinstance(value, int) or value < 0 or value % self._align:
                raise InvalidInputError(f"{name}={value!r} must be a non-negative multiple of {self._align}")
        end = start + num_tokens
        if num_tokens and end >= seq.num_tokens:
            raise InvalidInputError(
                f"sequence {seq.seq_id!r}: tokens up to {end} of {seq.num_tokens} would cover the last token"
            )
        return end

    def _cap(self, seq: KVSequence, start: int, max_tokens: int | None) -> int:
        cap = (seq.num_tokens - 1) // self._align * self._align
        if max_tokens is not None:
            cap = min(cap, start + max_tokens // self._align * self._align)
        return cap

    def _hashes(self, seq: KVSequence) -> dict[int, list[bytes]]:
        return {g: self.manager.block_hashes(seq, g) for g in self._groups}

    # ------------------------------------------------------------------ lookup
    def num_external_tokens(self, seq: KVSequence, local_hit_tokens: int, max_tokens: int | None = None) -> int:
        """Tokens past ``local_hit_tokens`` the tiers can supply for every group (aligned, capped).

        Never covers the last token nor more than ``max_tokens``; checks existence only, in a
        logarithmic number of probes (``connectors.lookup``). The hit is the manager's own rule
        (``HitRules``) over what the tiers hold.
        """
        self._check_range(seq, local_hit_tokens, 0)
        return self._lookup(seq, self._hashes(seq), local_hit_tokens, self._cap(seq, local_hit_tokens, max_tokens))

    def _lookup(self, seq: KVSequence, hashes: dict[int, list[bytes]], start: int, cap: int) -> int:
        with self._lock:
            self.stats.lookups += 1
        if not self._possible or cap <= start:
            return 0

        def probe(items: list[tuple[int, int]]) -> list[bool]:
            keys = [self.key(g, hashes[g][i]) for g, i in items]
            return self._exists(keys)

        hit, chain = probe_hit(self._rules, seq, start, cap, probe, self.fanout)
        with self._lock:
            if start < chain < cap and self._growing:  # a junction: the next request with this prefix resumes here
                g = self._growing[0]
                self._junctions.add(hashes[g][chain // self._block_size[g] - 1])
                self.stats.junctions += 1
            self.stats.external_hit_tokens += hit - start
        return hit - start

    def _exists(self, keys: list[bytes]) -> list[bool]:
        """Whether some tier holds each key: one batched check per tier still asked."""
        found = [False] * len(keys)
        pending = list(range(len(keys)))
        for tier in self.tiers:
            if not pending:
                break
            answer = self._safe(tier.exists_many, [keys[j] for j in pending])
            with self._lock:
                self.stats.probes += 1
                self.stats.probed_blocks += len(pending)
            if answer is FAILED:
                continue
            for j, ok in zip(pending, answer):
                found[j] = bool(ok)
            pending = [j for j in pending if not found[j]]
        return found

    # ------------------------------------------------------------------ load
    def start_load(self, seq: KVSequence, local_hit_tokens: int, max_tokens: int | None = None) -> PendingLoad:
        """Look up and read what the tiers hold past ``local_hit_tokens``: on the worker thread with
        ``BackgroundLoads`` (a failure or a timeout is a miss), else at once. Touches no manager state."""
        self._check_range(seq, local_hit_tokens, 0)
        start, cap = local_hit_tokens, self._cap(seq, local_hit_tokens, max_tokens)
        hashes = self._hashes(seq)
        if self.loads is not None:  # a snapshot the worker may read
            hashes = {g: list(h) for g, h in hashes.items()}

        def work() -> FetchedKV:
            n = self._lookup(seq, hashes, start, cap)
            return self._fetch(seq, hashes, start, start + n)

        miss = FetchedKV(seq.seq_id, start, 0, {})
        if self.loads is None or cap <= start or not self._possible:
            return DoneLoad(work() if cap > start else miss)
        return self.loads.submit(work, miss, lambda: self._fault("timeout", "a tier load outlasted its timeout"))

    def fetch(self, seq: KVSequence, start_token: int, num_tokens: int) -> FetchedKV:
        """Read and verify the blocks for tokens ``[start_token, start_token + num_tokens)``.

        Returns the longest aligned prefix every group can resume from; a fault, a missing entry
        or a rejected frame ends it (everything after becomes a miss). Touches no manager state.
        """
        end = self._check_range(seq, start_token, num_tokens)
        return self._fetch(seq, self._hashes(seq), start_token, end)

    def _fetch(self, seq: KVSequence, hashes: dict[int, list[bytes]], start_token: int, end: int) -> FetchedKV:
        payloads: dict[tuple[int, int], bytes] = {}
        stop = start_token
        if end > start_token and self._possible:
            bs = self._block_size
            order = sorted(((i + 1) * bs[g], g, i) for g in self._groups for i in self._needed(g, start_token, end))
            items = [(g, i) for _, g, i in order]  # token order: a fault ends the prefix where it happens
            key = self.key
            keys = [key(g, hashes[g][i]) for g, i in items]
            for lo in range(0, len(items), self.batch_blocks):
                got = self._get(keys[lo : lo + self.batch_blocks], seq)
                for (g, i), payload in zip(items[lo : lo + self.batch_blocks], got):
                    if payload is not None:
                        payloads[(g, i)] = payload
                if None in got:
                    break
            # What this cache holds per group: the local hit's blocks and the blocks read.
            held: dict[int, dict[int, int]] = {g: dict.fromkeys(range(start_token // bs[g]), 1) for g in self._groups}
            for g, i in payloads:
                held[g][i] = 1
            sizes = {g: len(hashes[g]) for g in self._groups}
            stop = max(start_token, self._rules.longest_hit(seq, by_position(held), limit=end, hashes=positions(sizes)))
        if stop < end:
            keep = {(g, i) for g in self._groups for i in self._needed(g, start_token, stop)}
            payloads = {k: v for k, v in payloads.items() if k in keep}
        with self._lock:
            self.stats.fetched_tokens += stop - start_token
        return FetchedKV(seq.seq_id, start_token, stop - start_token, payloads)

    def _get(self, keys: list[bytes], seq: KVSequence | None = None) -> list[bytes | None]:
        """Payloads of ``keys`` (blocks of ``seq``) from the first tier that serves each, as the codec
        decodes them (a rejected value is a fault, dropped from its tier), promoting upwards."""
        out: list[bytes | None] = [None] * len(keys)
        pending = list(range(len(keys)))
        rejected: set[int] = set()  # counted as a fault already
        loaded = promoted = 0
        for depth, tier in enumerate(self.tiers):
            if not pending:
                break
            asked = keys if len(pending) == len(keys) else [keys[j] for j in pending]
            values = self._safe(tier.get_many, asked)
            if values is FAILED:
                rejected.update(pending)
                continue
            payloads, bad = self.codec.decode_many(asked, values)
            for i, exc in bad:
                self._fault(exc.kind, f"tier {tier.name}: {exc}")
                rejected.add(pending[i])
                self._safe(tier.delete, asked[i])
            found = [(i, value) for i, (payload, value) in enumerate(zip(payloads, values))
                     if payload is not None and value is not None]
            if not found:
                continue
            for i, _ in found:
                out[pending[i]] = payloads[i]
            loaded += sum(len(value) for _, value in found)
            if depth and self.promote:
                promote = [(asked[i], value) for i, value in found]
                if self.events is not None and seq is not None:
                    self.events.note(seq, [k for k, _ in promote])
                for upper in self.tiers[:depth]:
                    self._safe(upper.put_many, promote)
                promoted += len(promote)
            pending = [j for j, payload in zip(pending, payloads) if payload is None]
        missing = sum(1 for j in pending if j not in rejected)
        with self._lock:
            self.stats.bytes_loaded += loaded
            self.stats.promoted_blocks += promoted
        if missing:
            self._fault("missing", "no tier holds a block it was asked for", missing)
        return out

    def write(self, fetched: FetchedKV, block_tables: BlockTables, write_block: WriteBlock) -> int:
        """Copy fetched payloads into the blocks ``allocate`` gave them; returns the tokens written.

        ``block_tables`` is ``manager.block_table(seq_id)``; ``write_block(group, block_id, payload)``.
        """
        for (group, index), payload in sorted(fetched.payloads.items()):
            table = block_tables[group]
            block = table[index] if index < len(table) else NULL_BLOCK
            if block == NULL_BLOCK:
                raise InvalidInputError(
                    f"sequence {fetched.seq_id!r}: group {group} has no block at index {index}; allocate "
                    f"with num_external_tokens={fetched.num_tokens} before writing"
                )
            write_block(group, block, payload)
        self._count_written(fetched)
        return fetched.num_tokens

    def _count_written(self, fetched: FetchedKV) -> None:
        """Count a written load in ``stats``."""
        per_group = fetched.blocks_per_group
        with self._lock:
            st = self.stats
            st.loaded_blocks += len(fetched.payloads)
            st.loaded_tokens += fetched.num_tokens
            for g, n in per_group.items():
                st.loaded_blocks_per_group[g] = st.loaded_blocks_per_group.get(g, 0) + n
            if fetched.num_tokens:
                st.recent_loads.append(LoadRecord(fetched.seq_id, fetched.start_token, fetched.num_tokens, per_group))

    def load(self, seq: KVSequence, start_token: int, num_tokens: int, block_tables: BlockTables,
             write_block: WriteBlock) -> int:
        """``fetch`` then ``write``: the tokens loaded, a block-aligned prefix of ``num_tokens``."""
        return self.write(self.fetch(seq, start_token, num_tokens), block_tables, write_block)

    # ------------------------------------------------------------------ store
    def offered(self, seq: KVSequence, num_tokens: int, start_token: int = 0) -> list[tuple[int, int, bytes]]:
        """``(group, block id, key)`` of the blocks ``store`` offers for tokens ``(start_token, num_tokens]``:
        the storage policy's choice among the blocks the device cache has registered under the
        sequence's hash (so superseded Mamba states are never stored), junction checkpoints included;
        those at normal priority first (``offered_by_priority``)."""
        normal, low = self.offered_by_priority(seq, num_tokens, start_token)
        return normal + low

    def offered_by_priority(self, seq: KVSequence, num_tokens: int, start_token: int = 0, *, with_low: bool = True
                            ) -> tuple[list[tuple[int, int, bytes]], list[tuple[int, int, bytes]]]:
        """``offered``, split into ``(normal, low)`` priority (``StoragePolicy.prioritized``)."""
        normal, low = self.chosen_by_priority(seq, num_tokens, start_token, with_low=with_low)
        return self._keyed(normal), self._keyed(low)

    def _keyed(self, offers: dict[int, list[Offer]]) -> list[tuple[int, int, bytes]]:
        """``(group, block id, tier key)`` of each offer."""
        key = self.key
        return [(g, b, key(g, h)) for g, blocks in offers.items() for _, b, h in blocks]

    def chosen_by_priority(self, seq: KVSequence, num_tokens: int, start_token: int = 0, *, with_low: bool = True
                           ) -> tuple[dict[int, list[Offer]], dict[int, list[Offer]]]:
        """The storage policy's choice for tokens ``(start_token, num_tokens]``, per group, before keying:
        ``(normal, low)`` priority ``Offer`` lists (junctions the lookups found included).
        ``with_low=False``: no tier takes low puts now; the low lists may be left empty."""
        if (not isinstance(num_tokens, int) or not isinstance(start_token, int)
                or not 0 <= start_token <= num_tokens <= seq.num_tokens):
            raise InvalidInputError(
                f"sequence {seq.seq_id!r}: need 0 <= start_token ({start_token!r}) <= num_tokens "
                f"({num_tokens!r}) <= its {seq.num_tokens} tokens"
            )
        junctions: list[int] = []
        if self._growing and len(self._junctions):
            g = self._growing[0]
            with self._lock:
                junctions = self._junctions.positions(self.manager.block_hashes(seq, g), self._block_size[g],
                                                      start_token, num_tokens)
        return self.storage.prioritized(self.manager, seq, start_token, num_tokens, junctions, with_low=with_low)

    def store(self, seq: KVSequence, num_tokens: int, read_block: ReadBlock, start_token: int = 0) -> int:
        """Offer the blocks computed in ``(start_token, num_tokens]`` (``offered``); returns blocks stored.

        The caller vouches that the KV of the first ``num_tokens`` tokens is in the blocks (an
        engine calls this right after a forward pass, with the range that pass computed); a tier
        that already holds a block is skipped (one held at low priority that is now offered at normal
        priority becomes normal). Low-priority offers go only to tiers with ``priorities``, and are
        chosen only when one of them can take one after the normal puts (``takes_low_puts``).
        ``read_block(group, block_id)`` returns the payload, which the codec encodes when a tier
        lacks the block. The blocks are the manager's own for the sequence (it must be running).
        Each tier takes the offers through ``KVTier.offer``. The call that completes the prompt marks
        the prompt's chain recently used, head last, so a tier evicts a prompt's tail before the
        prefix it shares.
        """
        targets = self.tiers if self.write_through else self.tiers[:1]
        count = 0  # the keys of one store are distinct: one tier's puts are counted as they are
        stored: set[bytes] = set()  # several tiers may put the same key
        nbytes = 0
        for is_low, chosen in self.chosen_in_order(seq, num_tokens, start_token, targets):
            for offer in self._block_offers(seq, chosen, is_low, read_block):
                for tier in targets:
                    if is_low and not tier.priorities:
                        continue
                    put, n = tier.offer(offer, self.batch_blocks, self._safe)
                    nbytes += n
                    if len(targets) == 1:
                        count += len(put)
                    else:
                        stored.update(put)
        with self._lock:
            self.stats.stored_blocks += count + len(stored)
            self.stats.bytes_stored += nbytes
        self._touch_prompt(seq, start_token, num_tokens, targets)
        return count + len(stored)

    def _block_offers(self, seq: KVSequence, chosen: dict[int, list[Offer]], low: bool, read_block: ReadBlock
                      ) -> Iterator[BlockOffer]:
        """The storage policy's choice of one priority as ``BlockOffer``s: one for all of it when the
        codec holds no payload, else one per ``batch_blocks`` blocks (their values built on demand
        and dropped with the offer, so a store never holds more than a batch of values)."""
        keys: list[bytes] = []
        flat: list[Offer] = []
        runs: list[tuple[int, int]] = []
        for g, offers in chosen.items():
            if offers:
                keys += self.keys_of(g, map(_hash_of, offers))
                flat += offers
                runs.append((g, len(offers)))
        if self.events is not None:
            self.events.note(seq, keys)
        if not keys:
            return
        if not self.codec.holds_payloads:
            yield BlockOffer(keys, runs, low, self._values(keys, runs, flat, read_block))
            return
        step = self.batch_blocks
        for lo in range(0, len(keys), step):
            part, part_runs = keys[lo : lo + step], _cut_runs(runs, lo, lo + step)
            yield BlockOffer(part, part_runs, low, self._values(part, part_runs, flat[lo : lo + step], read_block))

    def _values(self, keys: list[bytes], runs: list[tuple[int, int]], offers: list[Offer], read_block: ReadBlock
                ) -> Callable[[int], bytes]:
        """``BlockOffer.value`` for these keys (of ``offers``, in ``runs``): encoded on first use, kept."""
        values: dict[int, bytes] = {}
        encode = self.codec.encode
        groups: list[int] = []  # each key's, listed on first use

        def value(i: int) -> bytes:
            got = values.get(i)
            if got is None:
                if not groups:
                    for g, n in runs:
                        groups.extend(repeat(g, n))
                got = values[i] = encode(keys[i], read_block(groups[i], offers[i][1]))
            return got

        return value

    def chosen_in_order(self, seq: KVSequence, num_tokens: int, start_token: int, targets: Sequence[KVTier]
                        ) -> Iterator[tuple[bool, dict[int, list[Offer]]]]:
        """``(is_low, offers)``: the storage policy's normal-priority choice, then its low-priority
        one, chosen only if one of ``targets`` can take a low put (``takes_low_puts``): asked first
        and, when no tier could, again once the caller has stored the normal offers (their
        evictions may have made room). Consume in order, storing as you go."""
        with_low = self.takes_low_puts(targets)
        normal, low = self.chosen_by_priority(seq, num_tokens, start_token, with_low=with_low)
        yield False, normal
        if not with_low and self.takes_low_puts(targets):
            low = self.chosen_by_priority(seq, num_tokens, start_token)[1]
        yield True, low

    def takes_low_puts(self, targets: Iterable[KVTier]) -> bool:
        """Whether any of ``targets`` could store a low-priority block now (``KVTier.takes_low_puts``):
        when none can, a store neither chooses nor offers them (each would be skipped)."""
        return any(t.priorities and t.takes_low_puts(self._smallest_payload) for t in targets)

    def _touch_prompt(self, seq: KVSequence, start: int, end: int, targets: list[KVTier]) -> None:
        """When ``(start, end]`` completes the prompt: touch its growing chain in the tiers, tail first."""
        prompt = seq.num_prompt_tokens
        if not start < prompt <= end or not self._growing:
            return
        keys: list[bytes] = []
        for g in self._growing:
            keys += self.keys_of(g, reversed(self.manager.block_hashes(seq, g)[: prompt // self._block_size[g]]))
        for tier in targets:
            for lo in range(0, len(keys), 4096):
                self._safe(tier.touch_many, keys[lo : lo + 4096])

    # ------------------------------------------------------------------ events
    def enable_events(self) -> TierEvents:
        """Start logging what enters and leaves the tiers that publish events (a medium, not shared);
        returns the log (``take_events`` drains it). Idempotent."""
        if self.events is None:
            self.events = TierEvents(self.tiers, self.manager)
        return self.events

    def take_events(self) -> list[tuple[str, list[KVCacheEvent]]]:
        """Per publishing tier, its medium and its events since the last call (empty until enabled)."""
        return [] if self.events is None else self.events.take()

    # ------------------------------------------------------------------ faults
    def _safe(self, method: Callable[[_A], _T], arg: _A) -> _T | Literal[Failed.FAILED]:
        """``method(arg)`` (a tier method), or ``FAILED`` and a counted fault if it raised."""
        try:
            return method(arg)
        except Exception as exc:  # a tier fault must never take the engine down
            kind: FaultKind = "timeout" if isinstance(exc, (TierTimeout, TimeoutError)) else "error"
            target = getattr(method, "func", method)  # a functools.partial names its function
            self._fault(kind, f"{getattr(target, '__qualname__', target)}: {exc!r}")
            return FAILED

    def _fault(self, kind: FaultKind, message: str, count: int = 1) -> None:
        with self._lock:
            self.stats.faults[kind] += count
        logger.debug("kv connector fault (%s, %d): %s", kind, count, message)

    def close(self) -> None:
        """Stop the background loads' worker (if any); the tiers stay open."""
        if self.loads is not None:
            self.loads.close()


def _cut_runs(runs: list[tuple[int, int]], lo: int, hi: int) -> list[tuple[int, int]]:
    """The ``(group, count)`` runs of the keys ``[lo, hi)`` of keys in ``runs``."""
    out: list[tuple[int, int]] = []
    start = 0
    for g, n in runs:
        a, b = max(lo, start), min(hi, start + n)
        if a < b:
            out.append((g, b - a))
        start += n
    return out


def _payload_sizes(layout: KVCacheLayout, given: Mapping[int, int] | None) -> dict[int, int]:
    """Bytes of one block's payload per group: ``given``, else layers x page size."""
    n = len(layout.groups)
    if given is None:
        return {i: max(1, len(g.layer_names)) * g.spec.page_size_bytes for i, g in enumerate(layout.groups)}
    sizes = dict(given)
    if sorted(sizes) != list(range(n)) or not all(isinstance(v, int) and v > 0 for v in sizes.values()):
        raise InvalidInputError(f"payload_bytes must map each group 0..{n - 1} to a positive size, got {given!r}")
    return sizes

"""The KV-cache events of a connector's tiers: which blocks entered and left each, per medium.

``TierEvents`` drains the change logs of the tiers with a ``medium`` (``KVTier.record_changes``) into
the core's ``BlockStored`` / ``BlockRemoved`` events, with parent hashes and token ids from the
sequences the connector noted; shared tiers publish nothing. Specification: docs/TIERS.md, "Tier
events".
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from hybridkv.connectors.base import Change, KVTier
from hybridkv.core import BlockRemoved, BlockStored, KVCacheEvent, KVCacheManager, KVSequence


def publishing(tier: KVTier) -> bool:
    """Whether ``tier``'s changes become events: it names a medium and no other instance writes it."""
    return tier.medium is not None and not tier.shared


class TierEvents:
    """Drains the change logs of ``tiers`` (those ``publishing``) into the core's events per medium."""

    def __init__(self, tiers: Sequence[KVTier], manager: KVCacheManager) -> None:
        self.tiers = [t for t in tiers if publishing(t)]
        self.manager = manager
        self._notes: dict[bytes, KVSequence] = {}
        self._older: dict[bytes, KVSequence] = {}
        self._lock = threading.Lock()  # a background load notes the blocks it promotes
        for tier in self.tiers:
            tier.record_changes(True)

    def note(self, seq: KVSequence, keys: Iterable[bytes]) -> None:
        """``keys`` about to be put hold blocks of ``seq`` (kept until the next ``take`` but one, so
        a put that lands after a ``take`` still finds its sequence)."""
        with self._lock:
            notes = self._notes
            for key in keys:
                notes[key] = seq

    def take(self) -> list[tuple[str, list[KVCacheEvent]]]:
        """Per publishing tier, in order: its medium and its changes since the last call as events."""
        with self._lock:
            notes, older = self._notes, self._older
            self._notes, self._older = {}, notes
        out: list[tuple[str, list[KVCacheEvent]]] = []
        positions: dict[tuple[int, int], dict[bytes, int]] = {}
        for tier in self.tiers:
            changes = tier.take_changes()
            if changes:
                assert tier.medium is not None
                out.append((tier.medium, self._events(changes, notes, older, positions)))
        return out

    def stop(self) -> None:
        """Stop the tiers' logs (what they held is no longer followed)."""
        for tier in self.tiers:
            tier.record_changes(False)

    def _events(self, changes: list[Change], notes: dict[bytes, KVSequence], older: dict[bytes, KVSequence],
                positions: dict[tuple[int, int], dict[bytes, int]]) -> list[KVCacheEvent]:
        """One tier's changes as events: a run of consecutive blocks of one group and sequence stored
        together is one ``BlockStored``; each removal a ``BlockRemoved`` (the publisher joins runs)."""
        out: list[KVCacheEvent] = []
        run: list[bytes] = []
        run_at: tuple[int, KVSequence | None, int] = (-1, None, -1)  # group, sequence, next index
        first = -1

        def flush() -> None:
            if run:
                group, seq, _ = run_at
                out.append(self._stored(group, tuple(run), seq, first))
                run.clear()

        for entered, key in changes:
            group, block_hash = _parse(key)
            if not entered:
                flush()
                out.append(BlockRemoved(group, (block_hash,)))
                continue
            seq = notes.get(key) or older.get(key)
            index = -1 if seq is None else self._position(seq, group, block_hash, positions)
            if index < 0:
                seq = None
            joins = seq is not None and run_at[0] == group and run_at[1] is seq and run_at[2] == index
            if not (run and joins):
                flush()
                first = index
            run.append(block_hash)
            run_at = (group, seq, index + 1 if seq is not None else -1)
        flush()
        return out

    def _position(self, seq: KVSequence, group: int, block_hash: bytes,
                  positions: dict[tuple[int, int], dict[bytes, int]]) -> int:
        """The table index of ``block_hash`` in ``seq``'s blocks of ``group`` (-1: not one of them)."""
        found = positions.get((id(seq), group))
        if found is None:
            hashes = self.manager.block_hashes(seq, group)
            found = positions[(id(seq), group)] = {h: i for i, h in enumerate(hashes)}
        return found.get(block_hash, -1)

    def _stored(self, group: int, hashes: tuple[bytes, ...], seq: KVSequence | None, first: int) -> BlockStored:
        """The store of ``hashes`` (blocks ``first..`` of ``seq`` in ``group``; unknown when None)."""
        size = self.manager.group_block_size(group)
        if seq is None:
            return BlockStored(group, hashes, (), None, (), size)
        parent = self.manager.block_hashes(seq, group)[first - 1] if first else None
        ids = seq.token_ids  # None for a sequence known only by its hashes
        tokens = () if ids is None else tuple(ids[first * size : (first + len(hashes)) * size])
        return BlockStored(group, hashes, (), parent, tokens, size)


def _parse(key: bytes) -> tuple[int, bytes]:
    """The group and block hash a tier key names (``frame.tier_key``: ``hkv1/<ns>/<group>/<hex>``)."""
    _, group, digest = key.rsplit(b"/", 2)
    return int(group), bytes.fromhex(digest.decode())

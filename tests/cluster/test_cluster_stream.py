"""Numbered event streams: gaps filled from the replay buffer, lost batches, restarts, late joins.

The index must never predict a hit a replica cannot serve: whenever batches are lost it forgets
what it cannot vouch for (a resync) and keeps only a view built from an unbroken run of batches.
"""

from __future__ import annotations

from collections.abc import Iterable

from hybridkv.cluster import (
    MEDIUM_GPU,
    AllClearedEvent,
    BlockRemovedEvent,
    BlockStoredEvent,
    ClusterIndex,
    EventBatch,
    HybridkvHashes,
    make_batch,
)

from helpers import full, layout, tokens

SCHEME = HybridkvHashes()
PROMPT = tokens(0, 200)
H = SCHEME.chain(PROMPT, 16, None)  # 12 blocks


def _index() -> ClusterIndex:
    index = ClusterIndex()
    index.add_replica("r", scheme=SCHEME, layout=layout(10, full(16)))
    return index


def stored(first: int, last: int) -> EventBatch:
    """A batch storing full blocks ``first .. last - 1`` of ``PROMPT``."""
    return make_batch([BlockStoredEvent(tuple(H[first:last]), None, (), 16, MEDIUM_GPU, 0, "full_attention")])


def removed(block: int) -> EventBatch:
    return make_batch([BlockRemovedEvent((H[block],), MEDIUM_GPU, 0)])


def hit(index: ClusterIndex) -> int:
    return index.lookup(PROMPT)["r"].tokens


class Buffer:
    """A publisher's replay buffer holding batches ``first ..`` (and counting requests)."""

    def __init__(self, batches: list[EventBatch], first: int = 0) -> None:
        self.batches = {first + i: b for i, b in enumerate(batches)}
        self.asked: list[int] = []

    def __call__(self, start: int) -> Iterable[tuple[int, EventBatch]]:
        self.asked.append(start)
        return sorted((s, b) for s, b in self.batches.items() if s >= start)


def test_batches_in_order_are_applied() -> None:
    index = _index()
    index.deliver("r", 0, stored(0, 4))
    index.deliver("r", 1, stored(4, 8))
    assert hit(index) == 128
    index.deliver("r", 2, removed(5))
    assert hit(index) == 80


def test_a_gap_is_filled_from_the_replay_buffer() -> None:
    batches = [stored(0, 4), stored(4, 8), removed(2), stored(8, 10)]
    index = _index()
    index.deliver("r", 0, batches[0])
    replay = Buffer(batches)
    index.deliver("r", 3, batches[3], replay)  # batches 1 and 2 were dropped in transit
    assert replay.asked == [1]
    assert hit(index) == 32  # block 2's removal was replayed: the chain stops there
    st = index.streams["r"]
    assert (st.gaps, st.replayed, st.resyncs, st.next_seq) == (1, 2, 0, 4)


def test_batches_the_buffer_no_longer_holds_force_a_resync() -> None:
    index = _index()
    index.deliver("r", 0, stored(0, 8))
    # Batches 1..5 are lost; the buffer holds only 4 and 5 (a removal of block 1, a store of 8..10).
    replay = Buffer([removed(1), stored(8, 10)], first=4)
    index.deliver("r", 6, stored(10, 12), replay)
    # Blocks 0..7 may have been removed by the lost batches: forgotten. Only 8..11 are vouched for,
    # and without blocks 0..7 the chain serves nothing.
    assert hit(index) == 0
    assert index.num_blocks()["r"] == 4
    st = index.streams["r"]
    assert (st.resyncs, st.lost) == (1, [1, 2, 3])


def test_numbers_going_back_mean_the_replica_restarted() -> None:
    index = _index()
    for seq in range(3):
        index.deliver("r", seq, stored(4 * seq, 4 * seq + 4))
    assert hit(index) == 192
    index.deliver("r", 0, stored(0, 2))  # a new process: its first batch
    assert hit(index) == 32
    assert index.streams["r"].restarts == 1


def test_a_late_joiner_replays_from_the_start_and_is_exact() -> None:
    batches = [stored(0, 6), removed(5), stored(5, 9)]
    index = _index()
    replay = Buffer(batches)
    index.deliver("r", 3, stored(9, 10), replay)
    assert replay.asked == [0]
    assert hit(index) == 160
    assert index.streams["r"].resyncs == 0


def test_a_late_joiner_whose_history_is_gone_keeps_a_partial_view_that_never_over_predicts() -> None:
    index = _index()
    # Batches 0..9 are gone; 10 removed block 3 (stored back in 0..9), 11 stores blocks 0..2.
    replay = Buffer([removed(3), stored(0, 3)], first=10)
    index.deliver("r", 12, stored(6, 8), replay)
    assert hit(index) == 48  # the truth may be more (blocks stored in lost batches), never less
    assert index.views["r"].unknown_removals == 1


def test_an_undecodable_batch_is_lost_and_resyncs() -> None:
    index = _index()
    index.deliver("r", 0, stored(0, 8))
    index.lost("r", 1)
    assert hit(index) == 0
    index.deliver("r", 2, stored(0, 3))
    assert hit(index) == 48
    assert index.streams["r"].gaps == 0


def test_all_blocks_cleared_empties_the_view() -> None:
    index = _index()
    index.deliver("r", 0, stored(0, 8))
    index.deliver("r", 1, make_batch([AllClearedEvent()]))
    assert hit(index) == 0 and index.num_blocks()["r"] == 0


def test_a_block_cached_twice_stays_held_until_both_copies_are_removed() -> None:
    index = _index()
    index.deliver("r", 0, stored(0, 4))
    index.deliver("r", 1, stored(0, 4))  # a duplicate of the same content in other blocks
    index.deliver("r", 2, removed(1))
    assert hit(index) == 64
    index.deliver("r", 3, removed(1))
    assert hit(index) == 16

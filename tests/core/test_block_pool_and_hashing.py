"""Block pool eviction order, lazy eviction, duplicates, events; chained hashing."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv import BlockHasher, BlockPool, BlockRemoved, BlockStored, InvalidInputError, Sequence
from hybridkv.core.block_pool import FreeQueue
from hybridkv.core.hashing import encode_extra_keys
from hybridkv.core.retention import KeptBlocks


def test_null_block_is_never_allocated_or_counted() -> None:
    pool = BlockPool(5)
    assert pool.num_free_blocks == 4
    assert sorted(pool.allocate(4, allow_reserved=False)) == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0
    pool.check_invariants()


def test_blocks_freed_without_hash_are_reused_before_never_used_and_cached_ones() -> None:
    pool = BlockPool(10)
    a, b, _ = pool.allocate(3, allow_reserved=False)  # 1, 2, 3
    pool.cache_blocks(0, [a], [b"h-a"])
    pool.free([a, b])  # a is cached -> LRU tail; b has no hash -> reused first
    assert pool.allocate(1, allow_reserved=False) == [b]
    assert pool.allocate(1, allow_reserved=False) == [4]  # then never-used blocks, in order
    rest = pool.allocate(5, allow_reserved=False)
    assert rest == [5, 6, 7, 8, 9]
    assert pool.allocate(1, allow_reserved=False) == [a]  # the cached block goes last
    pool.check_invariants()


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(4)
    ids = pool.allocate(3, allow_reserved=False)
    pool.cache_blocks(0, ids, [b"x", b"y", b"z"])
    pool.free([ids[2], ids[0], ids[1]])
    assert pool.allocate(3, allow_reserved=False) == [ids[2], ids[0], ids[1]]


def test_lazy_eviction_keeps_the_hash_until_the_block_is_reused() -> None:
    pool = BlockPool(3, enable_events=True)
    (b,) = pool.allocate(1, allow_reserved=False)
    pool.cache_blocks(0, [b], [b"prefix"])
    pool.free([b])
    assert pool.get_cached_block(0, b"prefix") == b  # still a hit while free
    pool.allocate(1, allow_reserved=False)  # the never-used block 2 goes first
    assert pool.get_cached_block(0, b"prefix") == b
    assert pool.allocate(1, allow_reserved=False) == [b]  # now reused: evicted
    assert pool.get_cached_block(0, b"prefix") is None
    events = pool.take_events()
    assert events == [BlockStored(0, (b"prefix",), (b,)), BlockRemoved(0, (b"prefix",))]
    assert pool.take_events() == []


def test_hash_index_keeps_duplicate_blocks_per_hash() -> None:
    pool = BlockPool(4)
    x, y = pool.allocate(2, allow_reserved=False)
    pool.cache_blocks(0, [x], [b"same"])
    pool.cache_blocks(0, [y], [b"same"])
    pool.free([x, y])
    pool.allocate(1, allow_reserved=False)  # fresh block 3
    assert pool.allocate(1, allow_reserved=False) == [x]  # evict one duplicate
    assert pool.get_cached_block(0, b"same") == y  # the other still serves the hash
    pool.check_invariants()


def test_groups_have_separate_hash_indexes() -> None:
    pool = BlockPool(4, num_groups=2)
    x, y = pool.allocate(2, allow_reserved=False)
    pool.cache_blocks(0, [x], [b"h"])
    pool.cache_blocks(1, [y], [b"h"])
    assert pool.get_cached_block(0, b"h") == x
    assert pool.get_cached_block(1, b"h") == y


def keep(pool: BlockPool, blocks: list[int], anchor: int) -> None:
    """Free ``blocks`` into the kept queue under ``anchor`` (what window retention does at a junction)."""
    kept = pool.kept
    assert isinstance(kept, KeptBlocks)
    pool.free_kept(blocks, lambda b: kept.admits(b, anchor))


def test_kept_windows_are_released_with_their_anchor() -> None:
    pool = BlockPool(6, num_groups=2, kept_queue=KeptBlocks)
    anchor, w1, w2 = pool.allocate(3, allow_reserved=False)
    pool.cache_blocks(0, [anchor], [b"fa"])
    pool.cache_blocks(1, [w1, w2], [b"w1", b"w2"])
    keep(pool, [w1, w2], anchor)
    # The anchor is held: its windows are reserved, a new sequence cannot take them.
    assert pool.num_free_blocks == 4 and pool.num_admissible_blocks == 2
    pool.check_invariants()
    pool.free([anchor])
    assert pool.num_admissible_blocks == 5
    # Fresh blocks first, then the anchor (LRU); evicting it releases its windows to `low`.
    assert pool.allocate(3, allow_reserved=False) == [4, 5, anchor]
    assert pool.num_kept_blocks == 0
    assert pool.allocate(2, allow_reserved=False) == [w1, w2]
    pool.check_invariants()


def test_running_growth_may_take_reserved_windows_as_a_last_resort() -> None:
    pool = BlockPool(4, num_groups=2, kept_queue=KeptBlocks)
    anchor, w = pool.allocate(2, allow_reserved=False)
    pool.cache_blocks(0, [anchor], [b"fa"])
    pool.cache_blocks(1, [w], [b"w"])
    keep(pool, [w], anchor)
    assert pool.allocate(1, allow_reserved=False) == [3]
    assert pool.num_admissible_blocks == 0 and pool.num_free_blocks == 1
    assert pool.allocate(1, allow_reserved=True) == [w]
    pool.check_invariants()


def test_reset_prefix_cache_refused_while_blocks_are_held() -> None:
    pool = BlockPool(4)
    (b,) = pool.allocate(1, allow_reserved=False)
    pool.cache_blocks(0, [b], [b"h"])
    assert pool.reset_prefix_cache() is False
    pool.free([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(0, b"h") is None
    pool.check_invariants()


# ---------------------------------------------------------------------- hashing
def test_block_hash_is_chained_sha256_over_parent_extra_and_tokens() -> None:
    hasher = BlockHasher()
    seq = Sequence("s", list(range(8)), cache_salt="tenant-a")
    h = seq.block_hashes(hasher, 4)
    extra = encode_extra_keys("tenant-a", None)
    first = hashlib.sha256(hasher.none_hash + extra + array("Q", range(4)).tobytes()).digest()
    second = hashlib.sha256(first + b"\0\0\0\0" + array("Q", range(4, 8)).tobytes()).digest()
    assert h == [first, second]


def test_cache_salt_and_adapter_change_every_block_hash() -> None:
    hasher = BlockHasher()
    base = Sequence("a", list(range(32))).block_hashes(hasher, 16)
    salted = Sequence("b", list(range(32)), cache_salt="x").block_hashes(hasher, 16)
    adapted = Sequence("c", list(range(32)), adapter_id="lora-1").block_hashes(hasher, 16)
    assert len({base[0], salted[0], adapted[0]}) == 3
    assert len({base[1], salted[1], adapted[1]}) == 3  # chained: the salt reaches later blocks


def test_hashes_are_deterministic_across_processes() -> None:
    code = ("from hybridkv import BlockHasher, Sequence;"
            "print(Sequence('s', range(40), cache_salt='t').block_hashes(BlockHasher(), 16)[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")}
    here = Sequence("s", range(40), cache_salt="t").block_hashes(BlockHasher(), 16)[-1].hex()
    assert outs == {here + "\n"}


def test_hashes_extend_incrementally_as_tokens_are_appended() -> None:
    hasher = BlockHasher()
    seq = Sequence("s", list(range(20)))
    assert len(seq.block_hashes(hasher, 16)) == 1
    seq.append_token_ids(range(20, 40))
    assert seq.block_hashes(hasher, 16) == Sequence("t", list(range(40))).block_hashes(hasher, 16)


def test_xxh3_is_opt_in_and_not_cryptographic() -> None:
    pytest.importorskip("xxhash")
    fast = BlockHasher("xxh3_128")
    assert not fast.cryptographic and BlockHasher().cryptographic
    h = Sequence("s", list(range(16))).block_hashes(fast, 16)
    assert len(h[0]) == 16 and h[0] != Sequence("s", list(range(16))).block_hashes(BlockHasher(), 16)[0]


def test_unknown_hash_algorithm_is_rejected() -> None:
    with pytest.raises(InvalidInputError, match="unknown hash algorithm"):
        BlockHasher("md5")  # type: ignore[arg-type]


def test_bad_tokens_are_rejected_with_the_offending_value() -> None:
    with pytest.raises(InvalidInputError, match="empty"):
        Sequence("s", [])
    with pytest.raises(InvalidInputError, match=r"1\.5"):
        Sequence("s", [1, 2, 1.5])  # type: ignore[list-item]
    with pytest.raises(InvalidInputError, match="-3"):
        Sequence("s", [1, -3])
    seq = Sequence("s", [1, 2])
    with pytest.raises(InvalidInputError, match="'x'"):
        seq.append_token_ids(["x"])  # type: ignore[list-item]
    assert seq.num_tokens == 2  # nothing was appended


class _TightQueue(FreeQueue):
    slack = 2  # cut and rebuild after a handful of entries, so short examples reach both


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "add_run", "remove", "pop", "take_run"]), st.integers(0, 11),
                          st.integers(1, 6)), max_size=80))
def test_free_queue_keeps_the_order_of_an_ordered_set(ops: list[tuple[str, int, int]]) -> None:
    # The pool's free queues append at the back, take from the front (one block or a run in one
    # slice) and remove from anywhere (a hit on a free block); stale entries are skipped and the
    # list is cut and rebuilt as it goes. The same operations on an insertion-ordered dict must
    # give the same blocks in the same order.
    from collections import OrderedDict

    queue, model = _TightQueue(), OrderedDict[int, None]()
    for op, b, n in ops:
        if op == "add" and b not in model:
            queue.append(b)
            model[b] = None
        elif op == "add_run":
            run = [x for x in range(b, b + n) if x not in model]
            queue.extend(run)
            model.update(dict.fromkeys(run))
        elif op == "remove" and b in model:
            queue.remove(b)
            del model[b]
        elif op == "pop" and model:
            assert queue.pop_front() == model.popitem(last=False)[0]
        elif op == "take_run" and model:
            run = queue.front(min(n, len(model)))
            assert run == list(model)[:len(run)]
            queue.drop_front(len(run))
            for _ in run:
                model.popitem(last=False)
        queue.check_invariants("q")
        assert len(queue) == len(model) and list(queue) == list(model)


def _pool_state(pool: BlockPool) -> tuple[object, ...]:
    return (list(pool.block_hash), [dict(i) for i in pool.index], [dict(d) for d in pool._dups], list(pool.ref_cnt),
            list(pool._low), list(pool._lru), pool.num_free_blocks, pool.num_admissible_blocks, pool.evictions)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "free", "free_low", "keep"]), st.integers(1, 9),
                          st.integers(0, 5), st.booleans()), max_size=40))
def test_bulk_eviction_leaves_the_pool_as_block_by_block_eviction(ops: list[tuple[str, int, int, bool]]) -> None:
    # With events on, the pool evicts block by block (each eviction is an event); without, in bulk
    # where it can. Both must take the same blocks and end in the same state, with kept windows,
    # duplicate hashes (a tiny hash space) and `low` blocks in play.
    pools = [BlockPool(12, num_groups=2, kept_queue=KeptBlocks, enable_events=events) for events in (True, False)]
    held: list[list[tuple[int, int]]] = [[], []]  # (group, block) per pool
    for op, n, salt, flag in ops:
        for k, pool in enumerate(pools):
            mine = held[k]
            if op == "take":
                n = min(n, pool.num_admissible_blocks)
                if not n:
                    continue
                blocks = pool.allocate(n, allow_reserved=flag)
                group = salt % 2
                pool.cache_blocks(group, blocks, [b"h%d" % ((salt + i) % 7) for i in range(n)])
                mine += [(group, b) for b in blocks]
            elif mine:
                chosen = mine[:n]
                del mine[:n]
                blocks = [b for _, b in chosen]
                if op == "free":
                    pool.free(blocks)
                elif op == "free_low":
                    pool.free_low(blocks)
                else:  # windows (group 1) kept under the first full-attention (group 0) block still held
                    anchor = next((b for g, b in mine if g == 0), None)
                    if anchor is None:
                        pool.free(blocks)
                    else:
                        keep(pool, blocks, anchor)
            pool.check_invariants()
        assert _pool_state(pools[0]) == _pool_state(pools[1])
        assert held[0] == held[1]


def test_eviction_of_an_anchor_releases_its_windows_before_the_next_lru_block() -> None:
    # Three cached blocks in the LRU, the oldest an anchor with two kept windows: evicting the
    # anchor releases its windows to `low`, which go before the LRU's next blocks (no bulk
    # eviction may skip past the anchor).
    pool = BlockPool(8, num_groups=2, kept_queue=KeptBlocks)
    anchors = pool.allocate(3, allow_reserved=False)
    pool.cache_blocks(0, anchors, [b"a0", b"a1", b"a2"])
    windows = pool.allocate(2, allow_reserved=False)
    pool.cache_blocks(1, windows, [b"w0", b"w1"])
    keep(pool, windows, anchors[0])
    pool.free(anchors)
    assert pool.allocate(5, allow_reserved=False) == [6, 7, anchors[0], *windows]
    assert pool.get_cached_block(0, b"a1") == anchors[1]
    pool.check_invariants()

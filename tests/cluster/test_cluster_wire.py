"""vLLM's KV-event wire format, our encoder and decoder.

The bytes we publish are what vLLM's msgspec ``KVEventBatch`` reads (checked against vLLM itself
in ``test_cluster_vllm.py``); here: round trips, the older array form, and malformed input named.
"""

from __future__ import annotations

import msgpack
import pytest

from hybridkv import Sequence
from hybridkv.cluster import (
    AllClearedEvent,
    BlockRemovedEvent,
    BlockStoredEvent,
    EventBatch,
    EventDecodeError,
    from_core_events,
    group_metadata,
    make_batch,
)
from hybridkv.cluster.wire import decode_batch, encode_batch

from helpers import full, mamba, manager, run_prefill, swa, tokens

STORED = BlockStoredEvent((b"\x01" * 32, b"\x02" * 32), b"\x00" * 32, tuple(range(32)), 16, "GPU", 1,
                          "sliding_window", 48)


def test_a_batch_round_trips_through_msgpack() -> None:
    batch = EventBatch(12.5, (STORED, BlockRemovedEvent((7, 2**64 - 1), "CPU", 0), AllClearedEvent()), 3)
    assert decode_batch(encode_batch(batch)) == batch


def test_the_batch_is_an_array_of_tagged_maps_as_vllm_encodes_it() -> None:
    obj = msgpack.unpackb(encode_batch(make_batch([STORED], ts=1.0)), raw=False)
    assert obj[0] == 1.0 and len(obj) == 2  # no data-parallel rank: omitted, as msgspec omits defaults
    assert obj[1][0] == {
        "type": "BlockStored", "block_hashes": [b"\x01" * 32, b"\x02" * 32], "parent_block_hash": b"\x00" * 32,
        "token_ids": list(range(32)), "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None,
        "group_idx": 1, "kv_cache_spec_kind": "sliding_window", "kv_cache_spec_sliding_window": 48,
    }


def test_the_older_array_form_of_events_decodes() -> None:
    payload = msgpack.packb([2.0, [["BlockStored", [5, 6], None, [1, 2, 3, 4], 2, None, "GPU"],
                                   ["BlockRemoved", [5], "GPU"], ["AllBlocksCleared"]]])
    batch = decode_batch(payload)
    assert batch.events == (BlockStoredEvent((5, 6), None, (1, 2, 3, 4), 2, "GPU"),
                            BlockRemovedEvent((5,), "GPU"), AllClearedEvent())


@pytest.mark.parametrize(("obj", "message"), [
    ({"ts": 1}, "an event batch is an array"),
    (["now", []], "batch ts must be a number"),
    ([1.0, [{"type": "BlockEvicted"}]], "event 0 has unknown type 'BlockEvicted'"),
    ([1.0, [{"type": "BlockStored", "block_hashes": ["x"], "token_ids": []}]], "event 0: block_hashes"),
    ([1.0, [{"type": "BlockStored", "block_hashes": [], "token_ids": [-1]}]], "event 0: token_ids"),
    ([1.0, [{"type": "BlockRemoved", "block_hashes": [], "group_idx": "0"}]], "event 0: group_idx"),
])
def test_a_malformed_batch_is_refused_naming_the_field(obj: object, message: str) -> None:
    with pytest.raises(EventDecodeError, match=message):
        decode_batch(msgpack.packb(obj))


def test_bytes_that_are_not_msgpack_are_refused() -> None:
    with pytest.raises(EventDecodeError, match="is not msgpack"):
        decode_batch(b"\xc1garbage")


def test_core_events_carry_group_kind_window_and_medium() -> None:
    mgr = manager(100, full(16), swa(48, 16), mamba(16), max_model_len=512, batch=512, enable_events=True)
    seq = Sequence("a", tokens(0, 40))
    run_prefill(mgr, seq, 64)
    mgr.free(seq)  # the recurrent checkpoint at 32 enters the cache once reported computed
    events = from_core_events(mgr.take_events(), group_metadata(mgr.layout), medium="GPU", int_hashes=True)
    stores = [e for e in events if isinstance(e, BlockStoredEvent)]
    assert [(e.group_idx, e.kind, e.sliding_window, e.medium, len(e.block_hashes)) for e in stores] == [
        (0, "full_attention", None, "GPU", 2), (1, "sliding_window", 48, "GPU", 2), (2, "mamba", None, "GPU", 1)]
    assert all(isinstance(h, int) and 0 <= h < 2**64 for e in stores for h in e.block_hashes)
    assert stores[0].token_ids == tuple(range(32)) and stores[0].parent_block_hash is None

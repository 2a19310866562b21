"""KV-event batches as msgpack bytes, and the ZMQ frames they travel in (needs ``msgpack``).

A published message is three frames: the topic (UTF-8, may be empty), the batch number as 8
big-endian bytes, and the msgpack payload. The replay socket (a ROUTER) takes a request of one
frame, the first batch number wanted as 8 big-endian bytes, and answers every buffered batch from
there as ``(topic, number, payload)`` then an end marker ``(b"", -1 as 8 signed bytes, b"")``.
"""

from __future__ import annotations

import msgpack

from hybridkv.cluster.events import EventBatch, EventDecodeError, batch_from_obj, batch_to_obj

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def encode_batch(batch: EventBatch) -> bytes:
    """``batch`` as the msgpack bytes vLLM's ``KVEventBatch`` decoder reads."""
    return bytes(msgpack.packb(batch_to_obj(batch), use_bin_type=True))


def decode_batch(payload: bytes) -> EventBatch:
    """A batch from msgpack bytes (vLLM's or ours); ``EventDecodeError`` when they are not one."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise EventDecodeError(f"payload of {len(payload)} bytes is not msgpack: {exc}") from exc
    return batch_from_obj(obj)


def seq_bytes(seq: int) -> bytes:
    """A batch number as its frame."""
    return seq.to_bytes(8, "big")


def seq_from(frame: bytes) -> int:
    """A batch number from its frame (-1 is the replay's end marker)."""
    if len(frame) != 8:
        raise EventDecodeError(f"a batch number frame has 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)

"""Tier keys and payload frames: what an external tier stores for one block of one group.

A key is ``hkv1/<namespace id>/<group>/<block hash hex>``; a frame is a header (magic, version,
flags, lengths, a sha256 or HMAC-sha256 digest), the key and the payload, checked field by field
on read (``FrameError`` names the fault). The layouts: docs/TIERS.md, "Keys and frames".
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from typing import Literal

from hybridkv.core import KVCacheLayout

FaultKind = Literal["error", "timeout", "short", "corrupt", "wrong_key", "wrong_size", "missing"]
FAULT_KINDS: tuple[FaultKind, ...] = ("error", "timeout", "short", "corrupt", "wrong_key", "wrong_size", "missing")

MAGIC = b"HKVF"
VERSION = 1
_HMAC = 1
_HEADER = struct.Struct("<4sBBHQ32s")


class FrameError(Exception):
    """A stored value that must not be served; ``kind`` says why."""

    def __init__(self, kind: FaultKind, message: str) -> None:
        super().__init__(message)
        self.kind: FaultKind = kind


def namespace_id(namespace: str, layout: KVCacheLayout, hash_algorithm: str) -> str:
    """Hex digest naming one model + layout + hash algorithm; part of every tier key."""
    groups = repr(tuple((g.spec, g.layer_names) for g in layout.groups))
    raw = "\0".join((namespace, groups, hash_algorithm)).encode()
    return hashlib.sha256(raw).hexdigest()[:32]


def tier_key(ns_id: str, group: int, block_hash: bytes) -> bytes:
    """The tier key of one block of one group."""
    return b"hkv1/%s/%d/%s" % (ns_id.encode(), group, block_hash.hex().encode())


def _digest(key: bytes, payload: bytes, auth_key: bytes | None) -> bytes:
    if auth_key is None:
        return hashlib.sha256(key + payload).digest()
    return hmac.new(auth_key, key + payload, hashlib.sha256).digest()


def encode_frame(key: bytes, payload: bytes, auth_key: bytes | None = None) -> bytes:
    """The framed value to store under ``key``."""
    flags = _HMAC if auth_key is not None else 0
    header = _HEADER.pack(MAGIC, VERSION, flags, len(key), len(payload), _digest(key, payload, auth_key))
    return header + key + payload


def decode_frame(key: bytes, data: bytes, auth_key: bytes | None = None) -> bytes:
    """The payload of a frame stored under ``key``; raises ``FrameError`` if any check fails."""
    if len(data) < _HEADER.size:
        raise FrameError("short", f"frame of {len(data)} bytes is shorter than its header")
    magic, version, flags, key_len, payload_len, digest = _HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise FrameError("corrupt", f"bad magic {magic!r} or version {version}")
    if flags != (_HMAC if auth_key is not None else 0):
        raise FrameError("corrupt", f"frame flags {flags} do not match this connector's authentication")
    start = _HEADER.size + key_len
    if len(data) < start:
        raise FrameError("short", f"frame of {len(data)} bytes ends inside its key")
    if data[_HEADER.size : start] != key:
        raise FrameError("wrong_key", "the frame belongs to another key")
    size = len(data) - start
    if size < payload_len:
        raise FrameError("short", f"payload has {size} of {payload_len} bytes")
    if size > payload_len:
        raise FrameError("corrupt", f"{size - payload_len} bytes after the payload")
    payload = data[start:]
    if not hmac.compare_digest(digest, _digest(key, payload, auth_key)):
        raise FrameError("corrupt", "payload digest mismatch")
    return payload

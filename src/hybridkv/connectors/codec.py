"""What a connector stores under a tier key for one block's payload, and how it reads it back.

``FrameCodec`` (real tiers) frames and signs each payload (``connectors.frame``) and checks every
value read; ``PlaceholderCodec`` (simulated tiers, which keep no payload) stores an empty value and
reads a value back unchecked. The connector holds one (``KVConnector(codec=...)``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from hybridkv.connectors.frame import FrameError, decode_frame, encode_frame

Decoded = tuple[list["bytes | None"], list[tuple[int, FrameError]]]
"""``decode_many``'s answer: the payload of each value (None: absent or rejected), and the rejected
values' positions with the reason."""


class BlockCodec:
    """Turns a block's payload into the value a tier stores under its key, and back."""

    holds_payloads: bool = True
    """Whether ``encode`` keeps the payload in the value. True: a store builds values a batch at a
    time (``KVConnector.batch_blocks``) so a long prompt's values are never all in memory at once;
    False (placeholders): a store offers all its blocks of one priority to a tier in one call."""

    def encode(self, key: bytes, payload: bytes) -> bytes:
        """The value to store under ``key`` for ``payload``."""
        raise NotImplementedError

    def decode(self, key: bytes, value: bytes) -> bytes:
        """The payload of ``value`` read under ``key``; ``FrameError`` if it must not be served."""
        raise NotImplementedError

    def decode_many(self, keys: Sequence[bytes], values: Sequence[bytes | None]) -> Decoded:
        """``decode`` for a batch read (``KVTier.get_many``'s answer to ``keys``)."""
        out: list[bytes | None] = []
        rejected: list[tuple[int, FrameError]] = []
        decode = self.decode
        for i, (key, value) in enumerate(zip(keys, values)):
            if value is None:
                out.append(None)
                continue
            try:
                out.append(decode(key, value))
            except FrameError as exc:
                out.append(None)
                rejected.append((i, exc))
        return out, rejected


class FrameCodec(BlockCodec):
    """Frames signed with ``auth_key`` (HMAC-sha256; None: plain sha256), checked on every read; a
    payload whose size is not ``payload_bytes`` of its group (``frame.tier_key``'s group) is
    ``wrong_size``."""

    def __init__(self, auth_key: bytes | None, payload_bytes: Mapping[int, int]) -> None:
        self.auth_key = auth_key
        self.payload_bytes = dict(payload_bytes)

    def encode(self, key: bytes, payload: bytes) -> bytes:
        return encode_frame(key, payload, self.auth_key)

    def decode(self, key: bytes, value: bytes) -> bytes:
        payload = decode_frame(key, value, self.auth_key)
        group = int(key.rsplit(b"/", 2)[1])  # tier_key: hkv1/<namespace>/<group>/<hash>
        if len(payload) != self.payload_bytes[group]:
            raise FrameError("wrong_size", f"group {group}: a payload of {len(payload)} bytes, a block holds "
                                           f"{self.payload_bytes[group]}")
        return payload


class PlaceholderCodec(BlockCodec):
    """Simulated values: a store puts an empty value (no payload is framed), a read serves the value
    as it is (a simulated tier answers with a tag naming itself, and cannot corrupt anything)."""

    holds_payloads = False

    def encode(self, key: bytes, payload: bytes) -> bytes:
        return b""

    def decode(self, key: bytes, value: bytes) -> bytes:
        return value

    def decode_many(self, keys: Sequence[bytes], values: Sequence[bytes | None]) -> Decoded:
        return values if isinstance(values, list) else list(values), []

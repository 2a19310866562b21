"""The secret that authenticates tier frames: given, from the environment, or from a key file.

First match wins: the connector's ``auth_key``, ``HYBRIDKV_TIER_KEY`` (the secret), then
``HYBRIDKV_TIER_KEY_FILE`` (a file holding it); the environment is read only for a shared tier, and a
shared tier without a secret is refused unless ``allow_unauthenticated``. Specification:
docs/TIERS.md, "The frame secret".
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from hybridkv.connectors.base import KVTier
from hybridkv.errors import InvalidInputError

KEY_ENV = "HYBRIDKV_TIER_KEY"
KEY_FILE_ENV = "HYBRIDKV_TIER_KEY_FILE"
MIN_KEY_BYTES = 16


def _checked(key: bytes, source: str) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise InvalidInputError(f"the tier key from {source} has {len(key)} bytes; use at least {MIN_KEY_BYTES} "
                                f"(e.g. the output of: python -c 'import secrets; print(secrets.token_hex(32))')")
    return key


def environment_key(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The tier key from ``HYBRIDKV_TIER_KEY`` or ``HYBRIDKV_TIER_KEY_FILE`` (None: neither is set).

    Raises ``InvalidInputError`` for a key that is too short or an unreadable key file."""
    env = os.environ if environ is None else environ
    if env.get(KEY_ENV):
        return _checked(env[KEY_ENV].encode(), KEY_ENV)
    if env.get(KEY_FILE_ENV):
        path = env[KEY_FILE_ENV]
        try:
            with open(path, "rb") as f:
                key = f.read().rstrip()
        except OSError as exc:
            raise InvalidInputError(f"{KEY_FILE_ENV}={path!r}: cannot read the tier key: {exc.strerror}") from None
        return _checked(key, f"{KEY_FILE_ENV}={path!r}")
    return None


def resolve_auth_key(auth_key: bytes | None, tiers: Sequence[KVTier], *, allow_unauthenticated: bool = False,
                     environ: Mapping[str, str] | None = None) -> bytes | None:
    """The frame secret for a connector over ``tiers``; None only where unauthenticated frames are allowed.

    Raises ``InvalidInputError`` for a key that is too short, an unreadable key file, or a shared
    tier without a key (unless ``allow_unauthenticated``).
    """
    env = os.environ if environ is None else environ
    if auth_key is not None:
        if not isinstance(auth_key, bytes):
            raise InvalidInputError(f"auth_key must be bytes, got {type(auth_key).__name__}")
        return _checked(auth_key, "auth_key")
    shared = [t.name for t in tiers if t.shared]
    if not shared:
        return None
    key = environment_key(env)
    if key is not None:
        return key
    if not allow_unauthenticated:
        raise InvalidInputError(
            f"tier {', '.join(shared)} is shared between instances but no tier key is set: set {KEY_ENV} (or "
            f"{KEY_FILE_ENV}) to the same secret on every instance, or pass allow_unauthenticated=True to accept "
            f"unsigned frames (anyone who can write the tier could then inject KV)"
        )
    return None

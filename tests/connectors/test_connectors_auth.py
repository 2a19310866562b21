"""Frames of shared tiers are signed by default, and payloads must have their group's block size."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridkv import Sequence
from hybridkv.connectors import DiskTier, HostTier, KVConnector, decode_frame, encode_frame
from hybridkv.connectors.frame import FrameError
from hybridkv.errors import InvalidInputError

from helpers import manager
from test_connectors import PAGE, TOKENS, Store, admit, connector, full, hybrid, produce

SECRET = "a-secret-of-32-characters-or-so!"


@pytest.fixture
def no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HYBRIDKV_TIER_KEY", raising=False)
    monkeypatch.delenv("HYBRIDKV_TIER_KEY_FILE", raising=False)


def stored_frame(tier: DiskTier | HostTier, conn: KVConnector) -> tuple[bytes, bytes]:
    """The key and frame of the first full-attention block of ``TOKENS``."""
    key = conn.keys(Sequence("probe", TOKENS), 0)[0]
    (frame,) = tier.get_many([key])
    assert frame is not None
    return key, frame


# ---------------------------------------------------------------------- where the key comes from
def test_a_shared_tier_without_a_key_refuses_to_start(tmp_path: Path, no_key: None) -> None:
    with pytest.raises(InvalidInputError) as err:
        connector([DiskTier(tmp_path, 1 << 20, shared=True)])
    message = str(err.value)
    assert "\n" not in message
    assert "HYBRIDKV_TIER_KEY" in message and "allow_unauthenticated=True" in message


def test_the_insecure_flag_starts_a_shared_tier_with_unsigned_frames(tmp_path: Path, no_key: None) -> None:
    disk = DiskTier(tmp_path, 1 << 20, shared=True)
    conn = connector([disk], allow_unauthenticated=True)
    assert conn.auth_key is None
    produce(conn, TOKENS)
    key, frame = stored_frame(disk, conn)
    assert len(decode_frame(key, frame)) == PAGE


def test_the_key_from_the_environment_signs_frames(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDKV_TIER_KEY", SECRET)
    disk = DiskTier(tmp_path, 1 << 20, shared=True)
    conn = connector([disk])
    produce(conn, TOKENS)
    key, frame = stored_frame(disk, conn)
    assert len(decode_frame(key, frame, SECRET.encode())) == PAGE
    with pytest.raises(FrameError):
        decode_frame(key, frame)  # not a plain digest
    store: Store = {}
    assert admit(connector([disk]), Sequence("consumer", TOKENS), store) == (0, 96)


def test_the_key_file_signs_frames(tmp_path: Path, no_key: None, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "tier.key"
    key_file.write_text(SECRET + "\n")
    monkeypatch.setenv("HYBRIDKV_TIER_KEY_FILE", str(key_file))
    conn = connector([DiskTier(tmp_path / "tier", 1 << 20, shared=True)])
    assert conn.auth_key == SECRET.encode()


def test_a_missing_key_file_is_named(tmp_path: Path, no_key: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDKV_TIER_KEY_FILE", str(tmp_path / "absent.key"))
    with pytest.raises(InvalidInputError, match=r"absent\.key.*No such file"):
        connector([DiskTier(tmp_path / "tier", 1 << 20, shared=True)])


def test_a_short_key_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDKV_TIER_KEY", "short")
    with pytest.raises(InvalidInputError, match="5 bytes; use at least 16"):
        connector([DiskTier(tmp_path, 1 << 20, shared=True)])


def test_private_tiers_keep_plain_digests_whatever_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HYBRIDKV_TIER_KEY", SECRET)
    host = HostTier(1 << 20)
    conn = connector([host])
    assert conn.auth_key is None
    produce(conn, TOKENS)
    key, frame = stored_frame(host, conn)
    assert len(decode_frame(key, frame)) == PAGE


# ---------------------------------------------------------------------- forged entries
def test_an_instance_with_another_key_loads_nothing(tmp_path: Path) -> None:
    disk = DiskTier(tmp_path, 1 << 20, shared=True)
    produce(connector([disk], auth_key=b"the-producers-secret-key"), TOKENS)
    conn = connector([disk], auth_key=b"a-different-secret-key!!")
    seq = Sequence("consumer", TOKENS)
    assert conn.num_external_tokens(seq, 0) == 96  # the entries exist ...
    assert conn.fetch(seq, 0, 96).num_tokens == 0  # ... but none is served
    assert conn.stats.faults["corrupt"] >= 1


def test_an_unsigned_forgery_is_rejected_by_a_signing_connector(tmp_path: Path, no_key: None) -> None:
    disk = DiskTier(tmp_path, 1 << 20, shared=True)
    conn = connector([disk], auth_key=SECRET.encode())
    seq = Sequence("victim", TOKENS)
    forged = [(k, encode_frame(k, b"\x00" * PAGE)) for g in conn.manager.caching_groups for k in conn.keys(seq, g)]
    disk.put_many(forged)
    assert conn.fetch(seq, 0, 96).num_tokens == 0
    assert conn.stats.faults["corrupt"] >= 1


@pytest.mark.parametrize("size", [0, 1, PAGE - 1, PAGE + 1, 64 * PAGE])
def test_a_well_formed_frame_of_the_wrong_size_is_a_counted_miss(tmp_path: Path, size: int) -> None:
    disk = DiskTier(tmp_path, 1 << 22, shared=True)
    produce(connector([disk], manager(400, full()), auth_key=SECRET.encode()), TOKENS)
    conn = connector([disk], manager(400, full()), auth_key=SECRET.encode())
    seq = Sequence("consumer", TOKENS)
    bad = conn.keys(seq, 0)[2]
    disk.put_many([(bad, encode_frame(bad, b"\x07" * size, SECRET.encode()))])  # signed, framed, wrong size
    store: Store = {}
    assert admit(conn, seq, store) == (0, 32)  # blocks 0 and 1 only
    assert conn.stats.faults["wrong_size"] == 1
    assert disk.exists_many([bad]) == [False]  # the rejected entry is dropped


def test_payload_sizes_default_to_layers_times_page_size() -> None:
    assert connector([HostTier(1)]).payload_bytes == {0: PAGE, 1: PAGE, 2: PAGE}


def test_payload_sizes_must_name_every_group() -> None:
    with pytest.raises(InvalidInputError, match=r"each group 0\.\.2"):
        KVConnector([HostTier(1)], hybrid(), namespace="m", payload_bytes={0: 128})
    with pytest.raises(InvalidInputError, match="positive size"):
        KVConnector([HostTier(1)], hybrid(), namespace="m", payload_bytes={0: 128, 1: 0, 2: 128})

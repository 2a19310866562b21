"""Events over ZMQ: a replica's publisher, the index's subscriber, replay and restarts.

Real sockets on 127.0.0.1 with ports the OS picks. A subscriber that connects after batches were
published (ZMQ's slow joiner) or reconnects after missing some asks the replay socket for them; a
publisher that restarts starts again at batch 0 and the index follows it from scratch.
"""

from __future__ import annotations

import time

import pytest

from hybridkv import Sequence
from hybridkv.cluster import ClusterIndex, HybridkvHashes
from hybridkv.cluster.publisher import KVEventPublisher
from hybridkv.cluster.subscriber import KVEventSubscriber
from hybridkv.errors import InvalidInputError

from helpers import full, manager, run_prefill, swa, tokens


def _wait(sub: KVEventSubscriber, name: str, next_seq: int, timeout: float = 10.0) -> None:
    """Poll until the index has applied ``name``'s batches up to ``next_seq - 1``."""
    deadline = time.monotonic() + timeout
    while (sub.index.streams[name].next_seq or 0) != next_seq:
        assert time.monotonic() < deadline, f"{name}: at {sub.index.streams[name].next_seq}, waiting for {next_seq}"
        sub.poll(0.05)


def _settle(sub: KVEventSubscriber, seconds: float = 0.3) -> None:
    """Poll for a while: a SUB socket attaches a new connection (and sends its subscription) only
    when its thread uses it, as the router's polling thread always does."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sub.poll(0.02)


def _setup(**kw: object) -> tuple[KVEventPublisher, ClusterIndex, KVEventSubscriber]:
    pub = KVEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", **kw)  # type: ignore[arg-type]
    index = ClusterIndex()
    index.add_replica("r", scheme=HybridkvHashes(), expected_groups=2)
    return pub, index, KVEventSubscriber(index)


def _serve(mgr: object, pub: KVEventPublisher, prompt: list[int], name: str) -> None:
    seq = Sequence(name, prompt)
    run_prefill(mgr, seq, 64)  # type: ignore[arg-type]
    pub.publish_manager(mgr)  # type: ignore[arg-type]
    mgr.free(seq)  # type: ignore[attr-defined]
    pub.publish_manager(mgr)  # type: ignore[arg-type]


def test_predictions_over_zmq_equal_the_publishing_managers_lookups() -> None:
    mgr = manager(40, full(16), swa(40, 16), max_model_len=1024, batch=1024, enable_events=True)
    pub, index, sub = _setup()
    try:
        sub.connect("r", pub.endpoint, pub.replay_endpoint)
        _settle(sub)  # a batch sent before the subscription is up is only replayed at the next gap
        for i in range(12):
            prompt = tokens(0, 100 + 37 * (i % 4)) + tokens(5000 + 100 * i, 20)
            _wait(sub, "r", pub.num_published)
            assert index.lookup(prompt)["r"].tokens == mgr.lookup(Sequence("q", prompt)).num_tokens
            _serve(mgr, pub, prompt, f"s{i}")
        _wait(sub, "r", pub.num_published)
        assert index.views["r"].verified  # the hashes were recomputed from a store event and matched
    finally:
        sub.close()
        pub.close()


def test_a_subscriber_that_joins_late_replays_the_history() -> None:
    mgr = manager(200, full(16), swa(40, 16), max_model_len=1024, batch=1024, enable_events=True)
    pub, index, sub = _setup()
    try:
        for i in range(3):
            _serve(mgr, pub, tokens(1000 * i, 150), f"s{i}")
        time.sleep(0.1)  # published before anyone listened
        sub.connect("r", pub.endpoint, pub.replay_endpoint)
        _settle(sub)
        _serve(mgr, pub, tokens(9000, 50), "late")
        _wait(sub, "r", pub.num_published)
        st = index.streams["r"]
        assert (st.batches, st.resyncs, st.restarts) == (pub.num_published, 0, 0)
        assert index.lookup(tokens(1000, 150))["r"].tokens == 144
    finally:
        sub.close()
        pub.close()


def test_batches_missed_while_disconnected_are_replayed() -> None:
    mgr = manager(200, full(16), swa(40, 16), max_model_len=1024, batch=1024, enable_events=True)
    pub, index, sub = _setup()
    try:
        sub.connect("r", pub.endpoint, pub.replay_endpoint)
        _settle(sub)
        _serve(mgr, pub, tokens(0, 100), "a")
        _wait(sub, "r", pub.num_published)
        sub.disconnect("r")
        _serve(mgr, pub, tokens(2000, 100), "b")  # missed
        sub.connect("r", pub.endpoint, pub.replay_endpoint)
        _settle(sub)
        _serve(mgr, pub, tokens(4000, 100), "c")
        _wait(sub, "r", pub.num_published)
        assert index.streams["r"].resyncs == 0
        assert [index.lookup(tokens(s, 100))["r"].tokens for s in (0, 2000, 4000)] == [96, 96, 96]
    finally:
        sub.close()
        pub.close()


def test_without_a_replay_socket_a_reconnect_forgets_the_view_and_never_over_predicts() -> None:
    mgr = manager(200, full(16), swa(40, 16), max_model_len=1024, batch=1024, enable_events=True)
    pub = KVEventPublisher("tcp://127.0.0.1:0")
    index = ClusterIndex()
    index.add_replica("r", scheme=HybridkvHashes(), layout=mgr.layout)
    sub = KVEventSubscriber(index)
    try:
        sub.connect("r", pub.endpoint)
        _settle(sub)
        _serve(mgr, pub, tokens(0, 100), "a")
        _wait(sub, "r", pub.num_published)
        sub.disconnect("r")
        _serve(mgr, pub, tokens(2000, 100), "b")
        sub.connect("r", pub.endpoint)
        _settle(sub)
        _serve(mgr, pub, tokens(4000, 100), "c")
        _wait(sub, "r", pub.num_published)
        # Nothing proves the stream continues (a restart looks the same): the view is dropped.
        assert index.streams["r"].restarts == 1
        # "a" is still cached in the replica but the index can no longer vouch for it; "b" is known
        # only if its batch was still in flight when the new subscription came up.
        a, b, c = (index.lookup(tokens(s, 100))["r"].tokens for s in (0, 2000, 4000))
        assert (a, c) == (0, 96) and b in (0, 96)
    finally:
        sub.close()
        pub.close()


def test_a_restarted_publisher_is_followed_from_scratch() -> None:
    mgr = manager(200, full(16), swa(40, 16), max_model_len=1024, batch=1024, enable_events=True)
    pub, index, sub = _setup()
    endpoint, replay = pub.endpoint, pub.replay_endpoint
    try:
        sub.connect("r", endpoint, replay)
        _settle(sub)
        for i in range(3):
            _serve(mgr, pub, tokens(1000 * i, 100), f"s{i}")
        _wait(sub, "r", pub.num_published)
        pub.close()
        # The replica restarts on the same endpoints with an empty cache.
        mgr = manager(200, full(16), swa(40, 16), max_model_len=1024, batch=1024, enable_events=True)
        pub = KVEventPublisher(endpoint, replay)
        _settle(sub)
        _serve(mgr, pub, tokens(7000, 100), "new")
        _wait(sub, "r", pub.num_published)
        assert index.streams["r"].restarts == 1
        assert [index.lookup(tokens(s, 100))["r"].tokens for s in (0, 1000, 7000)] == [0, 0, 96]
    finally:
        sub.close()
        pub.close()


def test_an_endpoint_in_use_is_refused_by_name() -> None:
    with KVEventPublisher("tcp://127.0.0.1:0") as pub, pytest.raises(InvalidInputError, match="KV events endpoint"):
        KVEventPublisher(pub.endpoint)


def test_an_undecodable_message_resyncs_that_replica_only() -> None:
    import zmq

    from hybridkv.cluster.wire import seq_bytes
    index = ClusterIndex()
    index.add_replica("r", scheme=HybridkvHashes(), expected_groups=1)
    sub = KVEventSubscriber(index)
    ctx = zmq.Context.instance()
    rogue = ctx.socket(zmq.PUB)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    try:
        sub.connect("r", f"tcp://127.0.0.1:{port}")
        _settle(sub)
        rogue.send_multipart((b"", seq_bytes(0), b"\xc1 not msgpack"))
        deadline = time.monotonic() + 5
        while sub.num_undecodable == 0 and time.monotonic() < deadline:
            sub.poll(0.05)
        assert sub.num_undecodable == 1
        assert (index.streams["r"].lost, index.streams["r"].next_seq) == ([0], 1)
    finally:
        sub.close()
        rogue.close(linger=0)

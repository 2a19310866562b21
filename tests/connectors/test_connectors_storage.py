"""What a tier keeps of a sequence: per group, only the blocks a later hit can use."""

from __future__ import annotations

from hybridkv import KVCacheManager, Sequence
from hybridkv.connectors import HostTier, KVConnector
from hybridkv.connectors.storage import StoreAll, StoreHitSpans

from helpers import chunked, full, mamba, manager, swa, tokens

PAYLOAD = 8


def connector(mgr: KVCacheManager, host: HostTier, **kw: object) -> KVConnector:
    """A connector storing hit spans only (``StoreHitSpans``) unless ``storage`` is given."""
    kw.setdefault("storage", StoreHitSpans())
    return KVConnector([host], mgr, namespace="m", payload_bytes=dict.fromkeys(range(len(mgr.layout.groups)), PAYLOAD),
                       **kw)  # type: ignore[arg-type]


def produce(conn: KVConnector, prompt: list[int], chunk: int = 100, seq_id: str = "p", hints: tuple[int, ...] = ()
            ) -> None:
    """Prefill ``prompt`` in chunks as an engine does: store right after each step, then report it computed."""
    mgr = conn.manager
    seq = Sequence(seq_id, prompt, checkpoint_hints=hints)
    hit = mgr.lookup(seq)
    seq_start = hit.num_tokens
    first = True
    while seq.num_computed_tokens < seq.num_tokens:
        c = seq.num_computed_tokens if not first else seq_start
        n = min(chunk, seq.num_tokens - c)
        assert mgr.allocate(seq, n, hit=hit if first else None) is not None
        seq.num_computed_tokens = c
        conn.store(seq, c + n, lambda g, b: b"k" * PAYLOAD, c)
        seq.num_computed_tokens = c + n
        first = False
    mgr.free(seq)


def stored(conn: KVConnector, host: HostTier, prompt: list[int], group: int) -> list[int]:
    """Table indices of ``group`` whose block of ``prompt`` the tier holds."""
    keys = conn.keys(Sequence("probe", prompt), group)
    return [i for i, there in enumerate(host.exists_many(keys)) if there]


def fresh(num_blocks: int, *specs: object) -> KVCacheManager:
    return manager(num_blocks, *specs, retention="none")


def test_growing_layers_keep_every_block_a_window_only_its_span_at_the_prompts_end() -> None:
    host = HostTier(1 << 20)
    conn = connector(fresh(400, full(), swa(64)), host)
    prompt = tokens(0, 300)
    produce(conn, prompt)
    assert stored(conn, host, prompt, 0) == list(range(18))  # 18 full blocks
    # The prompt's end rounds down to 288: a hit there reads the window's blocks 14..17.
    assert stored(conn, host, prompt, 1) == [14, 15, 16, 17]
    assert connector(fresh(400, full(), swa(64)), host).num_external_tokens(Sequence("c", prompt + [7]), 0) == 288


def test_a_checkpoint_hint_stores_the_window_a_hit_there_needs() -> None:
    """A marked system prompt's end (100 -> 96) is a checkpoint: a later request sharing only that
    prefix resumes from the tier."""
    host = HostTier(1 << 20)
    conn = connector(fresh(400, full(), swa(64)), host)
    prompt = tokens(0, 300)
    produce(conn, prompt, hints=(100,))
    assert stored(conn, host, prompt, 1) == [2, 3, 4, 5, 14, 15, 16, 17]
    later = prompt[:100] + tokens(5000, 80)
    assert connector(fresh(400, full(), swa(64)), host).num_external_tokens(Sequence("t1", later), 0) == 96


def test_store_all_keeps_every_layer_of_every_block() -> None:
    host = HostTier(1 << 20)
    conn = connector(fresh(400, full(), swa(64)), host, storage=StoreAll())
    prompt = tokens(0, 300)
    produce(conn, prompt)
    assert stored(conn, host, prompt, 1) == list(range(18))


def test_a_coarser_end_alignment_keeps_the_window_at_the_last_content_block() -> None:
    host = HostTier(1 << 20)
    conn = connector(fresh(400, full(), swa(64)), host, storage=StoreHitSpans(end_align=128))
    prompt = tokens(0, 300)
    produce(conn, prompt)
    assert stored(conn, host, prompt, 1) == [12, 13, 14, 15]  # the window at 256
    # A later turn sharing the first 256 tokens resumes there from the tier.
    later = prompt[:256] + tokens(5000, 80)
    assert connector(fresh(400, full(), swa(64)), host).num_external_tokens(Sequence("t1", later), 0) == 256


def test_an_interval_adds_a_window_every_n_tokens() -> None:
    host = HostTier(1 << 20)
    conn = connector(fresh(400, full(), swa(64)), host, storage=StoreHitSpans(interval=96))
    prompt = tokens(0, 300)
    produce(conn, prompt)
    # Windows at 96, 192 and 288 (also the prompt's end).
    assert stored(conn, host, prompt, 1) == [2, 3, 4, 5, 8, 9, 10, 11, 14, 15, 16, 17]


def test_a_prompt_of_whole_blocks_also_keeps_the_window_one_block_earlier() -> None:
    host = HostTier(1 << 20)
    conn = connector(fresh(400, full(), swa(64)), host)
    prompt = tokens(0, 288)
    produce(conn, prompt)
    assert stored(conn, host, prompt, 1) == [13, 14, 15, 16, 17]  # windows at 288 and 272
    # The same prompt again cannot cover its last token: it resumes at 272.
    assert connector(fresh(400, full(), swa(64)), host).num_external_tokens(Sequence("again", prompt), 0) == 272


def test_a_junction_a_lookup_found_gets_a_window_when_a_sequence_computes_it() -> None:
    host = HostTier(1 << 20)
    mgr = fresh(400, full(), swa(64))
    conn = connector(mgr, host)
    produce(conn, tokens(0, 300), seq_id="a")
    mgr.reset_prefix_cache()
    b = tokens(0, 200) + tokens(9000, 100)  # shares 192 tokens of whole blocks with a
    # The tier holds a's chain to 192 but no window there: no hit, and 192 is remembered.
    assert conn.num_external_tokens(Sequence("b", b), 0) == 0 and conn.stats.junctions == 1
    produce(conn, b, seq_id="b")  # b computes 192 and keeps the window there
    mgr.reset_prefix_cache()
    c = tokens(0, 200) + tokens(7000, 50)
    assert conn.num_external_tokens(Sequence("c", c), 0) == 192


def test_a_chunked_local_group_keeps_the_current_chunk_at_a_checkpoint() -> None:
    host = HostTier(1 << 20)
    conn = connector(fresh(400, full(), chunked(64)), host)
    prompt = tokens(0, 300)
    produce(conn, prompt)
    assert stored(conn, host, prompt, 1) == [16, 17]  # the chunk from 256 to the prompt's end at 288
    assert connector(fresh(400, full(), chunked(64)), host).num_external_tokens(Sequence("c", prompt + [1]), 0) == 288


def test_a_recurrent_state_is_stored_when_the_step_that_computed_it_is_offered() -> None:
    # A state enters the cache once its step ran: reported computed, or its blocks offered to a tier
    # (the offer vouches that the step ran). An offer that stops short of the state stores none.
    prompt = tokens(0, 300)
    for report_first, offered, expected in ((False, 200, []), (False, 300, [17]), (True, 300, [17])):
        host = HostTier(1 << 20)  # 17: the state at 288, the prompt's last boundary
        mgr = fresh(400, full(), mamba())
        conn = connector(mgr, host)
        seq = Sequence("m", prompt)
        assert mgr.allocate(seq, 300) is not None
        if report_first:
            seq.num_computed_tokens = 300
        conn.store(seq, offered, lambda g, b: b"k" * PAYLOAD, 0)
        assert stored(conn, host, prompt, 1) == expected
        mgr.free(seq)


def test_hit_spans_keep_far_fewer_bytes_for_the_same_hit_at_the_prompts_end() -> None:
    prompt = tokens(0, 2000)
    sizes = {}
    for policy in (StoreAll(), StoreHitSpans()):
        host = HostTier(1 << 24)
        produce(connector(fresh(600, full(), swa(64), swa(64), swa(64)), host, storage=policy), prompt, chunk=512)
        sizes[policy.name] = host.used_bytes
        consumer = connector(fresh(600, full(), swa(64), swa(64), swa(64)), host)
        assert consumer.num_external_tokens(Sequence("c", prompt + [3]), 0) == 2000
    # 125 blocks in all four groups (500 entries) against full attention's 125 and, in each window
    # group, the 5 blocks of the windows at 2000 and 1984.
    assert sizes["hit-spans"] * 500 == sizes["all"] * 140

"""External KV tiers in the simulator: capacity, bandwidth and latency, through the real connector.

``TierSpec`` parses ``--tier KIND:SIZE[@BANDWIDTH][@LATENCY]``; ``SimTiers`` builds one run's
``SimTier``s behind a ``SimConnector`` (the real ``KVConnector`` with placeholder values, raw-hash
keys and simulated load times) and accounts the loads. The tier model: docs/SIMULATOR.md, "The
tier model".
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from hybridkv.connectors.codec import PlaceholderCodec
from hybridkv.connectors.connector import BlockTables, FetchedKV, KVConnector, WriteBlock
from hybridkv.connectors.loads import PendingLoad
from hybridkv.connectors.storage import StoragePolicy
from hybridkv.core import NULL_BLOCK, KVCacheManager, KVSequence
from hybridkv.errors import InvalidInputError
from hybridkv.sim.sim_tier import SimTier, tier_key_group
from hybridkv.sizes import parse_bytes, split_number

KINDS = ("host", "disk", "net")
ALIASES = {"redis": "net", "network": "net"}
DEFAULT_BANDWIDTH: dict[str, float] = {"host": 25e9, "disk": 5e9, "net": 3e9}
"""Bytes/s per GPU of each tier kind when the spec names none."""
DEFAULT_LATENCY_S: dict[str, float] = {"host": 0.0, "disk": 100e-6, "net": 1e-3}
"""Seconds per sequence loading from a tier of each kind when the spec names none."""

TIER_MEDIA = {"host": "CPU", "disk": "STORAGE", "net": "NET"}
"""The medium each tier kind's KV events name (vLLM's strings for host memory and disk)."""

_TIME_UNITS = {"us": 1e-6, "µs": 1e-6, "ns": 1e-9, "ms": 1e-3, "s": 1.0}


def _parse_bandwidth(text: str) -> float:
    body = text.strip()
    if not body.lower().endswith("/s"):
        raise ValueError(f"expected a bandwidth such as 25GB/s, got {text!r}")
    value = parse_bytes(body[:-2])
    if value <= 0:
        raise ValueError(f"the bandwidth must be > 0, got {text!r}")
    return float(value)


def _parse_latency(text: str) -> float:
    got = split_number(text)
    if got is None or got[1] not in _TIME_UNITS:
        raise ValueError(f"expected a latency such as 1ms, 100us or 0.002s, got {text!r}")
    return got[0] * _TIME_UNITS[got[1]]


def _format_bytes(n: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n:g}B"


def _format_rate(bps: float) -> str:
    for unit, size in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bps >= size:
            return f"{bps / size:.4g}{unit}"
    return f"{bps:g}B/s"


@dataclass(frozen=True)
class TierSpec:
    """One simulated external KV tier: kind, capacity (bytes), bandwidth (bytes/s), latency (s)."""

    kind: str
    capacity_bytes: int
    bandwidth: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidInputError(f"tier kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.capacity_bytes, int) or self.capacity_bytes <= 0:
            raise InvalidInputError(f"tier capacity must be a positive number of bytes, got {self.capacity_bytes!r}")
        if not self.bandwidth > 0:
            raise InvalidInputError(f"tier bandwidth must be > 0 bytes/s, got {self.bandwidth!r}")
        if not self.latency_s >= 0:
            raise InvalidInputError(f"tier latency must be >= 0 s, got {self.latency_s!r}")

    @classmethod
    def parse(cls, text: str) -> TierSpec:
        """``KIND:SIZE[@BANDWIDTH][@LATENCY]`` (docs/SIMULATOR.md, "The tier model"); ``InvalidInputError``
        with the reason."""
        spec = text.strip()
        head, *extras = spec.split("@")
        kind, sep, size = head.partition(":")
        kind = ALIASES.get(kind.strip().lower(), kind.strip().lower())
        if not sep or kind not in KINDS or not size.strip():
            raise InvalidInputError(
                f"tier {text!r}: expected KIND:SIZE[@BANDWIDTH][@LATENCY] with KIND one of host, disk, net "
                f"(or redis), e.g. host:64GiB, disk:1TiB@5GB/s, net:256GiB@3GB/s@1ms"
            )
        try:
            capacity = parse_bytes(size)
            if capacity <= 0:
                raise ValueError(f"the size must be > 0 bytes, got {size!r}")
            bandwidth = DEFAULT_BANDWIDTH[kind]
            latency = DEFAULT_LATENCY_S[kind]
            seen: set[str] = set()
            for extra in extras:
                what = "bandwidth" if "/" in extra else "latency"
                if what in seen:
                    raise ValueError(f"{what} given twice")
                seen.add(what)
                if what == "bandwidth":
                    bandwidth = _parse_bandwidth(extra)
                else:
                    try:
                        latency = _parse_latency(extra)
                    except ValueError:
                        raise ValueError(f"expected @BANDWIDTH (e.g. @25GB/s) or @LATENCY (e.g. @1ms), "
                                         f"got @{extra}") from None
        except ValueError as exc:
            raise InvalidInputError(f"tier {text!r}: {exc}") from None
        return cls(kind, capacity, bandwidth, latency)

    @property
    def medium(self) -> str:
        """The medium its KV events name: ``CPU`` (host), ``STORAGE`` (disk), ``NET`` (a network store
        every replica of a cluster shares)."""
        return TIER_MEDIA[self.kind]

    @property
    def label(self) -> str:
        """The spec written back: ``host:64GiB@25GB/s`` (latency shown when not 0)."""
        text = f"{self.kind}:{_format_bytes(self.capacity_bytes)}@{_format_rate(self.bandwidth)}"
        if self.latency_s >= 1e-3:
            text += f"@{self.latency_s * 1e3:.4g}ms"
        elif self.latency_s:
            text += f"@{self.latency_s * 1e6:.4g}us"
        return text


def parse_tiers(text: str) -> tuple[TierSpec, ...]:
    """Tiers joined by ``+`` (``host:64GiB+disk:1TiB``), or ``none`` / empty for no tier."""
    t = text.strip()
    if t.lower() in ("", "none", "off"):
        return ()
    return tuple(TierSpec.parse(part) for part in t.split("+"))


def tier_arg(text: str) -> TierSpec:
    """argparse ``type`` of ``--tier``: a bad spec exits with status 2 and the reason."""
    try:
        return TierSpec.parse(text)
    except InvalidInputError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def group_block_bytes(manager: KVCacheManager) -> dict[int, int]:
    """Nominal bytes of one block of each group: its layers times the unpadded page of one layer."""
    return {i: max(1, len(g.layer_names)) * g.spec.real_page_size_bytes
            for i, g in enumerate(manager.layout.groups)}


def _no_payload(_group: int, _block: int) -> bytes:
    return b""


def _no_write(_group: int, _block: int, _payload: bytes) -> None:
    return None


class SimClock:
    """The simulated time, which the simulator advances step by step."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0


class SimLoad(PendingLoad):
    """A tier load that finishes at simulated time ``ready_at`` (its bytes at the serving tiers'
    bandwidth plus their latency after it started)."""

    __slots__ = ("start_token", "fetched", "ready_at", "clock")

    def __init__(self, fetched: FetchedKV, ready_at: float, clock: SimClock) -> None:
        self.start_token = fetched.start_token
        self.fetched = fetched
        self.ready_at = ready_at
        self.clock = clock

    def done(self) -> bool:
        return self.clock.now >= self.ready_at

    def result(self) -> FetchedKV:
        return self.fetched


class SimConnector(KVConnector):
    """The real ``KVConnector`` (lookups, fetches, stores, windows, promotion, storage policy) with
    simulated time for loads, placeholder values (``PlaceholderCodec``, the default ``codec``: a
    ``SimTier`` keeps no payload, so framing millions of blocks would only cost time) and raw hash
    bytes in the tier keys (a key never leaves the process).

    ``start_load`` reads at once and returns a ``SimLoad`` ready after the load's simulated
    duration (``async_loads``; else ready at once, and the simulator adds the duration to the step
    that admits the request). A load longer than ``load_timeout_s`` is a miss, ready at the timeout.
    """

    def __init__(self, tiers: Sequence[SimTier], manager: KVCacheManager, *, clock: SimClock,
                 block_bytes: Mapping[int, int], async_loads: bool = True, load_timeout_s: float | None = None,
                 **kw: Any) -> None:
        kw.setdefault("codec", PlaceholderCodec())
        super().__init__(tiers, manager, **kw)
        self.clock = clock
        self.block_bytes = dict(block_bytes)
        self.async_loads = async_loads
        self.load_timeout_s = load_timeout_s
        self.sim_tiers = list(tiers)

    def write(self, fetched: FetchedKV, block_tables: BlockTables, write_block: WriteBlock) -> int:
        """``KVConnector.write`` for simulated payloads, which hold no KV: the same check that
        ``allocate`` gave every fetched block one (in one pass; a missing one is reported as
        ``KVConnector.write`` reports it) and the same counts; ``write_block`` is not called."""
        blocks = [block_tables[g][i] if i < len(block_tables[g]) else NULL_BLOCK for g, i in fetched.payloads]
        if NULL_BLOCK in blocks:
            return super().write(fetched, block_tables, write_block)
        self._count_written(fetched)
        return fetched.num_tokens

    def load_seconds(self, fetched: FetchedKV) -> float:
        """Simulated seconds to load ``fetched``: per serving tier, its bytes at its bandwidth plus its latency."""
        nbytes = [0] * len(self.sim_tiers)
        for (group, _index), payload in fetched.payloads.items():
            nbytes[payload[0]] += self.block_bytes[group]
        return sum(n / t.spec.bandwidth + t.spec.latency_s for n, t in zip(nbytes, self.sim_tiers) if n)

    def start_load(self, seq: KVSequence, local_hit_tokens: int, max_tokens: int | None = None) -> PendingLoad:
        fetched = super().start_load(seq, local_hit_tokens, max_tokens).result()
        now = self.clock.now
        if not self.async_loads or not fetched.num_tokens:
            return SimLoad(fetched, now, self.clock)
        seconds = self.load_seconds(fetched)
        if self.load_timeout_s is not None and seconds > self.load_timeout_s:
            self._fault("timeout", "a simulated tier load outlasted its timeout")
            return SimLoad(FetchedKV(fetched.seq_id, fetched.start_token, 0, {}), now + self.load_timeout_s,
                           self.clock)
        return SimLoad(fetched, now + seconds, self.clock)

    def key(self, group: int, block_hash: bytes) -> bytes:
        """A simulated tier's key: the group's tier-key prefix and the raw hash bytes (a key never
        leaves the process, so the hex of ``frame.tier_key`` would only cost time)."""
        return self._prefix[group] + block_hash

    def keys_of(self, group: int, block_hashes: Iterable[bytes]) -> list[bytes]:
        prefix = self._prefix[group]
        return [prefix + h for h in block_hashes]

    def parse_key(self, key: bytes) -> tuple[int, bytes]:
        """The group and block hash a simulated tier key (``key``) names."""
        group = int(tier_key_group(key))
        return group, key[len(self._prefix[group]):]


class SimTiers:
    """The simulated tiers of one run behind the real ``KVConnector``, and their load-time accounting."""

    def __init__(self, specs: Sequence[TierSpec], manager: KVCacheManager, namespace: str, *,
                 storage: StoragePolicy | None = None, async_loads: bool = True,
                 load_timeout_s: float | None = None) -> None:
        """``storage``: what the tiers keep (default ``StoreSpansSpill()``). ``async_loads``: a request
        waits for its load while others run (else the load's time is added to the step that admits it)."""
        if not specs:
            raise InvalidInputError("SimTiers needs at least one tier")
        self.manager = manager
        self.block_bytes = group_block_bytes(manager)
        self.tiers = [SimTier(s, i, self.block_bytes) for i, s in enumerate(specs)]
        self.clock = SimClock()
        self.async_loads = async_loads
        # A SimTier answers with a 1-byte payload (the tier's index), not a block of KV.
        self.connector = SimConnector(self.tiers, manager, clock=self.clock, block_bytes=self.block_bytes,
                                      async_loads=async_loads, load_timeout_s=load_timeout_s, namespace=namespace,
                                      payload_bytes=dict.fromkeys(self.block_bytes, 1), storage=storage)
        self.hash_block_size = manager.hash_block_size
        n = len(self.tiers)
        self.loaded_blocks = [0] * n
        """Blocks each tier served to admitted sequences."""
        self.loaded_bytes = [0] * n
        self.load_s = [0.0] * n
        self.loaded_seqs = [0] * n

    def admit(self, external: Mapping[str, Any]) -> float:
        """Seconds to add to the step for what its admissions loaded (``SchedulerOutput.external``):
        0 with asynchronous loads (the requests waited for them), else the loads' duration.

        Also writes the fetched blocks through the connector (no bytes move), as the engine does.
        """
        total = 0.0
        n = len(self.tiers)
        for sid, fetched in external.items():
            assert isinstance(fetched, FetchedKV)
            blocks = [0] * n
            nbytes = [0] * n
            payloads = fetched.payloads  # (group, index) -> the serving tier's one-byte tag
            for (group, tag), count in Counter(zip(map(itemgetter(0), payloads), payloads.values())).items():
                blocks[tag[0]] += count
                nbytes[tag[0]] += count * self.block_bytes[group]
            for t, tier in enumerate(self.tiers):
                if blocks[t]:
                    s = nbytes[t] / tier.spec.bandwidth + tier.spec.latency_s
                    self.loaded_blocks[t] += blocks[t]
                    self.loaded_bytes[t] += nbytes[t]
                    self.loaded_seqs[t] += 1
                    self.load_s[t] += s
                    total += s
            self.connector.write(fetched, self.manager.block_table(sid), _no_write)
        return 0.0 if self.async_loads else total

    def store(self, seq: Any, start: int, num_tokens: int) -> None:
        """Write-through of the full blocks a step computed, tokens ``[start, start + num_tokens)``."""
        bs = self.hash_block_size
        if (start + num_tokens) // bs > start // bs:  # a block was completed
            self.connector.store(seq, start + num_tokens, _no_payload, start)

    def summary(self) -> dict[str, Any]:
        """Per tier figures, keyed ``"<index>:<kind>"`` (see ``simulator`` for the keys)."""
        out: dict[str, Any] = {}
        for t, tier in enumerate(self.tiers):
            st = tier.stats
            out[f"{t}:{tier.name}"] = {
                "spec": tier.spec.label,
                "capacity_bytes": tier.capacity_bytes,
                "bandwidth_bytes_per_s": tier.spec.bandwidth,
                "latency_s": tier.spec.latency_s,
                "loaded_blocks": self.loaded_blocks[t],
                "loaded_bytes": self.loaded_bytes[t],
                "loaded_sequences": self.loaded_seqs[t],
                "load_s": self.load_s[t],
                "read_hits": st.hits,
                "read_misses": st.misses,
                "stored_blocks": st.puts,
                "stored_bytes": st.bytes_written,
                "evictions": st.evictions,
                "used_bytes": tier.used_bytes,
                "entries": len(tier),
                "low_entries": tier.low_priority_entries(),
                "low_puts": st.low_puts,
                "low_evictions": st.low_evictions,
                "low_skipped": st.low_skipped,
                "low_promotions": st.low_promotions,
            }
        return out

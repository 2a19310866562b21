"""Checks of the engine's command-line options that need no weights, run before the model loads.

A mistake the options alone reveal is reported as one line naming the flag, before a load of up
to a minute. See docs/ENGINE.md, "Checks before the model loads".
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from hybridkv.errors import InvalidInputError

MODEL_PRESET = "gemma-3-270m"
"""The planner preset with the embedded model's layer shapes."""


def _tiers(args: argparse.Namespace) -> list[tuple[str, str]]:
    """``(flag, spec)`` of every external tier the options name."""
    tiers = [("--kv-tier", spec) for spec in getattr(args, "kv_tier", None) or []]
    if getattr(args, "kv_store", None):
        tiers.append(("--kv-store", args.kv_store))
    return tiers


def check_tiers(args: argparse.Namespace) -> None:
    """Each ``--kv-tier``/``--kv-store`` parses, and a shared one (Redis) has a tier key and the redis package."""
    from hybridkv.connectors.auth import KEY_ENV, KEY_FILE_ENV, MIN_KEY_BYTES, environment_key
    from hybridkv.engine.tiers import tier_parts

    for flag, spec in _tiers(args):
        try:
            kind, _, _ = tier_parts(spec)
        except InvalidInputError as exc:
            raise InvalidInputError(f"{flag} {spec!r}: {str(exc).split(': ', 1)[-1]}") from None
        if kind != "redis":
            continue
        if environment_key() is None:
            raise InvalidInputError(
                f"{flag} {spec}: a store shared between instances needs a tier key that signs its entries: set "
                f"{KEY_ENV} (at least {MIN_KEY_BYTES} characters) or {KEY_FILE_ENV} to the same secret on every "
                f"instance")
        import redis  # noqa: F401  # a missing package is the 'tiers' extra's one line (hybridkv.cli)


def layout_minimum(config: Any) -> int:
    """The smallest ``kv_cache_memory`` in bytes that holds one request of ``config.max_model_len`` tokens
    on the embedded model (the engine's layout plan on its layer shapes)."""
    import torch

    from hybridkv.core import capacity_report, plan_layout
    from hybridkv.engine.config import parse_dtype
    from hybridkv.planning import get_preset
    from hybridkv.planning.hf_config import layer_specs, parse_config

    preset = get_preset(MODEL_PRESET)
    kv_bytes = torch.tensor([], dtype=parse_dtype(config.dtype)).element_size()
    specs = layer_specs(parse_config(dict(preset.config)), block_size=config.block_size, kv_dtype_bytes=kv_bytes)
    roomy = plan_layout(specs, 1 << 50, max_model_len=config.max_model_len,
                        max_num_batched_tokens=config.max_num_batched_tokens)
    report = capacity_report(roomy, max_model_len=config.max_model_len,
                             max_num_batched_tokens=config.max_num_batched_tokens)
    block_bytes = roomy.page_size_bytes * roomy.group_size
    return (sum(report.blocks_per_request) + 1) * block_bytes  # + the null block


def engine_config(args: argparse.Namespace) -> Any:
    """The ``EngineConfig`` of parsed ``add_engine_arguments`` options."""
    from hybridkv.engine.engine import EngineConfig

    names = ("kv_cache_memory", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "retention", "policy")
    options: dict[str, Any] = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    tiers = [*getattr(args, "kv_tier", []), *([args.kv_store] if getattr(args, "kv_store", None) else [])]
    return EngineConfig(model=getattr(args, "model", "gemma-3-270m"), dtype=args.dtype,
                        weights=getattr(args, "weights", "auto"), device=args.device,
                        enable_prefix_caching=not args.no_prefix_caching, kv_tiers=tuple(tiers),
                        enforce_eager=getattr(args, "enforce_eager", False),
                        speculative=getattr(args, "speculative", None),
                        num_speculative_tokens=_speculative_tokens(args),
                        kv_events_endpoint=getattr(args, "kv_events_endpoint", None),
                        kv_events_replay_endpoint=getattr(args, "kv_events_replay_endpoint", None), **options)


def _speculative_tokens(args: argparse.Namespace) -> int:
    """``--num-speculative-tokens`` (4 with ``--speculative`` alone; EngineConfig checks the range)."""
    k = getattr(args, "num_speculative_tokens", None)
    if k is None:
        return 4 if getattr(args, "speculative", None) else 0
    return int(k)


def checked_engine_config(args: argparse.Namespace) -> Any:
    """The ``EngineConfig`` of the options of ``generate``/``serve``/``engine-demo`` once everything about
    them that needs no weights is checked; ``InvalidInputError`` naming the flag otherwise."""
    from hybridkv.planning import get_preset

    if getattr(args, "kv_events_replay_endpoint", None) and not getattr(args, "kv_events_endpoint", None):
        raise InvalidInputError("--kv-events-replay-endpoint needs --kv-events-endpoint")
    check_tiers(args)
    config = engine_config(args)
    if getattr(args, "model", None) not in (None, MODEL_PRESET):
        return config  # another model: its shapes are known once it loads, and the engine checks them then
    context = get_preset(MODEL_PRESET).max_model_len
    if config.max_model_len > context:
        raise InvalidInputError(f"--max-model-len {config.max_model_len} exceeds the model's context of "
                                f"{context} tokens")
    minimum = layout_minimum(config)
    if config.kv_cache_memory < minimum:
        raise InvalidInputError(
            f"--kv-cache-memory of {config.kv_cache_memory:,} bytes holds no request of --max-model-len "
            f"{config.max_model_len} tokens: the minimum at --dtype {config.dtype} is {minimum:,} bytes (e.g. "
            f"--kv-cache-memory {math.ceil(minimum / (1 << 20))}MiB), or give a shorter --max-model-len")
    return config

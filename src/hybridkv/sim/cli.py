"""``hybridkv simulate``: workloads through the real scheduler and manager, timed by a cost model.

What it models, in full: ``docs/SIMULATOR.md``, "hybridkv simulate: tiers, clusters and traces".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

from hybridkv.cli_args import (
    add_recurrent_pages_arg,
    count_arg,
    input_file_arg,
    non_negative_float_arg,
    non_negative_int_arg,
    output_path_arg,
    positive_float_arg,
    positive_int_arg,
    write_output,
)
from hybridkv.cluster.router_cli import add_locality_arguments
from hybridkv.core.hits import LOSS_CAUSES
from hybridkv.errors import InvalidInputError
from hybridkv.sim.cluster import CLUSTER_OPTIONS, OUTCOMES, ROUTERS, ClusterConfig, cluster_variants, simulate_cluster
from hybridkv.sim.simulator import SimConfig, SimResult, simulate
from hybridkv.sim.tiers import parse_tiers, tier_arg
from hybridkv.sim.workloads import (
    Arrivals,
    Bursty,
    ClosedLoop,
    LengthDist,
    Poisson,
    Workload,
    chat_lengths,
    multi_turn_chat,
    shared_prefix,
)
from hybridkv.sizes import size_arg
from hybridkv.terminal import print_table, print_text

SUMMARY_ROWS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("requests finished / rejected", lambda s: f"{s['finished']} / {s['rejected']}"),
    ("simulated time", lambda s: f"{s['duration_s']:.1f} s"),
    ("throughput", lambda s: f"{s['throughput_tokens_per_s']:,.0f} tok/s, {s['throughput_requests_per_s']:.2f} req/s"),
    ("prefix-hit rate (tokens)", lambda s: f"{s['prefix_hit_rate']:.1%}"),
    ("the same, first admissions only (vLLM's count)",
     lambda s: f"{s['first_admission_hit_rate']:.1%} ({s['readmitted_hit_tokens']:,} hit tokens of "
               f"{s['readmissions']} re-admissions left out)"),
    ("hit tokens lost: window / state evicted / not checkpointed",
     lambda s: " / ".join(f"{s['lost_hit_tokens'][c]:,}" for c in LOSS_CAUSES)),
    ("TTFT p50 / p90 / p99", lambda s: f"{s['ttft_p50_s']:.3f} / {s['ttft_p90_s']:.3f} / {s['ttft_p99_s']:.3f} s"),
    ("ITL p50 / p90 / p99", lambda s: f"{s['itl_p50_s'] * 1e3:.1f} / {s['itl_p90_s'] * 1e3:.1f} / "
                                      f"{s['itl_p99_s'] * 1e3:.1f} ms"),
    ("preemptions", lambda s: str(s["preemptions"])),
    ("KV usage mean / max", lambda s: f"{s['kv_usage_mean']:.1%} / {s['kv_usage_max']:.1%}"),
    ("KV capacity", lambda s: f"{s['kv_capacity_tokens']:,} tokens, {s['num_blocks']:,} blocks"),
    ("max concurrency (plan) / peak running", lambda s: f"{s['max_concurrency']} / {s['peak_running']}"),
]

SPEC_ROWS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("speculative tokens / drafts accepted",
     lambda s: f"{s['spec_decode']['num_speculative_tokens']} / {s['spec_decode']['acceptance_rate']:.1%}"),
    ("tokens per decode step", lambda s: f"{s['spec_decode']['tokens_per_step']:.2f}"),
]
"""Rows added to the summary when any variant speculates."""

TIER_ROWS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("KV tiers", lambda s: " + ".join(s["tiers"]) or "none"),
    ("tier / total hit rate (tokens)", lambda s: f"{s['tier_hit_rate']:.1%} / {s['total_hit_rate']:.1%}"),
    ("tokens loaded from tiers", lambda s: f"{s['tier_hit_tokens']:,}"),
    ("loaded per tier (GB)", lambda s: ", ".join(f"{k.split(':', 1)[1]} {v['loaded_bytes'] / 1e9:,.1f}"
                                                 for k, v in s["tier_stats"].items()) or "-"),
    ("tier load time (all loads)", lambda s: f"{s['tier_load_s']:.2f} s ({s['tier_loads']})" if s["tiers"] else "-"),
    ("tier storage / bytes written",
     lambda s: f"{s['tier_storage']} / {s['tier_stored_bytes'] / 2**30:,.1f} GiB" if s["tiers"] else "-"),
]
"""Rows added to the summary when any variant has tiers."""


CLUSTER_ROWS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("replicas / router", lambda s: f"{s['instances']} / {s['router']}"),
    ("requests per replica (min - max)", lambda s: f"{min(s['routed'].values())} - {max(s['routed'].values())}"),
    ("hit found =, <, > prediction", lambda s: f"{s['prediction_equal']}, {s['prediction_over']}, "
                                               f"{s['prediction_under']}"),
    ("chain-only index over-predicts", lambda s: f"{s['chain_over_requests']} requests, "
                                                 f"{s['chain_over_tokens']:,} tokens"),
    ("routing decided by", lambda s: ", ".join(f"{k} {v}" for k, v in sorted(s["decisions"].items()))),
]
"""Rows added to the summary of a cluster (``--instances``)."""


RETENTION_SENTENCE = ("retention=none is plain LRU: the sliding-window blocks a shared prefix needs are freed as "
                      "the window moves and evicted first, so the prefix stops hitting; retention=window keeps the "
                      "window blocks at the end of a shared prefix for as long as its full-attention blocks stay "
                      "cached.")
"""Printed under a comparison of the two retention policies."""


def add_parser(sub: Any) -> None:
    """Register the ``simulate`` subcommand."""
    p = sub.add_parser(
        "simulate", help="simulate a workload on a model + GPU with the real scheduler and manager",
        description="Run a workload through the real scheduler and KV-cache manager, timed by a GPU cost model. "
                    "Give a workload: --workload shared-prefix|multi-turn|chat, or --workload trace --trace FILE.",
    )
    _system_arguments(p.add_argument_group("the simulated system"))
    _cluster_arguments(p.add_argument_group("a cluster of replicas (sim.cluster)"))
    _workload_arguments(p.add_argument_group("the workload"))
    _output_arguments(p.add_argument_group("output"))
    p.set_defaults(func=run)


def _system_arguments(system: Any) -> None:
    """The model, GPU, engine and pool options."""
    system.add_argument("--model", default="gemma-3-27b",
                        help="preset id (hybridkv plan --list-models) or path to a Hugging Face config.json")
    system.add_argument("--num-params", type=count_arg, default=None, metavar="COUNT",
                        help="parameter count of a config.json model, e.g. 27e9 or 27B (presets know theirs)")
    system.add_argument("--gpu", default="h100-80gb", help="GPU preset (hybridkv plan --help lists them)")
    system.add_argument("--tp", type=positive_int_arg, default=1, help="tensor parallel size")
    system.add_argument("--max-model-len", type=positive_int_arg, default=None, metavar="TOKENS",
                        help="longest request (default: the model's max context)")
    system.add_argument("--max-num-batched-tokens", type=positive_int_arg, default=8192, metavar="TOKENS",
                        help="tokens one engine step computes at most")
    system.add_argument("--max-num-seqs", type=positive_int_arg, default=256, help="sequences running at once at most")
    system.add_argument("--long-prefill-threshold", type=non_negative_int_arg, default=0, metavar="TOKENS",
                        help="cap on one prefill chunk (0: no cap)")
    system.add_argument("--retention", choices=("none", "window"), default="window",
                        help="none: freed blocks in plain LRU order; window: keep the sliding-window blocks a "
                             "cached prefix needs")
    system.add_argument("--admission", choices=("max_utilization", "guaranteed_no_preemption"),
                        default="max_utilization",
                        help="admit when the prompt fits now, or only when every admitted request can grow "
                             "to its output length")
    system.add_argument("--policy", choices=("fcfs", "priority"), default="fcfs", help="order of the waiting queue")
    system.add_argument("--no-prefix-caching", action="store_true", help="turn prefix caching off")
    system.add_argument("--kv-cache-tokens", type=positive_int_arg, default=None, metavar="TOKENS",
                        help="size the pool to this many tokens instead of from GPU memory")
    system.add_argument("--kv-cache-memory", type=size_arg, default=None, metavar="SIZE",
                        help="size the pool for this KV budget (e.g. 48MiB) as the reference engine plans it")
    system.add_argument("--weights-dtype", default="bf16", choices=("fp32", "bf16", "fp16", "fp8", "int4"),
                        help="dtype of the weights")
    system.add_argument("--kv-dtype", default="bf16", choices=("fp32", "bf16", "fp16", "fp8"),
                        help="dtype of the KV cache")
    system.add_argument("--block-size", type=positive_int_arg, default=16, metavar="TOKENS",
                        help="tokens per attention KV block (hits end at multiples of it; on a recurrent hybrid a "
                             "larger block also means fewer pages per state and less manager work per step)")
    add_recurrent_pages_arg(system)
    system.add_argument("--calibration", default=None, metavar="PATH",
                        help="fit the cost model to measured steps in this JSON file (default: the GPU's "
                             "built-in profile, h100-80gb only; other GPUs use data-sheet peaks); 'data-sheet': "
                             "the one-roofline data-sheet model on any GPU (how figures before the profiles were "
                             "timed)")
    system.add_argument("--lm-head", choices=("per_token", "per_sample"), default=None,
                        help="charge the output projection per new token (generic) or per sampled sequence "
                             "(default: per sampled sequence under a calibrated profile, else per token)")
    _tier_arguments(system)


def _tier_arguments(system: Any) -> None:
    """The KV tier and speculative decoding options."""
    system.add_argument("--tier", type=tier_arg, action="append", default=None, metavar="SPEC",
                        help="external KV tier, queried in the order given (repeatable): "
                             "KIND:SIZE[@BANDWIDTH][@LATENCY] with KIND host (default 25GB/s), disk (5GB/s, "
                             "100us) or net/redis (3GB/s, 1ms), e.g. host:64GiB, disk:1TiB@7GB/s; per GPU")
    system.add_argument("--tier-storage", choices=("spans+spill", "hit-spans", "all"), default="spans+spill",
                        help="what tiers keep: hit-spans (growing layers every block, window/chunk layers only "
                             "around checkpoints), spans+spill (hit-spans, and every other block at low "
                             "priority: evicted first, kept while there is room) or all (every layer of every "
                             "block)")
    system.add_argument("--tier-checkpoint-interval", type=non_negative_int_arg, default=0, metavar="TOKENS",
                        help="with hit-spans or spans+spill: also keep a window checkpoint every TOKENS tokens "
                             "(0: none)")
    system.add_argument("--tier-end-align", type=positive_int_arg, default=None, metavar="TOKENS",
                        help="with hit-spans or spans+spill: the prompt-end checkpoint at the prompt's length rounded "
                             "down to a multiple of TOKENS (default: a Mooncake trace's 512-token blocks, else the hit "
                             "alignment)")
    system.add_argument("--tier-loads", choices=("async", "blocking"), default="async",
                        help="async: a request waits for its tier load while others run; blocking: the load's "
                             "time is added to the step that admits it")
    system.add_argument("--tier-load-timeout", type=positive_float_arg, default=None, metavar="SECONDS",
                        help="a tier load longer than this is a miss (the prompt is computed)")
    system.add_argument("--speculative-tokens", type=non_negative_int_arg, default=0, metavar="K",
                        help="speculative decoding: each decode step verifies K draft tokens (at most 16; with "
                             "recurrent state, its block size less one: 15 with 16-token blocks; admission reserves "
                             "K draft slots per request); needs --acceptance-rate")
    system.add_argument("--acceptance-rate", type=non_negative_float_arg, default=None, metavar="A",
                        help="with --speculative-tokens: the probability that a draft is accepted, drafts after the "
                             "first rejection are lost (seeded by --seed)")


def _cluster_arguments(cl: Any) -> None:
    """The cluster's options (``--instances`` and routing)."""
    cl.add_argument("--instances", type=positive_int_arg, default=None, metavar="N",
                    help="simulate N replicas of the engine behind a router (each its own device pool; net tiers "
                         "are shared by all, host and disk tiers are per replica)")
    cl.add_argument("--router", choices=ROUTERS, default=None,
                    help="with --instances: how requests are routed (default hybrid_exact: the least prefill "
                         "work before the first token, the hit predicted on the device and the tiers, among the "
                         "replicas not overloaded; prefix: hit of the full-attention chain against queue length)")
    add_locality_arguments(cl, "replica")
    cl.add_argument("--load-weight", type=non_negative_float_arg, default=0.25, metavar="FRACTION",
                    help="prefix, least_loaded: what one queued request weighs against a predicted hit, as a "
                         "fraction of the request's prompt")
    cl.add_argument("--kv-weight", type=non_negative_float_arg, default=0.0, metavar="FRACTION",
                    help="prefix, least_loaded: what a full KV cache weighs against a predicted hit, as a "
                         "fraction of the request's prompt")
    cl.add_argument("--index-device-only", action="store_true",
                    help="feed the router's index device events only (default: the tiers' too)")
    cl.add_argument("--explain", action="store_true",
                    help="join each routing decision with what every replica held, and print where requests' "
                         "reusable tokens were and what sent them elsewhere")


def _workload_arguments(work: Any) -> None:
    """The workload options."""
    work.add_argument("--workload", choices=("shared-prefix", "multi-turn", "chat", "trace"), required=True,
                      help="shared-prefix: requests over a few long shared prefixes; multi-turn: conversations "
                           "whose turns extend each other; chat: chat-like lengths; trace: a JSONL file (--trace)")
    work.add_argument("--trace", type=input_file_arg, default=None, metavar="PATH",
                      help="JSONL trace (with --workload trace)")
    work.add_argument("--trace-format", choices=("hybridkv", "mooncake"), default=None,
                      help="the trace's format: hybridkv (default) or mooncake (Mooncake FAST'25 traces: "
                           "timestamp in ms, input_length, output_length, hash_ids of 512-token blocks)")
    work.add_argument("--mark-last-block", action="store_true",
                      help="mooncake trace: a prompt's partial last block starts at a checkpoint hint, where a "
                           "longer prompt continuing it parts (a conversation's next turn): a recurrent hybrid "
                           "checkpoints its state there, and tiers store there")
    work.add_argument("--time-scale", type=positive_float_arg, default=None, metavar="S",
                      help="trace: replay the logged arrival times multiplied by S (open loop; 0.5 is twice as "
                           "fast)")
    work.add_argument("--requests", type=positive_int_arg, default=None,
                      help="requests (shared-prefix, chat; default 600); with a trace: its first N requests")
    work.add_argument("--prefixes", type=positive_int_arg, default=30, help="distinct shared prefixes (shared-prefix)")
    work.add_argument("--prefix-len", type=positive_int_arg, default=2048, metavar="TOKENS",
                      help="tokens of each shared prefix (shared-prefix)")
    work.add_argument("--suffix-len", type=positive_int_arg, default=256, metavar="TOKENS",
                      help="unique tokens after the prefix (shared-prefix), median user turn (multi-turn)")
    work.add_argument("--output-len", type=positive_int_arg, default=128, metavar="TOKENS",
                      help="tokens generated per request")
    work.add_argument("--popularity", choices=("uniform", "zipf"), default="uniform",
                      help="how requests pick their prefix (shared-prefix)")
    work.add_argument("--conversations", type=positive_int_arg, default=100, help="conversations (multi-turn)")
    work.add_argument("--turns", type=positive_int_arg, default=4, help="turns per conversation (multi-turn)")
    work.add_argument("--system-prompt-len", type=positive_int_arg, default=1024, metavar="TOKENS",
                      help="shared system prompt (multi-turn)")
    work.add_argument("--rate", type=positive_float_arg, default=None, metavar="REQ_PER_S",
                      help="Poisson arrivals at this rate (open loop; default: a closed loop of --concurrency; "
                           "not with --concurrency)")
    work.add_argument("--burstiness", type=positive_float_arg, default=None,
                      help="with --rate: bursty (gamma) arrivals, < 1 burstier than Poisson")
    work.add_argument("--concurrency", type=positive_int_arg, default=None,
                      help="requests in flight in the closed loop (not with --rate; default 64); with a trace: "
                           "replay it as a closed loop of this many, ignoring its arrival times")
    work.add_argument("--seed", type=int, default=0, help="random seed of the workload")


def _output_arguments(out: Any) -> None:
    """What is written, and the variants compared."""
    out.add_argument("--compare", default=None, metavar="OPTION=V1,V2",
                     help="run variants side by side, e.g. retention=none,window or tier=none,host:64GiB+disk:1TiB")
    out.add_argument("--json", type=output_path_arg, default=None, metavar="PATH",
                     help="write the summary as JSON to PATH ('-' for stdout)")
    out.add_argument("--plot", type=output_path_arg, default=None, metavar="PATH",
                     help="write KV usage and hit rate over time and the TTFT CDF to a PNG (needs the sim extra)")
    out.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

def _arrivals(args: argparse.Namespace) -> Arrivals:
    if args.rate is not None and args.concurrency is not None:
        raise InvalidInputError(f"give --rate {args.rate:g} (open loop: arrivals at that rate) or --concurrency "
                                f"{args.concurrency} (closed loop: that many requests in flight), not both")
    if args.burstiness is not None and args.rate is None:
        raise InvalidInputError("--burstiness shapes the arrivals of --rate: give --rate REQ_PER_S with it")
    if args.rate is None:
        return ClosedLoop(args.concurrency or 64)
    if args.burstiness is not None:
        return Bursty(rate=args.rate, burstiness=args.burstiness)
    return Poisson(args.rate)


def build_workload(args: argparse.Namespace) -> Workload:
    """The workload the options describe."""
    if args.trace and args.workload != "trace":
        raise InvalidInputError(f"--trace is read only with --workload trace, not --workload {args.workload}")
    if args.workload == "trace":
        return _trace_workload(args)
    for option, value in (("--trace-format", args.trace_format), ("--time-scale", args.time_scale),
                          ("--mark-last-block", args.mark_last_block or None)):
        if value is not None:
            raise InvalidInputError(f"{option} applies to --workload trace, not --workload {args.workload}")
    requests = args.requests or 600
    arrivals = _arrivals(args)
    if args.workload == "shared-prefix":
        return shared_prefix(requests, args.prefixes, args.prefix_len, args.suffix_len,
                             max_new_tokens=args.output_len, popularity=args.popularity, arrivals=arrivals,
                             seed=args.seed)
    if args.workload == "multi-turn":
        return multi_turn_chat(args.conversations, args.turns, system_prompt_len=args.system_prompt_len,
                               user_len=LengthDist(median=max(1, args.suffix_len), sigma=0.5, min_len=1),
                               max_new_tokens=args.output_len, arrivals=arrivals, seed=args.seed)
    return chat_lengths(requests, arrivals=arrivals, seed=args.seed)


def _trace_workload(args: argparse.Namespace) -> Workload:
    """The trace the options name, replayed as they say (first N requests, time scale, closed loop)."""
    if not args.trace:
        raise InvalidInputError("--workload trace needs --trace PATH")
    if args.rate is not None or args.burstiness is not None:
        raise InvalidInputError("a trace brings its own arrivals: use --time-scale S or --concurrency C, not --rate")
    if args.time_scale is not None and args.concurrency is not None:
        raise InvalidInputError("give --time-scale (open loop at the trace's arrivals) or --concurrency "
                                "(closed loop), not both")
    if args.trace_format == "mooncake":
        from hybridkv.sim.mooncake import read_mooncake

        return read_mooncake(args.trace, time_scale=args.time_scale or 1.0, concurrency=args.concurrency,
                             limit=args.requests, mark_last_block=args.mark_last_block)
    if args.mark_last_block:
        raise InvalidInputError("--mark-last-block reads a Mooncake trace's blocks: give --trace-format mooncake")
    from hybridkv.sim.trace import read_trace, replay

    return replay(read_trace(args.trace), limit=args.requests, time_scale=args.time_scale,
                  concurrency=args.concurrency)


def sim_config(args: argparse.Namespace) -> SimConfig:
    """The simulated system the options describe."""
    return SimConfig(model=args.model, gpu=args.gpu, tensor_parallel_size=args.tp, max_model_len=args.max_model_len,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                     long_prefill_token_threshold=args.long_prefill_threshold, retention=args.retention,
                     admission=args.admission, policy=args.policy, enable_prefix_caching=not args.no_prefix_caching,
                     kv_cache_tokens=args.kv_cache_tokens, kv_cache_memory=args.kv_cache_memory,
                     weights_dtype=args.weights_dtype, kv_dtype=args.kv_dtype, calibration=args.calibration,
                     lm_head=args.lm_head, tiers=tuple(args.tier or ()), num_params=args.num_params,
                     tier_storage=args.tier_storage, tier_checkpoint_interval=args.tier_checkpoint_interval,
                     tier_end_align=args.tier_end_align, tier_loads=args.tier_loads,
                     tier_load_timeout_s=args.tier_load_timeout, recurrent_pages=args.recurrent_pages,
                     block_size=args.block_size, speculative_tokens=args.speculative_tokens,
                     acceptance_rate=_acceptance_rate(args), speculative_seed=args.seed)


def _acceptance_rate(args: argparse.Namespace) -> float:
    """``--acceptance-rate``, required with ``--speculative-tokens`` (0.0 without speculation)."""
    if args.acceptance_rate is None:
        if args.speculative_tokens:
            raise InvalidInputError(f"--speculative-tokens {args.speculative_tokens} needs --acceptance-rate A "
                                    f"(the probability that a draft is accepted, e.g. 0.7)")
        return 0.0
    return float(args.acceptance_rate)


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_OPTIONAL_INTS = ("max_model_len", "kv_cache_tokens", "kv_cache_memory", "gpu_memory_bytes", "tier_end_align")


def variants(base: SimConfig, compare: str | None) -> list[tuple[str, SimConfig]]:
    """``[(label, config)]``: the base alone, or one variant per value of ``OPTION=V1,V2``.

    ``tier`` (or ``tiers``) takes tier sets: ``none`` or specs joined by ``+`` (``sim.tiers``)."""
    if not compare:
        return [("", base)]
    if "=" not in compare:
        raise InvalidInputError(f"--compare expects OPTION=V1,V2, got {compare!r}")
    key, values = compare.split("=", 1)
    name = key.strip().replace("-", "_")
    if name in ("tier", "tiers"):
        return [(f"tier={raw.strip()}", replace(base, tiers=parse_tiers(raw))) for raw in values.split(",")]
    known = {f.name: f for f in fields(SimConfig)}
    if name not in known:
        raise InvalidInputError(f"--compare: unknown option {key!r}; known: {', '.join(known)}")
    current = getattr(base, name)
    out = []
    for raw in values.split(","):
        raw = raw.strip()
        value: Any = raw
        if isinstance(current, bool) and raw.lower() not in _TRUE + _FALSE:
            raise InvalidInputError(f"--compare {key}: {raw!r} is not one of {', '.join(_TRUE + _FALSE)}")
        try:
            if isinstance(current, bool):
                value = raw.lower() in _TRUE
            elif isinstance(current, int) or name in _OPTIONAL_INTS:
                value = int(raw)
            elif isinstance(current, float):
                value = float(raw)
        except ValueError:
            raise InvalidInputError(f"--compare {key}: {raw!r} is not a number") from None
        out.append((f"{name}={raw}", replace(base, **{name: value})))
    return out


def cluster_config(args: argparse.Namespace) -> ClusterConfig | None:
    """The cluster the options describe (None: one engine)."""
    if args.instances is None:
        if args.router is not None:
            raise InvalidInputError("--router needs --instances N (the replicas it routes to)")
        return None
    return ClusterConfig(instances=args.instances, router=args.router or "hybrid_exact",
                         load_weight=args.load_weight, kv_weight=args.kv_weight, balance=args.balance,
                         slack=args.slack, home_tokens=args.home_tokens, miss_weight=args.miss_weight,
                         junction_weight=args.junction_weight,
                         index_tiers=not args.index_device_only,
                         explain=args.explain)


def _variants(args: argparse.Namespace) -> list[tuple[str, SimConfig, ClusterConfig | None]]:
    """``[(label, system, cluster)]`` for each variant ``--compare`` asks for (router and cluster options
    vary the cluster, the others the simulated system)."""
    base = sim_config(args)
    cluster = cluster_config(args)
    key = (args.compare or "").split("=", 1)[0].strip().replace("-", "_")
    if key in CLUSTER_OPTIONS:
        if cluster is None:
            raise InvalidInputError(f"--compare {key}=...: needs --instances N (a cluster to route in)")
        return [(label, base, c) for label, c in cluster_variants(cluster, args.compare)]
    if cluster is not None and args.plot:
        raise InvalidInputError("--plot draws one engine's timeline; a cluster (--instances) has none")
    return [(label, cfg, cluster) for label, cfg in variants(base, args.compare)]


def _progress(label: str, enabled: bool) -> Callable[[int, int], None] | None:
    if not enabled:
        return None
    state = {"t": 0.0}
    tty = sys.stderr.isatty()

    def report(done: int, total: int) -> None:
        now = time.perf_counter()
        if not tty:  # a log file gets one line per variant, not a redrawn bar
            if done == total:
                sys.stderr.write(f"{label}: {done}/{total} requests simulated\n")
            return
        if done == total or now - state["t"] > 0.2:
            state["t"] = now
            width = 30
            filled = int(width * done / total)
            sys.stderr.write(f"\r{label:<24} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}")
            if done == total:
                sys.stderr.write("\n")
            sys.stderr.flush()

    return report


def run(args: argparse.Namespace) -> int:
    """Simulate, print the summary (side by side for ``--compare``), write JSON / plot."""
    if args.plot:
        from hybridkv.sim.plot import require_matplotlib

        require_matplotlib()  # before the simulation, not after it
    workload = build_workload(args)
    if not workload.requests:
        raise InvalidInputError(f"--trace {args.trace}: the trace holds no requests" if args.workload == "trace"
                                else f"--workload {args.workload}: no requests to simulate")
    configs = _variants(args)
    results: list[tuple[str, SimResult]] = []
    show = not args.no_progress
    for label, cfg, cluster in configs:
        t0 = time.perf_counter()
        report = _progress(label or "simulating", show)
        res = (simulate(workload, cfg, progress=report) if cluster is None
               else simulate_cluster(workload, cfg, cluster, progress=report))
        res.summary["wall_s"] = time.perf_counter() - t0
        results.append((label, res))
    idle = [(label, _why_none_finished(res)) for label, res in results if not res.summary["finished"]]
    if len(idle) == len(results):
        raise InvalidInputError(idle[0][1])
    if args.json:
        doc: Any = results[0][1].summary if len(results) == 1 else {lbl: r.summary for lbl, r in results}
        text = json.dumps(doc, indent=2)
        if args.json == "-":
            print(text)
        else:
            write_output(args.json, text + "\n")
    if args.json != "-":
        print_summary(workload, results)
        if {cfg.retention for _, cfg, _ in configs} == {"none", "window"}:
            print_text(RETENTION_SENTENCE)
    if args.plot:
        from hybridkv.sim.plot import plot_results

        plot_results(results, args.plot)
        if args.json != "-":
            print(f"plot written to {args.plot}")
    for label, why in idle:  # some variants finished requests, these none
        print(f"hybridkv simulate: {label}: {why}", file=sys.stderr)
    return 1 if idle else 0


def _why_none_finished(result: SimResult) -> str:
    """One line on why a run finished no request: every one was rejected, and for what."""
    summary, max_len = result.summary, result.config.max_model_len
    limit = f"--max-model-len {max_len}" if max_len else "the model's context (--max-model-len)"
    rejected, too_long, blocks = summary["rejected"], summary["rejected_too_long"], summary["num_blocks"] - 1
    if too_long == rejected:
        return f"every request ({rejected}) was rejected: each prompt is longer than {limit}"
    return (f"every request ({rejected}) was rejected: {too_long} longer than {limit}, the others do not fit in the "
            f"KV cache ({blocks:,} block{'s' if blocks != 1 else ''}) at their full length; give more KV memory "
            f"(--kv-cache-memory, --kv-cache-tokens, --gpu) or shorter requests")


def _outcome(outcome: str) -> Callable[[dict[str, Any]], str]:
    """A row of ``--explain``'s breakdown: requests, and the tokens they could have reused."""
    def row(s: dict[str, Any]) -> str:
        found = (s.get("routing_breakdown") or {}).get(outcome)
        return f"{found['requests']}, {found['reusable_tokens']:,}" if found else "-"
    return row


def print_summary(workload: Workload, results: list[tuple[str, SimResult]]) -> None:
    """A side-by-side table of the variants (rich when installed)."""
    s0 = results[0][1].summary
    title = (f"{workload.name}: {len(workload.requests)} requests on {s0['model']} / {s0['gpu']}"
             + (f", closed loop x{workload.concurrency}" if workload.concurrency else ""))
    labels = [lbl or "result" for lbl, _ in results]
    spec_rows = SUMMARY_ROWS + (TIER_ROWS if any(r.summary["tiers"] for _, r in results) else [])
    if any(r.summary.get("spec_decode", {}).get("num_speculative_tokens") for _, r in results):
        spec_rows = spec_rows + SPEC_ROWS
    if any("instances" in r.summary for _, r in results):
        spec_rows = spec_rows + CLUSTER_ROWS
    if any(r.summary.get("routing_breakdown") for _, r in results):
        spec_rows = spec_rows + [(f"{outcome}: requests, reusable tokens", _outcome(outcome)) for outcome in OUTCOMES]
    rows = [(name, [fmt(r.summary) for _, r in results]) for name, fmt in spec_rows]
    rows.append(("simulation wall time", [f"{r.summary['wall_s']:.1f} s" for _, r in results]))
    print_table(title, ["", *labels], [(name, *vals) for name, vals in rows])
    sources = sorted({str(r.summary.get("cost_model", "")) for _, r in results} - {""})
    if sources:
        print_text("step times: " + "; ".join(sources))

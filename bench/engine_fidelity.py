"""Simulator fidelity: the cost model calibrated on this machine's engine, then one workload through both.

    .venv/bin/python bench/engine_fidelity.py [--kv-cache-memory-mib 256] [--threads 1] [--calibrate-every 1]
                                              [--clock cpu|wall] [--json FILE]

Defaults: 16 requests, 3 shared prefixes of 704 tokens, unique suffixes of 100-200, 16-32 output
tokens (``ignore_eos``), closed loop of 4, batch budget 1,024 tokens, max_model_len 2,048, KV pool
256 MiB (2,730 blocks; ``--kv-cache-memory-mib 64`` gives 682 blocks, evicts shared prefixes and
keeps at most 3 requests running). About 2.5 minutes on 2 shared cores.

1. **Calibration sweep.** Its own engine (Gemma 3 270M, fp32, CPU) runs a fixed sweep of step shapes:
   prefill chunks of 16 to 1,024 tokens after 0 to 1,024 cached tokens, decode batches of 1 to 8
   sequences at contexts ~150 and ~900, and 3 decodes mixed with prefill chunks (one unfinished).
   Each ``step()`` is timed and its work recorded as the cost model's ``SeqWork`` list (read from
   the scheduler's output as the simulator builds it: tokens, context, whether it samples), and
   written to ``bench/out/engine_fidelity_calibration.json``.
2. **Engine run.** A shared-prefix workload (closed loop) is written as a trace
   (``bench/out/engine_fidelity_trace.jsonl``). Prompts are token ids derived from the segment keys
   (``SimRequest.prompt_token_ids``: same key, same tokens). A fresh engine runs it: the first
   ``concurrency`` requests are added, then after every ``step()`` one new request per finished
   one, before the next step: the simulator's closed loop with no think time.
3. **Simulation.** The same trace through ``simulate`` (library) and ``hybridkv simulate`` (CLI,
   in-process) on the ``cpu`` preset with fp32 weights and KV, the engine's pool size
   (``kv_cache_memory`` through the same ``plan_layout``), scheduler settings and the calibration.

The machine is shared, and its speed drifts by 2x within minutes. So the sweep runs interleaved with
the workload, in one process: one sweep step after every ``--calibrate-every`` workload steps (the
sweep cycles through its shapes, at least once), and the workload's clock (total time, TTFT) leaves
the sweep's steps out. ``--calibrate-every 0`` calibrates first instead. ``--threads 1`` (default)
because two OpenMP threads stall on each other whenever another job holds a core.

Every step is timed twice: wall clock, and process CPU time (with one thread: the engine's own
time, without the time other jobs held the core; on an idle machine the two agree). Each clock has
its calibration file (``engine_fidelity_calibration{,_cpu}.json``) and its simulation. The engine's
workload steps are written in the same format (``engine_fidelity_workload_steps{,_cpu}.json``).

It prints hit tokens (the manager's counter and first-admission hits per request), total time in
both clocks, steps and TTFT medians of both sides, and the cost model's error on the engine's own
workload steps. Exits 1 if the hit tokens differ or the total time in ``--clock`` (default ``cpu``:
the wall clock of a shared machine drifts too much within one run) differs by more than
``--tolerance`` (20%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from hybridkv.engine.engine import EngineConfig, LLMEngine, RequestOutput
from hybridkv.engine.gguf_file import GGUFFile
from hybridkv.engine.sampling import SamplingParams
from hybridkv.engine.weights import Gemma3Weights, default_model_path
from hybridkv.scheduling.scheduler import SchedulerOutput
from hybridkv.sim.cost_model import CostModel, SeqWork, fit_efficiency, load_calibration
from hybridkv.sim.simulator import SimConfig, SimResult, simulate
from hybridkv.sim.trace import read_trace, write_trace
from hybridkv.sim.workloads import ClosedLoop, LengthDist, SimRequest, Workload, shared_prefix

MODEL = "gemma-3-270m"
TOKEN_VOCAB = 200_000
"""Prompt token ids are drawn from 1 .. TOKEN_VOCAB - 1 (the model's vocabulary is 262,144)."""
OUT = Path(__file__).resolve().parent / "out"


class _NoTokenizer:
    """Token-id prompts only: the engine needs an EOS id and a ``decode`` for its text output."""

    eos_token_id = 1

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        raise NotImplementedError("this bench sends token ids")

    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str:
        return ""

    def decode_incremental(self, ids: Seq[int], prefix_offset: int, read_offset: int,
                           skip_special_tokens: bool = True, final: bool = False) -> tuple[str, int, int]:
        return "", prefix_offset, len(ids)


class Recorder:
    """Times ``engine.step()`` and records the step's work as the simulator computes it."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.steps: list[tuple[list[SeqWork], float]] = []
        """(work, wall seconds) of every step that ran the model."""
        self.cpu_steps: list[tuple[list[SeqWork], float]] = []
        """The same steps with the process CPU seconds they took."""
        self._work: list[SeqWork] = []
        sched = engine.scheduler
        schedule = sched.schedule

        def recording_schedule() -> SchedulerOutput:
            out = schedule()
            work = []
            for sid, n in out.num_scheduled_tokens.items():
                seq = sched.requests[sid].seq
                c = seq.num_computed_tokens
                work.append(SeqWork(n, c, sampled=c + n == seq.num_tokens))
            self._work = work
            return out

        sched.schedule = recording_schedule  # type: ignore[method-assign]

    def step(self) -> list[RequestOutput]:
        start, cpu = time.perf_counter(), time.process_time()
        outs = self.engine.step()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        if self._work:
            self.steps.append((self._work, seconds))
            self.cpu_steps.append((self._work, max(cpu, 1e-6)))
        self._work = []
        return outs


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(dtype="float32", kv_cache_memory=args.kv_cache_memory_mib << 20,
                        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_num_seqs=args.max_num_seqs)


def sim_config(args: argparse.Namespace, calibration: str | None) -> SimConfig:
    return SimConfig(model=MODEL, gpu="cpu", max_model_len=args.max_model_len,
                     max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                     kv_cache_memory=args.kv_cache_memory_mib << 20, weights_dtype="fp32", kv_dtype="fp32",
                     calibration=calibration, lm_head=args.lm_head)


def ids_of(segments: tuple[tuple[str, int], ...]) -> list[int]:
    return SimRequest("x", 0.0, segments, 1).prompt_token_ids(TOKEN_VOCAB)


# ---------------------------------------------------------------------- calibration

Prompt = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class Phase:
    """Requests started together and run to the end; ``later`` ones join after ``after`` steps."""

    prompts: list[Prompt]
    max_tokens: int
    later: list[Prompt] = field(default_factory=list)
    after: int = 0
    later_max_tokens: int = 2


def sweep_phases() -> list[Phase]:
    """A 1,088-token prompt (an unfinished 1,024-token chunk, then 64 tokens); prefill chunks of 16-512
    tokens after 0-1,024 cached ones; decode batches of 1, 2, 3, 4 and 8 at contexts ~150 and ~900;
    3 decodes with 128, 448 or 700 + 600 new prompt tokens (the 600 unfinished in that step)."""
    long_len = 1024
    phases = [Phase([(("long", long_len + 64),)], 2)]
    for c in (0, 512, long_len):
        for n in (16, 128, 512):
            phases.append(Phase([(("long", c), (f"p{c}-{n}", n))] if c else [((f"p{c}-{n}", n),)], 1))
    for c in (128, 896):
        for b in (1, 2, 3, 4, 8):
            phases.append(Phase([(("long", c), (f"d{c}-{b}-{i}", 16)) for i in range(b)], 5))
    for extra in ([128], [448], [700, 600]):
        phases.append(Phase([(("long", 768), (f"m{extra[0]}-{i}", 16)) for i in range(3)], 6,
                            later=[((f"m{extra[0]}-new{j}", n),) for j, n in enumerate(extra)], after=2))
    return phases


class CalibrationSweep:
    """The sweep on its own engine, one ``step()`` at a time, cycling through ``sweep_phases``.

    Content keys carry the cycle number, so each cycle prefills its own shared prefix and repeats
    the same step shapes. Its pool is large enough that the prefix stays cached within a cycle.
    """

    def __init__(self, weights: Gemma3Weights, cfg: EngineConfig) -> None:
        self.engine = LLMEngine(weights, _NoTokenizer(), replace(cfg, kv_cache_memory=max(cfg.kv_cache_memory,
                                                                                         256 << 20)))
        self.rec = Recorder(self.engine)
        self.phases = sweep_phases()
        self.index = -1
        self.cycle = 0
        self.phase_steps = 0
        self.count = 0
        self.cycles_done = 0
        self.seconds = 0.0
        """Wall time spent in ``step()``."""
        self.cpu_seconds = 0.0

    def warm_up(self) -> None:
        """Unrecorded steps: allocator, MKL and thread start-up costs."""
        self._add([(("warm", 64),)], 3)
        while self.engine.has_unfinished:
            self.engine.step()

    def _add(self, prompts: list[Prompt], max_tokens: int) -> None:
        for segs in prompts:
            self.count += 1
            keyed = tuple((f"cal{self.cycle}-{key}", n) for key, n in segs)
            self.engine.add_request(f"cal-{self.count}", ids_of(keyed),
                                    SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    def step(self) -> None:
        start, cpu = time.perf_counter(), time.process_time()
        if not self.engine.has_unfinished:
            self.index += 1
            if self.index == len(self.phases):
                self.index, self.cycle = 0, self.cycle + 1
            self.phase_steps = 0
            phase = self.phases[self.index]
            self._add(phase.prompts, phase.max_tokens)
        phase = self.phases[self.index]
        self.rec.step()
        self.phase_steps += 1
        if phase.later and self.phase_steps == phase.after:
            self._add(phase.later, phase.later_max_tokens)
        if self.index == len(self.phases) - 1 and not self.engine.has_unfinished:
            self.cycles_done += 1
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.process_time() - cpu


def write_calibration(path: Path, samples: list[tuple[list[SeqWork], float]], meta: dict[str, Any]) -> None:
    doc = {"meta": meta, "samples": [
        {"work": [[w.num_new_tokens, w.context_len, w.num_loaded_tokens, int(w.sampled)] for w in work],
         "seconds": seconds} for work, seconds in samples]}
    path.write_text(json.dumps(doc, indent=1) + "\n")


# ---------------------------------------------------------------------- workload


def build_workload(args: argparse.Namespace) -> Workload:
    return shared_prefix(args.requests, args.prefixes, args.prefix_len,
                         LengthDist(median=150, sigma=0.3, min_len=100, max_len=200),
                         max_new_tokens=LengthDist(median=24, sigma=0.3, min_len=16, max_len=32),
                         arrivals=ClosedLoop(args.concurrency), seed=args.seed)


def run_engine(weights: Gemma3Weights, workload: Workload, args: argparse.Namespace, sweep: CalibrationSweep,
               log: Callable[[str], None]) -> dict[str, Any]:
    """The workload on a fresh engine, closed loop: a new request right after each step that finished one.

    Every ``args.calibrate_every`` workload steps the sweep runs one step (0: the whole first cycle
    before the workload); the workload's clock leaves the sweep's time out. After the workload the
    sweep completes at least one cycle.
    """
    if any(r.conversation_id is not None or r.cache_salt is not None for r in workload.requests):
        raise SystemExit("this driver runs single-turn, unsalted workloads only")
    concurrency = workload.concurrency
    assert concurrency is not None
    every = args.calibrate_every
    if not every:
        while not sweep.cycles_done:
            sweep.step()
        log(f"calibration: {len(sweep.rec.steps)} steps in {sweep.seconds:.1f} s")
    engine = LLMEngine(weights, _NoTokenizer(), engine_config(args))
    rec = Recorder(engine)
    prompts = {r.request_id: r.prompt_token_ids(TOKEN_VOCAB) for r in workload.requests}
    pending = list(reversed(workload.requests))
    in_flight = 0
    arrival: dict[str, float] = {}
    first_token: dict[str, float] = {}
    final: dict[str, RequestOutput] = {}
    start, start_cpu = time.perf_counter(), time.process_time()
    cal_before, cal_cpu_before = sweep.seconds, sweep.cpu_seconds

    def clock() -> float:
        """Seconds since the start, without the sweep's steps."""
        return time.perf_counter() - start - (sweep.seconds - cal_before)

    while pending or engine.has_unfinished:
        while pending and in_flight < concurrency:
            r = pending.pop()
            engine.add_request(r.request_id, prompts[r.request_id],
                               SamplingParams(max_tokens=r.max_new_tokens, ignore_eos=True))
            arrival[r.request_id] = clock()
            in_flight += 1
        outs = rec.step()
        now = clock()
        for out in outs:
            if out.token_ids and out.request_id not in first_token:
                first_token[out.request_id] = now
            if out.finished:
                final[out.request_id] = out
                in_flight -= 1
        if every and len(rec.steps) % every == 0:
            sweep.step()
    total = clock()
    total_cpu = time.process_time() - start_cpu - (sweep.cpu_seconds - cal_cpu_before)
    while not sweep.cycles_done:
        sweep.step()
    stats = engine.manager.stats
    ttfts = {rid: first_token[rid] - arrival[rid] for rid in first_token}
    return {
        "total_s": total,
        "total_cpu_s": total_cpu,
        "steps": len(rec.steps),
        "step_samples": rec.steps,
        "cpu_step_samples": rec.cpu_steps,
        "hit_tokens": stats.hit_tokens,
        "queried_tokens": stats.queried_tokens,
        "first_admission_hit_tokens": engine.metrics.prefix_hits,
        "per_request_hits": {rid: o.num_cached_tokens for rid, o in final.items()},
        "preemptions": engine.metrics.preemptions,
        "finished": len(final),
        "output_tokens": sum(len(o.token_ids) for o in final.values()),
        "ttft_p50_s": statistics.median(ttfts.values()),
        "num_blocks": engine.layout.num_blocks,
    }


def run_cli(trace: Path, calibration: Path, args: argparse.Namespace, out: Path) -> tuple[list[str], dict[str, Any]]:
    """``hybridkv simulate`` in-process on the trace; (command line, its JSON summary)."""
    from hybridkv.cli import main

    argv = ["simulate", "--model", MODEL, "--gpu", "cpu", "--weights-dtype", "fp32", "--kv-dtype", "fp32",
            "--kv-cache-memory", f"{args.kv_cache_memory_mib}MiB", "--max-model-len", str(args.max_model_len),
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--max-num-seqs", str(args.max_num_seqs),
            "--calibration", str(calibration), "--lm-head", args.lm_head, "--workload", "trace",
            "--trace", str(trace), "--no-progress", "--json", str(out)]
    rc = main(argv)
    if rc != 0:
        raise SystemExit(f"hybridkv simulate failed with exit code {rc}")
    summary: dict[str, Any] = json.loads(out.read_text())
    return argv, summary


def pct(sim: float, real: float) -> float:
    return (sim - real) / real * 100 if real else float("nan")


def step_errors(model: CostModel, samples: list[tuple[list[SeqWork], float]]) -> dict[str, float]:
    """The cost model against measured steps: summed times and the median per-step error."""
    predicted = [model.step_time(w) for w, _ in samples]
    measured = [s for _, s in samples]
    errors = [abs(p - m) / m * 100 for p, m in zip(predicted, measured)]
    return {"measured_s": sum(measured), "predicted_s": sum(predicted),
            "sum_error_pct": pct(sum(predicted), sum(measured)),
            "median_abs_step_error_pct": statistics.median(errors)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prefixes", type=int, default=3)
    p.add_argument("--prefix-len", type=int, default=704)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv-cache-memory-mib", type=int, default=256,
                   help="the engine's KV budget (MiB; 256 is EngineConfig's default, 64 evicts shared prefixes)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--lm-head", choices=("per_token", "per_sample"), default="per_sample")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: steadiest on a shared machine; 0: torch's choice)")
    p.add_argument("--calibrate-every", type=int, default=1,
                   help="run one calibration step after every N workload steps (0: calibrate first)")
    p.add_argument("--tolerance", type=float, default=0.20, help="allowed relative total-time error")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                   help="which total time the tolerance applies to (both are reported)")
    p.add_argument("--out-dir", type=Path, default=OUT)
    p.add_argument("--json", default=None, help="write the figures as JSON to PATH")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    if args.threads:
        torch.set_num_threads(args.threads)
    bench_start = time.perf_counter()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    trace = args.out_dir / "engine_fidelity_trace.jsonl"
    calib = args.out_dir / "engine_fidelity_calibration.json"
    write_trace(trace, build_workload(args))
    workload = read_trace(trace)
    log(f"load average before: {os.getloadavg()[0]:.2f}; torch threads {torch.get_num_threads()}")
    t0 = time.perf_counter()
    weights = Gemma3Weights.load(GGUFFile(default_model_path()))
    log(f"weights loaded in {time.perf_counter() - t0:.1f} s")

    sweep = CalibrationSweep(weights, engine_config(args))
    sweep.warm_up()
    log(f"engine run: {len(workload.requests)} requests, closed loop x{workload.concurrency}, calibration "
        + (f"step every {args.calibrate_every} steps" if args.calibrate_every else "first"))
    eng = run_engine(weights, workload, args, sweep, log)
    log(f"engine: {eng['total_s']:.1f} s, {eng['steps']} steps; calibration {len(sweep.rec.steps)} steps, "
        f"{sweep.seconds:.1f} s; load average {os.getloadavg()[0]:.2f}")
    meta = {"model": MODEL, "dtype": "float32", "threads": torch.get_num_threads(),
            "calibrate_every": args.calibrate_every, "load_average_end": os.getloadavg()[0]}
    calib_cpu = args.out_dir / "engine_fidelity_calibration_cpu.json"
    write_calibration(calib, sweep.rec.steps, {**meta, "clock": "wall"})
    write_calibration(calib_cpu, sweep.rec.cpu_steps, {**meta, "clock": "process CPU"})
    write_calibration(args.out_dir / "engine_fidelity_workload_steps.json", eng["step_samples"],
                      {**meta, "clock": "wall"})
    write_calibration(args.out_dir / "engine_fidelity_workload_steps_cpu.json", eng["cpu_step_samples"],
                      {**meta, "clock": "process CPU"})

    sim: SimResult = simulate(workload, sim_config(args, str(calib)))
    argv_cli, cli_summary = run_cli(trace, calib, args, args.out_dir / "engine_fidelity_sim.json")
    s = sim.summary
    sim_cpu = simulate(workload, sim_config(args, str(calib_cpu))).summary
    other = "per_token" if args.lm_head == "per_sample" else "per_sample"
    alt = simulate(workload, replace(sim_config(args, str(calib)), lm_head=other)).summary
    base = CostModel.from_preset(MODEL, "cpu", weights_dtype="fp32", kv_dtype="fp32", lm_head=args.lm_head)
    calibration = load_calibration(calib)
    fitted = base.with_efficiency(fit_efficiency(base, calibration))

    sim_hits_first = sum(int(r["hit_tokens"]) for r in sim.requests.values())
    sim_ttft = statistics.median(r["ttft_s"] for r in sim.requests.values())
    per_request_equal = all(eng["per_request_hits"][rid] == int(r["hit_tokens"]) for rid, r in sim.requests.items())
    time_err = pct(s["duration_s"], eng["total_s"])
    cpu_err = pct(sim_cpu["duration_s"], eng["total_cpu_s"])
    hits_equal = (eng["hit_tokens"] == s["hit_tokens"] == cli_summary["hit_tokens"]
                  and eng["first_admission_hit_tokens"] == sim_hits_first and per_request_equal)
    gated = cpu_err if args.clock == "cpu" else time_err
    ok = hits_equal and abs(gated) <= args.tolerance * 100
    rows = [
        ("num_blocks", eng["num_blocks"], s["num_blocks"], ""),
        ("hit tokens (manager)", eng["hit_tokens"], s["hit_tokens"],
         "equal" if eng["hit_tokens"] == s["hit_tokens"] else "DIFFER"),
        ("hit tokens (first admission)", eng["first_admission_hit_tokens"], sim_hits_first,
         "equal per request" if per_request_equal else "DIFFER"),
        ("queried tokens", eng["queried_tokens"], s["queried_tokens"], ""),
        ("steps", eng["steps"], s["steps"], ""),
        ("preemptions", eng["preemptions"], s["preemptions"], ""),
        ("output tokens", eng["output_tokens"], s["output_tokens"], ""),
        ("total wall time (s)", f"{eng['total_s']:.2f}", f"{s['duration_s']:.2f}", f"{time_err:+.1f}%"),
        ("TTFT median (s)", f"{eng['ttft_p50_s']:.2f}", f"{sim_ttft:.2f}", f"{pct(sim_ttft, eng['ttft_p50_s']):+.1f}%"),
        ("total CPU time (s)", f"{eng['total_cpu_s']:.2f}", f"{sim_cpu['duration_s']:.2f}",
         f"{cpu_err:+.1f}% (calibrated on CPU time)"),
    ]
    print(f"\n{MODEL} fp32 on CPU ({torch.get_num_threads()} threads): {len(workload.requests)} requests, "
          f"{args.prefixes} prefixes of {args.prefix_len}, closed loop x{args.concurrency}, "
          f"KV {args.kv_cache_memory_mib} MiB, batch {args.max_num_batched_tokens}")
    print(f"{'':<30} {'engine':>10} {'simulator':>10}")
    for name, a, b, note in rows:
        print(f"{name:<30} {a!s:>10} {b!s:>10}  {note}")
    eff = fitted.efficiency
    print(f"\ncalibration: {len(calibration)} steps; lm_head={args.lm_head}: compute {eff.compute:.3f}, "
          f"memory {eff.memory:.3f}, step overhead {eff.step_overhead_s * 1e3:.1f} ms, "
          f"per sampled sequence {eff.sample_overhead_s * 1e3:.1f} ms")
    cal_err = step_errors(fitted, calibration)
    wl_err = step_errors(fitted, eng["step_samples"])
    print(f"  on the calibration steps: median |error| {cal_err['median_abs_step_error_pct']:.1f}% per step")
    print(f"  on the engine's workload steps: predicted {wl_err['predicted_s']:.2f} s of measured "
          f"{wl_err['measured_s']:.2f} s ({wl_err['sum_error_pct']:+.1f}%), median |error| "
          f"{wl_err['median_abs_step_error_pct']:.1f}% per step")
    alt_err = pct(alt["duration_s"], eng["total_s"])
    print(f"  lm_head={other} instead: simulated {alt['duration_s']:.2f} s ({alt_err:+.1f}%)")
    print(f"CLI: hybridkv {' '.join(argv_cli)}")
    print(f"  -> {cli_summary['duration_s']:.2f} s, {cli_summary['hit_tokens']} hit tokens")
    runtime = time.perf_counter() - bench_start
    print(f"\n{'PASS' if ok else 'FAIL'}: hit tokens {'identical' if hits_equal else 'DIFFER'}, total {args.clock} "
          f"time error {gated:+.1f}% (tolerance {args.tolerance:.0%}; wall {time_err:+.1f}%, CPU {cpu_err:+.1f}%); "
          f"bench ran {runtime:.0f} s")
    if args.json:
        doc = {
            "ok": ok, "clock": args.clock, "hits_equal": hits_equal, "time_error_pct": time_err,
            "cpu_time_error_pct": cpu_err,
            "bench_runtime_s": runtime, "threads": torch.get_num_threads(), "load_average_end": os.getloadavg()[0],
            "engine": {k: v for k, v in eng.items()
                       if k not in ("step_samples", "cpu_step_samples", "per_request_hits")},
            "simulator": {**s, "first_admission_hit_tokens": sim_hits_first, "ttft_median_s": sim_ttft},
            "simulator_cpu_time": {"duration_s": sim_cpu["duration_s"], "efficiency": sim_cpu["efficiency"]},
            "cli": {"argv": argv_cli, "duration_s": cli_summary["duration_s"], "hit_tokens": cli_summary["hit_tokens"]},
            "calibration": {"steps": len(calibration), "compute": eff.compute, "memory": eff.memory,
                            "step_overhead_s": eff.step_overhead_s, "sample_overhead_s": eff.sample_overhead_s,
                            "lm_head": args.lm_head, **cal_err},
            "workload_steps": wl_err,
            f"simulator_{other}": {"duration_s": alt["duration_s"], "time_error_pct": alt_err},
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

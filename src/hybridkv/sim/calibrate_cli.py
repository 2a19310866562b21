"""``hybridkv calibrate``: fit the cost model to measured steps and show how well it predicts them.

``hybridkv calibrate [FILE] --model MODEL --gpu GPU`` fits the step-shaped cost model's physical
parameters (``cost_model.FIT_PARAMETERS``) to the steps in FILE (a calibration profile; default:
the GPU's built-in profile) and prints them with each step's measured and predicted time;
``--check`` instead predicts the steps with the GPU's default efficiencies (the built-in profile's
fit) without fitting, e.g. to see how the H100 profile carries to another model's measurements;
``--leave-one-out`` adds each step predicted by a fit to the others.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from typing import Any

from hybridkv.cli_args import count_arg, positive_int_arg
from hybridkv.errors import InvalidInputError
from hybridkv.planning.hardware import get_hardware
from hybridkv.planning.planner import load_model
from hybridkv.sim.calibration import StepError, error_summary, fit_profile, leave_one_out, step_errors
from hybridkv.sim.cost_model import (
    BUILTIN_PROFILES,
    FIT_PARAMETERS,
    CostModel,
    Efficiency,
    builtin_profile,
    load_profile,
)
from hybridkv.terminal import print_table, print_text


def add_parser(sub: Any) -> None:
    """Register the ``calibrate`` subcommand."""
    p = sub.add_parser(
        "calibrate", help="fit the simulator's cost model to measured step times and print its errors",
        description="Fit the step-shaped cost model (matmul FLOP/s curve, memory bandwidth, attention FLOP/s, "
                    "per-layer launch costs eager and under CUDA graphs) to a calibration profile of measured "
                    "steps and print the fitted parameters and each step's error.",
    )
    p.add_argument("profile", nargs="?", default=None, metavar="FILE",
                   help="calibration profile (JSON: {'meta': {...}, 'samples': [{'work', 'seconds', 'mode'}]}); "
                        "default: the GPU's built-in profile (" + ", ".join(BUILTIN_PROFILES) + ")")
    p.add_argument("--model", default=None,
                   help="model preset the steps ran, or a path to its config.json (default: the profile's meta "
                        "'model')")
    p.add_argument("--num-params", type=count_arg, default=None, metavar="COUNT",
                   help="parameter count of a config.json model, e.g. 4e9 (presets know theirs)")
    p.add_argument("--gpu", default="h100-80gb", help="GPU preset the steps ran on")
    p.add_argument("--tp", type=positive_int_arg, default=1, help="tensor parallel size")
    p.add_argument("--weights-dtype", default="bf16", help="weights dtype of the measured engine")
    p.add_argument("--kv-dtype", default="bf16", help="KV cache dtype of the measured engine")
    p.add_argument("--check", action="store_true",
                   help="do not fit: predict the steps with the GPU's default efficiencies")
    p.add_argument("--leave-one-out", action="store_true",
                   help="also predict each step from a fit to all the other steps")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Fit (or check) and print."""
    if args.profile is None:
        profile = builtin_profile(args.gpu)
        if profile is None:
            raise InvalidInputError(f"GPU {args.gpu!r} has no built-in profile; give a calibration FILE "
                                    f"(built-in: {', '.join(BUILTIN_PROFILES)})")
    else:
        profile = load_profile(args.profile)
    model_id = args.model or profile.meta.get("model")
    if not isinstance(model_id, str):
        raise InvalidInputError(f"{profile.source}: the profile does not name its model (meta 'model'); "
                                f"pass --model")
    loaded = load_model(model_id)
    options: dict[str, Any] = {"tensor_parallel_size": args.tp, "weights_dtype": args.weights_dtype,
                               "kv_dtype": args.kv_dtype, "lm_head": "per_sample"}
    if loaded.is_preset:
        model = CostModel.from_preset(model_id, args.gpu, **options)
    elif not args.num_params:
        raise InvalidInputError(f"{model_id}: a config.json does not say how many parameters the model has; "
                                f"pass --num-params")
    else:
        model = CostModel.from_config(loaded.config, args.num_params, get_hardware(args.gpu), name=loaded.name,
                                      **options)
    if args.check:
        eff, source = model.efficiency, model.efficiency_source
    else:
        eff, source = fit_profile(model, profile), f"fitted to {profile.source}"
    errors = step_errors(model, profile, eff)
    loo = leave_one_out(model, profile) if args.leave_one_out and not args.check else None
    if args.json:
        doc: dict[str, Any] = {
            "model": model_id, "gpu": args.gpu, "profile": profile.source, "efficiency_source": source,
            "efficiency": asdict(eff),
            "steps": [_step_doc(e, loo[i] if loo else None) for i, e in enumerate(errors)],
            "errors": _summary_doc(errors),
        }
        if loo is not None:
            doc["leave_one_out"] = _summary_doc(loo)
        print(json.dumps(doc, indent=2))
        return 0
    print_parameters(eff, model, f"{model_id} on {args.gpu}: {source}")
    columns = ["step", "mode", "measured ms", "predicted ms", "error"] + (["leave-one-out"] if loo else [])
    rows = []
    for i, e in enumerate(errors):
        row = [e.describe(), e.step.mode or "-", f"{e.step.seconds * 1e3:.2f}", f"{e.predicted_s * 1e3:.2f}",
               f"{e.error:+.1%}"]
        if loo:
            row.append(f"{loo[i].error:+.1%}")
        rows.append(row)
    print_table(f"{len(errors)} measured steps ({profile.source})", columns, rows)
    print_errors("errors" + (" (in-sample)" if not args.check else ""), errors)
    if loo is not None:
        print_errors("leave-one-out errors", loo)
    return 0


def print_parameters(eff: Efficiency, model: CostModel, title: str) -> None:
    """The step-shaped parameters, with the FLOP/s and bytes/s they mean on the GPU."""
    hw = model.hardware
    attention = eff.attention_compute if eff.attention_compute is not None else eff.compute
    rows = [
        ("matmul efficiency (max)", f"{eff.compute:.3f}", f"{eff.compute * hw.bf16_flops / 1e12:.0f} TFLOP/s"),
        ("matmul half-efficiency tokens", f"{eff.gemm_m_half:.1f}", "eff(M) = max * M / (M + m_half)"),
        ("memory efficiency", f"{eff.memory:.3f}", f"{eff.memory * hw.bandwidth / 1e12:.2f} TB/s"),
        ("attention efficiency", f"{attention:.3f}", f"{attention * hw.bf16_flops / 1e12:.0f} TFLOP/s"),
        ("activation traffic", f"{eff.activation_traffic:.3f}",
         f"x {model.activation_bytes_per_token / 1e6:.1f} MB per token (unfused decoder)"),
        ("launch per layer, eager", f"{eff.launch_s_per_layer * 1e6:.1f} us",
         f"{eff.launch_s_per_layer * model.num_layers * 1e3:.2f} ms per step here"),
        ("launch per layer, CUDA graph", f"{eff.graph_launch_s_per_layer * 1e6:.1f} us",
         f"{eff.graph_launch_s_per_layer * model.num_layers * 1e3:.2f} ms per step here"),
        ("host per layer, eager (prior)", f"{eff.host_s_per_layer * 1e6:.1f} us", "an eager step's floor"),
        ("per-step fixed cost (prior)", f"{eff.step_overhead_s * 1e3:.2f} ms", ""),
    ]
    print_table(title, ["parameter", "value", "means"], rows)


def print_errors(title: str, errors: list[StepError]) -> None:
    """Median and worst |error| per kind of step."""
    summary = error_summary(errors)
    print_text(title + ": " + "; ".join(f"{kind} ({n}): median {med:.1%}, worst {worst:.1%}"
                                        for kind, (n, med, worst) in summary.items()))


def _step_doc(e: StepError, loo: StepError | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"work": e.describe(), "mode": e.step.mode, "measured_s": e.step.seconds,
                           "predicted_s": e.predicted_s, "error": e.error}
    if loo is not None:
        doc["leave_one_out_error"] = loo.error
    return doc


def _summary_doc(errors: list[StepError]) -> dict[str, dict[str, float]]:
    return {k: {"steps": n, "median_abs_error": med, "worst_abs_error": worst}
            for k, (n, med, worst) in error_summary(errors).items()}


__all__ = ["FIT_PARAMETERS", "add_parser", "run"]

"""How well the simulator's cost model predicts measured GPU step times.

    python bench/cost_model_fit.py [FILE --model PRESET --gpu GPU]

Default: the built-in H100 profile (Gemma-3-27B-shaped steps; ``src/hybridkv/sim/profiles/``).
Prints the fitted physical parameters of the step-shaped model (``cost_model.fit_step_model``),
its in-sample errors, its leave-one-out errors (fit on all steps but one, predict the held-out
one) per kind of step, and for comparison the errors of the one-roofline model with the data-sheet
defaults and with its own fit (``fit_efficiency``), which charge the LM head per token.
Targets (issue 24): leave-one-out median |error| <= 5% and worst <= 15% for prefill, decode and
mixed steps. Pure Python: a few seconds.
"""

from __future__ import annotations

import argparse
import sys
import time

from hybridkv.sim.calibrate_cli import print_errors, print_parameters
from hybridkv.sim.calibration import StepError, error_summary, fit_profile, leave_one_out, step_errors
from hybridkv.sim.cost_model import (
    DEFAULT_EFFICIENCY,
    CostModel,
    Profile,
    builtin_profile,
    fit_efficiency,
    load_profile,
)

TARGET_MEDIAN, TARGET_WORST = 0.05, 0.15


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", nargs="?", default=None, help="calibration profile (default: the built-in one)")
    ap.add_argument("--model", default=None, help="model preset of the profile (default: its meta 'model')")
    ap.add_argument("--gpu", default="h100-80gb")
    args = ap.parse_args(argv)
    profile = builtin_profile(args.gpu) if args.profile is None else load_profile(args.profile)
    if profile is None:
        ap.error(f"{args.gpu} has no built-in profile: give FILE")
    model_id = args.model or str(profile.meta.get("model"))
    model = CostModel.from_preset(model_id, args.gpu, lm_head="per_sample")
    t0 = time.perf_counter()
    eff = fit_profile(model, profile)
    fit_s = time.perf_counter() - t0
    print(f"{len(profile.steps)} steps of {model_id} on {args.gpu} ({profile.source}); "
          f"window kernel {profile.window_kernel}; one fit {fit_s:.2f} s\n")
    print_parameters(eff, model, f"fitted parameters ({model.num_layers} layers)")
    print_errors("step-shaped model, in-sample", step_errors(model, profile, eff))
    t0 = time.perf_counter()
    loo = leave_one_out(model, profile)
    print_errors(f"step-shaped model, leave-one-out ({time.perf_counter() - t0:.1f} s)", loo)

    generic = CostModel.from_preset(model_id, args.gpu, efficiency=DEFAULT_EFFICIENCY, lm_head="per_token")
    print_errors("one roofline, data-sheet defaults (before issue 24)", _one_roofline(generic, profile))
    refit = generic.with_efficiency(fit_efficiency(generic, [(list(s.work), s.seconds) for s in profile.steps]))
    print_errors("one roofline, fitted (fit_efficiency, in-sample)", _one_roofline(refit, profile))

    ok = True
    for kind, (n, median, worst) in error_summary(loo).items():
        if kind == "all":
            continue
        met = median <= TARGET_MEDIAN and worst <= TARGET_WORST
        ok &= met
        print(f"  leave-one-out {kind:8s} ({n:2d} steps): median {median:5.1%}  worst {worst:5.1%}  "
              f"{'meets' if met else 'MISSES'} <= {TARGET_MEDIAN:.0%} / <= {TARGET_WORST:.0%}")
    return 0 if ok else 1


def _one_roofline(model: CostModel, profile: Profile) -> list[StepError]:
    return [StepError(s, model.step_time(s.work)) for s in profile.steps]


if __name__ == "__main__":
    sys.exit(main())

"""Fitting the step-shaped cost model to a calibration profile, and how well it predicts.

``fit_profile`` fits ``cost_model.fit_step_model`` to a profile on the profile's window kernel;
``step_errors`` compares a model's predictions with the measured steps; ``leave_one_out`` fits
on every step but one and predicts that one, for each step (how the fit generalises to a step it
did not see); ``error_summary`` gives the median and worst |error| per kind of step (``prefill``,
``decode``, ``mixed``). ``hybridkv calibrate`` and ``bench/cost_model_fit.py`` print them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from hybridkv.errors import InvalidInputError
from hybridkv.sim.cost_model import CostModel, Efficiency, Profile, ProfileStep, fit_step_model


@dataclass(frozen=True)
class StepError:
    """One measured step against its prediction."""

    step: ProfileStep
    predicted_s: float

    @property
    def error(self) -> float:
        """Relative error of the prediction, (predicted - measured) / measured."""
        return self.predicted_s / self.step.seconds - 1.0

    def describe(self) -> str:
        """The step's work in a few words: groups of equal sequences as ``B x new@context``."""
        groups: dict[tuple[int, int, int], int] = {}
        for w in self.step.work:
            key = (w.num_new_tokens, w.context_len, w.num_loaded_tokens)
            groups[key] = groups.get(key, 0) + 1
        return " + ".join(f"{b} x {n}@{c}" + (f"+{ext}" if ext else "") for (n, c, ext), b in groups.items())


def for_profile(model: CostModel, profile: Profile) -> CostModel:
    """``model`` charging sliding windows as the profile's engine ran them (to fit or check it)."""
    return replace(model, window_kernel=profile.window_kernel)


def fit_profile(model: CostModel, profile: Profile, prior: Efficiency | None = None) -> Efficiency:
    """The step-shaped efficiencies fitted to ``profile`` (``fit_step_model`` on its window kernel)."""
    return fit_step_model(for_profile(model, profile), profile.steps, prior)


def step_errors(model: CostModel, profile: Profile, efficiency: Efficiency | None = None) -> list[StepError]:
    """Each step of ``profile`` predicted by ``model`` (with ``efficiency`` if given), in its mode."""
    m = for_profile(model, profile)
    if efficiency is not None:
        m = m.with_efficiency(efficiency)
    return [StepError(s, m.step_time(s.work, graph=s.graph)) for s in profile.steps]


def leave_one_out(model: CostModel, profile: Profile, prior: Efficiency | None = None) -> list[StepError]:
    """For each step, the prediction of a fit to all the other steps."""
    if len(profile.steps) < 2:
        raise InvalidInputError("leave-one-out needs at least two measured steps")
    m = for_profile(model, profile)
    out = []
    steps = profile.steps
    for i, step in enumerate(steps):
        eff = fit_step_model(m, steps[:i] + steps[i + 1:], prior)
        out.append(StepError(step, m.with_efficiency(eff).step_time(step.work, graph=step.graph)))
    return out


def error_summary(errors: Sequence[StepError]) -> dict[str, tuple[int, float, float]]:
    """Per kind of step (and ``all``): (steps, median |error|, worst |error|)."""
    kinds: dict[str, list[float]] = {}
    for e in errors:
        kinds.setdefault(e.step.kind, []).append(abs(e.error))
    kinds["all"] = [abs(e.error) for e in errors]
    return {k: (len(v), statistics.median(v), max(v)) for k, v in kinds.items()}

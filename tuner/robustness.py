"""The top configs re-run on other slices and seeds of the workload."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import optuna

from engine.config import EngineConfig
from tuner.evaluate import Evaluator
from tuner.outcome import TrialRow, best_row, distinct, pareto_front
from tuner.progress import Progress
from tuner.runners import TrialRunner
from tuner.spec import OBJECTIVE_UNIT, TuneSpec


@dataclass(frozen=True)
class Robustness:
    """One top config re-run on the workload's other slices and seeds."""

    number: int  # its trial
    value: float  # its objective in the study
    values: dict[str, float]  # variant label -> objective there
    missed: dict[str, str]  # variant label -> why it missed the SLOs there

    @property
    def worst(self) -> float:
        return min([self.value, *self.values.values()])

    @property
    def moved(self) -> float:
        """The worst case's relative change from the study's value (-0.1: 10% lower)."""
        return self.worst / self.value - 1 if self.value > 0 else 0.0

    def key(self) -> tuple[int, float, float]:
        """Fewest variants missed, then the best worst case, then the best study value."""
        return (-len(self.missed), self.worst, self.value)


def run_robustness(spec: TuneSpec, study: optuna.Study, runner: TrialRunner,
                prepared: EngineConfig, progress: Progress | None) -> list[Robustness]:
    """The top `spec.robust_top` feasible configs on every variant of the workload. Results
    are kept in the study (user attribute "robustness"), so a resumed study re-runs only
    configs it has not checked yet."""
    if not spec.variants or spec.robust_top <= 0:
        return []
    rows = [TrialRow.of(t) for t in study.get_trials(deepcopy=False)]
    # pareto: only points of the front, so the recommendation is never a dominated config
    pool = pareto_front(rows) if spec.multi_objective else rows
    top = distinct(sorted((r for r in pool if r.feasible and r.value is not None),
                           key=lambda r: (-(r.value or 0.0), r.number)))[:spec.robust_top]
    known = study.user_attrs.get("robustness", {})
    labels = [v.label for v in spec.variants]
    evaluator = Evaluator(spec, runner, prepared)
    for i, row in enumerate(top):
        entry = known.get(str(row.number))
        if entry is not None and sorted(entry["values"]) == sorted(labels):
            continue
        values, missed = {}, {}
        for variant in spec.variants:
            try:
                scored = evaluator.score(evaluator.config(row.params), variant.requests)
            except ValueError as exc:
                values[variant.label], missed[variant.label] = 0.0, f"did not start: {exc}"
                continue
            values[variant.label] = scored.value
            if scored.missed is not None:
                missed[variant.label] = scored.missed
        known[str(row.number)] = {"values": values, "missed": missed}
        study.set_user_attr("robustness", known)
        if progress is not None:
            worst = min([row.value or 0.0, *values.values()])
            progress.note(f"robustness {i + 1}/{len(top)} (#{row.number}): worst case "
                     f"{worst:.4g} {OBJECTIVE_UNIT[spec.objective]} over "
                     f"{len(values)} variants" + (f", missed the SLOs on {', '.join(missed)}"
                                                 if missed else ""))
    return [Robustness(r.number, r.value or 0.0, known[str(r.number)]["values"],
                       known[str(r.number)]["missed"]) for r in top]


def recommend(rows: Sequence[TrialRow], robustness: Sequence[Robustness]) -> TrialRow | None:
    """The best worst case over the robustness re-runs (fewest variants missed first), or
    without re-runs the study's best trial."""
    if not robustness:
        return best_row(rows)
    chosen = max(robustness, key=lambda r: (r.key(), -r.number))
    return next(r for r in rows if r.number == chosen.number)


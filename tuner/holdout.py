"""Held-out selection: the recommendation is chosen on windows of the workload the search never
optimised on.

The search trains on one window. Then the study's top configs and the baselines (the default
and vLLM grid's best on the training window) run on every held-out window, each with its
objective's 95% interval there (`Evaluator.score(..., interval=True)`). A config's held-out
value is its mean over the windows, its lower bound the mean of its windows' lower bounds.

The rule, from the default up: the grid's best replaces the default only when its held-out
lower bound beats the default's held-out value, and a searched config replaces that best
baseline only when its lower bound beats the baseline's value. Otherwise the baseline is the
recommendation and the report says the search found no significant gain; ties go to the
default. Every config replays the same held-out requests (common random numbers), so configs
differ only by their knobs.

Results are kept in the study (user attribute "holdout"), so a resumed study re-runs only the
configs it has not checked yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import optuna

from engine.config import EngineConfig
from tuner.evaluate import Evaluator
from tuner.outcome import TrialRow, baseline_row, best_row, distinct, pareto_front
from tuner.progress import Progress
from tuner.runners import TrialRunner
from tuner.spec import OBJECTIVE_UNIT, TuneSpec


@dataclass(frozen=True)
class HeldOut:
    """One config on every held-out window."""

    number: int  # its trial
    role: str  # "default", "vllm-grid 128x2048" or "search"
    train_value: float  # its objective on the training window
    values: dict[str, float]  # window label -> objective there
    intervals: dict[str, tuple[float, float]]  # window label -> 95% interval there
    missed: dict[str, str]  # window label -> why it missed the SLOs there

    @property
    def value(self) -> float:
        return sum(self.values.values()) / len(self.values) if self.values else 0.0

    @property
    def low(self) -> float:
        lows = [self.intervals.get(label, (value, value))[0]
                for label, value in self.values.items()]
        return sum(lows) / len(lows) if lows else 0.0

    @property
    def high(self) -> float:
        highs = [self.intervals.get(label, (value, value))[1]
                 for label, value in self.values.items()]
        return sum(highs) / len(highs) if highs else 0.0

    def beats(self, other: HeldOut) -> bool:
        """Significantly better: its held-out lower bound is above the other's value."""
        return self.low > other.value


@dataclass(frozen=True)
class Selection:
    """What the held-out windows chose, and against what."""

    checked: list[HeldOut]  # the baselines first, then the searched configs
    chosen: HeldOut
    baseline: HeldOut | None  # the best baseline the chosen config was held against

    @property
    def gain(self) -> bool:
        """A searched config won: the search found a significant gain."""
        return self.chosen.role == "search"

    def verdict(self, unit: str) -> str:
        chosen, base = self.chosen, self.baseline
        if base is None:
            return (f"no baseline ran: #{chosen.number} has the best held-out value "
                    f"({chosen.value:.4g} {unit})")
        if self.gain:
            return (f"#{chosen.number} beats the best baseline ({base.role}, #{base.number}) "
                    f"on the held-out windows: {_ratio(chosen.value, base.value)}, "
                    f"{chosen.value:.4g} {unit} (lower bound {chosen.low:.4g}) against "
                    f"{base.value:.4g}")
        best_search = max((h for h in self.checked if h.role == "search"),
                          key=lambda h: h.value, default=None)
        against = "" if best_search is None else (
            f"; the search's best held-out, #{best_search.number}, reached "
            f"{best_search.value:.4g} {unit} (lower bound {best_search.low:.4g}) against "
            f"{base.value:.4g}")
        return (f"the search found no significant gain on the held-out windows: the "
                f"recommendation is the {base.role} (#{base.number}){against}")


def _ratio(value: float, other: float) -> str:
    return f"{value / other:.2f}x" if other > 0 else "above zero"


def holdout_candidates(spec: TuneSpec, rows: Sequence[TrialRow]
                       ) -> list[tuple[str, TrialRow]]:
    """(role, row): the default, vLLM grid's best on the training window, then the study's top
    `spec.holdout_top` distinct feasible configs (pareto: points of the front) that are not a
    baseline's knobs (any of vLLM's grid included: a grid config is no gain of the search)."""
    out: list[tuple[str, TrialRow]] = []
    default = baseline_row(rows, "default")
    if default is not None and default.ran:
        out.append(("default", default))
    grid = [r for r in rows if (r.baseline or "").startswith("vllm-grid") and r.ran]
    grid_best = best_row(grid) or max(grid, key=lambda r: (r.value or 0.0, -r.number),
                                      default=None)
    if grid_best is not None and grid_best.baseline is not None:
        out.append((grid_best.baseline, grid_best))
    taken = {_key(r) for r in rows if r.baseline is not None}  # every baseline's, grid's too
    pool = pareto_front(rows) if spec.multi_objective else rows
    ranked = distinct(sorted((r for r in pool if r.feasible and r.value is not None),
                             key=lambda r: (-(r.value or 0.0), r.number)))
    out += [("search", r) for r in ranked if _key(r) not in taken][:spec.holdout_top]
    return out


def _key(row: TrialRow) -> str:
    return repr(sorted(row.params.items()))


def run_holdout(spec: TuneSpec, study: optuna.Study, runner: TrialRunner,
                prepared: EngineConfig, progress: Progress | None) -> Selection | None:
    """Every candidate on every held-out window, then the rule; None without windows."""
    rows = [TrialRow.of(t) for t in study.get_trials(deepcopy=False)]
    if not spec.holdout or best_row(rows) is None:  # no config met the SLOs: nothing to choose
        return None
    candidates = holdout_candidates(spec, rows)
    if not candidates:
        return None
    known = study.user_attrs.get("holdout", {})
    labels = [w.label for w in spec.holdout]
    evaluator = Evaluator(spec, runner, prepared)
    unit = OBJECTIVE_UNIT[spec.objective]
    checked = []
    for i, (role, row) in enumerate(candidates):
        entry = known.get(str(row.number))
        fresh = entry is None or sorted(entry["values"]) != sorted(labels)
        if fresh:
            entry = _evaluate(evaluator, row, spec)
            known[str(row.number)] = entry
            study.set_user_attr("holdout", known)
        held = HeldOut(row.number, role, row.value or 0.0, entry["values"],
                       {k: (v[0], v[1]) for k, v in entry["intervals"].items()},
                       entry["missed"])
        checked.append(held)
        if progress is not None and fresh:
            progress.note(f"held-out {i + 1}/{len(candidates)} (#{row.number}, {role}): "
                          f"{held.value:.4g} {unit} ({held.low:.4g}..{held.high:.4g}) over "
                          f"{len(labels)} windows" + (
                              f", missed the SLOs on {', '.join(held.missed)}"
                              if held.missed else ""))
    return select(checked)


def _evaluate(evaluator: Evaluator, row: TrialRow, spec: TuneSpec) -> dict[str, dict[str, object]]:
    values: dict[str, object] = {}
    intervals: dict[str, object] = {}
    missed: dict[str, object] = {}
    for window in spec.holdout:
        try:
            scored = evaluator.score(evaluator.config(row.params), window.requests,
                                     interval=True)
        except ValueError as exc:
            values[window.label], intervals[window.label] = 0.0, [0.0, 0.0]
            missed[window.label] = f"did not start: {exc}"
            continue
        low, high = scored.interval or (scored.value, scored.value)
        if scored.missed is not None:
            missed[window.label] = scored.missed
            if spec.objective != "capacity":  # capacity: the rate the SLOs held at, if any
                low = high = 0.0
        values[window.label] = scored.value if window.label not in missed or \
            spec.objective == "capacity" else 0.0
        intervals[window.label] = [low, high]
    return {"values": values, "intervals": intervals, "missed": missed}


def select(checked: Sequence[HeldOut]) -> Selection:
    """The rule: the default, replaced by the grid's best only when that significantly beats
    it, replaced by the best searched config only when that significantly beats the baseline.
    A config that missed the SLOs on a window scores 0 there (capacity: the rate at which
    they held, 0 when none did)."""
    assert checked, "nothing was checked"
    baselines = [h for h in checked if h.role != "search"]
    incumbent = next((h for h in baselines if h.role == "default"), None)
    for grid in (h for h in baselines if h.role != "default"):
        if incumbent is None or grid.beats(incumbent):
            incumbent = grid
    searched = sorted((h for h in checked if h.role == "search"),
                      key=lambda h: (-h.value, h.number))
    if incumbent is None:
        return Selection(list(checked), searched[0], None)
    winner = next((h for h in searched if h.beats(incumbent)), None)
    return Selection(list(checked), winner or incumbent, incumbent)

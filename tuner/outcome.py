"""A study's trials as rows, the best and the pareto front, and their text for people."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from optuna.trial import FrozenTrial

from tuner.measures import CONSTRAINT_TEXT, seconds_text
from tuner.spec import OBJECTIVE_UNIT

if TYPE_CHECKING:
    from tuner.holdout import Selection
    from tuner.recheck import Recheck


@dataclass(frozen=True)
class TrialRow:
    """One trial as the outputs show it."""

    number: int
    state: str
    params: dict[str, Any]
    baseline: str | None  # "default", "vllm-grid 128x2048", else None
    ran: bool
    measures: dict[str, Any] | None
    value: float | None  # the objective: goodput or capacity (req/s), pareto's tokens/s
    infeasible: str | None
    capacity: dict[str, Any] | None = None  # rate_rps, factor, probes, workload_rate_rps
    retried_from: int | None = None  # the trial of a killed worker this one re-ran
    objective: str = "goodput"
    uncertain: tuple[str, ...] = ()  # the p99s whose interval straddles their SLO

    @property
    def feasible(self) -> bool:
        return self.state == "COMPLETE" and self.infeasible is None

    @classmethod
    def of(cls, trial: FrozenTrial) -> TrialRow:
        attrs = trial.user_attrs
        values = trial.values
        baseline = attrs.get("baseline")
        # a stepped float comes back as 0.8799999999999999: as its step wrote it
        params = {k: round(v, 9) if isinstance(v, float) else v for k, v in trial.params.items()}
        return cls(number=trial.number, state=trial.state.name, params=params,
                   baseline=baseline if isinstance(baseline, str) else None,
                   ran=bool(attrs.get("ran")), measures=attrs.get("measures"),
                   value=values[0] if values else None, infeasible=attrs.get("infeasible"),
                   capacity=attrs.get("capacity"),
                   retried_from=trial.system_attrs.get("failed_trial"),
                   objective=str(attrs.get("objective", "goodput")),
                   uncertain=tuple(attrs.get("uncertain") or ()))


@dataclass(frozen=True)
class StudyOutcome:
    study_name: str
    rows: list[TrialRow]
    best: TrialRow | None  # the recommendation: chosen on the held-out windows
    default: TrialRow | None  # the base config's trial
    files: list[Path] = field(default_factory=list)
    selection: Selection | None = None  # the held-out windows' figures and verdict
    front: list[TrialRow] = field(default_factory=list)  # pareto: the feasible front
    recheck: Recheck | None = None  # shadow: the best configs on the captured trace

    @property
    def top(self) -> TrialRow | None:
        """The feasible trial with the best objective in the study itself."""
        return best_row(self.rows)

    @property
    def grid(self) -> list[TrialRow]:
        """vLLM's grid trials that ran to an end (a killed one counts by its re-run)."""
        labels = dict.fromkeys(r.baseline for r in self.rows
                               if (r.baseline or "").startswith("vllm-grid"))
        return [row for label in labels if label and (row := baseline_row(self.rows, label))
                and row.state == "COMPLETE"]


def baseline_row(rows: Sequence[TrialRow], label: str) -> TrialRow | None:
    """The trial of a baseline: its last that completed (a killed one's re-run copies its
    label), else its first."""
    mine = [r for r in rows if r.baseline == label]
    done = [r for r in mine if r.state == "COMPLETE"]
    return done[-1] if done else next(iter(mine), None)


def best_row(rows: Sequence[TrialRow]) -> TrialRow | None:
    feasible = [r for r in rows if r.feasible and r.value is not None]
    return max(feasible, key=lambda r: (r.value, -r.number), default=None)


def pareto_front(rows: Sequence[TrialRow]) -> list[TrialRow]:
    """Feasible trials no other feasible trial beats on both output tokens/s and p99 TTFT,
    by ascending p99 TTFT (one per set of knobs)."""
    points = [(r, float(r.measures.get("output_tokens_per_s") or 0.0),
               float(r.measures["p99_ttft_s"])) for r in rows
              if r.feasible and r.measures is not None and r.measures.get("p99_ttft_s")
              is not None]
    front = [r for r, tps, ttft in points if not any(
        t2 >= tps and f2 <= ttft and (t2 > tps or f2 < ttft) for _, t2, f2 in points)]
    return sorted(distinct(front), key=lambda r: (r.measures or {})["p99_ttft_s"])


def distinct(rows: Sequence[TrialRow]) -> list[TrialRow]:
    """The first row of each set of knobs (a retried or re-suggested config counts once)."""
    seen: set[str] = set()
    out = []
    for row in rows:
        key = json.dumps(row.params, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(row)
    return out


def knob_text(value: Any) -> str:
    """A knob's value as every table, progress line and summary prints it: 4 significant
    digits (gpu_memory_utilization 0.8875 stays apart from 0.89)."""
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def describe_result(row: TrialRow) -> str:
    if row.state != "COMPLETE":
        return row.state.lower()
    if not row.ran:
        return f"infeasible ({row.infeasible})"
    m = row.measures or {}
    at = " at that rate" if row.capacity is not None else ""
    text = (f"{value_text(row)}, p99 TTFT {seconds_text(m.get('p99_ttft_s'))}, "
            f"p99 TPOT {seconds_text(m.get('p99_tpot_s'))}, "
            f"p99 ITL {seconds_text(m.get('p99_itl_s'))}{at}")
    if row.infeasible:
        return f"{text}, infeasible ({row.infeasible})"
    return f"{text}, feasible" + (f", {uncertain_text(row)}" if row.uncertain else "")


def uncertain_text(row: TrialRow) -> str:
    names = ", ".join(CONSTRAINT_TEXT.get(name, name) for name in row.uncertain)
    return (f"uncertain ({names}: the 95% interval straddles the SLO; it may win only once "
            "re-run on more requests)")


def value_text(row: TrialRow) -> str:
    """The objective's value for people: 'goodput 9.2 req/s', 'throughput 812 tok/s' or
    'capacity 23.4 req/s (2.55x the workload's rate, 9 probes)'."""
    value = row.value or 0.0
    if row.capacity is not None:
        return (f"capacity {value:.4g} req/s ({row.capacity['factor']:.3g}x the workload's "
                f"rate, {row.capacity['probes']} probes)")
    if row.objective == "pareto":
        return f"throughput {value:.4g} tok/s"
    if row.objective == "shadow":
        return f"SLO attainment {value:+.3f} against live"
    return f"{row.objective} {value:.4g} {OBJECTIVE_UNIT.get(row.objective, 'req/s')}"


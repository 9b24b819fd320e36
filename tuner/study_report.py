"""What `fairgate tune` writes to --out: best.yaml, trials.csv, report.md and report.html.

best.yaml is the recommendation (the best worst case over the robustness re-runs, or the
study's best without them) as an `engine:` section that `fairgate engine -c` and
`fairgate serve -c` load as it is. The reports compare it with the base config and, with
`--baseline vllm-grid`, with the best of vLLM auto_tune's 8 configs. After a shadow study they
show its best configs re-checked on the captured traffic (`tuner.recheck`: live shadow,
replay and sim side by side), also in recheck.csv.
"""

from __future__ import annotations

import csv
import io
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
import yaml

from engine.config import EngineConfig
from protocol.stats import MIN_TAIL_SAMPLES, min_samples, tail_samples
from tuner import recheck as recheck_table
from tuner import report_html as html
from tuner.engines import DEFAULT_ENGINE, engine_named
from tuner.evaluate import wilson
from tuner.measures import seconds_text, slo_text
from tuner.outcome import (
    StudyOutcome,
    TrialRow,
    best_row,
    knob_text,
    pareto_front,
    uncertain_text,
    value_text,
)
from tuner.spec import OBJECTIVE_TEXT, OBJECTIVE_UNIT, TuneSpec


def write_outputs(spec: TuneSpec, outcome: StudyOutcome,
                  study: optuna.Study | None = None) -> list[Path]:
    """best.yaml (only when a trial met both SLOs), trials.csv, recheck.csv (only when configs
    were re-checked), report.md and report.html in spec.out_dir; each file appears whole or
    not at all."""
    files = {"trials.csv": trials_csv(spec, outcome.rows), "report.md": report_md(spec, outcome),
             "report.html": report_html(spec, outcome, study)}
    if outcome.recheck is not None and outcome.recheck.rows:
        files["recheck.csv"] = recheck_csv(spec, outcome)
    if outcome.best is not None:
        files = {"best.yaml": best_yaml(spec, outcome), **files}
    spec.out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("best.yaml", "recheck.csv"):  # an earlier run's must not outlive this report
        if name not in files:
            (spec.out_dir / name).unlink(missing_ok=True)
    paths = []
    for name, text in files.items():
        path = spec.out_dir / name
        partial = path.with_name(f".{name}.partial")
        partial.write_text(text, encoding="utf-8")
        os.replace(partial, path)
        paths.append(path)
    return paths


def engine_section(base: EngineConfig, params: dict[str, Any]) -> dict[str, Any]:
    """The knobs `base` sets away from the defaults, plus the tuned ones."""
    config = base.replace(**params)
    defaults = EngineConfig().to_dict()
    return {k: v for k, v in config.to_dict().items() if k in params or v != defaults[k]}


def best_yaml(spec: TuneSpec, outcome: StudyOutcome) -> str:
    best = outcome.best
    assert best is not None
    m = best.measures or {}
    header = (f"# fairgate tune --mode {spec.mode}: study {outcome.study_name}, trial "
              f"#{best.number}\n# {value_text(best)}, p99 TTFT "
              f"{seconds_text(m.get('p99_ttft_s'))} (SLO {seconds_text(spec.slo.ttft_s)}), p99 ITL "
              f"{seconds_text(m.get('p99_itl_s'))} (SLO {seconds_text(spec.slo.itl_s)})\n")
    body = yaml.safe_dump({"engine": engine_section(spec.base, best.params),
                           "tuner": engine_flags(spec, best.params)}, sort_keys=False)
    return header + body


def engine_flags(spec: TuneSpec, params: dict[str, Any]) -> dict[str, Any]:
    """best.yaml's `tuner:` section: the winner's tuned knobs as --engine's own command-line
    flags (vLLM's, SGLang's, or fairgate's `--set`), to start that server with."""
    engine = engine_named(getattr(spec.runner, "engine", DEFAULT_ENGINE))
    return {"engine": engine.name, "flags": engine.flags_for(params)}


CAPACITY_COLUMNS = ("factor", "probes")  # the rate factor at capacity, probes run to find it
CSV_MEASURES = ("p99_ttft_s", "p99_ttft_ci", "p99_tpot_s", "p99_tpot_ci", "p99_itl_s",
                "p99_itl_ci", "gaps", "good_fraction", "output_tokens_per_s", "failed",
                "refused", "wall_s")


# replay/launch: the engine's own /stats over the run, beside the client's figures
ENGINE_COLUMNS = ("p99_ttft_s", "p99_tpot_s", "requests")


def workload_text(spec: TuneSpec) -> str:
    if spec.mode == "shadow":
        return (f"{spec.workload} ({len(spec.requests)} a trial, within "
                f"{spec.runner.shadow_window_s:g} s)")
    return (f"{spec.workload} ({len(spec.requests)} requests over "
            f"{spec.requests[-1].arrival:.1f} s)")


def objective_text(spec: TuneSpec) -> str:
    if spec.mode == "shadow":
        return ("SLO attainment of the mirrored requests on the shadow engine minus the live "
                "engine's on the same requests (both SLOs; -1..1)")
    return f"{spec.objective} ({OBJECTIVE_TEXT[spec.objective]})"


def value_column(spec: TuneSpec) -> str:
    """trials.csv's objective column: goodput_rps, capacity_rps or throughput_tok_s."""
    if spec.objective == "pareto":
        return "throughput_tok_s"
    if spec.mode == "shadow":
        return "attainment_gain"  # the shadow's SLO attainment minus the live engine's
    return f"{spec.objective}_rps"


def trials_csv(spec: TuneSpec, rows: Sequence[TrialRow]) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    knobs = list(spec.space)
    capacity = spec.objective == "capacity"
    writer.writerow(["number", "state", "baseline", "ran", *knobs, value_column(spec),
                     *(CAPACITY_COLUMNS if capacity else ()), *CSV_MEASURES,
                     *(f"engine_{name}" for name in ENGINE_COLUMNS), "retried_from",
                     "infeasible", "uncertain"])
    for row in rows:
        m = row.measures or {}
        engine = m.get("engine_stats") or {}
        writer.writerow([row.number, row.state, row.baseline or "", row.ran,
                         *(row.params.get(k, "") for k in knobs),
                         "" if row.value is None else f"{row.value:.6g}",
                         *(_cell((row.capacity or {}).get(name, "")) for name in
                           (CAPACITY_COLUMNS if capacity else ())),
                         *(_cell(m.get(name)) for name in CSV_MEASURES),
                         *("" if engine.get(name) is None else _cell(engine[name])
                           for name in ENGINE_COLUMNS),
                         "" if row.retried_from is None else row.retried_from,
                         row.infeasible or "", " ".join(row.uncertain)])
    return out.getvalue()


def recheck_csv(spec: TuneSpec, outcome: StudyOutcome) -> str:
    assert outcome.recheck is not None
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(
        recheck_table.csv_rows(outcome.recheck, list(spec.space)))
    return out.getvalue()


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return "..".join(_cell(v) for v in value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return "inf" if value is None else str(value)


def report_md(spec: TuneSpec, outcome: StudyOutcome, top: int = 10) -> str:
    rows = outcome.rows
    feasible = sorted((r for r in rows if r.feasible), key=lambda r: -(r.value or 0))
    retried = [r for r in rows if r.retried_from is not None]
    lines = [f"# fairgate tune: study {outcome.study_name}", "",
             f"- mode: {spec.mode}; objective: {objective_text(spec)}",
             f"- workload: {workload_text(spec)}",
             f"- SLOs: {slo_text(spec.slo)} (TPOT per request, ITL every gap)",
             *([f"- sample: {sample}"] if (sample := sample_text(spec)) else []),
             "- space: " + ", ".join(f"{k} {v}" for k, v in spec.space.describe().items()),
             f"- trials: {len(rows)}, feasible: {len(feasible)}"
             + (f", re-run after a worker stopped: {len(retried)}" if retried else ""), ""]
    lines += _comparison(spec, outcome)
    lines += _holdout_md(spec, outcome)
    lines += _recheck_md(spec, outcome)
    if spec.multi_objective and outcome.front:
        lines += ["", f"## Pareto front ({len(outcome.front)} trials: output tokens/s against "
                  "p99 TTFT, both SLOs met)", ""]
        lines += _table(spec, outcome.front)
    lines += ["", f"## Top {min(top, len(feasible))} feasible trials", ""]
    lines += _table(spec, feasible[:top])
    infeasible = [r for r in rows if not r.feasible]
    if infeasible:
        lines += ["", "## Infeasible trials", ""] + [
            f"- #{r.number}: {r.infeasible or r.state.lower()}" for r in infeasible]
    return "\n".join(lines) + "\n"


def comparison_rows(outcome: StudyOutcome) -> list[tuple[str, TrialRow]]:
    """(name, row): the recommendation, the study's top trial when that differs, the default
    and the best of the vLLM grid."""
    shown: list[tuple[str, TrialRow]] = []
    if outcome.best is not None:
        shown.append(("recommended", outcome.best))
    top = outcome.top
    if top is not None and outcome.best is not None and top.number != outcome.best.number:
        shown.append(("study's best", top))
    if outcome.default is not None:
        shown.append(("default", outcome.default))
    grid_best = best_row(outcome.grid) or next(iter(outcome.grid), None)
    if grid_best is not None:
        shown.append((f"best of vLLM grid ({grid_best.baseline})", grid_best))
    return shown


def margin_text(spec: TuneSpec, outcome: StudyOutcome) -> list[str]:
    """How far the recommendation is ahead of the default and of the vLLM grid's best: on
    the held-out windows when there are any (the figures that chose it), else on the study's
    own window; and whether the objective could tell the configs apart at all."""
    best = outcome.best
    if best is None or not best.value:
        return []
    unit = OBJECTIVE_UNIT[spec.objective]
    note = separation_note(spec, outcome)
    lines = [f"- {note}"] if note else []
    if outcome.selection is not None:
        selection = outcome.selection
        lines.append(f"- {selection.verdict(unit)}")
        for held in selection.checked:
            if held.role != "search" and held is not selection.chosen and held.value > 0:
                lines.append(f"- held out: {selection.chosen.value / held.value:.2f}x the "
                             f"{held.role} (#{held.number}): {selection.chosen.value:.4g} "
                             f"against {held.value:.4g} {unit}")
        return lines
    lines.append("- on the study's own window (no held-out check):")
    for name, other in (("the default", outcome.default), ("the best vLLM grid config",
                                                          best_row(outcome.grid))):
        if other is None:
            if name != "the default" and outcome.grid:
                first = outcome.grid[0]
                lines.append(f"- none of vLLM's {len(outcome.grid)} grid configs met both SLOs "
                             f"(#{first.number}: {first.infeasible})")
            continue
        if other.number == best.number:
            lines.append(f"- {name} (#{other.number}) is the recommendation")
        elif not other.feasible:
            lines.append(f"- {name} (#{other.number}) missed the SLOs ({other.infeasible})")
        elif other.value:
            lines.append(f"- {best.value / other.value:.2f}x {name} (#{other.number}): "
                         f"{best.value:.4g} against {other.value:.4g} {unit}")
    return lines


def _comparison(spec: TuneSpec, outcome: StudyOutcome) -> list[str]:
    shown = comparison_rows(outcome)
    if outcome.best is None:
        lines = ["**No trial met the SLOs**: no best.yaml was written. Loosen the SLOs, widen "
                 "the space or lower the rate."]
        if shown:
            lines += ["", "## The baselines", ""]
            lines += _table(spec, [r for _, r in shown], names=[n for n, _ in shown])
        return lines
    lines = ["## Recommended vs default" + (" vs vLLM grid" if outcome.grid else ""), ""]
    lines += _table(spec, [r for _, r in shown], names=[n for n, _ in shown])
    margins = margin_text(spec, outcome)
    return lines + ([""] + margins if margins else [])


def holdout_table(spec: TuneSpec, outcome: StudyOutcome) -> list[list[str]]:
    """The held-out windows: each checked config's objective and 95% interval per window."""
    selection = outcome.selection
    assert selection is not None
    labels = [w.label for w in spec.holdout]
    unit = OBJECTIVE_UNIT[spec.objective]
    rows = [["", "trial", "train window", *labels, f"held-out mean {unit} (95% CI)"]]
    for held in selection.checked:
        name = ("recommended " if held is selection.chosen else "") + held.role
        rows.append([name, f"#{held.number}", f"{held.train_value:.4g}", *(
            f"{held.values.get(label, 0.0):.4g} ({_interval(held.intervals.get(label))})"
            + (" missed" if label in held.missed else "") for label in labels),
            f"{held.value:.4g} ({held.low:.4g}..{held.high:.4g})"])
    return rows


def _interval(bounds: tuple[float, float] | None) -> str:
    return "-" if bounds is None else f"{bounds[0]:.4g}..{bounds[1]:.4g}"


def holdout_notes(spec: TuneSpec, outcome: StudyOutcome) -> list[str]:
    selection = outcome.selection
    if selection is None:
        return []
    notes = [selection.verdict(OBJECTIVE_UNIT[spec.objective])]
    for held in selection.checked:
        for label, why in held.missed.items():
            notes.append(f"#{held.number} ({held.role}) missed the SLOs on {label}: {why}")
    return notes


def _holdout_md(spec: TuneSpec, outcome: StudyOutcome) -> list[str]:
    if outcome.selection is None:
        if spec.mode == "shadow":
            return []
        return ["", "No held-out windows (--holdout 0): the recommendation is the study's own "
                "best on the one window it trained on, which may not hold on other traffic."]
    sizes = ", ".join(f"{w.label}: {len(w.requests)} requests at {w.rate:.3g} req/s"
                      for w in spec.holdout)
    lines = ["", f"## Held-out windows: {len(spec.holdout)} the search never optimised on", "",
             f"The recommendation is chosen here ({sizes}). A searched config replaces the best "
             "baseline only when its held-out lower bound beats the baseline's held-out value; "
             "ties go to the default.", ""]
    lines += _markdown(holdout_table(spec, outcome))
    notes = holdout_notes(spec, outcome)
    return lines + ["", f"**{notes[0]}**"] + [f"- {n}" for n in notes[1:]]


def sample_text(spec: TuneSpec) -> str:
    """How many requests an evaluation has, and how many lie beyond its p99."""
    if spec.mode == "shadow":
        return ""
    n = len(spec.requests)
    tail = tail_samples(n, 100 * spec.slo.target)
    needed = min_samples(100 * spec.slo.target)
    text = (f"{n} requests a window: each p99 rests on {tail:.3g} requests beyond it")
    return text + ("" if n >= needed else
                   f" (fewer than {MIN_TAIL_SAMPLES}: noise may pick the winner; "
                   f"{needed} requests would carry it)")


def separation_note(spec: TuneSpec, outcome: StudyOutcome) -> str | None:
    """Said when the objective cannot tell the top configs apart at the workload's rate:
    at a rate every good config serves, goodput (and throughput) is the offered rate."""
    if spec.objective not in ("goodput", "pareto") or spec.mode == "shadow":
        return None
    feasible = [r for r in outcome.rows if r.feasible and r.value]
    best = outcome.top
    if best is None or len(feasible) < 3 or not best.value:
        return None
    if spec.objective == "goodput":
        n, fraction = len(spec.requests), (best.measures or {}).get("good_fraction") or 1.0
        floor = best.value * wilson(round(fraction * n), n)[0] / fraction
    else:
        floor = best.value * 0.99
    tied = [r for r in feasible if (r.value or 0.0) >= floor]
    if len(tied) * 2 < len(feasible):
        return None
    return (f"{len(tied)} of {len(feasible)} feasible trials are within noise of the best "
            f"({spec.objective} at the workload's rate: nearly every config serves what is "
            "offered), so the objective cannot separate them here; --objective capacity "
            "measures how far each config can go")


RECHECK_TITLE = "Re-check on the captured traffic: live shadow, replay and sim"


def _recheck_md(spec: TuneSpec, outcome: StudyOutcome) -> list[str]:
    recheck = outcome.recheck
    if recheck is None:
        return []
    lines = ["", f"## {RECHECK_TITLE}", ""]
    if recheck.rows:
        knobs = list(spec.space)
        lines += _markdown([recheck_table.header(knobs), *recheck_table.cells(recheck, knobs)])
        lines.append("")
    notes = recheck_table.notes(recheck)
    return lines + ([notes[0]] + [f"- {line}" for line in notes[1:]] if notes else [])


def _recheck_html(spec: TuneSpec, outcome: StudyOutcome) -> str:
    recheck = outcome.recheck
    assert recheck is not None
    knobs = list(spec.space)
    table = (html.table_html(recheck_table.header(knobs), recheck_table.cells(recheck, knobs))
             if recheck.rows else "")
    return table + html.list_html(recheck_table.notes(recheck))


def _table(spec: TuneSpec, rows: Sequence[TrialRow], names: Sequence[str] = ()) -> list[str]:
    return _markdown([_table_header(spec, names), *_table_cells(spec, rows, names)])


def _table_cells(spec: TuneSpec, rows: Sequence[TrialRow],
                 names: Sequence[str] = ()) -> list[list[str]]:
    knobs = list(spec.space)
    extra = CAPACITY_COLUMNS[:1] if spec.objective == "capacity" else ()
    out = []
    for i, row in enumerate(rows):
        m = row.measures or {}
        label = [names[i]] if names else []
        out.append([*label, f"#{row.number}", *(knob_text(row.params.get(k, "")) for k in knobs),
                    f"{row.value or 0:.4g}", *(_cell((row.capacity or {}).get(n)) for n in extra),
                    _with_ci(m, "p99_ttft"), _with_ci(m, "p99_tpot"), _with_ci(m, "p99_itl"),
                    _result(row)])
    return out


def _result(row: TrialRow) -> str:
    if not row.feasible:
        return row.infeasible or row.state.lower()
    return "feasible" + (f", {uncertain_text(row)}" if row.uncertain else "")


def _table_header(spec: TuneSpec, names: Sequence[str] = ()) -> list[str]:
    extra = CAPACITY_COLUMNS[:1] if spec.objective == "capacity" else ()
    return [*([""] if names else []), "trial", *spec.space,
            ("SLO attainment vs live" if spec.mode == "shadow"
             else f"{spec.objective} {OBJECTIVE_UNIT[spec.objective]}"),
            *(f"rate {name}" for name in extra), "p99 TTFT (95% CI)", "p99 TPOT (95% CI)",
            "p99 ITL (95% CI)",
            "result"]


def _markdown(table: Sequence[Sequence[str]]) -> list[str]:
    """A header row and body rows as a Markdown table; a `|` inside a cell is escaped."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    return [line(table[0]), "|" + " --- |" * len(table[0]), *map(line, table[1:])]


def _with_ci(m: dict[str, Any], name: str) -> str:
    if f"{name}_s" not in m:
        return "-"
    low, high = m.get(f"{name}_ci") or (None, None)
    return f"{seconds_text(m[f'{name}_s'])} ({seconds_text(low)}..{seconds_text(high)})"


# ----------------------------------------------------------------------------- report.html


def report_html(spec: TuneSpec, outcome: StudyOutcome, study: optuna.Study | None) -> str:
    """report.md's content with plots: the optimisation history, output tokens/s against p99
    TTFT (the Pareto front), parameter importances, the recommendation against the default
    and the vLLM grid. Inline SVG: the page needs nothing from the network."""
    unit = OBJECTIVE_UNIT[spec.objective]
    label = f"{spec.objective} ({unit})"
    rows = outcome.rows
    summary = report_md(spec, outcome).split("\n\n")[1].splitlines()  # the header's list
    sections = [("Study", html.list_html(line.removeprefix("- ") for line in summary))]
    shown = comparison_rows(outcome)
    if outcome.best is not None:
        bars = html.bar_chart([(f"{name} #{row.number}", row.value or 0.0) for name, row in shown],
                              label, title="recommended vs default vs vLLM grid")
        margins = margin_text(spec, outcome)
        sections.append(("Recommended vs default" + (" vs vLLM grid" if outcome.grid else ""),
                         _html_table(spec, [r for _, r in shown], [n for n, _ in shown]) + bars
                         + (html.list_html(m.removeprefix("- ") for m in margins)
                            if margins else "")))
    else:
        sections.append(("No trial met the SLOs", "<p>No best.yaml was written. Loosen the "
                         "SLOs, widen the space or lower the rate.</p>"))
    history = [html.HistoryPoint(r.number, r.value, r.feasible, r.baseline) for r in rows
               if r.state == "COMPLETE"]
    sections.append(("Optimisation history", html.history_plot(history, y_label=label)))
    front = {r.number for r in pareto_front(rows)}
    scatter = [html.ScatterPoint((r.measures or {})["p99_ttft_s"],
                                 (r.measures or {}).get("output_tokens_per_s") or 0.0,
                                 r.number in front, f"#{r.number}" + (
                                     f" {r.baseline}" if r.baseline else ""))
               for r in rows if r.feasible and (r.measures or {}).get("p99_ttft_s") is not None]
    sections.append(("Pareto front: output tokens/s against p99 TTFT", html.scatter_plot(
        scatter, "p99 TTFT (s)", "output tokens/s", title="feasible trials")))
    importances = param_importances(study)
    if importances:
        sections.append(("Parameter importances", html.bar_chart(
            sorted(importances.items(), key=lambda kv: -kv[1]), "importance (PED-ANOVA)")))
    if outcome.selection is not None:
        table = holdout_table(spec, outcome)
        sections.append(("Held-out windows", html.table_html(table[0], table[1:])
                         + html.list_html(holdout_notes(spec, outcome))))
    if outcome.recheck is not None:
        sections.append((RECHECK_TITLE, _recheck_html(spec, outcome)))
    feasible = sorted((r for r in rows if r.feasible), key=lambda r: -(r.value or 0))
    sections.append((f"Top {min(10, len(feasible))} feasible trials",
                     _html_table(spec, feasible[:10])))
    infeasible = [r for r in rows if not r.feasible]
    if infeasible:
        sections.append(("Infeasible trials", html.list_html(
            f"#{r.number}: {r.infeasible or r.state.lower()}" for r in infeasible)))
    return html.html_page(f"fairgate tune: study {outcome.study_name}", sections)


def param_importances(study: optuna.Study | None) -> dict[str, float]:
    """PED-ANOVA importances (Optuna's default evaluator, no scikit-learn needed) of the knobs for the (first) objective over the feasible trials;
    empty when there are too few trials or the knobs never varied."""
    if study is None:
        return {}
    trials = [t for t in study.get_trials(deepcopy=False, states=(
        optuna.trial.TrialState.COMPLETE,)) if t.user_attrs.get("ran")]
    if len(trials) < 3 or len({tuple(sorted(t.params.items())) for t in trials}) < 2:
        return {}
    try:
        with warnings.catch_warnings():  # it warns on any target; this one is negated on purpose
            warnings.filterwarnings("ignore", category=UserWarning, module="optuna.importance")
            return dict(optuna.importance.get_param_importances(
                study, target=lambda t: -t.values[0], normalize=True))  # low is good
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}


def _html_table(spec: TuneSpec, rows: Sequence[TrialRow], names: Sequence[str] = ()) -> str:
    """_table's cells as HTML."""
    return html.table_html(_table_header(spec, names), _table_cells(spec, rows, names))

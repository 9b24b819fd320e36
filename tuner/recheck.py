"""After a shadow study: its best configs re-checked on the traffic the gateway captured during
it, so the report shows live-shadow, replay and sim figures side by side.

The re-checked configs are the recommendation and the next best feasible trials
(`TuneSpec.recheck` in all, distinct knobs). The trace is the gateway's capture of the study's
span (`GET /admin/capture?since=&until=&limit=`), capped to the most recent
`shadow_requests` requests: about one trial's worth. Each config then runs it twice, through
the robustness re-runs' machinery (`study._Evaluator.score`, every request run to its end):

- sim: the in-process simulator on the study's base config's simulated hardware;
- replay: the shadow target's engine, reconfigured to the config, with the trace replayed by
  the load generator straight at it. Meanwhile the gateway's mirroring to that target is
  paused (its sample set to 0, restored in a `finally`: also on Ctrl-C or an error), so
  mirrored copies do not mix in.

The replays run the recommendation last, so the shadow engine is left on the recommended
config (what best.yaml holds), where the paired stats go on comparing it with the live engine.

No capture on the gateway, or none of its requests in the span: the study still succeeds and
the re-check is skipped with one line on stderr and in the report saying why and how to turn
it on.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from tuner.evaluate import Evaluator
from tuner.measures import TrialMeasures, seconds_text
from tuner.outcome import StudyOutcome, TrialRow, distinct, knob_text
from tuner.progress import Progress
from tuner.remote import error_text, request_bytes, request_json
from tuner.runners import SimRunner, TrialRunner
from tuner.shadow_mode import ShadowRunner, find_target
from tuner.spec import TuneSpec
from tuner.traces import TraceError, TraceRequest, parse_fairgate_trace

SOURCES = ("shadow", "replay", "sim")
SOURCE_TEXT = {"shadow": "live shadow", "replay": "replay", "sim": "sim"}
DRAIN_S = 30.0  # how long the mirrored copies already sent get to finish before the replays
POLL_S = 0.1
ENABLE_HINT = ("set gateway.capture: {path: FILE} in the gateway's config (and restart it) to "
               "re-check the best configs on replay and sim")

Say = Callable[[str], None]


@dataclass(frozen=True)
class Figures:
    """One config's figures from one source; a p99 that could not be met is inf."""

    p99_ttft_s: float
    p99_itl_s: float
    slo_attainment: float  # the fraction of the requests that met both SLOs
    result: str  # "met both SLOs", or why not
    attainment_gain: float | None = None  # live shadow: SLO attainment minus the live engine's

    @classmethod
    def of(cls, measures: TrialMeasures, missed: str | None) -> Figures:
        return cls(measures.p99_ttft_s, measures.p99_itl_s, measures.good_fraction,
                   missed or "met both SLOs")

    @classmethod
    def of_trial(cls, row: TrialRow) -> Figures:
        """The trial's own figures (stored JSON-safe: an infinite p99 is null)."""
        m = row.measures or {}
        return cls(_finite_or_inf(m.get("p99_ttft_s")), _finite_or_inf(m.get("p99_itl_s")),
                   float(m.get("good_fraction") or 0.0), row.infeasible or "met both SLOs",
                   row.value)


def _finite_or_inf(value: Any) -> float:
    return math.inf if value is None else float(value)


@dataclass(frozen=True)
class Rechecked:
    """One re-checked config: its figures by source, or why a source has none."""

    number: int
    role: str  # "recommended" or "next best"
    params: dict[str, Any]
    figures: dict[str, Figures] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # source -> why it did not run


@dataclass(frozen=True)
class Recheck:
    rows: list[Rechecked]
    skipped: str | None = None  # why nothing was re-checked
    requests: int = 0  # in the captured trace
    span: tuple[float, float] | None = None  # the study's span it was captured in (epochs)
    duration_s: float = 0.0  # from its first request to its last
    engine: str = ""  # what the shadow engine was left on


class Skip(Exception):
    """The re-check cannot run; the message says why and what to do."""


# ----------------------------------------------------------------------------- the re-check


def run_recheck(spec: TuneSpec, outcome: StudyOutcome, runner: TrialRunner,
                progress: Progress | None, since: float) -> Recheck:
    """The re-check of `outcome`'s best configs on the traffic captured since `since`; never
    raises for a gateway without a capture (the Recheck says why it skipped)."""
    say = _say(progress)
    picked = candidates(outcome, spec.recheck)
    until = time.time()
    try:
        if not isinstance(runner, ShadowRunner):
            raise Skip("the re-check replays on a gateway's shadow target: --mode shadow only")
        if not picked:
            raise Skip("no trial met both SLOs on the mirrored traffic, so there is no config "
                       "to re-check")
        trace = fetch_capture(runner, since, until, spec.runner.shadow_requests)
    except Skip as exc:
        say(f"fairgate tune: re-check skipped: {exc}")
        return Recheck([], skipped=str(exc))
    say(f"fairgate tune: re-check: {len(picked)} config(s) on the {len(trace)} requests the "
        "gateway captured last in the study, in sim, then replayed on the shadow engine")
    sims = run_source(spec, SimRunner(), picked, trace, "sim", say)
    replays, engine = _replays(spec, runner, picked, trace, say)
    rows = [Rechecked(row.number, "recommended" if i == 0 else "next best", row.params,
                      {"shadow": Figures.of_trial(row)}) for i, row in enumerate(picked)]
    for row in rows:
        for source, results in (("replay", replays), ("sim", sims)):
            result = results.get(row.number, "not run")
            if isinstance(result, Figures):
                row.figures[source] = result
            else:
                row.notes[source] = result
    return Recheck(rows, requests=len(trace), span=(since, until),
                   duration_s=trace[-1].arrival, engine=engine)


def candidates(outcome: StudyOutcome, count: int) -> list[TrialRow]:
    """The recommendation, then the next best feasible trials (one per set of knobs)."""
    best = outcome.best
    if best is None or count <= 0:
        return []
    others = sorted((r for r in outcome.rows if r.feasible and r.value is not None),
                    key=lambda r: (-(r.value or 0.0), r.number))
    return distinct([best, *others])[:count]


def run_source(spec: TuneSpec, runner: TrialRunner, rows: Iterable[TrialRow],
               trace: Sequence[TraceRequest], source: str, say: Say) -> dict[int, Figures | str]:
    """Each config of `rows` on `trace` with `runner` (every request to its end): its figures,
    or why it did not run."""
    evaluator = Evaluator(spec, runner, runner.prepare(spec.base), full_runs=True)
    out: dict[int, Figures | str] = {}
    rows = list(rows)
    for i, row in enumerate(rows):
        try:
            scored = evaluator.score(evaluator.config(row.params), trace)
        except ValueError as exc:
            out[row.number] = f"did not start: {' '.join(str(exc).split())}"
        else:
            out[row.number] = Figures.of(scored.measures, scored.missed)
        say(f"fairgate tune: re-check {source} {i + 1}/{len(rows)} (#{row.number}): "
            + describe(out[row.number]))
    return out


def _replays(spec: TuneSpec, runner: ShadowRunner, picked: Sequence[TrialRow],
             trace: Sequence[TraceRequest],
             say: Say) -> tuple[dict[int, Figures | str], str]:
    """The replays on the shadow engine, mirroring paused, the recommendation last (so the
    engine is left on it); and what the engine was left on."""
    try:
        with paused_mirroring(runner.gateway, runner.admin_key, runner.shadow, say):
            replays = run_source(spec, runner.engine, reversed(picked), trace, "replay", say)
    except Skip as exc:
        say(f"fairgate tune: re-check replay skipped: {exc}")
        return {row.number: f"not run: {exc}" for row in picked}, ""
    best = picked[0].number
    if isinstance(replays.get(best), Figures):
        return replays, f"the shadow engine is left on the recommended config (#{best})"
    return replays, (f"the shadow engine could not be set to the recommended config (#{best}); "
                     "it is on the last config that started")


def describe(result: Figures | str) -> str:
    if isinstance(result, str):
        return result
    return (f"p99 TTFT {seconds_text(result.p99_ttft_s)}, p99 ITL {seconds_text(result.p99_itl_s)}, SLO "
            f"attainment {result.slo_attainment:.1%} ({result.result})")


def _say(progress: Progress | None) -> Say:
    if progress is not None:
        return progress.note
    return lambda line: print(line, file=sys.stderr)


# ----------------------------------------------------------------------------- the gateway


def fetch_capture(runner: ShadowRunner, since: float, until: float,
                  limit: int) -> list[TraceRequest]:
    """The gateway's captured requests of [since, until), the latest `limit`; Skip when there
    are none, or no capture to read them from."""
    url = (f"{runner.gateway}/admin/capture?since={since:.6f}&until={until:.6f}"
           f"&limit={limit}")
    try:
        status, raw = request_bytes(url, runner.admin_key, timeout=60.0)
    except OSError as exc:
        raise Skip(f"cannot reach the gateway for its capture: {getattr(exc, 'reason', exc)}") \
            from None
    return capture_trace(status, raw, since, until)


def capture_trace(status: int, raw: bytes, since: float, until: float) -> list[TraceRequest]:
    """The trace in a `GET /admin/capture` answer; Skip, with why and how to turn it on, for
    a gateway without a capture, an error or a span with no requests."""
    span = f"{_clock(since)} to {_clock(until)} UTC"
    if status == 404:
        body = request_error(raw)
        if body.get("code") == "no_capture":
            raise Skip(f"the gateway captures no traffic; {ENABLE_HINT}")
        raise Skip(f"the gateway has no /admin/capture ({error_text({'error': body}, status)}); "
                   f"upgrade it and {ENABLE_HINT}")
    if status != 200:
        raise Skip(f"the gateway's /admin/capture answered {status}: "
                   f"{error_text({'error': request_error(raw)}, status)}")
    try:
        trace = parse_fairgate_trace(raw.decode("utf-8", errors="replace"), "the capture")
    except TraceError as exc:
        raise Skip(f"the gateway's capture could not be read: {exc}") from None
    if not trace:
        raise Skip(f"the gateway's capture holds no requests from the study's span ({span}); "
                   "is gateway.capture.sample 0, or was the live traffic not served by this "
                   "gateway?")
    return trace


def request_error(raw: bytes) -> dict[str, Any]:
    """The OpenAI-shaped error object of an answer (empty when it has none)."""
    try:
        error = json.loads(raw or b"{}").get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


def _clock(epoch: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(epoch))


@contextlib.contextmanager
def paused_mirroring(gateway: str, admin_key: str | None, shadow: str,
                     say: Say) -> Iterator[None]:
    """The gateway's mirroring to `shadow` paused (sample 0) until the block ends, the copies
    already sent finished first; the old sample is restored however the block ends (a restore
    that fails is said, loudly, and does not hide the block's own result or error)."""
    old = float(_target(gateway, admin_key, shadow)["sample"])
    _set_sample(gateway, admin_key, shadow, 0.0)
    try:
        _drain(gateway, admin_key, shadow)
        yield
    finally:
        try:
            _set_sample(gateway, admin_key, shadow, old)
        except Skip as exc:
            say(f"fairgate tune: could not restore shadow target {shadow!r}'s sample to "
                f"{old:g} ({exc}): PATCH /admin/shadow/{shadow} {{\"sample\": {old:g}}} "
                "by hand")


def _target(gateway: str, admin_key: str | None, shadow: str) -> dict[str, Any]:
    try:
        return find_target(gateway, admin_key, shadow)
    except ValueError as exc:
        raise Skip(str(exc)) from None


def _set_sample(gateway: str, admin_key: str | None, shadow: str, sample: float) -> None:
    try:
        status, body = request_json(f"{gateway}/admin/shadow/{quote(shadow)}", admin_key,
                                    {"sample": sample}, method="PATCH")
    except OSError as exc:
        raise Skip(f"cannot reach the gateway: {getattr(exc, 'reason', exc)}") from None
    if status != 200:
        raise Skip(f"setting shadow target {shadow!r}'s sample to {sample:g} answered {status}: "
                   f"{error_text(body, status)}")


def _drain(gateway: str, admin_key: str | None, shadow: str) -> None:
    """Until the target has no copy queued, in flight or handed on unanswered (or DRAIN_S
    passed)."""
    deadline = time.monotonic() + DRAIN_S
    while time.monotonic() < deadline:
        target = _target(gateway, admin_key, shadow)
        if not any(target.get(k) for k in ("queued", "inflight", "outstanding")):
            return
        time.sleep(POLL_S)


# ----------------------------------------------------------------------------- the report


def header(knobs: Sequence[str]) -> list[str]:
    cells = ["", "trial", *knobs]
    for source in SOURCES:
        name = SOURCE_TEXT[source]
        cells += [f"{name} p99 TTFT", f"{name} p99 ITL", f"{name} SLO attainment"]
        if source == "shadow":
            cells.append("gain vs live")
    return cells


def cells(recheck: Recheck, knobs: Sequence[str]) -> list[list[str]]:
    out = []
    for row in recheck.rows:
        line = [row.role, f"#{row.number}", *(knob_text(row.params.get(k, "")) for k in knobs)]
        for source in SOURCES:
            got = row.figures.get(source)
            line += ([seconds_text(got.p99_ttft_s), seconds_text(got.p99_itl_s), f"{got.slo_attainment:.1%}"]
                     if got is not None else ["-", "-", "-"])
            if source == "shadow":
                gain = got.attainment_gain if got is not None else None
                line.append("-" if gain is None else f"{gain:+.3f}")
        out.append(line)
    return out


def notes(recheck: Recheck) -> list[str]:
    """The lines under the table: what the trace was, where the engine was left, and every
    source that missed the SLOs or did not run."""
    if recheck.skipped is not None:
        return [f"Skipped: {recheck.skipped}."]
    lines = []
    if recheck.span is not None:
        since, until = recheck.span
        lines.append(f"On the last {recheck.requests} requests the gateway captured in the "
                     f"study's span ({_clock(since)} to {_clock(until)} UTC; "
                     f"{recheck.duration_s:.1f} s of traffic), every request run to its end; "
                     "live shadow is the trial's own window of mirrored requests. "
                     "Replay ran on the shadow engine with the gateway's mirroring to it "
                     "paused; sim on the base config's simulated hardware.")
    if recheck.engine:
        lines.append(f"After the re-check {recheck.engine}.")
    for row in recheck.rows:
        for source in SOURCES:
            got = row.figures.get(source)
            why = row.notes.get(source) or (got.result if got is not None
                                            and got.result != "met both SLOs" else None)
            if why:
                lines.append(f"#{row.number} {SOURCE_TEXT[source]}: {why}")
    return lines


def csv_rows(recheck: Recheck, knobs: Sequence[str]) -> list[list[str]]:
    """recheck.csv: a row per config, each source's figures and result side by side."""
    head = ["trial", "role", *knobs]
    for source in SOURCES:
        head += [f"{source}_p99_ttft_s", f"{source}_p99_itl_s", f"{source}_slo_attainment"]
        if source == "shadow":
            head.append("shadow_attainment_gain")
        head.append(f"{source}_result")
    rows = [head]
    for row in recheck.rows:
        line = [str(row.number), row.role, *(str(row.params.get(k, "")) for k in knobs)]
        for source in SOURCES:
            got = row.figures.get(source)
            if got is None:
                line += ["", "", ""] + ([""] if source == "shadow" else [])
                line.append(row.notes.get(source, "not run"))
                continue
            line += [_number(got.p99_ttft_s), _number(got.p99_itl_s),
                     _number(got.slo_attainment)]
            if source == "shadow":
                line.append("" if got.attainment_gain is None else _number(got.attainment_gain))
            line.append(got.result)
        rows.append(line)
    return rows


def _number(value: float) -> str:
    return "inf" if math.isinf(value) else f"{value:.6g}"


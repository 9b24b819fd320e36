"""The Optuna study behind `fairgate tune`: create or resume it, run its workers, choose.

A trial: the space suggests knobs, `tuner.space.build_config` checks them before anything runs,
the mode's `TrialRunner` (`tuner.runners`) replays the train window under them, and each p99
the SLO sets (TTFT and TPOT per request, ITL every gap: `tuner.measures`) becomes an Optuna
constraint (`p99 - SLO`, feasible when <= 0; `tuner.evaluate`). The objective, maximised, is
goodput, capacity or pareto's throughput against p99 TTFT (`tuner.spec.OBJECTIVES`).

After the search the recommendation is chosen on the held-out windows (`tuner.holdout`), and
a shadow study is re-checked on its captured traffic (`tuner.recheck`). Several workers, in
this process's children or on other machines, share one study through its storage: each
takes its own sampler slot, and the baselines (`tuner.baselines`) are enqueued once, under
the database's lock (`tuner.study_lock`). The runner puts back what the study changed when it
ends, however it ends (replay: the engine's own config).
"""

from __future__ import annotations

import dataclasses
import datetime
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from engine.config import EngineConfig
from tuner.baselines import baseline_params
from tuner.evaluate import Evaluator, beat_orphans
from tuner.holdout import run_holdout
from tuner.outcome import (
    StudyOutcome,
    TrialRow,
    baseline_row,
    best_row,
    describe_result,
    pareto_front,
    value_text,
)
from tuner.progress import Progress
from tuner.runners import RUNNERS, TrialRunner
from tuner.space import build_config
from tuner.spec import FINGERPRINT_TEXT, TuneSpec
from tuner.study_lock import database_lock, open_rdb_storage, storage_text


def open_storage(spec: TuneSpec) -> optuna.storages.RDBStorage:
    """Optuna's RDB storage on the study's URL, with heartbeats: a trial whose worker stopped
    beating for two intervals is failed and re-run once, with the same knobs. Opened under
    the database's lock: processes that open a new database at once would each create
    Optuna's tables, and all but one fail. On SQLite every transaction takes the write lock
    as it begins (`tuner.study_lock.immediate_transactions`), or two workers could run the
    same waiting trial."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry = optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=1)
    return open_rdb_storage(spec.storage, heartbeat_interval=spec.heartbeat_s,
                            grace_period=2 * spec.heartbeat_s,
                            heartbeat_stale_trial_callback=retry)


def run_study(spec: TuneSpec, progress: Progress | None = None) -> StudyOutcome:
    """Run the study named in `spec` until it holds `spec.trials` finished trials (or for
    `spec.timeout_s`), creating or resuming it, over `spec.workers` workers; then choose the
    recommendation on the held-out windows (`tuner.holdout`; shadow mode: re-check the best
    ones on the study's captured traffic, `tuner.recheck`) and write best.yaml, trials.csv
    and reports."""
    runner = _runner(spec, 0)
    prepared = runner.prepare(spec.base)
    if spec.mode == "replay":  # the engine's own config is the base and the default trial
        spec = dataclasses.replace(spec, base=prepared)
    winner = None
    try:
        outcome = _run(spec, runner, prepared, progress)
        if outcome.best is not None:
            winner = build_config(prepared, outcome.best.params)
        return outcome
    finally:
        _finish(runner, winner, progress)


def _finish(runner: TrialRunner, winner: EngineConfig | None,
            progress: Progress | None) -> None:
    """The runner puts back what the study changed; a failure to is said, never raised over
    the study's own outcome or error."""
    try:
        runner.finish(winner)
    except ValueError as exc:
        if progress is not None:
            progress.note(f"fairgate tune: could not restore the engine: {exc}")


def _run(spec: TuneSpec, runner: TrialRunner, prepared: EngineConfig,
         progress: Progress | None) -> StudyOutcome:
    from tuner.recheck import run_recheck
    from tuner.study_report import write_outputs

    baselines = baseline_params(spec, prepared)  # checked before the storage is touched
    study = _open_study(spec, prepared, open_storage(spec), baselines)
    if progress is not None:
        earlier = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        progress.started = progress.done = earlier
        progress.note(f"fairgate tune: study {spec.study_name} on {storage_text(spec.storage)}"
                 + (f", resumed with {earlier} trials done" if earlier else "")
                 + f"; {len(spec.requests)} requests per trial"
                 + (f"; {spec.workers} workers" if spec.workers > 1 else ""))
    _settle_running(spec, study, progress)
    children = _start_workers(spec)
    try:
        _optimize(spec, study, runner, prepared, worker=0, progress=progress)
    finally:
        failed = _join_workers(children)
    if failed:
        if progress is not None:
            progress.note(f"fairgate tune: {failed} worker(s) exited early; re-running what "
                          "they left")
        _settle_running(spec, study, progress)
        _optimize(spec, study, runner, prepared, worker=0, progress=progress)
    selection = run_holdout(spec, study, runner, prepared, progress)
    rows = [TrialRow.of(t) for t in study.get_trials(deepcopy=False)]
    if selection is None:  # no held-out re-run: an uncertain trial does not win over a sure one
        best = best_row([r for r in rows if not r.uncertain]) or best_row(rows)
    else:  # the held-out windows re-ran it on more requests
        best = next(r for r in rows if r.number == selection.chosen.number)
    outcome = StudyOutcome(spec.study_name, rows, best, baseline_row(rows, "default"),
                           selection=selection,
                           front=pareto_front(rows) if spec.multi_objective else [])
    if spec.mode == "shadow" and spec.recheck > 0:
        outcome = dataclasses.replace(outcome, recheck=run_recheck(
            spec, outcome, runner, progress, _started_at(study)))
    return dataclasses.replace(outcome, files=write_outputs(spec, outcome, study))


def _started_at(study: optuna.Study) -> float:
    """When the study's first trial started (epoch seconds; over every run of a resumed
    study): the start of the span whose captured traffic the re-check replays."""
    starts = [t.datetime_start.timestamp() for t in study.get_trials(deepcopy=False)
              if t.datetime_start is not None]
    return min(starts, default=time.time())


def _runner(spec: TuneSpec, worker: int) -> TrialRunner:
    options = dataclasses.replace(spec.runner, knobs=tuple(spec.space))
    if spec.urls:
        options = dataclasses.replace(options, url=spec.urls[worker % len(spec.urls)])
    return RUNNERS[spec.mode](options)


def _open_study(spec: TuneSpec, prepared: EngineConfig, storage: optuna.storages.BaseStorage,
                baselines: Sequence[tuple[str, dict[str, Any]]]) -> optuna.Study:
    """Create or load the study. Under the study's lock (`tuner.study_lock`), so of the
    processes that open it at once exactly one sets it up: its fingerprint, its objectives'
    names (optuna-dashboard's and trials_dataframe's columns: trials.csv's), and its baselines,
    enqueued once per study (`user_attrs["baselines"]` says it is done: a resumed study, or a
    process joining a running one, enqueues none again)."""
    from tuner.study_report import value_column

    directions: list[optuna.study.StudyDirection] = [optuna.study.StudyDirection.MAXIMIZE]
    names = [value_column(spec)]
    if spec.multi_objective:
        directions.append(optuna.study.StudyDirection.MINIMIZE)
        names.append("p99_ttft_s")
    with database_lock(spec.storage, f"study {spec.study_name}"):
        study = optuna.create_study(storage=storage, study_name=spec.study_name,
                                    directions=directions, load_if_exists=True)
        fingerprint = spec.fingerprint(prepared)
        stored = study.user_attrs.get("spec")
        if stored is None:
            study.set_user_attr("spec", fingerprint)
        elif stored != fingerprint:
            keys = [k for k in fingerprint if stored.get(k) != fingerprint[k]]
            if "requests" in keys and "requests_sha256" in keys:
                keys.remove("requests_sha256")
            differ = ", ".join(FINGERPRINT_TEXT.get(k, k) for k in keys)
            raise ValueError(f"study {spec.study_name!r} was made with a different {differ}; "
                             "resume it with the same options or pick a new --study name")
        if study.metric_names != names:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                study.set_metric_names(names)
        if "baselines" not in study.user_attrs:
            for label, params in baselines:  # skip_if_exists: a study from before the mark
                study.enqueue_trial(params, user_attrs={"baseline": label}, skip_if_exists=True)
            study.set_user_attr("baselines", [label for label, _ in baselines])
    return study


def _sampler(spec: TuneSpec, study: optuna.Study, worker: int) -> optuna.samplers.BaseSampler:
    """Multivariate TPE with the constant liar (a trial running in any process counts as a
    poor result, so samplers that share the study propose apart; alone it changes nothing),
    seeded --seed + the study's trials now + 7919 x this sampler's slot. A slot is a number
    each sampler takes once, atomically, from the study (`user_attrs["sampler_slots"]`
    counts them): workers and processes that join one study with the same --seed never share
    a seed, while a study's first sampler takes slot 0, so one process with --seed N draws
    what it always did. Counting the trials keeps a resumed study from replaying the first
    run's samples. (`worker` is no part of the seed: the slot tells samplers apart.)"""
    with database_lock(spec.storage, f"study {spec.study_name}"):
        slot = study.user_attrs.get("sampler_slots", 0)
        study.set_user_attr("sampler_slots", slot + 1)
        done = len(study.get_trials(deepcopy=False))
    return optuna.samplers.TPESampler(seed=spec.seed + done + 7919 * slot, multivariate=True,
                                      constant_liar=True)


def _optimize(spec: TuneSpec, study: optuna.Study, runner: TrialRunner, prepared: EngineConfig,
              worker: int, progress: Progress | None) -> None:
    """This worker's share: trials until the study holds spec.trials, finished or running."""
    study.sampler = _sampler(spec, study, worker)
    n_trials = None
    callbacks: list[Callable[[optuna.Study, FrozenTrial], None]] = []
    if spec.trials is not None:
        n_trials = spec.trials - _taken(study)
        if n_trials <= 0:
            return
        callbacks.append(_StudySize(spec.trials))
    evaluate = Evaluator(spec, runner, prepared, progress, worker)
    if progress is not None:
        callbacks.append(_ProgressLine(spec, progress))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        # the base config's values may lie outside a --space file's ranges: it runs as it is
        warnings.filterwarnings("ignore", "Fixed parameter .* is out of range", UserWarning)
        started = time.monotonic()
        while True:
            study.optimize(evaluate, n_trials=n_trials, timeout=_left(spec, started),
                           callbacks=callbacks, gc_after_trial=False)
            # A killed run's trial that went stale only after this worker counted it as
            # running is failed and queued again (with its knobs), here or meanwhile: run it
            # too, or the study ends a trial short (or with it RUNNING forever). Failed trials
            # queue at most once (max_retry), so this ends.
            if spec.trials is None or _left(spec, started) == 0.0:
                return
            _fail_stale_trials(study)
            n_trials = min(spec.trials - _taken(study), len(study.get_trials(
                deepcopy=False, states=(TrialState.WAITING,))))
            if n_trials <= 0:
                return


def _left(spec: TuneSpec, started: float) -> float | None:
    """What is left of --timeout since `started` (None: no timeout)."""
    if spec.timeout_s is None:
        return None
    return max(0.0, spec.timeout_s - (time.monotonic() - started))


def _taken(study: optuna.Study) -> int:
    """Trials that count toward the study's size: finished, or running in some worker."""
    return len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,
                                                        TrialState.RUNNING)))


class _StudySize:
    """Stops a worker once the study's trials, finished or running anywhere, reach its size
    (a worker never starts a trial the others already fill)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if _taken(study) >= self.size:
            study.stop()


def _settle_running(spec: TuneSpec, study: optuna.Study, progress: Progress | None) -> None:
    """Trials RUNNING when this worker starts belong to a live worker or to one that was
    killed. Wait until each finishes or misses its heartbeats for the grace period (then it is
    failed and queued again with the same knobs, `open_storage`), so a study restarted at once
    after a kill still re-runs the killed trial; a trial still beating after that is a live
    worker's, and counts toward the size."""
    if spec.trials is None:
        return
    running = {t.number for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))}
    if not running:
        return
    # the grace period (2 beats), one more beat, and a second: SQLite's clock
    # (CURRENT_TIMESTAMP, which Optuna's heartbeats read) has whole seconds
    wait_s = 3 * spec.heartbeat_s + 1.0
    if progress is not None:
        progress.note(f"fairgate tune: trial(s) {', '.join(f'#{n}' for n in sorted(running))} "
                      f"running (another worker's, or a killed one's): waiting up to {wait_s} s "
                      "for their heartbeats")
    deadline = time.monotonic() + wait_s
    while True:
        _fail_stale_trials(study)
        still = running & {t.number for t in study.get_trials(
            deepcopy=False, states=(TrialState.RUNNING,))}
        if not still or time.monotonic() > deadline:
            break
        time.sleep(min(0.5, spec.heartbeat_s / 4))
    ended = running - still
    if progress is not None and ended:
        progress.note(f"fairgate tune: trial(s) {', '.join(f'#{n}' for n in sorted(ended))} "
                      "ended or stopped beating; one that stopped runs again with its knobs")


def _fail_stale_trials(study: optuna.Study, now: datetime.datetime | None = None) -> None:
    """Fail the study's trials whose worker stopped beating (each is queued again once, with its
    knobs: `open_storage`'s callback). Optuna does this as each trial starts; a worker ending
    its share does it once more, for a killed worker's trial that went stale meanwhile.

    Optuna never finds a trial stale that has no heartbeat at all (a worker killed while the
    sampler chose its knobs): `evaluate.beat_orphans` gives such a trial one first (`now`: the
    time to judge its age by, default the clock's)."""
    beat_orphans(study, now)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        optuna.storages.fail_stale_trials(study)


WORKER_START_S = 120.0  # how long the first worker waits for the others to load the study


def _start_workers(spec: TuneSpec) -> list[Any]:
    """Workers 1..N-1 as processes (spawned: no state shared but the storage). Returns once
    each has loaded the study (or WORKER_START_S passed), so all start sampling together."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready = [context.Event() for _ in range(1, spec.workers)]
    children = [context.Process(target=_worker_main, args=(spec, worker, ready[worker - 1]),
                                daemon=True, name=f"fairgate-tune-worker-{worker}")
                for worker in range(1, spec.workers)]
    for child in children:
        child.start()
    for child, event in zip(children, ready, strict=True):
        deadline = time.monotonic() + WORKER_START_S
        while not event.wait(0.1) and child.is_alive() and time.monotonic() < deadline:
            pass
    return children


def _join_workers(children: Sequence[Any]) -> int:
    for child in children:
        child.join()
    return sum(child.exitcode != 0 for child in children)


def _worker_main(spec: TuneSpec, worker: int, ready: Any) -> None:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    runner = _runner(spec, worker)
    prepared = runner.prepare(spec.base)
    try:
        study = optuna.load_study(study_name=spec.study_name, storage=open_storage(spec))
        ready.set()
        _optimize(spec, study, runner, prepared, worker, progress=None)
    finally:  # this worker's engine (replay with several) back on its own config
        _finish(runner, None, None)


class _ProgressLine:
    """Each finished trial to the progress bar: its result and the study's best so far."""

    def __init__(self, spec: TuneSpec, progress: Progress) -> None:
        self.progress = progress

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        rows = [TrialRow.of(t) for t in study.get_trials(deepcopy=False, states=(
            TrialState.COMPLETE,))]
        best = best_row(rows)
        best_text = (f"best {value_text(best)} (#{best.number})" if best is not None
                     else "no feasible trial yet")
        self.progress.done = len(rows) - 1  # the study's, every worker's: finish adds this one
        self.progress.finish(trial.number, describe_result(TrialRow.of(trial)), best_text)


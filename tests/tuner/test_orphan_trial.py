"""A worker killed while the sampler chose a trial's knobs leaves a RUNNING trial with no
heartbeat, which Optuna never finds stale: `tuner.study._fail_stale_trials` gives it one beat,
so it is failed and re-run like any killed trial (the flake of
tests/gateway/test_tune_jobs.py's killed-gateway test: 4 of 5 trials, #3 RUNNING forever)."""

from __future__ import annotations

import datetime
import warnings
from pathlib import Path

import optuna
from optuna.trial import TrialState

from tests.support.waiting import poll_until
from tuner.evaluate import heartbeats
from tuner.study import _fail_stale_trials


def test_a_trial_killed_before_its_first_beat_is_failed_and_queued_again(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(
            f"sqlite:///{tmp_path / 'study.db'}", heartbeat_interval=1, grace_period=2,
            heartbeat_stale_trial_callback=optuna.storages.RetryHeartbeatStaleTrialCallback(
                max_retry=1))
    study = optuna.create_study(study_name="orphan", storage=storage)
    with warnings.catch_warnings():  # "Heartbeat ... supposed to be used with Study.optimize"
        warnings.simplefilter("ignore", UserWarning)
        orphan = study.ask()  # RUNNING; its worker "dies" before the objective's first beat
    started = orphan.datetime_start
    assert started is not None
    _fail_stale_trials(study)  # young: left alone
    assert study.get_trials()[0].state is TrialState.RUNNING
    _fail_stale_trials(study, now=started + datetime.timedelta(seconds=3))  # past the grace

    def failed() -> bool:
        _fail_stale_trials(study)  # called again and again (the settle loop): beaten once only
        return study.get_trials()[0].state is not TrialState.RUNNING

    # its one beat goes stale after the grace period (SQLite's clock has whole seconds)
    poll_until(failed, 15, "the orphan trial failed", every=0.2)
    states = [t.state for t in study.get_trials()]
    assert states == [TrialState.FAIL, TrialState.WAITING], states  # failed and queued again


def test_the_objectives_first_beat_reaches_a_cached_rdb_storage(tmp_path: Path) -> None:
    """A study keeps its RDB storage behind Optuna's cache (no RDBStorage): the objective's
    first beat (evaluate._beat) went nowhere while it looked for one."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(f"sqlite:///{tmp_path / 'study.db'}",
                                             heartbeat_interval=1)
    assert heartbeats(optuna.create_study(storage=storage)) is not None
    assert heartbeats(optuna.create_study()) is None  # in memory: no heartbeats

"""One study that several `fairgate tune` processes share, and Optuna's own tools on it: joiners
sample apart and enqueue the baselines once; the storage printed is one optuna-dashboard opens;
objectives are named and infeasible trials are infeasible to Optuna's readers too."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import optuna
import pytest
from optuna.study._constrained_optimization import _get_feasible_trials
from optuna.trial import FrozenTrial, TrialState

from fairgate.cli import main
from tests.support import postgres
from tests.support.processes import ROOT
from tuner.spec import VLLM_GRID
from tuner.study_lock import storage_text

WORKLOAD = ["--workload", "uniform", "--rate", "10", "--duration", "4"]  # 36 requests
# a trial long enough that joiners started together open the study within one trial
SHARED_WORKLOAD = ["--workload", "uniform", "--rate", "10", "--duration", "10"]
SLOS = ["--slo-ttft-p99", "1", "--slo-itl-p99", "0.1"]
RAN = (0, 1)  # exit status 1: no trial met the SLOs, a finished study all the same
TRIALS = 30  # in all, over every joiner: each runs with --trials 30
WORKERS = 4  # three joiners, one with two workers
PG_SKIP = postgres.unreachable()


def joiner(storage: str, out: Path, *options: str) -> subprocess.Popen[str]:
    """A `fairgate tune` process joining study "shared" (all with the same --seed)."""
    command = [sys.executable, "-m", "fairgate", "tune", "--mode", "sim", *SHARED_WORKLOAD,
               *SLOS, "--study", "shared", "--storage", storage, "--out", str(out),
               "--robustness", "0", *options]
    return subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run_joiners(storage: str, tmp_path: Path, *options: str) -> list[str]:
    """Three joiners started together with the same --seed and `options`, one of them with
    two workers: their stderr."""
    procs = [joiner(storage, tmp_path / "a", *options), joiner(storage, tmp_path / "b", *options),
             joiner(storage, tmp_path / "c", *options, "--workers", "2")]
    errs = []
    for proc in procs:
        _, err = proc.communicate(timeout=240)
        assert proc.returncode in RAN, err[-3000:]
        errs.append(err)
    return errs


def knobs(trial: FrozenTrial) -> tuple[tuple[str, object], ...]:
    return tuple(sorted(trial.params.items()))


def check_shared_study(study: optuna.Study, size: int, baselines: list[str]) -> None:
    trials = study.get_trials()
    finished = [t for t in trials if t.state.is_finished()]
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    # each worker checks the study's size after its trial and asks for the next one apart
    # from that check: workers that finish together may each start one more (tuner.study's
    # _StudySize), so up to WORKERS - 1 beyond the size
    assert size <= len(finished) <= size + WORKERS - 1, sorted(t.number for t in finished)
    # a killed trial's re-run repeats its knobs by design; none is killed here
    repeats = {k: n for k, n in Counter(knobs(t) for t in complete
                                        if "failed_trial" not in t.system_attrs).items() if n > 1}
    assert not repeats, f"trials with the same knobs: {repeats}"
    labels = [t.user_attrs["baseline"] for t in trials if "baseline" in t.user_attrs]
    assert sorted(labels) == sorted(baselines)  # each enqueued once, by one of the joiners
    assert study.user_attrs["baselines"] == baselines
    # the --workers 2 joiner's second worker may find the study full by the time it has
    # spawned (sim trials take milliseconds here): it may run none, never another's knobs
    assert {t.user_attrs["worker"] for t in complete} <= {0, 1}


@pytest.mark.skipif(PG_SKIP is not None, reason=PG_SKIP or "")
def test_joiners_share_one_postgresql_study_without_repeats(tmp_path: Path) -> None:
    with postgres.fresh_database("fg_shared") as name:
        # trust auth: the password is ignored by the server, and must never be printed
        url = f"postgresql+asyncpg://{postgres.PG_USER}:hunter2@{postgres.PG_HOST}:" \
              f"{postgres.PG_PORT}/{name}"
        errs = run_joiners(url, tmp_path, "--trials", str(TRIALS))
        shown = f"postgresql://{postgres.PG_USER}:***@{postgres.PG_HOST}:{postgres.PG_PORT}/{name}"
        for err in errs:
            assert f"study shared on {shown}" in err and "hunter2" not in err, err[:2000]
        study = optuna.load_study(study_name="shared", storage=url.replace(
            "postgresql+asyncpg", "postgresql"))
        check_shared_study(study, TRIALS, ["default"])


SQLITE_TRIALS = 16  # SQLite takes one writer at a time: a smaller study, the same race
GRID = ["default", *(f"vllm-grid {seqs}x{tokens}" for seqs, tokens in VLLM_GRID)]


def test_joiners_share_one_sqlite_study_without_repeats(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'studies.db'}"
    errs = run_joiners(url, tmp_path, "--trials", str(SQLITE_TRIALS), "--baseline", "vllm-grid")
    assert all(f"study shared on sqlite:///{tmp_path / 'studies.db'}" in err for err in errs)
    check_shared_study(optuna.load_study(study_name="shared",
                                         storage=f"sqlite:///{tmp_path / 'studies.db'}"),
                       SQLITE_TRIALS, GRID)


def tune(tmp_path: Path, *extra: str, slos: list[str] = SLOS) -> int:
    return main(["tune", "--mode", "sim", *WORKLOAD, *slos, "--study", "s", "--storage",
                 f"sqlite:///{tmp_path / 'studies.db'}", "--out", str(tmp_path / "out"),
                 "--robustness", "0", *extra])


def load(tmp_path: Path) -> optuna.Study:
    return optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'studies.db'}")


def test_a_resumed_study_enqueues_no_baseline_again(tmp_path: Path) -> None:
    assert tune(tmp_path, "--trials", "2") in RAN
    assert tune(tmp_path, "--trials", "4") in RAN
    study = load(tmp_path)
    assert [t.user_attrs.get("baseline") for t in study.get_trials()].count("default") == 1
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 4


def test_the_storage_shown_is_the_sync_url_without_its_password() -> None:
    assert storage_text("postgresql+asyncpg://u:secret@db:5432/fg") == "postgresql://u:***@db:5432/fg"
    assert storage_text("sqlite+aiosqlite:///x/s.db") == "sqlite:///x/s.db"
    assert storage_text("postgresql://u@db/fg") == "postgresql://u@db/fg"


@pytest.mark.parametrize(("objective", "names"), [
    ("goodput", ["goodput_rps"]), ("pareto", ["throughput_tok_s", "p99_ttft_s"])])
def test_objectives_are_named_as_trials_csv_names_them(
        tmp_path: Path, objective: str, names: list[str]) -> None:
    assert tune(tmp_path, "--trials", "2", "--objective", objective) in RAN
    study = load(tmp_path)
    assert study.metric_names == names
    columns = study.trials_dataframe(multi_index=True).columns
    assert [name for top, name in columns if top in ("value", "values")] == names
    header = (tmp_path / "out" / "trials.csv").read_text().splitlines()[0].split(",")
    assert set(names) <= set(header)


INFEASIBLE_SPACE = "max_num_seqs: {low: 4096, high: 8192}\n"  # above the 2048-token budget


def infeasible_study(tmp_path: Path) -> optuna.Study:
    """The base config (loose SLOs: it meets them) and trials that cannot run."""
    space = tmp_path / "space.yaml"
    space.write_text(INFEASIBLE_SPACE)
    assert tune(tmp_path, "--trials", "3", "--space", str(space),
                slos=["--slo-ttft-p99", "10", "--slo-itl-p99", "0.5"]) == 0
    return load(tmp_path)


def test_infeasible_trials_are_infeasible_through_optunas_api(tmp_path: Path) -> None:
    study = infeasible_study(tmp_path)
    trials = study.get_trials(states=(TrialState.COMPLETE,))
    ours = {t.number for t in trials if t.user_attrs["infeasible"] is None}
    assert ours == {0} and len(trials) == 3  # the default met the SLOs; the rest never ran
    assert {t.number for t in _get_feasible_trials(trials)} == ours
    assert all(any(v > 0 for v in t.constraints.values()) for t in trials if t.number not in ours)
    assert study.best_trial.number == 0  # the infeasible ones never win


def test_infeasible_trials_are_infeasible_in_optuna_dashboard(tmp_path: Path) -> None:
    study = infeasible_study(tmp_path)
    for trial in study.get_trials(states=(TrialState.COMPLETE,)):
        # optuna_dashboard._serializer: trial._system_attrs.get("constraints", []), feasible
        # when every value is <= 0
        listed = trial.system_attrs.get("constraints", [])
        assert all(c <= 0 for c in listed) == (trial.user_attrs["infeasible"] is None)


def test_tune_reads_fairgate_yaml_in_the_working_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("fairgate.yaml").write_text("engine:\n  max_num_seqs: 48\n")
    assert tune(tmp_path, "--trials", "1") in RAN
    (default,) = load(tmp_path).get_trials()
    assert default.user_attrs["baseline"] == "default" and default.params["max_num_seqs"] == 48
    other = tmp_path / "other.yaml"  # -c given: that file, not ./fairgate.yaml
    other.write_text("engine:\n  max_num_seqs: 40\n")
    assert main(["tune", "--mode", "sim", *WORKLOAD, *SLOS, "--study", "c", "-c", str(other),
                 "--storage", f"sqlite:///{tmp_path / 'studies.db'}", "--out",
                 str(tmp_path / "out-c"), "--robustness", "0", "--trials", "1"]) in RAN
    (chosen,) = optuna.load_study(study_name="c",
                                  storage=f"sqlite:///{tmp_path / 'studies.db'}").get_trials()
    assert chosen.params["max_num_seqs"] == 40



def open_storages_at_once(url: str, openers: int = 6) -> None:
    """`openers` threads, half writers and half readers, open Optuna's storage on the new
    database `url` at one moment: every one gets a storage, and the schema is whole after."""
    import threading

    from tuner.study_lock import open_rdb_storage

    barrier = threading.Barrier(openers)
    errors: list[BaseException] = []
    storages: list[object] = []

    def open_one(writer: bool) -> None:
        barrier.wait()
        try:
            storages.append(open_rdb_storage(url, writer=writer))
        except BaseException as exc:  # reported below, with every other
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(i % 2 == 0,)) for i in range(openers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert len(storages) == openers
    optuna.create_study(study_name="after", storage=url)
    assert optuna.study.get_all_study_names(storage=url) == ["after"]


def test_storages_opened_at_once_on_a_new_sqlite_database_all_open(tmp_path: Path) -> None:
    """A job's worker creates the study while the jobs API opens it to read (CI saw the
    reader fail: `UNIQUE constraint failed: alembic_version`)."""
    open_storages_at_once(f"sqlite:///{tmp_path / 'new.db'}")


@pytest.mark.skipif(PG_SKIP is not None, reason=PG_SKIP or "")
def test_storages_opened_at_once_on_a_new_postgresql_database_all_open() -> None:
    with postgres.fresh_database("fg_open_race") as name:
        open_storages_at_once(f"postgresql://{postgres.PG_USER}@{postgres.PG_HOST}:"
                              f"{postgres.PG_PORT}/{name}")

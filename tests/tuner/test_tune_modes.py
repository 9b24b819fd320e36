"""`fairgate tune --mode replay | launch` end to end against real `fairgate engine` subprocesses
(simulated executor on the real-time clock), in process through fairgate.cli.main."""

from __future__ import annotations

import csv
import json
import re
import shlex
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from engine.config import EngineConfig
from fairgate.cli import main
from tests.support.processes import fairgate_engine
from tuner.remote import check_template, fill_template, free_port, timing_of
from tuner.report import RequestResult

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD = ["--workload", "uniform", "--rate", "10", "--duration", "1"]
SLOS = ["--slo-ttft-p99", "2", "--slo-tpot-p99", "0.5"]
SPACE = "max_num_seqs: {low: 2, high: 64, log: true}\n"
ENGINE = ["-m", "fairgate", "engine", "--set", "executor=sim", "--set", "sim_clock=realtime"]


@pytest.fixture
def engine_url() -> Iterator[str]:
    with fairgate_engine("executor=sim", "sim_clock=realtime") as url:
        yield url


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launched servers find fairgate from any working directory."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))


def tune(tmp_path: Path, *mode: str, trials: int = 2) -> int:
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    return main(["tune", *mode, *WORKLOAD, *SLOS, "--space", str(space), "--trials",
                 str(trials), "--storage", f"sqlite:///{tmp_path / 'studies.db'}",
                 "--study", "s", "--out", str(tmp_path / "out")])


def read_trials(tmp_path: Path) -> list[dict[str, str]]:
    with open(tmp_path / "out" / "trials.csv", newline="") as f:
        return list(csv.DictReader(f))


def engine_load(url: str) -> dict[str, object]:
    with urllib.request.urlopen(f"{url}/load", timeout=5) as resp:
        loaded: dict[str, object] = json.load(resp)
    return loaded


def test_replay_reconfigures_the_engine_per_trial(tmp_path: Path, engine_url: str) -> None:
    assert tune(tmp_path, "--mode", "replay", "--url", engine_url) == 0
    rows = read_trials(tmp_path)
    assert [r["ran"] for r in rows] == ["True", "True"]
    assert all(r["infeasible"] == "" for r in rows)
    seqs = [int(r["max_num_seqs"]) for r in rows]
    assert seqs[0] != seqs[1]
    # the default trial is the engine's own config, and the engine is put back on it
    assert engine_load(engine_url)["max_num_seqs"] == seqs[0]
    best = yaml.safe_load((tmp_path / "out" / "best.yaml").read_text())
    assert best["engine"]["max_num_seqs"] in seqs
    # the engine's own /stats window over each run, beside the client's figures: the same
    # requests, and the server's TTFT is the client's less the HTTP round trip
    report = (tmp_path / "out" / "report.md").read_text()
    planned = int(report.split(" requests over ")[0].rsplit("(", 1)[1])
    for r in rows:
        assert int(r["engine_requests"]) == planned
        assert 0 < float(r["engine_p99_ttft_s"]) <= float(r["p99_ttft_s"])


def test_replay_stops_a_hopeless_trial_early(tmp_path: Path, engine_url: str) -> None:
    """An SLO no request can meet: the run stops after the first misses past the 1% budget,
    so most of the workload is never sent (the engine saw only those requests)."""
    workload = ["--workload", "uniform", "--rate", "10", "--duration", "20"]  # about 200
    code = main(["tune", "--mode", "replay", "--url", engine_url, *workload, "--slo-ttft-p99",
                 "0.0001", "--slo-tpot-p99", "0.5", "--space", _space(tmp_path), "--trials", "1",
                 "--storage", f"sqlite:///{tmp_path / 'studies.db'}", "--out",
                 str(tmp_path / "out")])
    assert code == 1
    [row] = read_trials(tmp_path)
    stopped = re.match(r"stopped early: \d+ of (\d+) requests missed the TTFT SLO",
                       row["infeasible"])
    assert stopped is not None, row["infeasible"]
    planned = int(stopped.group(1))
    # the rest were never sent or were cancelled: the engine finished few of them
    assert int(row["engine_requests"] or 0) < planned / 2


def test_replay_with_two_engines_runs_a_worker_on_each(tmp_path: Path, engine_url: str) -> None:
    with fairgate_engine("executor=sim", "sim_clock=realtime") as second:
        assert main(["tune", "--mode", "replay", "--url", engine_url, "--url", second,
                     *WORKLOAD, *SLOS, "--space", _space(tmp_path), "--trials", "4",
                     "--storage", f"sqlite:///{tmp_path / 'studies.db'}", "--study", "two",
                     "--out", str(tmp_path / "out")]) == 0
        rows = read_trials(tmp_path)
        assert 4 <= len(rows) <= 5 and all(r["ran"] == "True" for r in rows)
        import optuna

        study = optuna.load_study(study_name="two",
                                  storage=f"sqlite:///{tmp_path / 'studies.db'}")
        assert {t.user_attrs["worker"] for t in study.trials} == {0, 1}
        # each engine is back on its own config, whichever worker drove it
        default = next(t.params["max_num_seqs"] for t in study.trials
                       if t.user_attrs.get("baseline") == "default")
        assert engine_load(engine_url)["max_num_seqs"] == default
        assert engine_load(second)["max_num_seqs"] == default


def _space(tmp_path: Path) -> str:
    space = tmp_path / "space.yaml"
    space.write_text(SPACE)
    return str(space)


def test_replay_records_a_refused_knob_as_infeasible(tmp_path: Path, engine_url: str) -> None:
    """The default trial is the engine's own config (seed 0); every searched trial asks for a
    seed, which the engine cannot change without a restart."""
    space = tmp_path / "space.yaml"
    space.write_text("seed: {low: 5, high: 6}\n")
    code = main(["tune", "--mode", "replay", "--url", engine_url, *WORKLOAD, *SLOS,
                 "--space", str(space), "--trials", "2", "--holdout", "0", "--storage",
                 f"sqlite:///{tmp_path / 'studies.db'}", "--out", str(tmp_path / "out")])
    assert code == 0
    default, searched = read_trials(tmp_path)
    assert default["ran"] == "True" and default["seed"] == "0"
    assert searched["ran"] == "False" and "cannot change seed without a restart" in (
        searched["infeasible"])


@pytest.mark.usefixtures("importable")
def test_launch_starts_a_server_per_trial(tmp_path: Path) -> None:
    command = shlex.join([sys.executable, *ENGINE, "--port", "{port}",
                          "--set", "max_num_seqs={max_num_seqs}"])
    assert tune(tmp_path, "--mode", "launch", "--command", command) == 0
    rows = read_trials(tmp_path)
    assert [r["ran"] for r in rows] == ["True", "True"]
    assert int(rows[0]["max_num_seqs"]) != int(rows[1]["max_num_seqs"])
    assert (tmp_path / "out" / "best.yaml").exists()


def test_launch_command_that_exits_is_an_infeasible_trial(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the base trial (max_num_seqs 64) and the next fail differently: the study goes on
    command = shlex.join([sys.executable, "-c", "import sys; print('no GPU for {max_num_seqs}'); "
                          "sys.exit(3 if {max_num_seqs} == 64 else 4)"])
    assert tune(tmp_path, "--mode", "launch", "--command", command) == 1  # no feasible trial
    rows = read_trials(tmp_path)
    assert len(rows) == 2 and all(r["ran"] == "False" for r in rows)  # the study went on
    assert "exited with status 3: no GPU for 64" in rows[0]["infeasible"]
    assert "exited with status 4: no GPU for" in rows[1]["infeasible"]
    err = capsys.readouterr().err
    assert "the base config's trial #0 got no server" in err
    assert not (tmp_path / "out" / "best.yaml").exists()


def test_launch_failing_the_same_way_twice_stops_the_study(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The sizes in the line differ per trial; the failure is the same: 30 trials would be."""
    command = shlex.join([sys.executable, "-c",
                          "import sys; print('no GPU for {max_num_seqs}'); sys.exit(3)"])
    assert tune(tmp_path, "--mode", "launch", "--command", command, trials=30) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith(
        "fairgate tune: error: two launches in a row failed the same way, so the study stopped: "
        "the server exited with status 3: no GPU for")


@pytest.mark.parametrize(("mode", "message"), [
    (["--mode", "replay"], "--mode replay needs --url"),
    (["--mode", "launch"], "--mode launch needs --command"),
    (["--mode", "launch", "--command", "serve --port {port} --set x={bogus}"],
     "unknown placeholder {bogus}"),
    (["--mode", "replay", "--url", f"http://127.0.0.1:{free_port()}"], "cannot reach --url"),
    (["--mode", "sim", "--url", "http://127.0.0.1:1"], "--url is for --mode replay"),
    (["--mode", "launch", "--command", "x {port}", "--launch-timeout", "0"], "--launch-timeout"),
    (["--mode", "sim", "--recheck", "2"], "--recheck re-checks a shadow study"),
])
def test_bad_mode_options_are_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: list[str],
        message: str) -> None:
    assert tune(tmp_path, *mode) == 2
    err = capsys.readouterr().err
    assert err.startswith("fairgate tune: error:") and message in err
    assert err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_template_fills_knobs_as_yaml_scalars() -> None:
    argv = check_template("serve --port {port} --set 'max_model_len={max_model_len}' "
                          "--set enable_prefix_caching={enable_prefix_caching}")
    config = EngineConfig(max_model_len=None, enable_prefix_caching=False)
    assert fill_template(argv, config, 8123) == [
        "serve", "--port", "8123", "--set", "max_model_len=null",
        "--set", "enable_prefix_caching=false"]


def test_load_generator_results_become_request_timings() -> None:
    ok = RequestResult(0, "t", None, 0.0, start=1.0, output_tokens=3, ttft=0.5, e2e=0.9,
                       itl=[0.2, 0.2])
    failed = RequestResult(1, "t", None, 0.0, start=2.0, status="HTTP 503")
    good, bad = timing_of(ok), timing_of(failed)
    assert good.ok and good.ttft == pytest.approx(0.5) and good.end == pytest.approx(1.9)
    assert good.tpot == pytest.approx(0.2)
    assert not bad.ok and bad.ttft is None

"""The study's operations: the Pareto objective, vLLM's grid as a baseline, robustness re-runs,
parallel workers, a killed worker's trial re-run, and PostgreSQL storage."""

from __future__ import annotations

import csv
import signal
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from optuna.trial import TrialState

from engine.config import EngineConfig
from engine.sim import SimExecutor
from fairgate.cli import main
from tests.support import postgres
from tests.support.processes import spawn_fairgate, wait_for_output
from tuner.holdout import HeldOut, select
from tuner.outcome import TrialRow, pareto_front
from tuner.space import build_config
from tuner.spec import VLLM_GRID

WORKLOAD = ["--workload", "uniform", "--rate", "10", "--duration", "4"]  # 36 requests
SLOS = ["--slo-ttft-p99", "0.5", "--slo-tpot-p99", "0.05"]


def tune(tmp_path: Path, *extra: str, storage: str | None = None, study: str = "s",
         slos: list[str] = SLOS) -> int:
    return main(["tune", "--mode", "sim", *WORKLOAD, *slos, "--study", study, "--storage",
                 storage or f"sqlite:///{tmp_path / 'studies.db'}", "--out",
                 str(tmp_path / "out"), *extra])


def read_trials(tmp_path: Path) -> list[dict[str, str]]:
    with open(tmp_path / "out" / "trials.csv", newline="") as f:
        return list(csv.DictReader(f))


def row(number: int, value: float, ttft: float, feasible: bool = True) -> TrialRow:
    return TrialRow(number=number, state="COMPLETE", params={"max_num_seqs": number},
                    baseline=None, ran=True,
                    measures={"p99_ttft_s": ttft, "output_tokens_per_s": value},
                    value=value, infeasible=None if feasible else "missed")


points = st.lists(st.tuples(st.integers(0, 20), st.integers(1, 20), st.booleans()),
                  min_size=1, max_size=25)


@given(points)
def test_the_pareto_front_is_exactly_the_undominated_feasible_trials(
        cases: list[tuple[int, int, bool]]) -> None:
    rows = [row(i, float(v), float(t), ok) for i, (v, t, ok) in enumerate(cases)]
    front = pareto_front(rows)
    feasible = [r for r in rows if r.feasible]

    def dominates(a: TrialRow, b: TrialRow) -> bool:
        av, at = a.value or 0, (a.measures or {})["p99_ttft_s"]
        bv, bt = b.value or 0, (b.measures or {})["p99_ttft_s"]
        return av >= bv and at <= bt and (av > bv or at < bt)

    assert all(r.feasible for r in front)
    assert not any(dominates(other, r) for r in front for other in feasible)
    for r in feasible:  # everything left out is dominated by something on the front
        if r not in front:
            assert any(dominates(f, r) for f in front)
    ttfts = [(r.measures or {})["p99_ttft_s"] for r in front]
    assert ttfts == sorted(ttfts)


def held(number: int, role: str, train: float, values: list[float],
         half_width: float = 0.5) -> HeldOut:
    labels = [f"w{i}" for i in range(len(values))]
    return HeldOut(number, role, train, dict(zip(labels, values, strict=True)),
                   {label: (v - half_width, v + half_width) for label, v in zip(
                       labels, values, strict=True)}, {})


def test_the_in_sample_winner_that_loses_held_out_is_not_recommended() -> None:
    default = held(0, "default", 8.0, [8.0, 8.2, 7.9])
    fragile = held(5, "search", 10.0, [6.0, 7.0, 6.5])  # the study's best on its own window
    steady = held(7, "search", 9.0, [9.5, 9.4, 9.6])
    selection = select([default, fragile, steady])
    assert selection.chosen is steady and selection.gain and selection.baseline is default
    # a searched config within noise of the default does not replace it: ties go to the default
    close = held(7, "search", 9.0, [8.3, 8.2, 8.1])
    selection = select([default, fragile, close])
    assert selection.chosen is default and not selection.gain
    assert "no significant gain" in selection.verdict("req/s")


def test_the_grid_replaces_the_default_only_when_significantly_better() -> None:
    default = held(0, "default", 8.0, [8.0, 8.0])
    grid = held(1, "vllm-grid 128x512", 8.2, [8.3, 8.4])  # lower bound 7.85: a tie
    search = held(9, "search", 9.0, [8.6, 8.7])  # lower bound 8.15 beats the default's 8.0
    assert select([default, grid, search]).chosen is search
    strong_grid = held(1, "vllm-grid 128x512", 9.0, [9.0, 9.0])
    selection = select([default, strong_grid, search])
    assert selection.chosen is strong_grid and selection.baseline is strong_grid
    assert select([default]).chosen is default


def test_held_out_selection_recommends_what_holds_on_traffic_the_study_did_not_see(
        tmp_path: Path) -> None:
    """The trace's first window has one 3,000-token prompt in 200, its later windows one in
    ten. max_model_len 2048 refuses that one request (within a p99's budget) and so wins the
    first window by far: no long prefill stalls the rest. On every later window it refuses
    10% and holds at no rate. The study's own best, which the tuner recommended before, is
    that config; the recommendation chosen on the held-out windows is the default."""
    lines = []
    for i in range(800):
        long = i == 100 if i < 200 else i % 10 == 5
        lines.append(f'{{"arrival": {i * 0.25}, "prompt_tokens": {3000 if long else 300}, '
                     '"output_tokens": 32}\n')
    trace = tmp_path / "shift.jsonl"
    trace.write_text("".join(lines))
    space = tmp_path / "space.yaml"
    space.write_text("max_model_len: {low: 2048, high: 2049}\n")  # the default keeps 8192
    assert main(["tune", "--mode", "sim", "--set", "executor=sim", "--set",
                 "sim_hardware=l4", "--set", "sim_model=llama-3-8b", "--set", "max_model_len=8192", "--trace", str(trace),
                 "--window", "50", "--holdout", "3", "--space", str(space),
                 "--objective", "capacity", "--slo-ttft-p99", "1", "--trials", "3",
                 "--study", "shift", "--storage", f"sqlite:///{tmp_path / 'studies.db'}",
                 "--out", str(tmp_path / "out")]) == 0
    rows = read_trials(tmp_path)
    default = next(r for r in rows if r["baseline"] == "default")
    top = max(rows, key=lambda r: float(r["capacity_rps"]))
    assert top["max_model_len"] == "2048" and top["infeasible"] == ""
    assert float(top["capacity_rps"]) > 1.3 * float(default["capacity_rps"])  # in-sample
    best = yaml.safe_load((tmp_path / "out" / "best.yaml").read_text())["engine"]
    assert best["max_model_len"] == 8192
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Held-out windows" in report and "| trace 50-100 s |" in report
    assert "the search found no significant gain" in report
    assert "refused: prompt plus max_tokens longer than max_model_len (2048)" in report


def test_pareto_study_writes_its_front_and_recommends_a_point_of_it(tmp_path: Path) -> None:
    assert tune(tmp_path, "--objective", "pareto", "--trials", "8") == 0
    rows = read_trials(tmp_path)
    assert "throughput_tok_s" in rows[0]
    feasible = [r for r in rows if r["infeasible"] == ""]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Pareto front" in report and "## Held-out windows" in report
    best = yaml.safe_load((tmp_path / "out" / "best.yaml").read_text())["engine"]
    chosen = [r for r in feasible if int(r["max_num_seqs"]) == best["max_num_seqs"]
              and int(r["max_num_batched_tokens"]) == best["max_num_batched_tokens"]]
    assert chosen, "best.yaml is a feasible trial"
    # and a point of the front: no feasible trial has more tokens/s at no worse p99 TTFT
    tps, ttft = float(chosen[0]["throughput_tok_s"]), float(chosen[0]["p99_ttft_s"])
    assert not any(float(r["throughput_tok_s"]) >= tps and float(r["p99_ttft_s"]) <= ttft
                   and (float(r["throughput_tok_s"]) > tps or float(r["p99_ttft_s"]) < ttft)
                   for r in feasible)
    html = (tmp_path / "out" / "report.html").read_text()
    assert "<svg" in html and "Optimisation history" in html and "Pareto front" in html


def test_vllm_grid_joins_the_study_with_its_memory_fraction_probed(tmp_path: Path) -> None:
    assert tune(tmp_path, "--set", "executor=sim", "--set", "sim_hardware=l4", "--set",
                "max_model_len=8192", "--baseline", "vllm-grid", "--trials", "10",
                "--robustness", "0", slos=["--slo-ttft-p99", "10", "--slo-tpot-p99", "0.5"]) == 0
    rows = read_trials(tmp_path)
    grid = [r for r in rows if r["baseline"].startswith("vllm-grid")]
    assert [r["baseline"] for r in grid] == [f"vllm-grid {s}x{t}" for s, t in VLLM_GRID]
    assert rows[0]["baseline"] == "default"
    base = EngineConfig(executor="sim", sim_hardware="l4", max_model_len=8192)
    for r in grid:  # auto_tune's probe: the highest fraction from 0.98 down that starts
        params = {"max_num_seqs": int(r["max_num_seqs"]),
                  "max_num_batched_tokens": int(r["max_num_batched_tokens"]),
                  "max_model_len": 8192}
        fraction = float(r["memory_fraction"])
        starts = build_config(base, {**params, "memory_fraction": fraction})
        SimExecutor(starts).plan_kv_capacity(starts)
        if fraction < 0.98:
            higher = build_config(base, {**params, "memory_fraction": round(fraction + 0.01, 2)})
            with pytest.raises(ValueError, match="out of memory"):
                SimExecutor(higher).plan_kv_capacity(higher)
    report = (tmp_path / "out" / "report.md").read_text()
    assert "vs vLLM grid" in report and "best of vLLM grid" in report


def test_held_out_results_are_kept_in_the_study(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tune(tmp_path, "--trials", "8", "--holdout", "2", "--holdout-top", "2") == 0
    first = capsys.readouterr().err
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'studies.db'}")
    kept = study.user_attrs["holdout"]
    # the default and the top two searched configs (the default may be one of the top)
    assert 1 <= len(kept) <= 3 and len(kept) == first.count("\nheld-out ")
    assert all(sorted(v["values"]) == ["seed 1", "seed 2"] for v in kept.values())
    assert all(len(v["intervals"]["seed 1"]) == 2 for v in kept.values())
    # the same study again: nothing left to run or re-check
    assert tune(tmp_path, "--trials", "8", "--holdout", "2", "--holdout-top", "2") == 0
    assert "\nheld-out " not in capsys.readouterr().err
    assert "| seed 1 | seed 2 |" in (tmp_path / "out" / "report.md").read_text()


def test_two_workers_share_one_study(tmp_path: Path) -> None:
    workload = ["--workload", "uniform", "--rate", "10", "--duration", "30"]
    assert main(["tune", "--mode", "sim", *workload, *SLOS, "--study", "w", "--storage",
                 f"sqlite:///{tmp_path / 'studies.db'}", "--out", str(tmp_path / "out"),
                 "--workers", "2", "--trials", "12", "--robustness", "0"]) == 0
    study = optuna.load_study(study_name="w", storage=f"sqlite:///{tmp_path / 'studies.db'}")
    done = study.get_trials(states=(TrialState.COMPLETE,))
    assert 12 <= len(done) <= 13  # a worker may start one more as the other finishes the last
    assert not study.get_trials(states=(TrialState.RUNNING, TrialState.WAITING, TrialState.FAIL))
    assert {t.user_attrs["worker"] for t in done} == {0, 1}
    assert len(read_trials(tmp_path)) == len(done)


def test_a_killed_worker_is_restarted_and_the_study_completes_without_loss_or_repeats(
        tmp_path: Path) -> None:
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    workload = ["--workload", "uniform", "--rate", "10", "--duration", "200"]  # 2,000 requests
    tune = ["tune", "--mode", "sim", *workload, *SLOS, "--study", "k", "--storage", storage,
            "--out", str(tmp_path / "out"), "--trials", "5", "--robustness", "0",
            "--heartbeat", "1"]
    worker = spawn_fairgate(*tune)
    wait_for_output(worker, b"(#2) running", timeout=120)  # a progress line
    worker.send_signal(signal.SIGKILL)  # mid-trial: #2 is RUNNING in the storage
    worker.wait()
    study = optuna.load_study(study_name="k", storage=storage)
    (killed,) = study.get_trials(states=(TrialState.RUNNING,))
    assert killed.number == 2
    assert [t.number for t in study.get_trials(states=(TrialState.COMPLETE,))] == [0, 1]
    # restarted at once: it waits for the killed trial's heartbeats to stop (two beats), which
    # fails it and queues it again with the same knobs, then runs it and what is left
    restarted = spawn_fairgate(*tune)
    printed = restarted.communicate(timeout=300)[0].decode()  # its progress lines (stderr) too
    assert restarted.returncode == 0, printed
    assert "trial(s) #2 running" in printed
    trials = study.get_trials()
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len(complete) == 5 and not [t for t in trials if t.state in (
        TrialState.RUNNING, TrialState.WAITING)]
    (failed,) = [t for t in trials if t.state == TrialState.FAIL]
    (retry,) = [t for t in complete if t.system_attrs.get("failed_trial") == 2]
    assert failed.number == 2 and retry.params == killed.params  # re-run once, same knobs
    assert len({tuple(sorted(t.params.items())) for t in complete}) == 5  # none repeated
    rows = read_trials(tmp_path)
    assert [r["retried_from"] for r in rows if r["number"] == str(retry.number)] == ["2"]
    assert "re-run after a worker stopped: 1" in (tmp_path / "out" / "report.md").read_text()


PG_SKIP = postgres.unreachable()


@pytest.mark.skipif(PG_SKIP is not None, reason=PG_SKIP or "")
def test_a_study_lives_in_postgresql_and_resumes_there(tmp_path: Path) -> None:
    with postgres.fresh_database("fg_tune") as name:
        # the project's own URL form (asyncpg) works as Optuna's storage
        url = f"postgresql+asyncpg://{postgres.PG_SERVER}/{name}"
        assert tune(tmp_path, "--trials", "3", "--robustness", "0", storage=url) == 0
        assert tune(tmp_path, "--trials", "5", "--robustness", "0", storage=url) == 0
        assert [r["number"] for r in read_trials(tmp_path)] == ["0", "1", "2", "3", "4"]
        study = optuna.load_study(study_name="s",
                                  storage=f"postgresql://{postgres.PG_SERVER}/{name}")
        assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 5


def test_a_storage_that_cannot_be_opened_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "such" / "dir" / "s.db"
    assert tune(tmp_path, "--trials", "1", storage=f"sqlite:///{missing}") == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "cannot open the database" in err, err
    assert not (tmp_path / "out").exists()


SEQS_SPACE = ("max_num_seqs: {low: 8, high: 128, log: true}\n"
              "max_num_batched_tokens: {choices: [512, 1024, 2048]}\n")


def test_every_config_replays_the_same_requests_on_each_held_out_window(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Common random numbers: a window's arrivals and lengths are drawn once, so configs
    differ on it only by their knobs."""
    from tuner import runners

    seen: dict[tuple[int, float], list[tuple[tuple[float, int, int], ...]]] = {}

    class Recording(runners.SimRunner):
        def run(self, config, requests, stop):  # type: ignore[no-untyped-def]
            key = (len(requests), round(max(r.arrival for r in requests), 6))
            seen.setdefault(key, []).append(
                tuple((r.arrival, r.prompt_tokens, r.output_tokens) for r in requests))
            return super().run(config, requests, stop)

    monkeypatch.setitem(runners.RUNNERS, "sim", Recording)
    space = tmp_path / "space.yaml"
    space.write_text(SEQS_SPACE)
    assert tune(tmp_path, "--trials", "6", "--holdout", "2", "--holdout-top", "3",
                "--space", str(space), slos=["--slo-ttft-p99", "0.5"]) == 0
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'studies.db'}")
    assert len(study.user_attrs["holdout"]) >= 2  # two configs or more ran on the windows
    draws = [runs for runs in seen.values() if len(runs) >= 3]
    assert len(draws) >= 2 and all(len(set(runs)) == 1 for runs in draws)


def test_an_uncertain_trial_is_marked_and_does_not_win_without_a_held_out_re_run(
        tmp_path: Path) -> None:
    """A TPOT target between the default's p99 and its interval's upper end: met, but not
    surely; the trial says so, and without held-out windows a sure feasible trial wins."""
    space = tmp_path / "space.yaml"
    space.write_text(SEQS_SPACE)
    longer = ["--duration", "100"]  # 1,000 requests (a later flag wins)
    args = ["--trials", "1", "--holdout", "0", "--space", str(space), *longer]
    assert tune(tmp_path, *args, study="probe",
                slos=["--slo-ttft-p99", "5", "--slo-tpot-p99", "1"]) == 0
    [probe] = read_trials(tmp_path)
    point = float(probe["p99_tpot_s"])
    low, high = (float(v) for v in probe["p99_tpot_ci"].split(".."))
    assert low <= point < high  # 1,000 requests: the interval reaches past the point
    target = (point + high) / 2
    assert tune(tmp_path, "--trials", "6", "--holdout", "0", "--space", str(space), *longer,
                study="doubt",
                slos=["--slo-ttft-p99", "5", "--slo-tpot-p99", repr(target)]) == 0
    rows = read_trials(tmp_path)
    default = rows[0]
    assert default["infeasible"] == "" and default["uncertain"] == "p99_tpot"
    report = (tmp_path / "out" / "report.md").read_text()
    assert "uncertain (p99 TPOT: the 95% interval straddles the SLO" in report
    sure = [r for r in rows if r["infeasible"] == "" and not r["uncertain"]]
    best = yaml.safe_load((tmp_path / "out" / "best.yaml").read_text())["engine"]
    chosen = [r for r in rows if int(r["max_num_seqs"]) == best["max_num_seqs"] and int(
        r["max_num_batched_tokens"]) == best["max_num_batched_tokens"]]
    assert chosen and (not sure or all(r in sure for r in chosen))


def _measures(p99: float, low: float, high: float) -> Any:
    from tuner.measures import TrialMeasures

    return TrialMeasures(p99_ttft_s=p99, p99_ttft_ci=(low, high), p99_tpot_s=0.0,
                         p99_tpot_ci=(0.0, 0.0), p99_itl_s=0.0, p99_itl_ci=(0.0, 0.0),
                         goodput_rps=1.0, good_fraction=1.0, requests=1000, failed=0,
                         wall_s=0.0)


def test_capacity_bounds_invert_the_p99_intervals() -> None:
    """p99 TTFT grows with the rate factor f as f seconds, known to +-10%: the SLO (1 s)
    surely holds up to f = 1/1.1 and is surely missed from f = 1/0.9."""
    from protocol.measures import SLO
    from tuner.capacity import MAX_FACTOR
    from tuner.evaluate import CI_STEP, capacity_bounds

    def run(probes: dict[float, Any], spread: float) -> tuple[float, float]:
        def probe(f: float) -> Any:
            m = _measures(f, f * (1 - spread), f * (1 + spread))
            probes[f] = (m, None if f <= 1.0 else "missed")
            return m if f <= 1.0 else None

        probe(1.0)
        return capacity_bounds(probe, probes, 1.0, SLO(ttft_s=1.0))

    low, high = run({}, 0.1)
    assert low == pytest.approx(1 / CI_STEP) and high == pytest.approx(CI_STEP)
    # intervals too wide to be sure of anything within the extra probes: 0 and the search's top
    low, high = run({}, 100.0)
    assert (low, high) == (0.0, MAX_FACTOR)


def test_vllm_grid_configs_are_no_searched_candidates() -> None:
    from tuner.holdout import holdout_candidates

    def trial(number: int, value: float, seqs: int, baseline: str | None = None) -> TrialRow:
        return TrialRow(number=number, state="COMPLETE", params={"max_num_seqs": seqs},
                        baseline=baseline, ran=True, measures={"p99_ttft_s": 0.1},
                        value=value, infeasible=None)

    rows = [trial(0, 1.0, 64, "default"), trial(1, 3.0, 128, "vllm-grid 128x512"),
            trial(2, 2.9, 256, "vllm-grid 256x512"), trial(3, 2.0, 32), trial(4, 2.5, 96)]

    class Spec:
        multi_objective, holdout_top = False, 3

    roles = [(role, r.number) for role, r in holdout_candidates(Spec(), rows)]  # type: ignore
    assert roles == [("default", 0), ("vllm-grid 128x512", 1), ("search", 4), ("search", 3)]

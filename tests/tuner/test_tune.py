"""`fairgate tune --mode sim` end to end, in process (fairgate.cli.main), on a tiny workload."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import pytest

from fairgate.cli import main
from fairgate.engine_cli import build_config
from protocol.measures import SLO, RequestTiming, attainment
from protocol.stats import percentile_interval
from tuner.capacity import mean_rate, scale_arrivals, search_capacity
from tuner.measures import early_stop, measure
from tuner.runners import SimRunner
from tuner.simulate import simulate
from tuner.space import build_config as build_space_config
from tuner.spec import optuna_storage_url
from tuner.traces import TraceRequest
from tuner.workload import LoadShape, MixSpec, TenantMix, build_mix, get_workload

WORKLOAD = ["--workload", "uniform", "--rate", "10", "--duration", "4"]  # 36 requests
SLOS = ["--slo-ttft-p99", "0.5", "--slo-tpot-p99", "0.05"]


def tune(tmp_path: Path, *extra: str, study: str = "s", space: str | None = None,
         slos: list[str] = SLOS, workload: list[str] = WORKLOAD) -> int:
    args = ["tune", "--mode", "sim", *workload, *slos, "--study", study,
            "--storage", f"sqlite:///{tmp_path / 'studies.db'}", "--out", str(tmp_path / "out")]
    if space is not None:
        path = tmp_path / "space.yaml"
        path.write_text(space)
        args += ["--space", str(path)]
    return main([*args, *extra])


def read_trials(tmp_path: Path) -> list[dict[str, str]]:
    with open(tmp_path / "out" / "trials.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_sim_study_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tune(tmp_path, "--trials", "4") == 0
    rows = read_trials(tmp_path)
    assert [r["number"] for r in rows] == ["0", "1", "2", "3"]
    default = rows[0]  # the base config, enqueued first
    assert default["baseline"] == "default" and default["ran"] == "True"
    assert (default["max_num_batched_tokens"], default["max_num_seqs"],
            default["max_model_len"], default["memory_fraction"]) == ("2048", "64", "4096", "0.9")
    assert default["infeasible"] == "" and float(default["goodput_rps"]) > 0
    # best.yaml loads through `fairgate engine -c`'s own loader
    best = build_config(str(tmp_path / "out" / "best.yaml"), [])
    winner = next(r for r in rows if r["number"] == _best_number(tmp_path))
    assert best.max_num_seqs == int(winner["max_num_seqs"])
    assert best.max_num_batched_tokens == int(winner["max_num_batched_tokens"])
    report = (tmp_path / "out" / "report.md").read_text()
    assert "## Recommended vs default" in report and "p99 TTFT <= 500.0 ms" in report
    err = capsys.readouterr().err
    ended = [line for line in err.splitlines() if line.startswith("trial ") and "running" not in line]
    assert [line.split(" (")[0] for line in ended] == [
        "trial 1/4", "trial 2/4", "trial 3/4", "trial 4/4"]
    assert all("| best " in line for line in ended)


def _best_number(tmp_path: Path) -> str:
    header = (tmp_path / "out" / "best.yaml").read_text().splitlines()[0]
    return header.split("trial #")[1]


def test_infeasible_configs_are_recorded_not_run(tmp_path: Path) -> None:
    space = "max_num_seqs: {low: 4096, high: 8192}\n"  # above the 2048-token budget
    assert tune(tmp_path, "--trials", "3", space=space) == 0  # the default still qualifies
    rows = read_trials(tmp_path)
    assert rows[0]["ran"] == "True" and rows[0]["max_num_seqs"] == "64"
    for row in rows[1:]:
        assert row["ran"] == "False" and row["goodput_rps"] == "0"
        assert row["infeasible"].startswith("not run: max_num_batched_tokens (2048) must be >=")


def test_a_config_that_cannot_start_is_infeasible(tmp_path: Path) -> None:
    space = "memory_fraction: {low: 0.05, high: 0.1}\n"  # less than llama-3-8b's weights on h100
    assert tune(tmp_path, "--trials", "2", space=space) == 0
    rows = read_trials(tmp_path)
    assert rows[1]["ran"] == "False" and rows[1]["infeasible"].startswith("did not start:")


def test_an_impossible_slo_leaves_every_trial_infeasible(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slos = ["--slo-ttft-p99", "0.000001", "--slo-tpot-p99", "0.05"]
    workload = ["--workload", "uniform", "--rate", "20", "--duration", "4"]  # > 50: early stop
    assert tune(tmp_path, "--trials", "2", slos=slos, workload=workload) == 1
    rows = read_trials(tmp_path)
    assert len(rows) == 2 and all(r["infeasible"] for r in rows)
    # the real cause first: a trial whose max_model_len refused requests says so
    for row in rows:
        if row["ran"] == "True":
            assert "stopped early:" in row["infeasible"]
            assert ("refused" in row["infeasible"].split("stopped early:")[0]) == (
                int(row["refused"]) > 0)
    assert not (tmp_path / "out" / "best.yaml").exists()
    assert "No trial met the SLOs" in (tmp_path / "out" / "report.md").read_text()
    assert "no trial met the SLOs" in capsys.readouterr().err.splitlines()[-1]


def test_a_missed_itl_names_its_p99_target_and_margin(tmp_path: Path) -> None:
    """An ITL-only SLO (every gap, pooled) that no config meets: each trial's cause is the
    measured p99 ITL over the target, by how much; the sample line says how few tail samples
    36 requests give a p99."""
    assert tune(tmp_path, "--trials", "2", "--holdout", "0",
                slos=["--slo-itl-p99", "0.001"]) == 1
    for row in read_trials(tmp_path):
        if row["ran"] == "True":
            itl_ms = float(row["p99_itl_s"]) * 1000
            over = f"p99 ITL {itl_ms:.1f} ms > 1.0 ms (+{(itl_ms / 1.0 - 1) * 100:.0f}%)"
            assert over in row["infeasible"], row["infeasible"]
            assert "TTFT" not in row["infeasible"] and "TPOT" not in row["infeasible"]
    report = (tmp_path / "out" / "report.md").read_text()
    assert ("- sample: 36 requests a window: each p99 rests on 0.36 requests beyond it (fewer "
            "than 10: noise may pick the winner; 1000 requests would carry it)") in report


@pytest.mark.parametrize("objective", ["goodput", "capacity"])
def test_goodput_that_cannot_separate_configs_says_so(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], objective: str) -> None:
    """At a rate every config serves, goodput is the offered rate for all of them: the report
    says the objective cannot separate them and points to capacity, which can."""
    space = "max_model_len: {low: 4096, high: 4096}\n"  # no trial refuses a request
    assert tune(tmp_path, "--trials", "5", "--holdout", "0", "--objective", objective,
                space=space, slos=["--slo-ttft-p99", "5", "--slo-tpot-p99", "1"]) == 0
    rows = read_trials(tmp_path)
    assert all(r["infeasible"] == "" for r in rows)
    note = "the objective cannot separate them here; --objective capacity measures how far"
    said = note in capsys.readouterr().err
    assert said == (note in (tmp_path / "out" / "report.md").read_text())
    assert said == (objective == "goodput")


def test_study_resumes(tmp_path: Path) -> None:
    assert tune(tmp_path, "--trials", "3", study="resume") == 0
    assert tune(tmp_path, "--trials", "5", study="resume") == 0  # the study's size: 2 more
    rows = read_trials(tmp_path)
    assert [r["number"] for r in rows] == ["0", "1", "2", "3", "4"]
    assert [r["baseline"] for r in rows].count("default") == 1
    params = {(r["max_num_batched_tokens"], r["max_num_seqs"], r["max_model_len"],
               r["memory_fraction"]) for r in rows}
    assert len(params) == 5  # the resumed sampler did not replay the first run's samples


def test_resuming_with_other_options_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tune(tmp_path, "--trials", "1", study="fixed") == 0
    capsys.readouterr()
    slos = ["--slo-ttft-p99", "0.4", "--slo-tpot-p99", "0.05"]
    assert tune(tmp_path, "--trials", "1", study="fixed", slos=slos) == 2
    assert "was made with a different slo" in capsys.readouterr().err
    # the same number of requests drawn with another seed is another workload
    assert tune(tmp_path, "--trials", "1", "--seed", "5", study="fixed") == 2
    assert "different number of requests" in capsys.readouterr().err
    for name, tokens in (("a.jsonl", 100), ("b.jsonl", 200)):  # the same count, other lengths
        (tmp_path / name).write_text("".join(
            f'{{"arrival": {i * 0.1}, "prompt_tokens": {tokens}, "output_tokens": 8}}\n'
            for i in range(20)))
    assert tune(tmp_path, "--trials", "1", study="t", workload=[
        "--trace", str(tmp_path / "a.jsonl")]) == 0
    capsys.readouterr()
    assert tune(tmp_path, "--trials", "1", study="t", workload=[
        "--trace", str(tmp_path / "b.jsonl")]) == 2
    assert "different workload (the same number of requests" in capsys.readouterr().err
    assert tune(tmp_path, "--trials", "9", "--baseline", "vllm-grid", study="fixed") == 2
    assert "different baseline" in capsys.readouterr().err


def test_a_run_with_no_winner_leaves_no_old_best_yaml(tmp_path: Path) -> None:
    assert tune(tmp_path, "--trials", "2", study="a") == 0
    assert (tmp_path / "out" / "best.yaml").exists()
    impossible = ["--slo-ttft-p99", "0.0001", "--slo-tpot-p99", "0.0001"]
    assert tune(tmp_path, "--trials", "1", study="b", slos=impossible) == 1
    assert not (tmp_path / "out" / "best.yaml").exists()
    assert "No trial met the SLOs" in (tmp_path / "out" / "report.md").read_text()


def test_an_out_path_that_is_a_file_is_refused_before_any_trial(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "out").write_text("not a directory")
    assert tune(tmp_path, "--trials", "1") == 2
    assert "--out" in capsys.readouterr().err and not (tmp_path / "studies.db").exists()


BAD_INPUTS = [
    (["--mode", "shadow"], None, "--mode shadow needs --gateway URL and --shadow NAME"),
    (["--mode", "simm"], None, "did you mean sim?"),
    (["--objective", "paretto"], None, "did you mean pareto?"),
    (["--baseline", "vllm"], None, "--baseline must be one of"),
    (["--baseline", "vllm-grid", "--trials", "5"], None, "--trials must be at least 9"),
    (["--baseline", "vllm-grid"], "max_num_seqs: {low: 8, high: 64}\n",
     "add max_num_batched_tokens to the space"),
    (["--workers", "0"], None, "--workers must be a positive integer"),
    (["--baseline", "vllm-grid", "--trials", "9"],
     "max_num_seqs: {choices: [32, 64]}\nmax_num_batched_tokens: {choices: [2048, 4096]}\n",
     "--baseline vllm-grid 128x512 has max_num_seqs 128, not among the choices {32, 64}"),
    ([], "num_kv_blocks: {low: 256, high: 4096}\n", "the base config leaves num_kv_blocks unset"),
    ([], "policy: {choices: [sjf, prefix]}\n", "has policy 'fcfs', not among the choices"),
    (["--robustness", "-1"], None, "--holdout must be in [0, 16]"),
    (["--set", "max_num_seq=8"], None, "did you mean max_num_seqs?"),
    (["--trials", "0"], None, "--trials must be a positive integer"),
    ([], "max_num_seq: {low: 8, high: 64}\n", "did you mean max_num_seqs?"),
    ([], "{}\n", "the search space is empty"),
    ([], "max_num_seqs: {low: 64, high: 8}\n", "low (64) must be <= high (8)"),
    ([], "policy: {low: 1, high: 2}\n", "give {choices: [...]}"),
]


@pytest.mark.parametrize(("extra", "space", "message"), BAD_INPUTS)
def test_bad_input_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], space: str | None,
        message: str) -> None:
    assert tune(tmp_path, *extra, space=space) == 2
    _assert_one_line(tmp_path, capsys, message)


@pytest.mark.parametrize(("slos", "workload", "message"), [
    (["--slo-ttft-p99", "0", "--slo-tpot-p99", "0.05"], WORKLOAD, "--slo-ttft-p99 must be > 0"),
    (["--slo-ttft-p99", "0.5", "--slo-tpot-p99", "-1"], WORKLOAD, "--slo-tpot-p99 must be > 0"),
    ([], WORKLOAD, "give at least one SLO"),
    (SLOS, ["--trace", "missing.csv"], "missing.csv"),
    (SLOS, [], "give the workload"),
])
def test_bad_slo_or_workload_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], slos: list[str],
        workload: list[str], message: str) -> None:
    assert tune(tmp_path, slos=slos, workload=workload) == 2
    _assert_one_line(tmp_path, capsys, message)


def _assert_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], message: str) -> None:
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("fairgate tune: error:") and message in err, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "studies.db").exists()


def test_storage_url_for_optuna() -> None:
    assert optuna_storage_url("sqlite+aiosqlite:///fairgate.db") == "sqlite:///fairgate.db"
    assert optuna_storage_url("postgresql+asyncpg://u@h/db") == "postgresql://u@h/db"
    assert optuna_storage_url("sqlite:///x.db") == "sqlite:///x.db"


@pytest.mark.parametrize("n", [1, 7, 99, 100, 101, 250])
def test_p99_meets_the_slo_exactly_when_attainment_does(n: int) -> None:
    slo = 1.0
    for misses in range(0, min(n, 5) + 1):
        values = [0.5] * (n - misses) + [math.inf] * misses
        p99, _ = percentile_interval(values, 99)
        met = attainment(n - misses, n)["fraction"]
        assert met is not None
        assert (p99 <= slo) == (met >= 0.99), (n, misses)


def test_early_stop_past_the_error_budget() -> None:
    stop = early_stop([TraceRequest(0.0, 8, 2)] * 200, SLO(ttft_s=0.1, tpot_s=0.1))
    miss = RequestTiming(start=0.0, token_times=(), num_output_tokens=0, end=0.0, ok=False)
    hit = RequestTiming(start=0.0, token_times=(0.01, 0.02), num_output_tokens=2, end=0.02)
    assert stop([miss, miss, hit]) is None  # 2 of 200 is the 1% a p99 allows
    reason = stop([miss, miss, miss])
    assert reason is not None and "3 of 200 requests were refused or failed" in reason
    slow = RequestTiming(start=0.0, token_times=(0.5, 0.51), num_output_tokens=2, end=0.51)
    reason = early_stop([TraceRequest(0.0, 8, 2)] * 200, SLO(ttft_s=0.1))([slow] * 3)
    assert reason is not None and "3 of 200 requests missed the TTFT SLO" in reason


def test_early_stop_counts_gaps_against_the_planned_gaps() -> None:
    """ITL is every gap: 100 requests of 11 tokens plan 1,000 gaps, of which a p99 lets 10
    miss; one request with 11 slow gaps is past that, though it is one request of 100."""
    requests = [TraceRequest(0.0, 8, 11)] * 100
    fast = RequestTiming(0.0, [0.01 * i for i in range(1, 12)], 11, 0.11)
    slow = RequestTiming(0.0, [0.5 * i for i in range(1, 13)], 12, 6.0)  # 11 slow gaps
    stop = early_stop(requests, SLO(itl_s=0.1))
    assert stop([fast] * 50) is None
    reason = stop([fast] * 50 + [slow])
    assert reason is not None and "11 of 1000 planned gaps" in reason and "ITL" in reason


# ----------------------------------------------------------------------------- capacity

CAPACITY = ["--objective", "capacity"]


def capacity_requests() -> list[TraceRequest]:
    """The requests WORKLOAD makes (seed 0), for re-simulating a trial's capacity point."""
    mix = MixSpec((TenantMix("default", get_workload("uniform")),),
                  LoadShape(rate=10, duration=4))
    return build_mix(mix)


def test_capacity_is_higher_with_more_room_and_its_point_holds(tmp_path: Path) -> None:
    space = "max_num_seqs: {low: 4, high: 4}\n"  # trial 0 is the default, max_num_seqs 64
    assert tune(tmp_path, *CAPACITY, "--trials", "2", space=space) == 0
    roomy, tight = read_trials(tmp_path)
    assert (roomy["max_num_seqs"], tight["max_num_seqs"]) == ("64", "4")
    assert roomy["infeasible"] == tight["infeasible"] == ""
    assert float(tight["capacity_rps"]) < 0.7 * float(roomy["capacity_rps"])
    requests = capacity_requests()
    assert len(requests) == 36
    assert float(roomy["capacity_rps"]) == pytest.approx(
        float(roomy["factor"]) * mean_rate(requests), rel=1e-5)
    config = build_space_config(SimRunner().prepare(build_config(None, [])),
                                {"max_num_seqs": 4})
    factor = float(tight["factor"])
    slo = SLO(ttft_s=0.5, tpot_s=0.05)
    for scale, meets in ((factor, True), (factor * 1.2, False)):
        run = simulate(config, scale_arrivals(requests, scale))
        assert (measure(run, len(requests), slo).missed(slo) is None) is meets, scale


def test_capacity_search_brackets_and_bisects() -> None:
    probes: list[float] = []

    def holds_below_3(factor: float) -> float | None:
        probes.append(factor)
        return factor if factor <= 3.0 else None

    search = search_capacity(holds_below_3)
    assert probes[:3] == [1.0, 2.0, 4.0]  # doubled up to the first failure
    assert 3.0 / 1.05 <= search.factor <= 3.0 and search.at == search.factor
    assert len(search.probes) <= 12
    assert search_capacity(lambda f: None).factor == 0.0  # halves down to 1/64, never holds
    assert min(f for f, _ in search_capacity(lambda f: None).probes) >= 1 / 64
    with pytest.raises(ValueError, match="needs requests spread over time"):
        mean_rate([TraceRequest(arrival=0.0, prompt_tokens=1, output_tokens=1)])


def test_capacity_infeasible_when_even_the_lowest_rate_fails(tmp_path: Path) -> None:
    slos = ["--slo-ttft-p99", "0.000001", "--slo-tpot-p99", "0.05"]
    assert tune(tmp_path, *CAPACITY, "--trials", "1", slos=slos) == 1
    (row,) = read_trials(tmp_path)
    assert row["ran"] == "True" and row["capacity_rps"] == "0" and row["factor"] == "0"
    assert row["infeasible"].startswith("misses the SLOs even at 0.0156x")
    assert not (tmp_path / "out" / "best.yaml").exists()


def test_capacity_cli_end_to_end_and_resume_needs_the_same_objective(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tune(tmp_path, *CAPACITY, "--trials", "3") == 0
    header = (tmp_path / "out" / "best.yaml").read_text().splitlines()[1]
    assert header.startswith("# capacity ") and "x the workload's rate" in header
    assert "capacity req/s" in (tmp_path / "out" / "report.md").read_text()
    assert "capacity " in capsys.readouterr().err.splitlines()[-1]
    assert tune(tmp_path, "--trials", "1") == 2  # the same study as goodput
    assert "was made with a different objective" in capsys.readouterr().err


def test_slos_not_given_are_the_strictest_enabled_tenants(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import asyncio

    from tenants import TenantStore

    db = f"sqlite:///{tmp_path / 'tenants.db'}"

    async def create() -> None:
        store = TenantStore(db)
        await store.init()
        await store.create_tenant("loose", slo_ttft_p99_s=0.8, slo_itl_p99_s=0.06)
        await store.create_tenant("strict", slo_ttft_p99_s=0.5)
        await store.create_tenant("off", slo_ttft_p99_s=0.01, slo_itl_p99_s=0.001,
                                  enabled=False)  # disabled: not served, not a target
        await store.close()

    asyncio.run(create())
    config = tmp_path / "fairgate.yaml"
    config.write_text(f"database: {db}\n")
    assert tune(tmp_path, "--trials", "2", "-c", str(config), slos=[]) == 0
    err = capsys.readouterr().err
    assert "--slo-ttft-p99 0.5 s, the strictest tenant SLO (strict)" in err
    assert "--slo-itl-p99 0.06 s, the strictest tenant SLO (loose)" in err
    assert "p99 TTFT <= 500.0 ms" in (tmp_path / "out" / "report.md").read_text()


def test_a_storage_url_of_no_known_database_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="not a database URL SQLAlchemy knows"):
        optuna_storage_url("nonsense://x")
    args = ["tune", "--mode", "sim", *WORKLOAD, *SLOS, "--storage", "nonsense://x",
            "--out", str(tmp_path / "out")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "nonsense://x" in err, err
    assert not (tmp_path / "out").exists()


def _workload_args(argv: list[str]) -> Any:
    """The workload options `fairgate tune` gives the windows for these flags."""
    from fairgate.cli import build_parser
    from fairgate.tune_cli import options_from_args, workload_args

    options, _ = options_from_args(build_parser(["tune"]).parse_args(["tune", *argv]))
    return workload_args(options)


def test_held_out_windows_are_the_next_stretches_of_the_trace_at_the_same_speed() -> None:
    from tuner.bench_cli import plan_requests
    from tuner.traces import load_trace
    from tuner.windows import study_windows

    path = Path(__file__).parent / "data" / "azure_conv_head.csv"
    args = _workload_args(["--trace", str(path), "--window", "40", "--start", "10"])
    args.speed = 2.0  # as a library caller may set it (the command line has --rate)
    trace = load_trace(path)
    train, (first, second) = study_windows(args, 2, 1000, plan_requests)
    for window, start in ((train, 10.0), (first, 50.0), (second, 90.0)):
        assert window.label == f"trace {start:.0f}-{start + 40:.0f} s"
        expected = [r for r in trace if start <= r.arrival < start + 40.0]
        assert [r.prompt_tokens for r in window.requests] == [r.prompt_tokens for r in expected]
        assert [r.arrival for r in window.requests] == pytest.approx(
            [(r.arrival - start) / 2 for r in expected])


@pytest.mark.parametrize("window", [30.0, 60.0])
def test_rate_is_the_mean_over_the_chosen_window(window: float) -> None:
    """--rate R sends R requests/s on average over the window (requests over its length),
    whatever the rest of the trace does; it used to rescale by the whole file's mean."""
    from tuner.bench_cli import plan_requests
    from tuner.traces import load_trace
    from tuner.windows import study_windows

    path = Path(__file__).parent / "data" / "azure_conv_head.csv"
    args = _workload_args(["--trace", str(path), "--rate", "0.6", "--window", str(window),
                           "--start", "20"])
    train, held = study_windows(args, 1, 1000, plan_requests)
    native = [r for r in load_trace(path) if 20 <= r.arrival < 20 + window]
    factor = (native[-1].arrival - 20) / train.requests[-1].arrival  # trace s per sent s
    assert len(train.requests) == len(native)
    assert len(native) / (window / factor) == pytest.approx(0.6)
    assert held[0].label == f"trace {20 + window:.0f}-{20 + 2 * window:.0f} s"
    # the held-out window replays at the same speed, so its load differs as the trace does
    again = [r for r in load_trace(path) if 20 + window <= r.arrival < 20 + 2 * window]
    assert held[0].requests[-1].arrival == pytest.approx(
        (again[-1].arrival - 20 - window) / factor)

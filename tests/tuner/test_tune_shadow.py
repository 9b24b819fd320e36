"""`fairgate tune --mode shadow` end to end: a gateway with a live engine and a shadow engine
(both `fairgate engine` processes on the simulated executor in real time), live traffic from the
load generator, a study whose trials reconfigure the shadow engine and are scored on the
mirrored requests against the live engine; then its best configs re-checked on the traffic the
gateway captured meanwhile, replayed on the shadow engine and simulated."""

from __future__ import annotations

import asyncio
import csv
import threading
from pathlib import Path

import pytest
import yaml

from control.app import make_app
from fairgate.cli import main
from gateway.config import GatewayConfig
from tests.gateway.helpers import ServerThread, create_tenants
from tests.support.processes import fairgate_engine
from tuner.loadgen import RunOptions, Target, run_workload_sync
from tuner.outcome import StudyOutcome, TrialRow
from tuner.recheck import (
    ENABLE_HINT,
    Recheck,
    Skip,
    candidates,
    capture_trace,
    notes,
    paused_mirroring,
)
from tuner.remote import request_json
from tuner.workload import Lengths, LoadShape, Synthetic, build_requests

ADMIN_KEY = "admin-key-0123456789"


def test_a_shadow_study_recommends_the_knobs_that_serve_the_mirrored_traffic_better(
        tmp_path: Path) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    key = asyncio.run(create_tenants(db, {"acme": {}}))["acme"]
    with fairgate_engine("executor=sim", "sim_clock=realtime", "max_num_seqs=16",
                         "max_model_len=1024") as live, \
            fairgate_engine("executor=sim", "sim_clock=realtime", "max_model_len=1024") as shadow:
        config = GatewayConfig.from_dict({
            "demo_tenant": False, "admin_key": ADMIN_KEY, "metrics_port": None,
            "backends": [{"url": live}], "shadow": [{"name": "cand", "url": shadow}],
            "capture": {"path": str(tmp_path / "capture" / "live.jsonl")}})
        with ServerThread(make_app(config, database=db)) as gateway:
            stop = threading.Event()
            traffic = build_requests(Synthetic("steady", Lengths("fixed", 64),
                                               Lengths("fixed", 16), default_rate=8.0),
                                     LoadShape(rate=8.0, duration=120.0))
            sender = threading.Thread(target=run_workload_sync, args=(
                traffic, Target(gateway.url, key)), kwargs={
                "options": RunOptions(), "stop": lambda _result: stop.is_set()}, daemon=True)
            sender.start()
            try:
                space = tmp_path / "space.yaml"
                space.write_text("max_num_seqs: {choices: [1, 16]}\n")
                code = main([
                    "tune", "--mode", "shadow", "--gateway", gateway.url, "--admin-key",
                    ADMIN_KEY, "--shadow", "cand", "--shadow-requests", "24",
                    "--shadow-window", "60", "--set", "max_num_seqs=1", "--set",
                    "max_model_len=1024", "--space", str(space), "--slo-ttft-p99", "0.25",
                    "--slo-tpot-p99", "0.1", "--trials", "3", "--storage",
                    f"sqlite:///{tmp_path / 'studies.db'}", "--out", str(tmp_path / "out")])
                targets = request_json(f"{gateway.url}/admin/shadow", ADMIN_KEY)[1]["shadows"]
            finally:
                stop.set()
                sender.join(timeout=60)
    assert code == 0
    with open(tmp_path / "out" / "trials.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    seqs = {r["max_num_seqs"] for r in rows}
    assert seqs == {"1", "16"}, rows  # both knobs were tried on the mirrored traffic
    one = next(r for r in rows if r["max_num_seqs"] == "1")
    sixteen = next(r for r in rows if r["max_num_seqs"] == "16")
    # one sequence at a time cannot keep up with 8 req/s: the copies queue on the shadow
    assert one["infeasible"] and float(one["attainment_gain"]) < float(sixteen["attainment_gain"])
    assert sixteen["infeasible"] == ""
    best = yaml.safe_load((tmp_path / "out" / "best.yaml").read_text())["engine"]
    assert best["max_num_seqs"] == 16
    report = (tmp_path / "out" / "report.md").read_text()
    assert "SLO attainment vs live" in report and "the live engine's on the same" in report
    assert "mirrored by" in report and "(24 a trial, within 60 s)" in report
    # the re-check: the recommendation (the only distinct feasible config) on the captured
    # traffic, replayed on the shadow engine and simulated, beside its live-shadow figures
    assert targets[0]["sample"] == 1.0  # the mirroring paused for the replays is back
    with open(tmp_path / "out" / "recheck.csv", newline="") as f:
        rechecked = list(csv.DictReader(f))
    assert [r["max_num_seqs"] for r in rechecked][0] == "16"
    assert rechecked[0]["role"] == "recommended"
    for row in rechecked:
        for source in ("shadow", "replay", "sim"):
            assert row[f"{source}_p99_ttft_s"] not in ("", "inf"), (source, row)
            assert 0 <= float(row[f"{source}_slo_attainment"]) <= 1, (source, row)
    sixteen_row = rechecked[0]
    # 16 seats at 8 req/s of 64-token prompts: both replay and sim meet the 250 ms p99 TTFT
    assert float(sixteen_row["replay_p99_ttft_s"]) < 0.25
    assert float(sixteen_row["sim_p99_ttft_s"]) < 0.25
    one_rows = [r for r in rechecked if r["max_num_seqs"] == "1"]
    for one_row in one_rows:  # re-checked only if it was feasible somewhere: slower there too
        for source in ("replay", "sim"):
            assert float(one_row[f"{source}_p99_ttft_s"]) > float(
                sixteen_row[f"{source}_p99_ttft_s"])
    assert "Re-check on the captured traffic" in report and "live shadow p99 TTFT" in report
    assert "left on the recommended config" in report
    assert "Re-check on the captured traffic" in (tmp_path / "out" / "report.html").read_text()


def test_the_recheck_is_skipped_with_why_and_how_without_a_capture_or_its_requests() -> None:
    no_capture = (b'{"error":{"message":"this gateway captures no traffic","type":'
                  b'"invalid_request_error","param":null,"code":"no_capture"}}')
    with pytest.raises(Skip, match="captures no traffic") as skipped:
        capture_trace(404, no_capture, 0.0, 60.0)
    assert ENABLE_HINT in str(skipped.value) and "gateway.capture" in ENABLE_HINT
    with pytest.raises(Skip, match="holds no requests from the study's span"):
        capture_trace(200, b"", 0.0, 60.0)
    with pytest.raises(Skip, match="answered 401: an admin key is required"):
        capture_trace(401, b'{"error":{"message":"an admin key is required"}}', 0.0, 60.0)
    trace = capture_trace(200, b"# fairgate trace captured from ...\n"
                               b'{"arrival":3.5,"prompt_tokens":8,"output_tokens":2}\n'
                               b'{"arrival":4.0,"prompt_tokens":9,"output_tokens":2}\n',
                          0.0, 60.0)
    assert [(r.arrival, r.prompt_tokens) for r in trace] == [(0.0, 8), (0.5, 9)]
    assert notes(Recheck([], skipped="the gateway captures no traffic")) == [
        "Skipped: the gateway captures no traffic."]  # the report's line


def _row(number: int, value: float | None, seqs: int, infeasible: str | None = None) -> TrialRow:
    return TrialRow(number, "COMPLETE", {"max_num_seqs": seqs}, None, True, {}, value,
                    infeasible, objective="shadow")


def test_the_recheck_takes_the_recommendation_then_the_next_best_distinct_feasible_configs(
        ) -> None:
    rows = [_row(0, -0.5, 1, "missed"), _row(1, 0.1, 16), _row(2, 0.3, 8), _row(3, 0.3, 8),
            _row(4, 0.2, 4), _row(5, 0.0, 2)]
    # the recommendation need not be the study's top trial (robustness may pick another)
    outcome = StudyOutcome("s", rows, best=rows[1], default=rows[0])
    assert [r.number for r in candidates(outcome, 3)] == [1, 2, 4]
    assert candidates(outcome, 0) == []
    assert candidates(StudyOutcome("s", rows, best=None, default=None), 3) == []


def test_the_mirroring_paused_for_the_replays_comes_back_however_they_end(
        tmp_path: Path) -> None:
    db = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    asyncio.run(create_tenants(db, {"acme": {}}))
    config = GatewayConfig.from_dict({
        "demo_tenant": False, "admin_key": ADMIN_KEY, "metrics_port": None,
        "shadow": [{"name": "cand", "url": "http://127.0.0.1:9", "sample": 0.4}]})
    said: list[str] = []
    with ServerThread(make_app(config, database=db)) as gateway:
        def sample() -> float:
            return float(request_json(f"{gateway.url}/admin/shadow", ADMIN_KEY)[1]
                         ["shadows"][0]["sample"])

        with pytest.raises(KeyboardInterrupt), paused_mirroring(gateway.url, ADMIN_KEY, "cand",
                                                                said.append):
            assert sample() == 0.0
            raise KeyboardInterrupt  # Ctrl-C mid-replay
        assert sample() == 0.4
        with paused_mirroring(gateway.url, ADMIN_KEY, "cand", said.append):
            assert sample() == 0.0
        assert sample() == 0.4
        with pytest.raises(Skip, match="no shadow target 'other'"), paused_mirroring(
                gateway.url, ADMIN_KEY, "other", said.append):
            pass
    assert said == []


def test_shadow_samples_carry_token_times_so_a_trial_scores_per_gap_itl() -> None:
    from control.shadow import Pair, samples
    from protocol.measures import SLO, RequestTiming
    from tuner.shadow_mode import timing_of

    stalled = RequestTiming(10.0, [10.1, 10.12, 10.62, 10.64], 4, 10.7)  # one 500 ms stall
    rows = samples([Pair("acme", SLO(), live=stalled, shadow=stalled)])
    timing = timing_of(rows["shadow"][0])
    assert list(timing.itls) == pytest.approx([0.02, 0.5, 0.02])
    assert timing.ttft == pytest.approx(0.1) and timing.tpot == pytest.approx(stalled.tpot)
    # a gateway from before the token times: five fields, the gaps evenly spaced at the TPOT
    old = timing_of(rows["shadow"][0][:5])
    assert list(old.itls) == pytest.approx([stalled.tpot] * 3)

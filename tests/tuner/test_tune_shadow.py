"""`fairgate tune --mode shadow` end to end: a gateway with a live engine and a shadow engine
(both `fairgate engine` processes on the simulated executor in real time), live traffic from the
load generator, a study whose trials reconfigure the shadow engine and are scored on the
mirrored requests against the live engine."""

from __future__ import annotations

import asyncio
import csv
import threading
from pathlib import Path

import yaml

from fairgate.cli import main
from gateway.app import make_app
from gateway.config import GatewayConfig
from tests.gateway.helpers import ServerThread, create_tenants
from tests.support.processes import fairgate_engine
from tuner.loadgen import RunOptions, Target, run_workload_sync
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
            "backends": [{"url": live}], "shadow": [{"name": "cand", "url": shadow}]})
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
                    "--slo-itl-p99", "0.1", "--trials", "3", "--storage",
                    f"sqlite:///{tmp_path / 'studies.db'}", "--out", str(tmp_path / "out")])
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

"""Replay tuning against a keyed engine: the workload, /load and /stats go with the api key,
/admin/config and /admin/reconfigure with the admin key; without the admin key the engine
refuses the study's first step, with a line that says which key to give."""

from __future__ import annotations

import argparse
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.async_engine import AsyncEngine
from engine.config import ENGINE_ADMIN_KEY_ENV, ENGINE_KEY_ENV, EngineAccess, EngineConfig
from engine.server import make_app
from fairgate.cli import main
from protocol.measures import RequestTiming
from tests.gateway.helpers import ServerThread
from tuner.remote import ReplayRunner
from tuner.traces import TraceRequest

API_KEY = "engine-key-0123456789"
ADMIN_KEY = "engine-admin-0123456789"
REQUESTS = [TraceRequest(i * 0.02, 16, 4) for i in range(4)]
KNOBS = ("max_num_seqs",)


@pytest.fixture
def engine_url() -> Iterator[str]:
    config = EngineConfig(executor="sim", sim_clock="realtime", sim_model="tiny",
                          sim_hardware="cpu", max_model_len=4096, num_kv_blocks=1024,
                          max_num_batched_tokens=512, max_num_seqs=32)
    app = make_app(AsyncEngine(config), access=EngineAccess(API_KEY, ADMIN_KEY))
    with ServerThread(app) as server:
        yield server.url


def live_seqs(url: str) -> int:
    req = urllib.request.Request(f"{url}/admin/config",
                                 headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return int(json.load(resp)["config"]["max_num_seqs"])


def never_stop(finished: list[RequestTiming]) -> None:
    return None


def test_a_replay_study_runs_on_a_keyed_engine_with_both_keys(engine_url: str) -> None:
    runner = ReplayRunner(engine_url, API_KEY, KNOBS, admin_key=ADMIN_KEY)
    base = runner.prepare(EngineConfig())
    assert base.max_num_seqs == 32
    try:
        run = runner.run(base.replace(max_num_seqs=4), REQUESTS, never_stop)
        assert len(run.timings) == len(REQUESTS) and all(t.ok for t in run.timings)
        assert live_seqs(engine_url) == 4
        assert run.steps > 0 and run.engine_stats is not None  # /load and /stats answered
    finally:
        runner.finish(None)
    assert live_seqs(engine_url) == 32


def test_without_the_admin_key_the_engine_refuses_the_study(engine_url: str) -> None:
    runner = ReplayRunner(engine_url, API_KEY, KNOBS)  # the api key is not the admin key
    with pytest.raises(ValueError, match="admin key is required.*--engine-admin-key"):
        runner.prepare(EngineConfig())
    with pytest.raises(ValueError, match="refused the knobs: an admin key is required"):
        runner.reconfigure(EngineConfig(max_num_seqs=4))
    assert live_seqs(engine_url) == 32


def test_fairgate_tune_reads_the_engine_keys_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from fairgate.tune_cli import register

    monkeypatch.setenv(ENGINE_KEY_ENV, API_KEY)
    monkeypatch.setenv(ENGINE_ADMIN_KEY_ENV, ADMIN_KEY)
    parser = argparse.ArgumentParser()
    register(parser)
    args = parser.parse_args(["--mode", "replay", "--url", "http://127.0.0.1:1"])
    assert (args.api_key, args.engine_admin_key) == (API_KEY, ADMIN_KEY)
    args = parser.parse_args(["--engine-admin-key", "flag-admin-0123456789"])
    assert args.engine_admin_key == "flag-admin-0123456789"


def test_fairgate_tune_replay_end_to_end_with_the_keys(tmp_path: Path, engine_url: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)
    monkeypatch.delenv(ENGINE_ADMIN_KEY_ENV, raising=False)
    space = tmp_path / "space.yaml"
    space.write_text("max_num_seqs: {low: 2, high: 16, log: true}\n")
    argv = ["tune", "--mode", "replay", "--url", engine_url, "--workload", "uniform",
            "--rate", "10", "--duration", "1", "--slo-ttft-p99", "2", "--slo-tpot-p99", "0.5",
            "--space", str(space), "--trials", "2", "--robustness", "0", "--no-tenant-slos",
            "--storage", f"sqlite:///{tmp_path / 'studies.db'}", "--study", "s",
            "--out", str(tmp_path / "out"), "--api-key", API_KEY]
    assert main(argv) == 2  # the admin routes refuse the api key: the study cannot start
    assert live_seqs(engine_url) == 32
    assert main([*argv, "--engine-admin-key", ADMIN_KEY]) == 0
    assert live_seqs(engine_url) == 32  # put back on its own config

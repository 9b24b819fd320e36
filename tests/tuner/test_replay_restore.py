"""Replay mode takes its base from the live engine (GET /admin/config) and puts the engine back
on that config when the study ends, however it ends, unless it applies the winner: against a
real `fairgate engine` (sim executor, real time) started with max_num_seqs=32."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.config import EngineConfig
from fairgate.cli import main
from protocol.measures import RequestTiming
from tests.support.processes import fairgate_engine
from tuner.remote import ReplayRunner
from tuner.traces import TraceRequest

REQUESTS = [TraceRequest(i * 0.05, 16, 4) for i in range(6)]
KNOBS = ("max_num_seqs",)


@pytest.fixture
def engine_url() -> Iterator[str]:
    with fairgate_engine("executor=sim", "sim_clock=realtime", "max_num_seqs=32") as url:
        yield url


def live_seqs(url: str) -> int:
    with urllib.request.urlopen(f"{url}/admin/config", timeout=10) as resp:
        return int(json.load(resp)["config"]["max_num_seqs"])


def never_stop(finished: list[RequestTiming]) -> None:
    return None


def test_the_base_is_the_engines_own_config_not_the_users(engine_url: str) -> None:
    runner = ReplayRunner(engine_url, None, KNOBS)
    base = runner.prepare(EngineConfig(max_num_seqs=4, policy="sjf"))
    assert base.max_num_seqs == 32 and base.policy == "fcfs"
    assert (base.executor, base.sim_clock) == ("sim", "realtime")
    assert base == runner.live_config()


def test_the_engine_is_back_on_its_config_after_the_study(engine_url: str) -> None:
    runner = ReplayRunner(engine_url, None, KNOBS)
    base = runner.prepare(EngineConfig())
    try:
        for seqs in (4, 8, 16):  # the study's trials, as tuner.study runs them
            run = runner.run(base.replace(max_num_seqs=seqs), REQUESTS, never_stop)
            assert all(t.ok for t in run.timings) and live_seqs(engine_url) == seqs
    finally:
        runner.finish(None)
    assert live_seqs(engine_url) == 32


def test_the_engine_is_back_on_its_config_after_an_interrupted_study(engine_url: str) -> None:
    runner = ReplayRunner(engine_url, None, KNOBS)
    base = runner.prepare(EngineConfig())

    def interrupt(finished: list[RequestTiming]) -> None:
        raise KeyboardInterrupt  # Ctrl-C while the second trial's requests are in flight

    with pytest.raises(KeyboardInterrupt):
        try:
            runner.run(base.replace(max_num_seqs=4), REQUESTS, never_stop)
            runner.run(base.replace(max_num_seqs=8), REQUESTS, interrupt)
        finally:
            runner.finish(None)
    assert live_seqs(engine_url) == 32


def test_apply_leaves_the_engine_on_the_winner_and_only_on_one(engine_url: str) -> None:
    runner = ReplayRunner(engine_url, None, KNOBS, apply=True)
    base = runner.prepare(EngineConfig())
    runner.run(base.replace(max_num_seqs=4), REQUESTS, never_stop)
    runner.finish(None)  # the study failed: no winner to apply
    assert live_seqs(engine_url) == 32
    runner.finish(base.replace(max_num_seqs=8))
    assert live_seqs(engine_url) == 8


def test_an_engine_without_a_readable_config_is_one_line(engine_url: str) -> None:
    runner = ReplayRunner(engine_url, "wrong-key", KNOBS)
    runner.url += "/nowhere"
    with pytest.raises(ValueError, match="cannot read the engine's config at .*/admin/config"):
        runner.prepare(EngineConfig())


def test_fairgate_tune_puts_the_engine_back(tmp_path: Path, engine_url: str) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("max_num_seqs: {low: 2, high: 64, log: true}\n")
    assert main(["tune", "--mode", "replay", "--url", engine_url, "--workload", "uniform",
                 "--rate", "10", "--duration", "1", "--slo-ttft-p99", "2", "--slo-tpot-p99",
                 "0.5", "--space", str(space), "--trials", "2", "--storage",
                 f"sqlite:///{tmp_path / 'studies.db'}", "--out", str(tmp_path / "out")]) == 0
    assert live_seqs(engine_url) == 32

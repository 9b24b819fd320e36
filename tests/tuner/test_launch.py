"""Launch mode against real processes: servers die with the tuner however it ends, a failed
launch is noticed at once, a failure the knobs did not cause stops the study the second time in
a row, and each engine (vLLM, SGLang, fairgate) gets its own flags: checked with stand-ins
that accept exactly that engine's flags (tests/tuner/stand_ins) and serve with `fairgate
engine` (sim executor, real time)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from engine.config import EngineConfig
from fairgate.cli import main
from fairgate.engine_cli import build_config
from tests.support.waiting import poll_until
from tuner.engines import FAIRGATE, SGLANG, VLLM
from tuner.remote import STOP_GRACE_S, LaunchAborted, LaunchCommand, LaunchRunner, normalized
from tuner.study_report import engine_flags
from tuner.traces import TraceRequest

ROOT = Path(__file__).resolve().parents[2]
STAND_INS = Path(__file__).resolve().parent / "stand_ins"
VLLM_STANDIN = [sys.executable, str(STAND_INS / "vllm_standin.py"), "serve"]
SGLANG_STANDIN = [sys.executable, str(STAND_INS / "sglang_standin.py"), "--model-path"]
REQUESTS = [TraceRequest(i * 0.05, 16, 4) for i in range(6)]
KNOBS = ("max_num_seqs", "max_num_batched_tokens", "memory_fraction")
CONFIG = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, memory_fraction=0.8)


def never_stop(finished: object) -> None:
    return None


def gone(pid: int) -> bool:
    """The process has exited (a zombie whose parent has not reaped it counts: it holds no
    memory and runs nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


# ----------------------------------------------------------------------------- dying with it


@contextmanager
def tuner_parent(mode: str, *extra: str) -> Iterator[tuple[subprocess.Popen[bytes], int, int]]:
    """tests/tuner/stand_ins/tuner_parent.py: (the parent, its server's pid, the worker's)."""
    parent = subprocess.Popen([sys.executable, str(STAND_INS / "tuner_parent.py"), mode,
                               *extra], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL)
    try:
        assert parent.stdout is not None and parent.stdin is not None
        server, worker = (int(pid) for pid in parent.stdout.readline().split())
        assert not gone(server) and not gone(worker)
        parent.stdin.write(b"go\n")
        parent.stdin.flush()
        yield parent, server, worker
    finally:
        parent.kill()
        parent.wait()
        parent.stdin.close()  # type: ignore[union-attr]
        parent.stdout.close()  # type: ignore[union-attr]


@pytest.mark.parametrize("end", ["sigkill", "sigterm", "raise", "exit", "with-raise"])
def test_a_launched_server_and_its_workers_die_with_the_tuner(end: str) -> None:
    with tuner_parent("wait" if end.startswith("sig") else end) as (parent, server, worker):
        if end.startswith("sig"):
            parent.send_signal(signal.SIGKILL if end == "sigkill" else signal.SIGTERM)
        parent.wait(timeout=30)
        poll_until(lambda: gone(server) and gone(worker), 15,
                   f"the server {server} and its worker {worker} are gone")


def test_a_server_that_ignores_sigterm_dies_at_once_with_a_killed_tuner() -> None:
    """The death signal (PR_SET_PDEATHSIG), not the reaper's SIGTERM and SIGKILL a grace
    later: well inside that grace."""
    with tuner_parent("wait", "stubborn") as (parent, server, _):
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        poll_until(lambda: gone(server), STOP_GRACE_S / 2, f"the server {server} is gone")


# ----------------------------------------------------------------------------- failed launches


def python(code: str) -> str:
    return shlex.join([sys.executable, "-c", code])


def test_a_server_that_exits_is_noticed_at_once_and_the_same_exit_twice_stops() -> None:
    # the status follows the knob; the last line differs in its pid only
    runner = LaunchRunner(python("import os, sys; print('pid', os.getpid(), 'no GPU'); "
                                 "sys.exit({max_num_seqs} % 2 + 3)"), None, 60.0,
                          knobs=["max_num_seqs"])
    started = time.monotonic()
    for seqs in (2, 3, 2):  # no two alike in a row: each trial is infeasible, the study goes on
        with pytest.raises(ValueError, match=rf"exited with status {seqs % 2 + 3}: pid \d+ no GPU"):
            runner.run(CONFIG.replace(max_num_seqs=seqs), REQUESTS, never_stop)
    with pytest.raises(LaunchAborted, match="two launches in a row failed the same way.*"
                                            "exited with status 3: pid"):
        runner.run(CONFIG.replace(max_num_seqs=2), REQUESTS, never_stop)
    assert time.monotonic() - started < 30  # not one --launch-timeout was waited out
    assert not issubclass(LaunchAborted, ValueError)  # ValueError: the trial is infeasible


def test_a_server_never_healthy_twice_stops_the_study() -> None:
    runner = LaunchRunner(python("import signal; signal.pause()"), None, 0.5)
    with pytest.raises(ValueError, match=r"never became healthy within 0.5 s"):
        runner.run(CONFIG, REQUESTS, never_stop)
    with pytest.raises(LaunchAborted, match=r"never became healthy within 0.5 s"):
        runner.run(CONFIG, REQUESTS, never_stop)


@pytest.mark.parametrize(("command", "engine", "line"), [
    (VLLM_STANDIN, "vllm", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate"),
    (SGLANG_STANDIN, "sglang", "RuntimeError: Not enough memory."),
])
def test_out_of_memory_is_an_infeasible_trial_every_time(command: list[str], engine: str,
                                                         line: str) -> None:
    runner = LaunchRunner(shlex.join([*command, "oom"]), None, 30.0, engine, KNOBS)
    for _ in range(3):  # never stops the study: other knobs may fit
        with pytest.raises(ValueError, match="^out of memory: ") as failed:
            runner.run(CONFIG, REQUESTS, never_stop)
        assert line in str(failed.value)


def test_a_server_of_another_engine_refuses_its_flags_and_the_study_stops() -> None:
    runner = LaunchRunner(shlex.join([*VLLM_STANDIN, "tiny"]), None, 30.0, "sglang", KNOBS)
    with pytest.raises(ValueError, match="exited with status 2:.*unrecognized arguments: "
                                         "--max-running-requests 8"):
        runner.run(CONFIG, REQUESTS, never_stop)
    with pytest.raises(LaunchAborted, match="unrecognized arguments"):
        runner.run(CONFIG.replace(max_num_seqs=16), REQUESTS, never_stop)


def test_an_unexplained_failure_repeated_stops_the_study() -> None:
    runner = LaunchRunner(shlex.join([*VLLM_STANDIN, "broken"]), None, 30.0, "vllm", KNOBS)
    with pytest.raises(ValueError, match="no weights found"):
        runner.run(CONFIG, REQUESTS, never_stop)
    with pytest.raises(LaunchAborted, match="no weights found"):
        runner.run(CONFIG.replace(max_num_seqs=4), REQUESTS, never_stop)


def test_failure_lines_compare_without_times_pids_and_sizes() -> None:
    assert normalized("ERROR 12-02 18:08:32 [x.py:91] (pid=4242) at 0x7f3a: 2.00 GiB") == (
        normalized("ERROR 12-03 09:00:01 [x.py:91]  (pid=77) at 0xbeef: 1.50 GiB"))


# ----------------------------------------------------------------------------- engines' flags


def test_each_engine_gets_its_own_flags_appended() -> None:
    config = CONFIG.replace(max_model_len=None)
    assert LaunchCommand.of("vllm serve M", VLLM, KNOBS).argv(config, 8123) == [
        "vllm", "serve", "M", "--host", "127.0.0.1", "--port", "8123", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512", "--gpu-memory-utilization", "0.8"]
    # an unset max_model_len is left to the engine (the model's context length)
    assert LaunchCommand.of("launch --model-path M --host 0.0.0.0", SGLANG,
                            ["max_num_seqs", "max_model_len"]).argv(config, 1) == [
        "launch", "--model-path", "M", "--host", "0.0.0.0", "--port", "1",
        "--max-running-requests", "8"]
    assert LaunchCommand.of("fairgate engine", FAIRGATE, ["max_num_seqs", "policy"]).argv(
        config, 2) == ["fairgate", "engine", "--host", "127.0.0.1", "--port", "2",
                       "--set", "max_num_seqs=8", "--set", "policy=fcfs"]


def test_the_template_style_keeps_working_beside_appended_flags() -> None:
    command = LaunchCommand.of("serve --port {port} --max-num-seqs {max_num_seqs}", VLLM,
                               ["max_num_seqs", "memory_fraction"])
    assert command.argv(CONFIG, 9) == ["serve", "--port", "9", "--max-num-seqs", "8",
                                       "--gpu-memory-utilization", "0.8"]


@pytest.mark.parametrize(("command", "engine", "knobs", "message"), [
    ("vllm serve M --max-num-seqs 64", VLLM, ["max_num_seqs"], "sets max_num_seqs itself"),
    ("fairgate engine --set max_num_seqs=64", FAIRGATE, ["max_num_seqs"],
     "sets max_num_seqs itself"),
    ("vllm serve M --port=8000", VLLM, [], "sets --port itself"),
    ("vllm serve M", VLLM, ["policy"], "--engine vllm has no flag for policy"),
])
def test_a_command_that_fights_the_tuner_is_refused(command: str, engine: object,
                                                    knobs: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LaunchCommand.of(command, engine, knobs)  # type: ignore[arg-type]


@pytest.mark.parametrize("command", [
    [*VLLM_STANDIN, "tiny", "--set", "max_num_seqs=4"],
    [*VLLM_STANDIN, "tiny", "--max-running-requests", "4"],
    [*SGLANG_STANDIN, "tiny", "--max-num-seqs", "4"],
])
def test_the_stand_ins_refuse_other_engines_flags(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, timeout=30)
    assert done.returncode == 2 and b"unrecognized arguments" in done.stderr


@pytest.mark.parametrize(("command", "engine", "flags"), [
    (VLLM_STANDIN, "vllm", ["--max-num-seqs", "8", "--max-num-batched-tokens", "512",
                            "--gpu-memory-utilization", "0.8"]),
    (SGLANG_STANDIN, "sglang", ["--max-running-requests", "8", "--chunked-prefill-size", "512",
                                "--mem-fraction-static", "0.8"]),
])
def test_a_trial_runs_on_each_engine_with_its_flags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: list[str], engine: str,
        flags: list[str]) -> None:
    log = tmp_path / "starts.jsonl"
    monkeypatch.setenv("STANDIN_LOG", str(log))
    runner = LaunchRunner(shlex.join([*command, "tiny"]), None, 60.0, engine, KNOBS)
    run = runner.run(CONFIG, REQUESTS, never_stop)
    assert len(run.timings) == len(REQUESTS) and all(t.ok for t in run.timings)
    [start] = [json.loads(line) for line in log.read_text().splitlines()]
    assert start["argv"][-len(flags):] == flags
    assert start["knobs"] == {"max_num_seqs": 8, "max_num_batched_tokens": 512,
                              "memory_fraction": 0.8}
    assert run.engine_stats is not None  # fairgate's own /stats: the stand-in is that engine


# ----------------------------------------------------------------------------- best.yaml


def test_best_yaml_carries_the_winner_as_the_engines_flags(tmp_path: Path) -> None:
    assert main(["tune", "--mode", "sim", "--workload", "uniform", "--rate", "10", "--duration",
                 "2", "--slo-ttft-p99", "2", "--slo-itl-p99", "0.5", "--trials", "2",
                 "--storage", f"sqlite:///{tmp_path / 'studies.db'}",
                 "--out", str(tmp_path / "out")]) == 0
    path = tmp_path / "out" / "best.yaml"
    best = yaml.safe_load(path.read_text())
    tuned = ["max_num_batched_tokens", "max_num_seqs", "max_model_len", "memory_fraction"]
    assert best["tuner"] == {"engine": "fairgate", "flags": [
        arg for knob in tuned for arg in ("--set", f"{knob}={best['engine'][knob]}")]}
    assert build_config(str(path), []).max_num_seqs == best["engine"]["max_num_seqs"]


@pytest.mark.parametrize(("engine", "flags"), [
    ("vllm", ["--max-num-seqs", "12", "--gpu-memory-utilization", "0.85"]),
    ("sglang", ["--max-running-requests", "12", "--mem-fraction-static", "0.85"]),
    ("fairgate", ["--set", "max_num_seqs=12", "--set", "memory_fraction=0.85",
                  "--set", "sim_model=tiny"]),
])
def test_best_yaml_flags_per_engine(engine: str, flags: list[str]) -> None:
    spec = SimpleNamespace(runner=SimpleNamespace(engine=engine))  # the fields engine_flags reads
    params = {"max_num_seqs": 12, "memory_fraction": 0.85, "sim_model": "tiny"}
    assert engine_flags(spec, params) == {"engine": engine, "flags": flags}  # type: ignore[arg-type]


def test_an_unknown_engine_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "--mode", "launch", "--command", "serve", "--engine", "vlm",
                 "--workload", "uniform", "--slo-ttft-p99", "1", "--slo-itl-p99", "0.1",
                 "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == ("fairgate tune: error: --engine must be one of fairgate | vllm | sglang, "
                   "got 'vlm'; did you mean vllm?\n")
    assert not (tmp_path / "out").exists()

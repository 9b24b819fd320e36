"""`fairgate engine`: configuration from file and --set, one-line errors, a real server."""

from __future__ import annotations

import json
import signal
import socket
import urllib.request
from pathlib import Path

import pytest

from engine.heap import YOUNG_PER_SEQ
from fairgate.cli import main
from fairgate.engine_cli import build_config, parse_overrides
from tests.support.processes import free_port, read_until, spawn_fairgate

SIM = ["--set", "executor=sim", "--set", "sim_model=tiny", "--set", "num_kv_blocks=256"]


def test_file_section_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "fairgate.yaml"
    path.write_text("engine:\n  executor: sim\n  max_num_seqs: 8\n  policy: sjf\n")
    config = build_config(str(path), ["max_num_seqs=16", "enable_prefix_caching=false",
                                      "num_kv_blocks=null"])
    assert (config.executor, config.max_num_seqs, config.policy) == ("sim", 16, "sjf")
    assert config.enable_prefix_caching is False and config.num_kv_blocks is None
    assert build_config(None, []).model == "random:tiny"
    assert parse_overrides(["sim_model=tiny", "memory_fraction=0.5"]) == {
        "sim_model": "tiny", "memory_fraction": 0.5}


@pytest.mark.parametrize(("yaml_text", "overrides", "message"), [
    ("engine:\n  max_num_seqs: [\n", [], "invalid YAML"),
    ("engine:\n  bogus: 1\n", [], "unknown engine setting"),
    ("engine: {}\n", ["memory_fraction=lots"], "memory_fraction must be a number in (0, 1]"),
    ("engine: {}\n", ["max_num_seqs"], "KNOB=VALUE"),
    ("engine: {}\n", ["policy=random"], "policy must be one of"),
])
def test_bad_configuration_is_one_line_and_exit_2(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], yaml_text: str,
        overrides: list[str], message: str) -> None:
    path = tmp_path / "fairgate.yaml"
    path.write_text(yaml_text)
    argv = ["engine", "-c", str(path)] + [a for o in overrides for a in ("--set", o)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("fairgate engine: error:") and message in err
    assert err.count("\n") == 1


def test_engine_server_starts_serves_and_stops_on_sigint() -> None:
    port = free_port()
    proc = spawn_fairgate("engine", "--port", str(port), *SIM, "--metrics-compat", "vllm",
                          "--set", "max_num_seqs=96")
    base = f"http://127.0.0.1:{port}"
    printed = b""
    try:
        printed = read_until(proc, b"serving ")  # logged once the port is open
        # the collector sized for the engine's steps (tests/engine/test_heap.py)
        assert (f"young generation {YOUNG_PER_SEQ * 96} objects (max_num_seqs 96)".encode()
                in printed), printed
        with urllib.request.urlopen(f"{base}/healthz", timeout=5) as resp:
            assert resp.status == 200
        request = urllib.request.Request(
            f"{base}/v1/completions", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"prompt": "hi", "max_tokens": 3}).encode())
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert json.load(resp)["usage"]["completion_tokens"] == 3
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as resp:
            assert b"vllm:num_requests_running" in resp.read()
    finally:
        proc.send_signal(signal.SIGINT)
        output = (printed + proc.communicate(timeout=20)[0]).decode()
    assert proc.returncode in (0, 130), output


def test_port_in_use_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = spawn_fairgate("engine", "--port", str(port), *SIM)
        printed = proc.communicate(timeout=120)[0].decode()  # stderr too
    assert proc.returncode == 2
    assert "Traceback" not in printed
    assert printed.strip().splitlines()[-1].startswith("fairgate engine: error: ")
    assert "address already in use" in printed

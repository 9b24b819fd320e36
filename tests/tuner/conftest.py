"""Fixtures for the tuner tests: a fake OpenAI-compatible server in its own process (for the
`fairgate bench` command, which runs its own event loop) and small trace files."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
StartServer = Callable[..., str]


@pytest.fixture
def fake_server_process() -> Iterator[StartServer]:
    """start(*args) -> base URL of `python -m tuner.fake_server --port 0 *args`."""
    procs: list[subprocess.Popen[str]] = []

    def start(*args: str) -> str:
        cmd = [sys.executable, "-m", "tuner.fake_server", "--port", "0", *args]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "listening on" in line, f"fake server did not start: {line!r}"
        return line.rsplit(" ", 1)[-1].strip()

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)

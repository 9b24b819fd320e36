"""Fixtures for the tuner tests: a fake OpenAI-compatible server in its own process (for the
`fairgate bench` command, which runs its own event loop) and small trace files."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator

import pytest

from tests.support.processes import drain, spawn_module, stop, wait_for_output

StartServer = Callable[..., str]


@pytest.fixture
def fake_server_process() -> Iterator[StartServer]:
    """start(*args) -> base URL of `python -m tuner.fake_server --port 0 *args`."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*args: str) -> str:
        proc = spawn_module("tuner.fake_server", "--port", "0", *args)
        procs.append(proc)
        line = wait_for_output(proc, b"listening on")
        drain(proc)
        return line.decode().rsplit(" ", 1)[-1].strip()

    yield start
    for proc in procs:
        stop(proc, signal.SIGTERM, 10)

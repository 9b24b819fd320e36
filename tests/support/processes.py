"""Servers in their own process: wait for the line a server prints once it listens (an event
on its output pipe), never a sleep-and-poll loop."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def wait_for_output(proc: subprocess.Popen[bytes], marker: bytes, timeout: float = 30.0) -> bytes:
    """Read `proc`'s stdout until a line containing `marker` (returned); AssertionError with
    what it printed when it exits first or `timeout` seconds pass."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    seen = b""
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as selector:
        selector.register(fd, selectors.EVENT_READ)
        while (left := deadline - time.monotonic()) > 0:
            if not selector.select(left):
                break
            chunk = os.read(fd, 65536)  # unbuffered: select and the read see the same bytes
            if not chunk:
                break  # the process closed its output: it exited
            seen += chunk
            for line in seen.splitlines():
                if marker in line:
                    return line
    raise AssertionError(f"the process never printed {marker!r} (exit {proc.poll()}): "
                         f"{seen.decode(errors='replace')[-2000:]}")


@contextmanager
def fairgate_engine(*sets: str, config: str | Path | None = None) -> Iterator[str]:
    """A real `fairgate engine [-c config] --set KNOB=VALUE ...` in its own process on a free
    port, ready (it logged its listening line): its URL; stopped with SIGINT (then killed)
    afterwards. Its output is drained while it serves, so a chatty engine never blocks."""
    with fairgate_engine_process(*sets, config=config) as (url, _):
        yield url


@contextmanager
def fairgate_engine_process(*sets: str, config: str | Path | None = None,
                            port: int | None = None) -> Iterator[
        tuple[str, subprocess.Popen[bytes]]]:
    """`fairgate_engine`, with the process (to signal it); `port`: that one instead of a free
    one (to start an engine again where a killed one served)."""
    with fairgate_engine_processes(sets, config=config, ports=[port]) as [engine]:
        yield engine


@contextmanager
def fairgate_engine_processes(*engines: Sequence[str], config: str | Path | None = None,
                              ports: Sequence[int | None] | None = None) -> Iterator[
        list[tuple[str, subprocess.Popen[bytes]]]]:
    """`fairgate_engine_process` for several engines (each its own `--set` knobs, and port
    when `ports` names one), started at once so that their startups overlap."""
    procs: list[tuple[int, subprocess.Popen[bytes]]] = []
    try:
        for sets, port in zip(engines, ports or [None] * len(engines), strict=True):
            port = _free_port() if port is None else port
            procs.append((port, _spawn_engine(port, sets, config)))
        for _, proc in procs:
            wait_for_output(proc, b"serving ")  # logged once the port is open
            assert proc.stdout is not None
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # to EOF
        yield [(f"http://127.0.0.1:{port}", proc) for port, proc in procs]
    finally:
        for _, proc in procs:  # all at once: their shutdowns overlap too
            proc.send_signal(signal.SIGCONT)  # a test may have stopped it
            proc.send_signal(signal.SIGINT)
        for _, proc in procs:
            _wait_or_kill(proc)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn_engine(port: int, sets: Sequence[str],
                  config: str | Path | None) -> subprocess.Popen[bytes]:
    args = [a for knob in sets for a in ("--set", knob)]
    if config is not None:
        args = ["-c", str(config), *args]
    return subprocess.Popen([sys.executable, "-m", "fairgate", "engine", "--port", str(port),
                             *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _wait_or_kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()

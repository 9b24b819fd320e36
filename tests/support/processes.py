"""Servers in their own process: started one way (`spawn_module`, `spawn_fairgate`), waited for
on the line a server prints once it listens (an event on its output pipe, never a
sleep-and-poll loop), stopped one way; and the free port they listen on."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on now (the system's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_module(module: str, *args: str, cwd: str | Path = ROOT,
                 env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`python -m module ARGS...` on this checkout (PYTHONPATH names it, so `cwd` may be the
    test's own folder), `env` added to the environment; stdout and stderr on one pipe, which
    the caller reads (`wait_for_output`, `drain`) so that a chatty process never blocks."""
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
                                 **(env or {})},
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def spawn_fairgate(*args: str, cwd: str | Path = ROOT,
                   env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`fairgate ARGS...` as `spawn_module` starts it."""
    return spawn_module("fairgate", *args, cwd=cwd, env=env)


def read_until(proc: subprocess.Popen[bytes], marker: bytes, timeout: float = 30.0) -> bytes:
    """Read `proc`'s stdout until a whole line containing `marker`: all it printed up to the
    end of that line; AssertionError with what it printed when it exits first or `timeout`
    seconds pass."""
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
            start = seen.rfind(b"\n") + 1  # the lines already read did not hold it
            seen += chunk
            end = seen.rfind(b"\n") + 1  # a line counts once it is whole
            at = seen.find(marker, start, end)
            if at >= 0:
                return seen[:seen.index(b"\n", at) + 1]
    raise AssertionError(f"the process never printed {marker!r} (exit {proc.poll()}): "
                         f"{seen.decode(errors='replace')[-2000:]}")


def wait_for_output(proc: subprocess.Popen[bytes], marker: bytes, timeout: float = 30.0) -> bytes:
    """`read_until`, answering just the line that holds `marker`."""
    return read_until(proc, marker, timeout).splitlines()[-1]


def drain(proc: subprocess.Popen[bytes]) -> None:
    """Read the rest of `proc`'s output, to its end, in a thread of its own (thrown away)."""
    assert proc.stdout is not None
    threading.Thread(target=proc.stdout.read, daemon=True).start()


def stop(proc: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGINT,
         timeout: float = 20.0) -> int:
    """Resume it (a test may have stopped it), send `sig`, wait `timeout` s, SIGKILL if it
    still runs: its exit status."""
    signal_to(proc, sig)
    return wait_or_kill(proc, timeout)


def signal_to(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(sig)


def wait_or_kill(proc: subprocess.Popen[bytes], timeout: float = 20.0) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


@contextmanager
def fairgate_process(*args: str, ready: bytes, timeout: float = 30.0, cwd: str | Path = ROOT,
                     env: Mapping[str, str] | None = None,
                     sig: signal.Signals = signal.SIGINT) -> Iterator[
        tuple[subprocess.Popen[bytes], bytes]]:
    """`fairgate ARGS...` once it printed a line containing `ready`: the process, and all it
    printed up to that line. The rest of its output is drained while it runs; `stop`ped with
    `sig` afterwards."""
    proc = spawn_fairgate(*args, cwd=cwd, env=env)
    try:
        printed = read_until(proc, ready, timeout)
        drain(proc)
        yield proc, printed
    finally:
        stop(proc, sig)


@contextmanager
def fairgate_engine(*sets: str, config: str | Path | None = None,
                    timeout: float = 30.0) -> Iterator[str]:
    """A real `fairgate engine [-c config] --set KNOB=VALUE ...` in its own process on a free
    port, ready (it logged its listening line within `timeout` s): its URL; stopped with
    SIGINT (then killed) afterwards. Its output is drained while it serves, so a chatty engine
    never blocks."""
    with fairgate_engine_process(*sets, config=config, timeout=timeout) as (url, _):
        yield url


@contextmanager
def fairgate_engine_process(*sets: str, config: str | Path | None = None,
                            port: int | None = None, timeout: float = 30.0) -> Iterator[
        tuple[str, subprocess.Popen[bytes]]]:
    """`fairgate_engine`, with the process (to signal it); `port`: that one instead of a free
    one (to start an engine again where a killed one served)."""
    with fairgate_engine_processes(sets, config=config, ports=[port],
                                   timeout=timeout) as [engine]:
        yield engine


@contextmanager
def fairgate_engine_processes(*engines: Sequence[str], config: str | Path | None = None,
                              ports: Sequence[int | None] | None = None,
                              timeout: float = 30.0) -> Iterator[
        list[tuple[str, subprocess.Popen[bytes]]]]:
    """`fairgate_engine_process` for several engines (each its own `--set` knobs, and port
    when `ports` names one), started at once so that their startups overlap."""
    procs: list[tuple[int, subprocess.Popen[bytes]]] = []
    try:
        for sets, port in zip(engines, ports or [None] * len(engines), strict=True):
            port = free_port() if port is None else port
            procs.append((port, spawn_fairgate("engine", "--port", str(port),
                                               *_engine_args(sets, config))))
        for _, proc in procs:
            wait_for_output(proc, b"serving ", timeout)  # logged once the port is open
            drain(proc)
        yield [(f"http://127.0.0.1:{port}", proc) for port, proc in procs]
    finally:
        for _, proc in procs:  # all at once: their shutdowns overlap too
            signal_to(proc, signal.SIGINT)
        for _, proc in procs:
            wait_or_kill(proc)


def _engine_args(sets: Sequence[str], config: str | Path | None) -> list[str]:
    args = [a for knob in sets for a in ("--set", knob)]
    return args if config is None else ["-c", str(config), *args]

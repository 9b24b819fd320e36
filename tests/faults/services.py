"""`fairgate` subprocesses whose whole output is kept: a thread drains the pipe (a chatty
server never blocks on a full pipe), waits are on lines it printed or on its exit, and the
output stays for the key-leak check after the test."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tests.support.processes import drain, spawn_fairgate, spawn_module, stop, wait_for_output


class Service:
    """One `python -m fairgate ARGS...` process, stdout and stderr together, run in `cwd`
    (the test's own folder: whatever it writes there, such as a usage spill file, stays out
    of the repository)."""

    def __init__(self, name: str, args: list[str], cwd: Path) -> None:
        self.name = name
        self.proc = spawn_fairgate(*args, cwd=cwd)
        self._lines: list[str] = []
        self._changed = threading.Condition()
        self._eof = False
        self._reader = threading.Thread(target=self._drain, name=f"{name}-output", daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self._changed:
                self._lines.append(raw.decode(errors="replace"))
                self._changed.notify_all()
        with self._changed:
            self._eof = True
            self._changed.notify_all()

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def output(self) -> str:
        with self._changed:
            return "".join(self._lines)

    def tail(self, chars: int = 3000) -> str:
        return f"--- {self.name} (exit {self.proc.poll()}) ---\n{self.output[-chars:]}"

    def _wait_line(self, marker: str, timeout: float) -> str:
        def found() -> str | None:
            return next((line for line in self._lines if marker in line), None)

        with self._changed:
            self._changed.wait_for(lambda: found() is not None or self._eof, timeout)
            line = found()
        if line is None:
            raise AssertionError(f"{self.name} never printed {marker!r}\n{self.tail()}")
        return line

    async def wait_line(self, marker: str, timeout: float = 30.0) -> str:
        """The first line containing `marker`; AssertionError when the process exits or
        `timeout` passes first."""
        return await asyncio.to_thread(self._wait_line, marker, timeout)

    async def exited(self, timeout: float) -> int:
        """Its exit status, waited for off the test's event loop (streams keep flowing)."""
        try:
            code = await asyncio.to_thread(self.proc.wait, timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} did not exit within {timeout} s\n"
                                 f"{self.tail()}") from None
        await asyncio.to_thread(self._reader.join, 10)  # the rest of its output
        return code

    def send(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, sig: signal.Signals = signal.SIGTERM, timeout: float = 15.0) -> int:
        """Resume (it may be SIGSTOPped), signal, wait; SIGKILL when it does not exit."""
        code = stop(self.proc, sig, timeout)
        self._reader.join(10)
        return code


async def serve_forever(app: web.Application, port: int, banner: str) -> None:
    """Serve `app` on 127.0.0.1:`port`, print `banner` (what `fake_process` waits for) and run
    until SIGTERM: the body of a test module's `__main__` that plays a fake server."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"serving {banner}", flush=True)
    await asyncio.Event().wait()


@contextmanager
def fake_process(module: str, port: int, args: list[str], cwd: Path) -> Iterator[str]:
    """`python -m module --port PORT ARGS...` (a fake server built on `serve_forever`) in its
    own process, once it listens: its URL; terminated afterwards."""
    proc = spawn_module(module, "--port", str(port), *args, cwd=cwd)
    try:
        wait_for_output(proc, b"serving ")
        drain(proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc, signal.SIGTERM, 10)


async def get_json(session: aiohttp.ClientSession, url: str,
                   headers: dict[str, str] | None = None) -> dict[str, Any]:
    """GET `url`, which must answer 200: its JSON object."""
    async with session.get(url, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        return dict(await resp.json())

"""Servers in their own process: wait for the line a server prints once it listens (an event
on its output pipe), never a sleep-and-poll loop."""

from __future__ import annotations

import os
import selectors
import subprocess
import time


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

"""A tuner-like parent: launches a server through tuner.remote.LaunchedServer (the server starts
a worker process of its own, as engines do), prints "SERVER_PID WORKER_PID", reads a line
(the go-ahead), then ends the way argv[1] says: `wait` (until a signal kills it), `raise` (an uncaught exception, the server never
stopped by hand), `exit` (sys.exit without stopping it) or `with-raise` (an exception inside
`with LaunchedServer(...)`); with `stubborn` after it, the server ignores SIGTERM."""

from __future__ import annotations

import signal
import sys

from tests.support.waiting import poll_until
from tuner.remote import LaunchedServer

SERVER = ("import signal, subprocess, sys; "
          "signal.signal(signal.SIGTERM, signal.SIG_IGN if sys.argv[1:] else signal.SIG_DFL); "
          "w = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()']); "
          "print(w.pid, flush=True); signal.pause()")


def worker_pid(server: LaunchedServer) -> str:
    """The first line the server printed: its worker's pid."""
    return str(poll_until(lambda: server.tail and server.tail[0], 20,
                          "the server printed its worker's pid", every=0.01))


def main(mode: str, stubborn: bool) -> None:
    server = LaunchedServer([sys.executable, "-c", SERVER, *(["stubborn"] if stubborn else [])])
    print(server.proc.pid, worker_pid(server), flush=True)
    sys.stdin.readline()
    if mode == "wait":
        while True:
            signal.pause()
    if mode == "exit":
        sys.exit(0)
    if mode == "with-raise":
        with server:
            raise RuntimeError("the study failed")
    raise RuntimeError("the study failed")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["stubborn"])

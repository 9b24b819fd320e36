"""The progress of `fairgate tune` on stderr: trial count, best so far, what is running.

On a terminal one status line is redrawn in place (`\\r`, then clear to the end of the line), and
each finished trial's result is printed above it; anywhere else (a pipe, a CI log, a test) every
event is one whole line, flushed, so that logs never hold half-drawn bars. Optuna calls back from
its worker threads when `n_jobs > 1`, hence the lock.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

CLEAR = "\r\x1b[K"  # back to the line's start, erase to its end


class ProgressBar:
    """`start(number, text)` when a trial begins, `finish(number, line, best)` when it ends (its
    one-line result and the best so far), `note(line)` for anything else worth keeping, `close()`
    at the end. `total` is the trial budget, None when the budget is a timeout: then the line
    shows the elapsed time instead of a bar."""

    def __init__(self, total: int | None, stream: TextIO, width: int = 30, label: str = "trial",
                 clock: Callable[[], float] = time.monotonic, columns: int | None = None) -> None:
        assert total is None or total >= 0, f"total ({total}) must be >= 0"
        assert width >= 1, f"width ({width}) must be >= 1"
        self.total, self.stream, self.width, self.label = total, stream, width, label
        self.clock, self.columns = clock, columns
        self.tty = stream.isatty()
        self.started_at = clock()
        self.started = 0  # trials begun
        self.done = 0  # trials ended
        self.running: dict[int, str] = {}  # trial number -> its text, in start order
        self.best = ""
        self.drawn = False  # whether the status line is on screen (a TTY only)
        self.closed = False
        self._lock = threading.Lock()

    def start(self, number: int, text: str) -> None:
        with self._lock:
            self.started += 1
            self.running[number] = text
            if self.tty:
                self._draw()
            else:
                self._write(f"{self._count(self.started)} (#{number}) running: {text}\n")

    def finish(self, number: int, line: str, best: str) -> None:
        with self._lock:
            self.done += 1
            self.running.pop(number, None)
            self.best = best
            if self.tty:
                self._above(f"{self._count(self.done)} (#{number}): {line}")
            else:
                self._write(f"{self._count(self.done)} (#{number}): {line} | {best}\n")

    def note(self, line: str) -> None:
        """A line that must stay readable: printed above the status line, which is redrawn."""
        with self._lock:
            if self.tty:
                self._above(line)
            else:
                self._write(line + "\n")

    def close(self) -> None:
        """Leave the last status line on screen (a TTY) and end it; idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.running.clear()
            if self.tty and (self.drawn or self.done):
                self._write(CLEAR + self._fit(self.status()) + "\n")
                self.drawn = False

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    def status(self) -> str:
        """`[#####-----] 12/30 trials | best goodput 9.18 req/s (#7) | running #13`."""
        if self.total is None:
            parts = [f"{self.done} {self.label}s", _elapsed(self.clock() - self.started_at)]
        else:
            parts = [f"{self._bar()} {self.done}/{self.total} {self.label}s"]
        if self.best:
            parts.append(self.best)
        if self.running:
            parts.append(self._running())
        return " | ".join(parts)

    def _bar(self) -> str:
        assert self.total is not None
        filled = self.width if self.total == 0 else min(self.width,
                                                        self.width * self.done // self.total)
        return "[" + "#" * filled + "-" * (self.width - filled) + "]"

    def _running(self) -> str:
        numbers = [f"#{n}" for n in self.running]
        if len(numbers) == 1:
            (text,) = self.running.values()
            return f"running {numbers[0]}" + (f": {text}" if text else "")
        return "running " + ", ".join(numbers)

    def _count(self, count: int) -> str:
        return f"{self.label} {count}" + (f"/{self.total}" if self.total is not None else "")

    def _above(self, line: str) -> None:
        self._write((CLEAR if self.drawn else "") + line + "\n")
        self.drawn = False
        self._draw()

    def _draw(self) -> None:
        if not self.closed:
            self._write(CLEAR + self._fit(self.status()))
            self.drawn = True

    def _fit(self, line: str) -> str:
        """Cut to the terminal's width: a wrapped line could not be redrawn with `\\r`."""
        columns = self.columns or shutil.get_terminal_size(fallback=(100, 24)).columns
        return line if len(line) < columns else line[: max(columns - 2, 1)] + "\u2026"

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()


def _elapsed(seconds: float) -> str:
    """'42s', '3m05s', '1h02m'."""
    seconds = max(0, int(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


Progress = ProgressBar  # the type a study reports to: a bar on a terminal, one line per event elsewhere

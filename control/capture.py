"""Trace capture: live traffic written as fairgate JSONL traces (tuner/traces.py's `fairgate`
format), which `fairgate bench --trace` and `fairgate tune --trace` replay as they are.

One line per request that was served (HTTP 200): its arrival (seconds since the capture
started), tenant, priority, prompt and output tokens, max_tokens, and the prompt's prefix hashes
(one id per `block_tokens` block, each chained over every block before it and keyed with a
secret, so equal ids mean an identical prompt prefix and reveal nothing of the text). No prompt
text is written unless `prompt_text: true`. The prefix hashes are over the prompt's token ids
when the gateway counted them with a tokenizer, else over its text (`block_tokens` x 4 bytes a
block, the gateway's own estimate of a token).

The live path appends the request and its figures to a list; a background task hashes,
encodes and writes them in batches off the event loop (in a thread) every `FLUSH_S`, rotating
the file past `rotate_mb` (the full file is renamed with a UTC time stamp and a new one begun)
and then deleting the oldest rotated files past `max_files` of them or `max_total_mb` in all
(the current file counted at `rotate_mb`, the size it grows to; it is never deleted). Shutdown
writes what is left. The files are the gateway's alone (mode 0600): without prompt text they
still say who sent what, and when.

Every file this process writes to begins its lines with a header comment that names the
capture's start (`# fairgate trace captured from <UTC>; ... (epoch <seconds>)`), also when it
appends to a file an earlier gateway left: a line's arrival is relative to the header above
it, which is how `GET /admin/capture` (`read_window`) finds the requests of a time span in
the current and the rotated files.
"""

from __future__ import annotations

import asyncio
import calendar
import contextlib
import hashlib
import hmac
import json
import logging
import math
import os
import random
import re
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gateway.config import CaptureConfig
from gateway.events import RequestFinished, RequestObserver
from protocol.openai import OpenAIRequest, prompt_text

log = logging.getLogger("fairgate.gateway")
FLUSH_S = 0.5
BLOCK_TOKENS = 512  # tuner.traces.BLOCK_TOKENS: the block a prefix hash covers
SECRET_ENV = "FAIRGATE_CAPTURE_SECRET"
FILE_MODE = 0o600
MB = 1 << 20


class TraceCapture(RequestObserver):
    """Served requests (HTTP 200) as a fairgate trace: subscribed to the gateway's finished
    requests."""

    def __init__(self, config: CaptureConfig, draw: Any = random.random) -> None:
        self.config = config
        self.path = Path(config.path)
        self.draw = draw
        secret = config.secret or os.environ.get(SECRET_ENV)
        # without a secret the hashes are this process's own: comparable within one capture
        self.key = (secret or os.urandom(32).hex()).encode()
        self.started = time.perf_counter()
        self.started_at = time.time()
        self.lines: list[tuple[OpenAIRequest, dict[str, Any]]] = []
        self.written = 0
        self._headed = False  # this process's header is in the current file
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    def finished(self, event: RequestFinished) -> None:
        if event.status == 200:
            self.record(event.request, event.tenant, event.priority, event.arrival,
                        event.prompt_tokens, event.completion_tokens, event.request.max_tokens)

    def record(self, req: OpenAIRequest, tenant: str, priority: str, arrival: float,
               prompt_tokens: int, output_tokens: int, max_tokens: int | None) -> None:
        """A served request (arrival on the perf_counter clock); sampled."""
        if self.config.sample < 1.0 and self.draw() >= self.config.sample:
            return
        # kept as they are: hashing and encoding happen in the writer's thread, off the loop
        self.lines.append((req, {
            "arrival": round(arrival - self.started, 6), "tenant": tenant,
            "priority": priority, "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "max_tokens": max_tokens}))

    def encode(self, req: OpenAIRequest, line: dict[str, Any]) -> str:
        """One trace line: `line` with the prompt's prefix hashes (and its text if asked)."""
        line = {**line, "prefix_hashes": self.prefix_hashes(req, line["tenant"]),
                "block_tokens": BLOCK_TOKENS}
        if self.config.prompt_text:
            line["prompt"] = prompt_text(req)
        return json.dumps(line, separators=(",", ":"))

    def prefix_hashes(self, req: OpenAIRequest, tenant: str) -> list[int]:
        """One keyed id per prompt block, chained (block i's id covers blocks 0..i), per
        tenant (the engines' prefix caches are per tenant too)."""
        if req.token_ids is not None:
            ids = req.token_ids
            blocks: Sequence[bytes] = [
                b",".join(str(t).encode() for t in ids[i:i + BLOCK_TOKENS])
                for i in range(0, len(ids), BLOCK_TOKENS)]
        else:
            raw = prompt_text(req).encode()
            size = 4 * BLOCK_TOKENS
            blocks = [raw[i:i + size] for i in range(0, len(raw), size)]
        digest = hmac.new(self.key, tenant.encode(), hashlib.sha256).digest()
        out = []
        for block in blocks:
            digest = hmac.new(self.key, digest + block, hashlib.sha256).digest()
            out.append(int.from_bytes(digest[:7], "big"))  # 56 bits: exact in JSON readers
        return out

    # ---- writing -------------------------------------------------------------------------------
    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.prune()  # an earlier gateway's files, to this one's bounds
        self._task = asyncio.create_task(self._flusher(), name="trace capture")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.flush()

    async def _flusher(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_S)
            try:
                await self.flush()
            except OSError as exc:  # a full or missing disk: keep the lines, say so, retry
                log.warning("trace capture to %s failed: %s", self.path, exc)

    async def flush(self) -> None:
        async with self._lock:
            if not self.lines:
                return
            lines, self.lines = self.lines, []
            try:
                await asyncio.to_thread(self._write, lines)
            except OSError:
                self.lines = lines + self.lines
                raise
            self.written += len(lines)

    def _write(self, records: list[tuple[OpenAIRequest, dict[str, Any]]]) -> None:
        lines = [self.encode(req, line) for req, line in records]
        if self.path.exists() and self.path.stat().st_size >= self.config.rotate_mb * MB:
            self._rotate()
        new = not self.path.exists()
        # 0600 from its creation (the umask only ever takes bits away), and one an earlier
        # gateway left is made so too
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            if new or not self._headed:  # a new file, or one an earlier gateway left
                os.fchmod(fd, FILE_MODE)
                f.write(header(self.started_at))
                self._headed = True
            f.write("\n".join(lines) + "\n")

    def _rotate(self) -> None:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        # a second rotation within the second is numbered after every one before it (a
        # number freed by a deletion is never taken again: the names keep the files' order)
        n = 1 + max((n for s, n, _ in self._rotations() if s == stamp), default=0)
        number = "" if n == 1 else f"-{n}"
        os.replace(self.path, self.path.with_name(
            f"{self.path.stem}-{stamp}{number}{self.path.suffix}"))
        self.prune()

    def rotated(self) -> list[Path]:
        """The rotated files of this capture, oldest first."""
        return [path for _, _, path in self._rotations()]

    def _rotations(self) -> list[tuple[str, int, Path]]:
        """(time stamp, number within its second, path) of each rotated file, in order."""
        name = re.compile(re.escape(self.path.stem) + r"-(\d{8}T\d{6}Z)(?:-(\d+))?"
                          + re.escape(self.path.suffix))
        found = []
        for path in self.path.parent.glob(f"{self.path.stem}-*{self.path.suffix}"):
            match = name.fullmatch(path.name)
            if match:
                found.append((match.group(1), int(match.group(2) or 1), path))
        return sorted(found)

    def prune(self) -> list[Path]:
        """Delete the oldest rotated files past `max_files` of them, or while the capture's
        files would take more than `max_total_mb` in all once the current one (never deleted)
        has grown to `rotate_mb`; the files deleted."""
        rotated = self.rotated()
        sizes = [_size(p) for p in rotated]
        max_files, max_total_mb = self.config.max_files, self.config.max_total_mb
        room = math.inf if max_total_mb is None else (
            max_total_mb * MB - max(_size(self.path), self.config.rotate_mb * MB))
        kept, total = len(rotated), sum(sizes)
        deleted = []
        for path, size in zip(rotated, sizes, strict=True):
            if (max_files is None or kept <= max_files) and total <= room:
                break
            with contextlib.suppress(FileNotFoundError):  # removed by the operator meanwhile
                path.unlink()
            deleted.append(path)
            kept, total = kept - 1, total - size
        if deleted:
            log.info("trace capture: deleted %d rotated file(s) past max_files=%s / "
                     "max_total_mb=%s: %s", len(deleted), max_files, max_total_mb,
                     ", ".join(p.name for p in deleted))
        return deleted

    # ---- reading (GET /admin/capture) -----------------------------------------------------------
    async def window(self, since: float, until: float, limit: int | None) -> str:
        """The captured requests that arrived in [since, until) (epoch seconds), the most
        recent `limit` of them, as a fairgate trace; what is buffered is written first, and
        the files are read in a thread (OSError when they cannot be)."""
        await self.flush()
        async with self._lock:  # no rotation while the files are listed and read
            return await asyncio.to_thread(self._read, since, until, limit)

    def _read(self, since: float, until: float, limit: int | None) -> str:
        return read_window(self.files(since), since, until, limit, self.started_at)

    def files(self, since: float) -> list[Path]:
        """The current capture file and its rotated copies, except those last written before
        `since` (every line in them arrived earlier)."""
        pattern = f"{self.path.stem}-*{self.path.suffix}"
        found = [self.path, *self.path.parent.glob(pattern)]
        out = []
        for path in found:
            try:
                if path.stat().st_mtime >= since:
                    out.append(path)
            except FileNotFoundError:  # rotated away meanwhile, or never written yet
                continue
        return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


HEADER_EPOCH = re.compile(r"\(epoch (\d+(?:\.\d*)?)\)")
HEADER_UTC = re.compile(r"captured from (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ)")


def header(started_at: float) -> str:
    """The comment that opens a capture's lines in a file: when its arrivals count from."""
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started_at))
    return (f"# fairgate trace captured from {since}; arrivals in seconds since then "
            f"(epoch {started_at:.6f})\n")


def header_epoch(line: str) -> float | None:
    """The epoch a header line names (a header without one, as captures before it wrote,
    by its UTC stamp, to the second); None for other comments."""
    found = HEADER_EPOCH.search(line)
    if found:
        return float(found.group(1))
    stamp = HEADER_UTC.search(line)
    if stamp:
        return float(calendar.timegm(time.strptime(stamp.group(1), "%Y-%m-%dT%H:%M:%SZ")))
    return None


def read_window(paths: Iterable[Path], since: float, until: float, limit: int | None,
                started_at: float) -> str:
    """The lines of `paths` whose arrival (the header above them, else `started_at`, plus
    their offset) is in [since, until), the latest `limit`, as a fairgate trace: arrivals
    rebased so the first request is at 0, as tuner.traces.load_trace rebases any trace, and
    the header naming the first request's epoch."""
    found: list[tuple[float, dict[str, Any]]] = []
    for path in paths:
        found += _lines_in(path, since, until, started_at)
    found.sort(key=lambda item: item[0])
    if limit is not None:
        found = found[-limit:]
    if not found:
        return ""
    first = found[0][0]
    out = [header(first)]
    for epoch, line in found:
        line["arrival"] = round(epoch - first, 6)
        out.append(json.dumps(line, separators=(",", ":")) + "\n")
    return "".join(out)


def _lines_in(path: Path, since: float, until: float,
              started_at: float) -> list[tuple[float, dict[str, Any]]]:
    """(epoch, line) of one capture file's requests in [since, until); a line that is not a
    request (a write cut off by a crash) is left out."""
    base = started_at
    out = []
    try:
        with path.open(encoding="utf-8", errors="replace") as f:
            for text in f:
                if text.startswith("#"):
                    base = header_epoch(text) or base
                    continue
                try:
                    line = json.loads(text)
                    epoch = base + float(line["arrival"])
                except (ValueError, TypeError, KeyError):
                    continue
                if math.isfinite(epoch) and since <= epoch < until:
                    out.append((epoch, line))
    except FileNotFoundError:  # rotated and removed by the operator meanwhile
        return []
    return out

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
encodes and writes them in batches off the event loop (in a thread) every `FLUSH_S`, rotating the file past `rotate_mb` (the full file is renamed with a UTC
time stamp and a new one begun). Shutdown writes what is left.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.config import CaptureConfig
from protocol.openai import OpenAIRequest, prompt_text

log = logging.getLogger("fairgate.gateway")
FLUSH_S = 0.5
BLOCK_TOKENS = 512  # tuner.traces.BLOCK_TOKENS: the block a prefix hash covers
SECRET_ENV = "FAIRGATE_CAPTURE_SECRET"


class TraceCapture:
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
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

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
        if self.path.exists() and self.path.stat().st_size >= self.config.rotate_mb * (1 << 20):
            stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
            rotated = self.path.with_name(f"{self.path.stem}-{stamp}{self.path.suffix}")
            n = 1
            while rotated.exists():  # two rotations in one second: never overwrite one
                n += 1
                rotated = self.path.with_name(f"{self.path.stem}-{stamp}-{n}{self.path.suffix}")
            os.replace(self.path, rotated)
        new = not self.path.exists()
        with self.path.open("a", encoding="utf-8") as f:
            if new:
                since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_at))
                f.write(f"# fairgate trace captured from {since}; arrivals in seconds since "
                        "then\n")
            f.write("\n".join(lines) + "\n")

"""The shadow sender process: every copy of a live request is sent, streamed, timed and thrown
away here, in a child process of the gateway, so the copies' HTTP work never runs on the live
event loop (`bench/shadow_overhead.py` measured it at 40% of the gateway's CPU per request when
it did).

The gateway (control/shadow.py) hands it pickled batches, one per event-loop turn, through a
shared-memory ring (control/shm_ring.py: `--ring-fd`, an inherited descriptor), read here on a
short timer while copies come and on a wake-up byte down stdin after a quiet spell; where the
ring is not supported, the batches come down stdin itself, length-prefixed (`FrameSender`,
`FrameReader`). Results go back up stdout the same way, in fewer, fuller batches. No thread, no
lock, and neither loop ever blocks on the other.

Gateway -> worker, in order:
    ("put", ShadowConfig)   start a target, or replace the one of that name (its queue and
                            the copies in flight are dropped, not reported)
    ("remove", name)
    ("copy", name, request_id, body, endpoint, tenant, priority, queued_at)
                            body without "model": the live request asked for the default
                            alias (or no model), so it goes under the model the target serves

Worker -> gateway, in batches: FLUSH_S after a copy ended, STATE_S after only a count changed
(each batch wakes the gateway's loop: few and full is what it costs least):
    ("done", name, request_id, wait_s, sent_at, started, stamps, tokens, end, ok, failure)
                            failure: (status, code, message) of a CopyFailure when not ok,
                            else None (a tuple: this module is __main__ here, not there)
    ("state", name, queued, inflight)
    ("hist", name, ttft_counts, ttft_sum, itl_counts, itl_sum)   (deltas since the last batch)
    ("model", name, served)   the model the target serves (its /v1/models), once learnt

The default alias: a target without a configured `model` is asked its /v1/models when it starts
(and before a copy that needs it while it has not said, and again after it answered
model_not_found: it may have been restarted with another model), so a copy of a request for "default" reaches it under the name
it serves, as the live request reached the live engine under the live engine's.

Times are `time.perf_counter()`, CLOCK_MONOTONIC on Linux: one clock for both processes, so a
copy's queue wait spans the hand-off. The worker exits when its stdin closes: the gateway
stopped, or died.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import pickle
import struct
import sys
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

from control import shm_ring
from gateway.config import ShadowConfig
from gateway.metrics import ITL_BUCKETS, LATENCY_BUCKETS
from gateway.upstream import UpstreamConnectError, UpstreamError, UpstreamPool, UpstreamTimeout
from protocol.sse import SSEReader, read_chunk

log = logging.getLogger("fairgate.shadow")
FLUSH_S = 0.025  # a copy's result waits at most this long to go back
STATE_S = 0.25  # queued / inflight counts, when nothing else goes back
_HEADER = struct.Struct(">I")
MAX_ERROR_BODY = 4096  # bytes of a refused copy's answer read for its error
MAX_FAILURE_MESSAGE = 300  # characters of the target's message kept with a failure
SENDER_NICE = 10  # the worker's niceness, added to the gateway's


@dataclass(frozen=True, slots=True)
class CopyFailure:
    """Why a copy did not end well: the target's HTTP status (None: no answer, or it broke
    off mid-stream after a 200 is still 200) and error code (the target's `error.code`, else
    its `error.type`, else one of ours: connect_failed, timeout, connection_broken,
    stream_error, stream_incomplete), with the target's message."""

    status: int | None
    code: str
    message: str = ""

    @property
    def reason(self) -> tuple[int | None, str]:
        """What failures are counted by."""
        return self.status, self.code

    def fields(self) -> tuple[int | None, str, str]:
        return self.status, self.code, self.message


def error_failure(status: int, data: bytes | dict[str, Any]) -> CopyFailure:
    """A failure from an OpenAI error body (`{"error": {"message", "type", "code"}}`), raw or
    parsed; a body that is not one still gives the status, with code "http_<status>"."""
    body: Any = data
    if isinstance(data, bytes):
        try:
            body = json.loads(data)
        except ValueError:
            body = None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        text = data.decode(errors="replace") if isinstance(data, bytes) else ""
        return CopyFailure(status, f"http_{status}", text[:MAX_FAILURE_MESSAGE])
    code = error.get("code") or error.get("type") or f"http_{status}"
    return CopyFailure(status, str(code), str(error.get("message") or "")[:MAX_FAILURE_MESSAGE])


# ---- framing: both processes, on their event loops -----------------------------------------
class FrameReader(asyncio.Protocol):
    """A pipe's bytes as batches: `on_batch(list)` per frame, `on_end()` when the pipe closes
    (or carries something that is not a frame: the other side is not ours, or broke)."""

    def __init__(self, on_batch: Callable[[list[Any]], None], on_end: Callable[[], None]) -> None:
        self.on_batch, self.on_end = on_batch, on_end
        self._buffer = bytearray()
        self._ended = False

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer, start)
            end = start + _HEADER.size + size
            if len(buffer) < end:
                break
            try:
                batch = pickle.loads(buffer[start + _HEADER.size:end])
            except Exception:  # noqa: BLE001 - whatever a corrupt frame raises, the pipe is done
                log.error("shadow pipe: a frame that does not unpickle; closing it")
                self.connection_lost(None)
                return
            start = end
            self.on_batch(batch)
        del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._ended:
            self._ended = True
            self.on_end()


async def write_transport(pipe: IO[bytes]) -> asyncio.WriteTransport:
    """The running loop's non-blocking write transport over `pipe`."""
    transport, _ = await asyncio.get_running_loop().connect_write_pipe(asyncio.Protocol, pipe)
    return transport


class FrameSender:
    """Items put on an event loop, written to a pipe as one frame per loop turn: `put` is a list
    append, and the pickling and the write come once for all that turn's items. The transport
    buffers what the pipe cannot take yet (never blocking the loop); the callers bound it."""

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self.transport = transport
        self.loop = asyncio.get_running_loop()
        self._items: list[Any] = []

    @classmethod
    async def open(cls, pipe: IO[bytes]) -> FrameSender:
        return cls(await write_transport(pipe))

    @property
    def broken(self) -> bool:
        return self.transport.is_closing()

    def put(self, item: Any) -> None:
        if not self._items:
            self.loop.call_soon(self._flush)
        self._items.append(item)

    def put_many(self, items: list[Any]) -> None:
        if items and not self._items:
            self.loop.call_soon(self._flush)
        self._items.extend(items)

    def _flush(self) -> None:
        items, self._items = self._items, []
        if items and not self.transport.is_closing():
            self._send(pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL))

    def _send(self, data: bytes) -> None:
        """One turn's pickled batch, as a length-prefixed frame down the pipe."""
        self.transport.write(_HEADER.pack(len(data)) + data)

    def close(self) -> None:
        """Write what is queued, then close (the other side reads the end of the pipe)."""
        self._flush()
        self.transport.close()


class RingSender(FrameSender):
    """A FrameSender whose turn's batch goes into a shared-memory ring (control/shm_ring.py);
    its pipe only wakes an idle reader, and its end ends the reader. What the ring cannot take
    yet waits here, in order, and is retried; the callers bound how much."""

    def __init__(self, ring: shm_ring.RingWriter, transport: asyncio.WriteTransport,
                 max_part: int = shm_ring.MAX_PART) -> None:
        super().__init__(transport)
        self.ring = ring
        self.max_part = max_part
        self._backlog: deque[memoryview] = deque()
        self._retry: asyncio.TimerHandle | None = None

    @classmethod
    async def open_ring(cls, ring: shm_ring.RingWriter, pipe: IO[bytes]) -> RingSender:
        return cls(ring, await write_transport(pipe))

    @property
    def waiting(self) -> int:
        """Bytes not in the ring yet (it was full)."""
        return sum(len(m) for m in self._backlog)

    def _send(self, data: bytes) -> None:
        """One turn's pickled batch, into the ring behind what waits already."""
        self._backlog.append(memoryview(data))
        self._drain()

    def _retried(self) -> None:
        self._retry = None
        self._drain()

    def _drain(self) -> None:
        wrote = False
        backlog = self._backlog
        while backlog:
            message = backlog[0]
            part = message[:self.max_part]
            more = len(message) > self.max_part
            if not self.ring.write(part, more):
                break
            wrote = True
            if more:
                backlog[0] = message[self.max_part:]
            else:
                backlog.popleft()
        if backlog and self._retry is None and not self.transport.is_closing():
            self._retry = self.loop.call_later(shm_ring.RETRY_S, self._retried)
        if wrote and self.ring.wake_wanted():
            self.transport.write(b"\0")

    def close(self) -> None:
        """Write what is queued and fits, then close the pipe (the reader's end of input);
        what the ring cannot take is dropped with the worker, which is stopping."""
        self._flush()
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        if self._backlog:
            log.warning("shadow ring: %d bytes not handed over at close", self.waiting)
            self._backlog.clear()
        self.transport.close()  # its end wakes an idle reader
        self.ring.close()


class RingReceiver(asyncio.Protocol):
    """The reading side, on the worker's event loop: `on_batch(list)` per message, read on a
    timer while messages come and on a wake-up byte after; `on_end()` once the pipe closes (the
    ring read a last time), or when the ring holds something that is not ours."""

    def __init__(self, ring: shm_ring.RingReader, on_batch: Callable[[list[Any]], None],
                 on_end: Callable[[], None]) -> None:
        self.ring = ring
        self.on_batch, self.on_end = on_batch, on_end
        self.loop = asyncio.get_running_loop()
        self._quiet_since = time.monotonic()
        self._timer: asyncio.Handle | None = self.loop.call_soon(self._poll)
        self._delay = shm_ring.BUSY_POLL_S
        self._idle = False
        self._ended = False

    def data_received(self, data: bytes) -> None:
        self._busy(time.monotonic())
        self._poll()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._ended:
            self._read()  # what was written before the end
            self._end()

    def _read(self) -> bool:
        try:
            messages = self.ring.read()
        except ValueError as exc:  # a part that runs past what was written
            log.error("shadow ring: %s; stopping", exc)
            self._end()
            return False
        for message in messages:
            try:
                batch = pickle.loads(message)
            except Exception:  # noqa: BLE001 - whatever a corrupt message raises, it is done
                log.error("shadow ring: a message that does not unpickle; stopping")
                self._end()
                return False
            self.on_batch(batch)
        return bool(messages)

    def _poll(self) -> None:
        if self._ended:
            return
        if self._timer is not None:
            self._timer.cancel()
        now = time.monotonic()
        if self._read():
            self._busy(now)
        elif not self._idle and now - self._quiet_since >= shm_ring.IDLE_AFTER_S:
            self._idle = True
            self.ring.set_state(shm_ring.IDLE)
            if self._read():  # arrived as it went idle
                self._busy(now)
        else:
            self._delay = min(2 * self._delay, shm_ring.MAX_POLL_S)
        if not self._ended:
            delay = shm_ring.IDLE_POLL_S if self._idle else self._delay
            self._timer = self.loop.call_later(delay, self._poll)

    def _busy(self, now: float) -> None:
        self._quiet_since = now
        self._delay = shm_ring.BUSY_POLL_S
        if self._idle:
            self._idle = False
            self.ring.set_state(shm_ring.BUSY)

    def _end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.on_end()


# ---- the worker process ----------------------------------------------------------------------
class _Histogram:
    """Bucket counts (not cumulative; the last is +Inf) and the sum since the last batch."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def take(self) -> tuple[list[int], float]:
        out = self.counts, self.sum
        self.counts, self.sum = [0] * (len(self.bounds) + 1), 0.0
        return out


class _Target:
    """One shadow target in the worker: its queue, `max_inflight` senders and pool."""

    def __init__(self, config: ShadowConfig, report: Callable[[_Target, tuple[Any, ...] | None],
                                                                None]) -> None:
        self.config = config
        self.report = report
        self.queue: deque[tuple[Any, ...]] = deque()
        self.inflight = 0
        self.ttft = _Histogram(LATENCY_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._http = UpstreamPool(config.base_url, headers)
        self.served: str | None = None  # the model it serves, once asked (the default alias)
        self._asking: asyncio.Task[str | None] | None = None
        self._wake = asyncio.Event()
        self._tasks = [asyncio.create_task(self._sender()) for _ in range(config.max_inflight)]
        if config.model is None:  # asked now: the gateway shows it before any copy needs it
            self._tasks.append(asyncio.create_task(self._learn_model()))

    @property
    def name(self) -> str:
        return self.config.name

    def add(self, copy: tuple[Any, ...]) -> None:
        self.queue.append(copy)
        self._wake.set()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._http.close()

    async def _sender(self) -> None:
        while True:
            while not self.queue:
                self._wake.clear()
                await self._wake.wait()
            copy = self.queue.popleft()
            if self.queue:
                self._wake.set()  # more for the other senders
            await self._send(*copy)

    async def _send(self, request_id: str, body: dict[str, Any], endpoint: str, tenant: str,
                    priority: str, queued_at: float) -> None:
        started = time.perf_counter()
        sent_at = time.time()
        stamps: list[float] = []
        self.inflight += 1
        self.report(self, None)
        try:
            tokens, failure = await self._exchange(body, endpoint, tenant, priority, stamps)
        finally:
            self.inflight -= 1
        end = time.perf_counter()
        if failure is None and stamps:
            self.ttft.observe(stamps[0] - started)
            for a, b in zip(stamps, stamps[1:], strict=False):
                self.itl.observe(b - a)
        if failure is not None and failure.code == "model_not_found":
            self.served = None  # ask again: it may serve another model now
        self.report(self, ("done", self.name, request_id, started - queued_at, sent_at, started,
                           stamps, len(stamps) if tokens is None else tokens, end,
                           failure is None, None if failure is None else failure.fields()))

    async def _exchange(self, body: dict[str, Any], endpoint: str, tenant: str, priority: str,
                        stamps: list[float]) -> tuple[int | None, CopyFailure | None]:
        """Send one copy and read its answer: (usage tokens, why it failed or None)."""
        try:
            model = self.config.model or body.get("model") or await self._served_model()
            path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
            resp = await self._http.request("POST", path,
                                            self._body(body, model, tenant, priority),
                                            timeout=self.config.timeout_s)
            try:
                if resp.status >= 400:
                    return None, error_failure(resp.status, await _head(resp))
                return await self._read(resp, stamps)
            finally:
                resp.close()
        except UpstreamConnectError as exc:
            return None, CopyFailure(None, "connect_failed", str(exc)[:MAX_FAILURE_MESSAGE])
        except UpstreamTimeout as exc:
            return None, CopyFailure(None, "timeout", str(exc)[:MAX_FAILURE_MESSAGE])
        except (UpstreamError, OSError) as exc:
            log.debug("shadow %s: %s", self.name, exc)
            return None, CopyFailure(None, "connection_broken", str(exc)[:MAX_FAILURE_MESSAGE])

    async def _served_model(self) -> str | None:
        """The model the target serves (its /v1/models' first), asked once for all the
        senders; None when it does not say (the copy then goes without a model)."""
        if self.served is None:
            if self._asking is None or self._asking.done():
                self._asking = asyncio.create_task(self._ask_model())
            self.served = await asyncio.shield(self._asking)
            if self.served is not None:
                self.report(self, ("model", self.name, self.served))
        return self.served

    async def _learn_model(self) -> None:
        await self._served_model()

    async def _ask_model(self) -> str | None:
        try:
            resp = await self._http.request("GET", "/v1/models", timeout=self.config.timeout_s)
            try:
                answer = json.loads(await resp.read()) if resp.status < 400 else {}
            finally:
                resp.close()
        except (UpstreamError, OSError, ValueError) as exc:
            log.warning("shadow %s: could not ask its /v1/models: %s", self.name, exc)
            return None
        models = answer.get("data") if isinstance(answer, dict) else None
        first = models[0] if isinstance(models, list) and models else None
        if not isinstance(first, dict) or "id" not in first:
            return None
        return str(first["id"])

    def _body(self, body: dict[str, Any], model: str | None, tenant: str,
              priority: str) -> bytes:
        copy = dict(body)
        copy.update(stream=True, stream_options={"include_usage": True})
        if model is not None:
            copy["model"] = model
        if self.config.kind == "fairgate":
            copy.update(tenant=tenant, priority=priority)
        else:
            copy.pop("priority", None)
        return json.dumps(copy, separators=(",", ":")).encode()

    async def _read(self, resp: Any, stamps: list[float]) -> tuple[int | None, CopyFailure | None]:
        """Read the stream to its end, stamping each token event (protocol.sse.read_chunk
        decides which are: the gateway and the load generator count the same ones); (usage
        tokens, why it did not end well or None)."""
        reader = SSEReader()
        tokens: int | None = None
        done = False
        resp.watch_stalls(self.config.timeout_s)
        while data := await resp.next_chunk():
            now = time.perf_counter()
            for event in reader.feed(data):
                try:
                    chunk = read_chunk(event.data)
                except ValueError:  # not JSON: nothing to time
                    continue
                if chunk.error:
                    assert chunk.body is not None
                    failure = error_failure(resp.status, chunk.body)
                    code = "stream_error" if failure.code.startswith("http_") else failure.code
                    return tokens, CopyFailure(resp.status, code, failure.message)
                done = done or chunk.done
                usage = chunk.usage
                if usage is not None and "completion_tokens" in usage:
                    tokens = int(usage["completion_tokens"])
                if chunk.token:
                    stamps.append(now)
        if not done:
            return tokens, CopyFailure(resp.status, "stream_incomplete",
                                       "the stream ended before [DONE]")
        return tokens, None


async def _head(resp: Any) -> bytes:
    """The start of a refused copy's answer (its error), read to MAX_ERROR_BODY bytes."""
    data = b""
    while len(data) < MAX_ERROR_BODY and (chunk := await resp.next_chunk()):
        data += chunk
    return data[:MAX_ERROR_BODY]


class Worker:
    """The worker's event loop side: targets by name, and the batch going back."""

    def __init__(self, out: FrameSender) -> None:
        self.out = out
        self.loop = asyncio.get_running_loop()
        self.targets: dict[str, _Target] = {}
        self.closing: set[asyncio.Task[None]] = set()
        self._batch: list[tuple[Any, ...]] = []
        self._dirty: dict[str, _Target] = {}
        self._flush_at: asyncio.TimerHandle | None = None

    def handle(self, batch: list[tuple[Any, ...]]) -> None:
        for message in batch:
            kind = message[0]
            if kind == "copy":
                target = self.targets.get(message[1])
                if target is not None:  # else removed since: the gateway forgot it too
                    target.add(message[2:])
                    self.report(target, None)
            elif kind == "put":
                self._retire(message[1].name)
                self.targets[message[1].name] = _Target(message[1], self.report)
            elif kind == "remove":
                self._retire(message[1])

    def _retire(self, name: str) -> None:
        old = self.targets.pop(name, None)
        if old is not None:
            self._dirty.pop(name, None)
            task = self.loop.create_task(old.close())
            self.closing.add(task)
            task.add_done_callback(self.closing.discard)

    def report(self, target: _Target, message: tuple[Any, ...] | None) -> None:
        if self.targets.get(target.name) is not target:
            return  # replaced or removed: its copies are not the gateway's any more
        self._dirty[target.name] = target
        delay = STATE_S
        if message is not None:
            self._batch.append(message)
            delay = FLUSH_S
        due = self.loop.time() + delay
        if self._flush_at is not None and self._flush_at.when() > due:
            self._flush_at.cancel()  # a state-only batch, due later than this result may wait
            self._flush_at = None
        if self._flush_at is None:
            self._flush_at = self.loop.call_at(due, self._flush)

    def _flush(self) -> None:
        self._flush_at = None
        batch, self._batch = self._batch, []
        for name, target in self._dirty.items():
            batch.append(("state", name, len(target.queue), target.inflight))
            (tc, ts), (ic, isum) = target.ttft.take(), target.itl.take()
            if any(tc) or any(ic):
                batch.append(("hist", name, tc, ts, ic, isum))
        self._dirty.clear()
        self.out.put_many(batch)


async def serve(stdin: IO[bytes], stdout: IO[bytes], ring_fd: int | None = None) -> None:
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()
    out = await FrameSender.open(stdout)
    worker = Worker(out)
    if ring_fd is None:
        await loop.connect_read_pipe(lambda: FrameReader(worker.handle, ended.set), stdin)
    else:
        ring = shm_ring.RingReader(ring_fd)
        os.close(ring_fd)  # the mapping keeps it
        await loop.connect_read_pipe(
            lambda: RingReceiver(ring, worker.handle, ended.set), stdin)
    await ended.wait()  # the gateway closed our stdin
    for name in list(worker.targets):
        worker._retire(name)
    if worker.closing:
        await asyncio.gather(*worker.closing)
    out.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m control.shadow_worker",
                                     description="the gateway's shadow sender process")
    parser.add_argument("--ring-fd", type=int, default=None,
                        help="an inherited shared-memory ring's descriptor (control/shm_ring.py)")
    args = parser.parse_args(argv)
    with contextlib.suppress(OSError):  # copies yield the cores to live traffic
        os.nice(SENDER_NICE)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # the frames go to the gateway on a private copy of stdout; fd 1 becomes stderr, so nothing
    # a library prints can land in the middle of a frame
    frames = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C reaches the gateway's whole group
        asyncio.run(serve(os.fdopen(os.dup(0), "rb", buffering=0), frames, args.ring_fd))


if __name__ == "__main__":
    main()

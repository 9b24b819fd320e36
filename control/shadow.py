"""Shadow traffic: a sample of admitted live requests copied to candidate engines, each copy's
latency paired with the live request it copies.

The live path only calls `ShadowSet.offer` (after admission) and `ShadowSet.live_done` (in
settle); both are a few dict and deque operations, never I/O, and never wait. The copies are
sent from a child process (control/shadow_worker.py), fed through a shared-memory ring
(control/shm_ring.py; a pipe where that is not supported) once per loop turn: their HTTP round
trips, stream parsing and histogram observations never run on the live event loop. Each target holds at most `max_queue + max_inflight` copies not yet answered; a copy
beyond that is dropped and counted, so a slow, failing or dead shadow changes nothing for live
clients. Copies never touch a tenant's rate windows, queues, fair-share counters or usage
ledger: they go straight to the shadow.

A copy's body is what the live engine got (`gateway.backends.engine_body`: the client's body
with max_tokens resolved and the fairgate extensions the gateway's own, never the client's), for
the shadow's model and kind, so a shadow-mode trial runs the live load and nothing a client
added to it. Every copy is sent streaming (with usage), whatever the live request asked, and
read to its end: its TTFT (from the copy's send) and every token's time are measured, then the
answer is thrown away. The live side's timing is the gateway's own (from arrival; TTFT and
gaps only for live streams). A pair is complete once both sides ended; `stats` summarises the
pairs completed in a window: both sides' percentiles (TTFT and TPOT over requests, ITL over
every gap), each side's SLO attainment per tenant (protocol.measures: TTFT and TPOT per
request; ITL per gap, apart), the per-request shadow/live ratios, and a bootstrap interval for
the difference of the p99s of the per-request measures.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from control import shm_ring
from control.shadow_metrics import ShadowMetrics
from control.shadow_worker import CopyFailure, FrameReader, FrameSender, RingSender
from gateway.backends import Job, engine_body
from gateway.config import ShadowConfig
from gateway.events import RequestAdmitted, RequestFinished, RequestObserver
from protocol.measures import (
    SLO,
    SLO_FIELDS,
    TIMING_FIELDS,
    RequestTiming,
    slo_fields,
    summarize,
    timing_fields,
)
from protocol.stats import bootstrap_interval, percentile_of_sorted, row_percentiles

log = logging.getLogger("fairgate.gateway")
MAX_PAIRS = 50_000  # completed pairs kept per target (the longest window's worth at high rate)
MAX_PENDING = 20_000  # copies whose live or shadow side has not ended yet
BOOTSTRAP_RESAMPLES = 500
STATS_QUANTILES = (50, 90, 99)
RESTART_S = 1.0  # after the sender process died, before the next one starts
# why a copy was not sent (fairgate_gateway_shadow_dropped_total's reason): the target's queue
# was full; the sender process died (or was restarting) with it
DROP_REASONS = ("queue_full", "sender_died")


@dataclass
class Pair:
    """One mirrored request: the live side and the shadow side."""

    tenant: str
    slo: SLO
    live: RequestTiming | None = None
    shadow: RequestTiming | None = None
    shadow_wait_s: float = 0.0  # waiting to be sent (hand-off and the target's queue)
    sent_at: float = 0.0  # epoch seconds, when the copy was sent
    ended_at: float = 0.0  # monotonic, when the later side ended


# A completed pair as it is kept: a flat tuple the collector stops tracking
# (protocol.measures.timing_fields), so 50,000 of them are not walked by every full collection
# of the gateway's heap: (ended_at, sent_at, tenant, shadow_wait_s, *slo_fields(slo),
# *timing_fields(live), *timing_fields(shadow)).
PairRow = tuple[Any, ...]
_LIVE = 4 + SLO_FIELDS  # where a row's live timing begins
_SHADOW = _LIVE + TIMING_FIELDS


def pair_row(pair: Pair) -> PairRow:
    assert pair.live is not None and pair.shadow is not None
    return (pair.ended_at, pair.sent_at, pair.tenant, pair.shadow_wait_s, *slo_fields(pair.slo),
            *timing_fields(pair.live), *timing_fields(pair.shadow))


def pair_from_row(row: PairRow) -> Pair:
    return Pair(row[2], SLO(*row[4:_LIVE]), RequestTiming(*row[_LIVE:_SHADOW]),
                RequestTiming(*row[_SHADOW:_SHADOW + TIMING_FIELDS]), row[3], row[1], row[0])


Send = Callable[[tuple[Any, ...]], None]
ALIASES = (None, "default")  # a live request's model meaning "whatever is served"


@dataclass
class Failures:
    """The copies of one target that failed for one reason (status and error code): how many,
    and the last one's message and time."""

    count: int = 0
    last: CopyFailure | None = None
    last_at: float = 0.0  # epoch seconds

    def add(self, failure: CopyFailure) -> None:
        self.count += 1
        self.last, self.last_at = failure, time.time()

    def describe(self) -> dict[str, Any]:
        assert self.last is not None
        return {"status": self.last.status, "code": self.last.code, "count": self.count,
                "message": self.last.message, "last_at": round(self.last_at, 3)}


class ShadowMirror:
    """One shadow target, as the gateway keeps it: the sample, the copies not yet answered, the
    pairs and the counts. The sending is the worker process's."""

    def __init__(self, config: ShadowConfig, metrics: ShadowMetrics, send: Send,
                 draw: Callable[[], float] = random.random) -> None:
        self.config = config
        self.metrics = metrics
        self.send = send
        self.draw = draw
        self.pending: dict[str, Pair] = {}
        self.pairs: deque[PairRow] = deque(maxlen=MAX_PAIRS)  # completed, oldest first
        self.sent = self.dropped = self.failed = 0
        self.outstanding = 0  # copies handed to the worker and not answered yet
        self.queued = self.inflight = 0  # as the worker last said
        self.model: str | None = config.model  # what copies go under, once the worker knows
        self.failures: dict[tuple[int | None, str], Failures] = {}  # by (status, code)
        self._limit = config.max_queue + config.max_inflight
        self._tenants = None if config.tenants == ("all",) else frozenset(config.tenants)
        for reason in DROP_REASONS:  # its series exist from the start, at zero
            metrics.dropped.labels(self.name, reason)
        # their series exist from the start too; the children are kept (a labels() lookup
        # per copy is most of what counting it costs)
        self._sent_total = metrics.sent.labels(self.name)
        self._failed_total = metrics.failed.labels(self.name)

    @property
    def name(self) -> str:
        return self.config.name

    # ---- the live path: never waits ------------------------------------------------------------
    def offer(self, job: Job, slo: SLO) -> None:
        """Copy an admitted request when the sample draws it; dropped when the target is full."""
        if self._tenants is not None and job.tenant not in self._tenants:
            return
        if self.config.sample < 1.0 and self.draw() >= self.config.sample:
            return
        if self.outstanding >= self._limit or len(self.pending) >= MAX_PENDING:
            self._drop("queue_full")
            return
        self.pending[job.request_id] = Pair(job.tenant, slo)
        self.outstanding += 1
        # what the live engine gets, for this target (pickled with the rest of the loop turn's
        # messages by the sender, encoded as JSON by the worker)
        body = engine_body(job, self.config.model or job.req.model or "", stream=True,
                           fairgate=self.config.kind == "fairgate")
        if self.config.model is None and job.req.body.get("model") in ALIASES:
            del body["model"]  # the worker sends it under the model the target serves
        self.send(("copy", self.name, job.request_id, body, job.req.endpoint, job.tenant,
                   job.priority, time.perf_counter()))

    def live_done(self, request_id: str, timing: RequestTiming) -> None:
        pair = self.pending.get(request_id)
        if pair is not None:
            pair.live = timing
            self._maybe_complete(request_id, pair)

    def _drop(self, reason: str, n: int = 1) -> None:
        self.dropped += n
        self.metrics.dropped.labels(self.name, reason).inc(n)

    def _maybe_complete(self, request_id: str, pair: Pair) -> None:
        if pair.live is None or pair.shadow is None:
            return
        del self.pending[request_id]
        pair.ended_at = time.monotonic()
        self.pairs.append(pair_row(pair))

    # ---- what the worker reports --------------------------------------------------------------
    def done(self, request_id: str, wait_s: float, sent_at: float, started: float,
             stamps: list[float], tokens: int, end: float, ok: bool,
             failure: tuple[int | None, str, str] | None = None) -> None:
        """A copy ended (the worker's "done"); `failure`: why not ok, a CopyFailure's fields."""
        pair = self.pending.get(request_id)
        if pair is None or pair.shadow is not None:
            return
        self.outstanding -= 1
        self.sent += 1
        self._sent_total.inc()
        if not ok:
            self.failed += 1
            self._failed_total.inc()
            why = CopyFailure(*failure) if failure else CopyFailure(None, "unknown")
            self.failures.setdefault(why.reason, Failures()).add(why)
        pair.shadow = RequestTiming(started, stamps, tokens, end, ok=ok)
        pair.shadow_wait_s, pair.sent_at = wait_s, sent_at
        self._maybe_complete(request_id, pair)

    def lost(self) -> None:
        """The worker died: the copies it held are dropped, and so are their pairs."""
        gone = [rid for rid, pair in self.pending.items() if pair.shadow is None]
        for rid in gone:
            del self.pending[rid]
        if gone:
            self._drop("sender_died", len(gone))
        self.outstanding = self.queued = self.inflight = 0

    # ---- what the admin API shows ---------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"name": c.name, "url": c.url, "kind": c.kind, "model": self.model,
                "sample": c.sample, "tenants": list(c.tenants), "max_inflight": c.max_inflight,
                "max_queue": c.max_queue, "timeout_s": c.timeout_s, "queued": self.queued,
                "inflight": self.inflight,
                "outstanding": self.outstanding, "sent": self.sent,
                "dropped": self.dropped, "failed": self.failed, "pairs": len(self.pairs),
                "failures": [f.describe() for f in sorted(self.failures.values(),
                                                          key=lambda f: -f.count)]}

    def window(self, window_s: float, sent_after: float | None = None) -> list[PairRow]:
        """The pairs completed in the last `window_s` seconds, and whose copy was sent after
        `sent_after` (epoch seconds) when given, as kept (a copy: taken on the event loop,
        summarised anywhere by `stats`; completed pairs never change)."""
        horizon = time.monotonic() - window_s
        return [row for row in self.pairs if row[0] >= horizon
                and (sent_after is None or row[1] >= sent_after)]

    def completed(self, rows: Sequence[PairRow] | None = None) -> list[Pair]:
        """`rows` (default: every completed pair kept) as Pair objects."""
        return [pair_from_row(row) for row in (self.pairs if rows is None else rows)]

    def stats(self, window_s: float, rows: Sequence[PairRow] | None = None,
              seed: int = 0, detail: bool = False) -> dict[str, Any]:
        """Both sides of the window's pairs (`rows`, from `window`, else taken now)."""
        pairs = self.completed(self.window(window_s) if rows is None else rows)
        extra = {"samples": samples(pairs)} if detail else {}
        return {**extra, "name": self.name, "window_s": window_s, "pairs": len(pairs),
                "mirrored_rate_rps": len(pairs) / window_s, "sample": self.config.sample,
                "note": (f"the shadow sees {self.config.sample:g} x the live load of "
                         + ("every tenant" if self._tenants is None else
                            "tenants " + ", ".join(sorted(self._tenants)))
                         + "; the live figures are of the same mirrored requests"),
                **paired_stats(pairs, seed)}


SAMPLE_FIELDS = ("ttft_s", "tpot_s", "e2e_s", "output_tokens", "ok", "token_times_s")


def samples(pairs: Sequence[Pair]) -> dict[str, Any]:
    """Each pair's two sides, in completion order: [ttft, tpot, e2e, output tokens, ok, token
    times from the request's start (0.1 ms)] (the tuner's shadow mode scores a trial from these,
    per-gap ITL included)."""
    def row(t: RequestTiming | None) -> list[Any]:
        if t is None:
            return [None, None, None, 0, False, []]
        return [t.ttft, t.tpot, t.e2e, t.num_output_tokens, t.ok,
                [round(x - t.start, 4) for x in t.token_times]]

    return {"fields": list(SAMPLE_FIELDS), "live": [row(p.live) for p in pairs],
            "shadow": [row(p.shadow) for p in pairs]}


def paired_stats(pairs: Sequence[Pair], seed: int = 0) -> dict[str, Any]:
    """Both sides of `pairs`: percentiles, SLO attainment per tenant (requests, and gaps for
    ITL), the per-request ratios (shadow / live) and the difference of the p99s (shadow - live)
    with a 95% interval."""
    sides = {"live": [p.live for p in pairs], "shadow": [p.shadow for p in pairs]}
    out: dict[str, Any] = {}
    for side, timings in sides.items():
        done = [t for t in timings if t is not None and t.ok]
        out[side] = {"ok": len(done), "failed": len(timings) - len(done),
                     "ttft": summarize(t.ttft for t in done if t.ttft is not None),
                     "tpot": summarize(v for t in done if (v := t.tpot) is not None),
                     "itl": summarize(gap for t in done for gap in t.itls),
                     "e2e": summarize(t.e2e for t in done),
                     "slo_attainment": _attainment(pairs, side),
                     "itl_attainment": _gap_attainment(pairs, side)}
    out["ratio"] = {name: _ratios(pairs, measure) for name, measure in MEASURES.items()}
    out["p99_difference"] = {name: _p99_difference(pairs, measure, seed)
                             for name, measure in MEASURES.items()}
    out["shadow_wait"] = summarize(p.shadow_wait_s for p in pairs)
    return out


def _ttft(t: RequestTiming) -> float | None:
    return t.ttft if t.ok else None


def _tpot(t: RequestTiming) -> float | None:
    return t.tpot if t.ok else None


def _e2e(t: RequestTiming) -> float | None:
    return t.e2e if t.ok else None


# per request, to pair (the pooled ITL has no value per request)
MEASURES: dict[str, Callable[[RequestTiming], float | None]] = {
    "ttft": _ttft, "tpot": _tpot, "e2e": _e2e}


def _both(pairs: Sequence[Pair],
          measure: Callable[[RequestTiming], float | None]) -> tuple[np.ndarray, np.ndarray]:
    """The pairs where both sides have the measure: (live, shadow) values."""
    live, shadow = [], []
    for p in pairs:
        if p.live is None or p.shadow is None:
            continue
        a, b = measure(p.live), measure(p.shadow)
        if a is not None and b is not None:
            live.append(a)
            shadow.append(b)
    return np.asarray(live, dtype=float), np.asarray(shadow, dtype=float)


def _ratios(pairs: Sequence[Pair],
            measure: Callable[[RequestTiming], float | None]) -> dict[str, float | int | None]:
    live, shadow = _both(pairs, measure)
    keep = live > 0
    ratios = np.sort(shadow[keep] / live[keep])
    if not len(ratios):
        return {"pairs": 0, "p10": None, "p50": None, "p90": None}
    return {"pairs": int(len(ratios)),
            **{f"p{q}": float(percentile_of_sorted(ratios, q)) for q in (10, 50, 90)}}


def _p99_difference(pairs: Sequence[Pair], measure: Callable[[RequestTiming], float | None],
                    seed: int) -> dict[str, Any]:
    """p99(shadow) - p99(live) over the pairs, with a bootstrap 95% interval (pairs resampled
    together, so load both sides shared cancels out)."""
    live, shadow = _both(pairs, measure)
    if not len(live):
        return {"pairs": 0, "shadow_minus_live_s": None, "ci95": [None, None]}
    low, high = bootstrap_interval(_p99_difference_of_rows, live, shadow, paired=True,
                                   resamples=BOOTSTRAP_RESAMPLES, seed=seed)
    return {"pairs": int(len(live)),
            "shadow_minus_live_s": float(_p99_difference_of_rows(live, shadow)),
            "ci95": [low, high]}


def _p99_difference_of_rows(live: np.ndarray, shadow: np.ndarray) -> np.ndarray:
    return row_percentiles(shadow, 99) - row_percentiles(live, 99)


def _attainment(pairs: Sequence[Pair], side: str) -> dict[str, dict[str, Any]]:
    """Per tenant: the share of its mirrored requests that met its TTFT and TPOT targets on
    this side (a failed request misses; a tenant without either is left out)."""
    counts: dict[str, list[int]] = {}
    for p in pairs:
        timing = p.live if side == "live" else p.shadow
        if timing is None or (p.slo.ttft_s is None and p.slo.tpot_s is None):
            continue
        entry = counts.setdefault(p.tenant, [0, 0])
        entry[0] += timing.meets(p.slo)
        entry[1] += 1
    return {tenant: {"met": met, "requests": total, "fraction": met / total}
            for tenant, (met, total) in sorted(counts.items())}


def _gap_attainment(pairs: Sequence[Pair], side: str) -> dict[str, dict[str, Any]]:
    """Per tenant with an ITL target: the share of the gaps of its mirrored requests on this
    side that were within it (protocol.measures: a failed request misses each gap and one
    more)."""
    counts: dict[str, list[int]] = {}
    for p in pairs:
        timing = p.live if side == "live" else p.shadow
        if timing is None or p.slo.itl_s is None:
            continue
        met, gaps = timing.gaps_within(p.slo)
        entry = counts.setdefault(p.tenant, [0, 0])
        entry[0] += met
        entry[1] += gaps
    return {tenant: {"met": met, "gaps": total, "fraction": met / total if total else None}
            for tenant, (met, total) in sorted(counts.items())}


class ShadowSet(RequestObserver):
    """Every shadow target of a gateway, by name, and the sender process they share; targets
    are started, changed and stopped at run time. Subscribed to the gateway's requests: each
    admitted one may be copied, each finished one is the live side of its pairs."""

    def __init__(self, configs: Sequence[ShadowConfig], metrics: ShadowMetrics) -> None:
        self.metrics = metrics
        self.mirrors: dict[str, ShadowMirror] = {
            c.name: ShadowMirror(c, metrics, self._send) for c in configs}
        self.running = False
        self.worker: subprocess.Popen[bytes] | None = None
        self._out: FrameSender | None = None
        self._restart: asyncio.TimerHandle | None = None

    def __bool__(self) -> bool:
        return bool(self.mirrors)

    def offer(self, job: Job, slo: SLO) -> None:
        for mirror in self.mirrors.values():
            mirror.offer(job, slo)

    def live_done(self, request_id: str, timing: RequestTiming) -> None:
        for mirror in self.mirrors.values():
            mirror.live_done(request_id, timing)

    def admitted(self, event: RequestAdmitted) -> None:
        if self.mirrors:  # targets come and go at run time (POST /admin/shadow)
            self.offer(event.job, event.slo)  # a copy may go to each target (never waited on)

    def finished(self, event: RequestFinished) -> None:
        if self.mirrors:
            self.live_done(event.request_id, event.timing)

    async def start(self) -> None:
        self.running = True
        if self.mirrors:
            await self._spawn()

    async def close(self) -> None:
        self.running = False
        if self._restart is not None:
            self._restart.cancel()
        await self._stop_worker()

    async def put(self, config: ShadowConfig) -> ShadowMirror:
        """Start a target, or replace the one of that name (its pairs are kept when only the
        sample or the tenants change)."""
        old = self.mirrors.get(config.name)
        mirror = ShadowMirror(config, self.metrics, self._send)
        if old is not None and (old.config.url, old.config.kind, old.config.model) == (
                config.url, config.kind, config.model):
            # the same candidate: its completed pairs and counts carry over (copies in flight
            # end with the old target's senders and are not paired)
            mirror.pairs = old.pairs
            mirror.sent, mirror.dropped, mirror.failed = old.sent, old.dropped, old.failed
            mirror.failures, mirror.model = old.failures, old.model
        self.mirrors[config.name] = mirror
        if self.running:
            if self.worker is None:
                await self._spawn()
            else:
                self._send(("put", config))
        return mirror

    async def remove(self, name: str) -> bool:
        if self.mirrors.pop(name, None) is None:
            return False
        if self.worker is not None:
            self._send(("remove", name))
        if not self.mirrors:
            await self._stop_worker()
        return True

    # ---- the sender process -------------------------------------------------------------------
    def _send(self, message: tuple[Any, ...]) -> None:
        if self._out is None or self._out.broken:
            if message[0] == "copy":  # no worker (died, restarting): the copy goes nowhere
                mirror = self.mirrors.get(message[1])
                if mirror is not None:
                    mirror.pending.pop(message[2], None)
                    mirror.outstanding -= 1
                    mirror._drop("sender_died")
            return
        self._out.put(message)

    async def _spawn(self) -> None:
        loop = asyncio.get_running_loop()
        command = [sys.executable, "-m", "control.shadow_worker"]
        ring = None
        if shm_ring.wanted():
            try:
                ring = shm_ring.create()
            except OSError as exc:  # memfd refused (a sandbox's seccomp, a memory limit)
                log.warning("shadow copies go down a pipe: no shared-memory ring (%s)", exc)
        try:
            worker = self.worker = subprocess.Popen(
                command if ring is None else [*command, "--ring-fd", str(ring)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                pass_fds=() if ring is None else (ring,))
            assert worker.stdin is not None and worker.stdout is not None
            if ring is None:  # copies go down the pipe
                self._out = await FrameSender.open(worker.stdin)
            else:  # into the ring; the pipe wakes an idle worker and ends it
                self._out = await RingSender.open_ring(shm_ring.RingWriter(ring), worker.stdin)
        finally:
            if ring is not None:
                os.close(ring)  # the mapping and the child keep it
        for mirror in self.mirrors.values():
            self._out.put(("put", mirror.config))
        await loop.connect_read_pipe(lambda: FrameReader(
            lambda batch: self._deliver(worker, batch), lambda: self._ended(worker)),
            worker.stdout)

    def _deliver(self, worker: subprocess.Popen[bytes], batch: list[tuple[Any, ...]]) -> None:
        if worker is not self.worker:
            return
        for message in batch:
            mirror = self.mirrors.get(message[1])
            if mirror is None:
                continue
            kind = message[0]
            if kind == "done":
                mirror.done(*message[2:])
            elif kind == "state":
                mirror.queued, mirror.inflight = message[2], message[3]
            elif kind == "model" and mirror.config.model is None:
                mirror.model = message[2]
            elif kind == "hist":
                self.metrics.latency.add(0, mirror.name, message[2], message[3])
                self.metrics.latency.add(1, mirror.name, message[4], message[5])

    def _ended(self, worker: subprocess.Popen[bytes]) -> None:
        if worker is not self.worker or not self.running:
            return
        code = worker.poll()
        log.error("the shadow sender process exited (code %s); its copies are dropped and "
                  "counted (reason sender_died); starting another in %g s", code, RESTART_S)
        self.worker, self._out = None, None
        for mirror in self.mirrors.values():
            mirror.lost()
        self._restart = asyncio.get_running_loop().call_later(RESTART_S, self._respawn)

    def _respawn(self) -> None:
        self._restart = None
        if self.running and self.worker is None and self.mirrors:
            task = asyncio.get_running_loop().create_task(self._spawn())
            task.add_done_callback(self._spawned)

    def _spawned(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("the shadow sender process did not start: %s", task.exception())

    async def _stop_worker(self) -> None:
        worker, out = self.worker, self._out
        self.worker, self._out = None, None
        if worker is None or out is None:
            return
        out.close()  # the worker reads the end of its stdin and exits
        try:
            await asyncio.to_thread(worker.wait, 10)
        except subprocess.TimeoutExpired:
            log.warning("the shadow sender process did not exit in 10 s: killed")
            worker.kill()
            await asyncio.to_thread(worker.wait)

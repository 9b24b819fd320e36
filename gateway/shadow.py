"""Shadow traffic: a sample of admitted live requests copied to candidate engines, each copy's
latency paired with the live request it copies.

The live path only calls `ShadowSet.offer` (after admission) and `ShadowSet.live_done` (in
settle); both are a few dict and deque operations, never I/O, and never wait. Each target has
its own bounded queue, its own keep-alive pool (`gateway.upstream.UpstreamPool`) and
`max_inflight` sender tasks; a copy that finds the queue full is dropped and counted, so a slow,
failing or dead shadow changes nothing for live clients. Copies never touch a tenant's rate
windows, queues, fair-share counters or usage ledger: they are sent from here, straight to the
shadow.

Every copy is sent streaming (with usage), whatever the live request asked, and read to its end:
its TTFT (from the copy's send) and every token's time are measured, then the answer is thrown
away. The live side's timing is the gateway's own (from arrival; TTFT and gaps only for live
streams). A pair is complete once both sides ended; `stats` summarises the pairs completed in a
window: both sides' percentiles, each side's SLO attainment per tenant (protocol.measures: ITL is
each request's TPOT), the per-request shadow/live ratios, and a bootstrap interval for the
difference of the p99s.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.config import ShadowConfig
from gateway.metrics import GatewayMetrics
from gateway.upstream import UpstreamError, UpstreamPool
from protocol.measures import SLO, RequestTiming, summarize
from protocol.sse import SSEReader

log = logging.getLogger("fairgate.gateway")
MAX_PAIRS = 50_000  # completed pairs kept per target (the longest window's worth at high rate)
MAX_PENDING = 20_000  # copies whose live or shadow side has not ended yet
BOOTSTRAP_RESAMPLES = 500
STATS_QUANTILES = (50, 90, 99)


@dataclass
class Pair:
    """One mirrored request: the live side and the shadow side."""

    tenant: str
    slo: SLO
    live: RequestTiming | None = None
    shadow: RequestTiming | None = None
    shadow_wait_s: float = 0.0  # in the mirror's queue before it was sent
    sent_at: float = 0.0  # epoch seconds, when the copy was sent
    ended_at: float = 0.0  # monotonic, when the later side ended


@dataclass
class _Copy:
    request_id: str
    body: dict[str, Any]  # the client's, not copied: nothing on the live path changes it
    endpoint: str
    tenant: str
    priority: str
    queued_at: float = field(default_factory=time.perf_counter)


class ShadowMirror:
    """One shadow target: its queue, senders, pool and pairs."""

    def __init__(self, config: ShadowConfig, metrics: GatewayMetrics,
                 draw: Callable[[], float] = random.random) -> None:
        self.config = config
        self.metrics = metrics
        self.draw = draw
        self.queue: deque[_Copy] = deque()
        self.pending: dict[str, Pair] = {}
        self.pairs: deque[Pair] = deque(maxlen=MAX_PAIRS)
        self.sent = self.dropped = self.failed = 0
        self.inflight = 0
        self.model: str | None = config.model
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._http = UpstreamPool(config.base_url, headers)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._tenants = None if config.tenants == ("all",) else frozenset(config.tenants)

    @property
    def name(self) -> str:
        return self.config.name

    # ---- the live path: never waits ------------------------------------------------------------
    def offer(self, request_id: str, body: dict[str, Any], endpoint: str, tenant: str,
              priority: str, slo: SLO) -> None:
        """Copy an admitted request when the sample draws it; dropped when the queue is full."""
        if self._tenants is not None and tenant not in self._tenants:
            return
        if self.config.sample < 1.0 and self.draw() >= self.config.sample:
            return
        if len(self.queue) >= self.config.max_queue or len(self.pending) >= MAX_PENDING:
            self._drop("queue_full")
            return
        self.pending[request_id] = Pair(tenant, slo)
        self.queue.append(_Copy(request_id, body, endpoint, tenant, priority))  # encoded later
        self._wake.set()

    def live_done(self, request_id: str, timing: RequestTiming) -> None:
        pair = self.pending.get(request_id)
        if pair is not None:
            pair.live = timing
            self._maybe_complete(request_id, pair)

    def _body(self, body: dict[str, Any], tenant: str, priority: str) -> bytes:
        copy = dict(body)
        copy.update(stream=True, stream_options={"include_usage": True})
        if self.model is not None:
            copy["model"] = self.model
        if self.config.kind == "fairgate":
            copy.update(tenant=tenant, priority=priority)
        else:
            copy.pop("priority", None)
        return json.dumps(copy, separators=(",", ":")).encode()

    def _drop(self, reason: str) -> None:
        self.dropped += 1
        self.metrics.child("shadow_dropped", self.name, reason).inc()

    def _maybe_complete(self, request_id: str, pair: Pair) -> None:
        if pair.live is None or pair.shadow is None:
            return
        del self.pending[request_id]
        pair.ended_at = time.monotonic()
        self.pairs.append(pair)

    # ---- the senders ------------------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._sender(), name=f"shadow-{self.name}-{i}")
                       for i in range(self.config.max_inflight)]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self._http.close()

    async def _sender(self) -> None:
        while True:
            while not self.queue:
                self._wake.clear()
                await self._wake.wait()
            copy = self.queue.popleft()
            if self.queue:
                self._wake.set()  # more for the other senders
            await self._send(copy)

    async def _send(self, copy: _Copy) -> None:
        pair = self.pending.get(copy.request_id)
        if pair is None:
            return
        started = time.perf_counter()
        pair.shadow_wait_s = started - copy.queued_at
        pair.sent_at = time.time()
        stamps: list[float] = []
        tokens: int | None = None
        ok = False
        self.inflight += 1
        try:
            path = "/v1/chat/completions" if copy.endpoint == "chat" else "/v1/completions"
            resp = await self._http.request("POST", path, self._body(
                copy.body, copy.tenant, copy.priority), timeout=self.config.timeout_s)
            try:
                if resp.status < 400:
                    tokens, ok = await self._read(resp, stamps)
            finally:
                resp.close()
        except (UpstreamError, OSError) as exc:
            log.debug("shadow %s: %s", self.name, exc)
        finally:
            self.inflight -= 1
        end = time.perf_counter()
        self.sent += 1
        self.metrics.child("shadow_sent", self.name).inc()
        timing = RequestTiming(started, stamps, tokens if tokens is not None else len(stamps),
                               end, ok=ok)
        if ok:
            self._observe(timing)
        else:
            self.failed += 1
            self.metrics.child("shadow_failed", self.name).inc()
        pair.shadow = timing
        self._maybe_complete(copy.request_id, pair)

    async def _read(self, resp: Any, stamps: list[float]) -> tuple[int | None, bool]:
        """Read the stream to its end, stamping each token event; (usage tokens, ended well)."""
        reader = SSEReader()
        tokens: int | None = None
        done = False
        resp.watch_stalls(self.config.timeout_s)
        while data := await resp.next_chunk():
            now = time.perf_counter()
            for event in reader.feed(data):
                data = event.data
                if data == b"[DONE]":
                    done = True
                    continue
                if _plain_text(data):  # the common event: a token, told apart without parsing
                    stamps.append(now)
                    continue
                try:
                    message = json.loads(data)
                except ValueError:
                    continue
                if "error" in message:
                    return tokens, False
                usage = message.get("usage")
                if isinstance(usage, dict) and "completion_tokens" in usage:
                    tokens = int(usage["completion_tokens"])
                if _has_text(message):
                    stamps.append(now)
        return tokens, done

    def _observe(self, timing: RequestTiming) -> None:
        ttft = timing.ttft
        if ttft is not None:
            self.metrics.child("shadow_ttft", self.name).observe(ttft)
        itl = self.metrics.child("shadow_itl", self.name)
        for gap in timing.itls:
            itl.observe(gap)

    # ---- what the admin API shows ---------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        c = self.config
        return {"name": c.name, "url": c.url, "kind": c.kind, "model": self.model,
                "sample": c.sample, "tenants": list(c.tenants), "max_inflight": c.max_inflight,
                "max_queue": c.max_queue, "queued": len(self.queue), "inflight": self.inflight,
                "sent": self.sent,
                "dropped": self.dropped, "failed": self.failed, "pairs": len(self.pairs)}

    def window(self, window_s: float, sent_after: float | None = None) -> list[Pair]:
        """The pairs completed in the last `window_s` seconds, and whose copy was sent after
        `sent_after` (epoch seconds) when given (a copy: taken on the event loop, summarised
        anywhere; completed pairs never change)."""
        horizon = time.monotonic() - window_s
        return [p for p in self.pairs if p.ended_at >= horizon
                and (sent_after is None or p.sent_at >= sent_after)]

    def stats(self, window_s: float, pairs: Sequence[Pair] | None = None,
              seed: int = 0, detail: bool = False) -> dict[str, Any]:
        if pairs is None:
            pairs = self.window(window_s)
        extra = {"samples": samples(pairs)} if detail else {}
        return {**extra, "name": self.name, "window_s": window_s, "pairs": len(pairs),
                "mirrored_rate_rps": len(pairs) / window_s, "sample": self.config.sample,
                "note": (f"the shadow sees {self.config.sample:g} x the live load of "
                         + ("every tenant" if self._tenants is None else
                            "tenants " + ", ".join(sorted(self._tenants)))
                         + "; the live figures are of the same mirrored requests"),
                **paired_stats(pairs, seed)}


SAMPLE_FIELDS = ("ttft_s", "tpot_s", "e2e_s", "output_tokens", "ok")


def samples(pairs: Sequence[Pair]) -> dict[str, Any]:
    """Each pair's two sides, in completion order: [ttft, tpot, e2e, output tokens, ok] (the
    tuner's shadow mode scores a trial from these)."""
    def row(t: RequestTiming | None) -> list[Any]:
        if t is None:
            return [None, None, None, 0, False]
        return [t.ttft, t.tpot, t.e2e, t.num_output_tokens, t.ok]

    return {"fields": list(SAMPLE_FIELDS), "live": [row(p.live) for p in pairs],
            "shadow": [row(p.shadow) for p in pairs]}


def paired_stats(pairs: Sequence[Pair], seed: int = 0) -> dict[str, Any]:
    """Both sides of `pairs`: percentiles, SLO attainment per tenant, the per-request ratios
    (shadow / live) and the difference of the p99s (shadow - live) with a 95% interval."""
    sides = {"live": [p.live for p in pairs], "shadow": [p.shadow for p in pairs]}
    out: dict[str, Any] = {}
    for side, timings in sides.items():
        done = [t for t in timings if t is not None and t.ok]
        out[side] = {"ok": len(done), "failed": len(timings) - len(done),
                     "ttft": summarize(t.ttft for t in done if t.ttft is not None),
                     "itl": summarize(v for t in done if (v := t.tpot) is not None),
                     "e2e": summarize(t.e2e for t in done),
                     "slo_attainment": _attainment(pairs, side)}
    out["ratio"] = {name: _ratios(pairs, measure) for name, measure in MEASURES.items()}
    out["p99_difference"] = {name: _p99_difference(pairs, measure, seed)
                             for name, measure in MEASURES.items()}
    out["shadow_wait"] = summarize(p.shadow_wait_s for p in pairs)
    return out


def _ttft(t: RequestTiming) -> float | None:
    return t.ttft if t.ok else None


def _itl(t: RequestTiming) -> float | None:
    return t.tpot if t.ok else None


def _e2e(t: RequestTiming) -> float | None:
    return t.e2e if t.ok else None


MEASURES: dict[str, Callable[[RequestTiming], float | None]] = {
    "ttft": _ttft, "itl": _itl, "e2e": _e2e}


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
    ratios = shadow[keep] / live[keep]
    if not len(ratios):
        return {"pairs": 0, "p10": None, "p50": None, "p90": None}
    p10, p50, p90 = np.percentile(ratios, [10, 50, 90])
    return {"pairs": int(len(ratios)), "p10": float(p10), "p50": float(p50), "p90": float(p90)}


def _p99(values: np.ndarray) -> float:
    k = max(1, math.ceil(0.99 * len(values) - 1e-9)) - 1  # nearest rank, as the tuner's
    return float(np.partition(values, k)[k])


def _p99_difference(pairs: Sequence[Pair], measure: Callable[[RequestTiming], float | None],
                    seed: int) -> dict[str, Any]:
    """p99(shadow) - p99(live) over the pairs, with a bootstrap 95% interval (pairs resampled
    together, so load both sides shared cancels out)."""
    live, shadow = _both(pairs, measure)
    if not len(live):
        return {"pairs": 0, "shadow_minus_live_s": None, "ci95": [None, None]}
    point = _p99(shadow) - _p99(live)
    rng = np.random.default_rng(seed)
    k = max(1, math.ceil(0.99 * len(live) - 1e-9)) - 1
    diffs = []
    batch = max(1, min(BOOTSTRAP_RESAMPLES, 1_000_000 // len(live)))  # ~8 MB at a time
    for start in range(0, BOOTSTRAP_RESAMPLES, batch):
        picks = rng.integers(0, len(live), size=(min(batch, BOOTSTRAP_RESAMPLES - start),
                                                 len(live)))
        diffs.append(np.partition(shadow[picks], k, axis=1)[:, k]
                     - np.partition(live[picks], k, axis=1)[:, k])
    low, high = np.percentile(np.concatenate(diffs), [2.5, 97.5])
    return {"pairs": int(len(live)), "shadow_minus_live_s": point,
            "ci95": [float(low), float(high)]}


def _attainment(pairs: Sequence[Pair], side: str) -> dict[str, dict[str, Any]]:
    """Per tenant: the share of its mirrored requests that met its SLO on this side (a failed
    request misses; a tenant without SLO targets is left out)."""
    counts: dict[str, list[int]] = {}
    for p in pairs:
        timing = p.live if side == "live" else p.shadow
        if timing is None or (p.slo.ttft_s is None and p.slo.itl_s is None):
            continue
        met = timing.meets_ttft(p.slo) and timing.meets_tpot(p.slo)
        entry = counts.setdefault(p.tenant, [0, 0])
        entry[0] += met
        entry[1] += 1
    return {tenant: {"met": met, "requests": total, "fraction": met / total}
            for tenant, (met, total) in sorted(counts.items())}


_TEXT_OPENERS = (b'"text":"', b'"text": "', b'"content":"', b'"content": "')
_EMPTY_TEXTS = (b'"text":""', b'"text": ""', b'"content":""', b'"content": ""')
_PARSE_MARKERS = (b'"usage":{', b'"usage": {', b'"error"')  # `"usage": null` needs no parse


def _plain_text(data: bytes) -> bool:
    """A token event with nothing else to read: non-empty text and no usage or error. The byte
    patterns are JSON keys: generated text cannot hold them unescaped."""
    return (any(o in data for o in _TEXT_OPENERS) and not any(e in data for e in _EMPTY_TEXTS)
            and not any(m in data for m in _PARSE_MARKERS))


def _has_text(message: dict[str, Any]) -> bool:
    for choice in message.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        text = choice.get("text") if delta is None else (
            delta.get("content") if isinstance(delta, dict) else None)
        if text:
            return True
    return False


class ShadowSet:
    """Every shadow target of a gateway, by name; started, changed and stopped at run time."""

    def __init__(self, configs: Sequence[ShadowConfig], metrics: GatewayMetrics) -> None:
        self.metrics = metrics
        self.mirrors: dict[str, ShadowMirror] = {c.name: ShadowMirror(c, metrics)
                                                 for c in configs}
        self.running = False

    def __bool__(self) -> bool:
        return bool(self.mirrors)

    def offer(self, request_id: str, body: dict[str, Any], endpoint: str, tenant: str,
              priority: str, slo: SLO) -> None:
        for mirror in self.mirrors.values():
            mirror.offer(request_id, body, endpoint, tenant, priority, slo)

    def live_done(self, request_id: str, timing: RequestTiming) -> None:
        for mirror in self.mirrors.values():
            mirror.live_done(request_id, timing)

    def start(self) -> None:
        self.running = True
        for mirror in self.mirrors.values():
            mirror.start()

    async def close(self) -> None:
        self.running = False
        for mirror in self.mirrors.values():
            await mirror.close()

    async def put(self, config: ShadowConfig) -> ShadowMirror:
        """Start a target, or replace the one of that name (its pairs are kept when only the
        sample or the tenants change)."""
        old = self.mirrors.get(config.name)
        mirror = ShadowMirror(config, self.metrics)
        if old is not None:
            if (old.config.url, old.config.kind, old.config.model) == (
                    config.url, config.kind, config.model):
                # the same candidate: its completed pairs and counts carry over (copies in
                # flight end with the old senders and are not paired)
                mirror.pairs = old.pairs
                mirror.sent, mirror.dropped, mirror.failed = old.sent, old.dropped, old.failed
            await old.close()
        self.mirrors[config.name] = mirror
        if self.running:
            mirror.start()
        return mirror

    async def remove(self, name: str) -> bool:
        mirror = self.mirrors.pop(name, None)
        if mirror is None:
            return False
        await mirror.close()
        return True

"""`fairgate tune --mode shadow`: trials on live traffic mirrored by a gateway's shadow target.

Each trial reconfigures the shadow target's engine with its knobs (`/admin/reconfigure`, as
replay mode does), then collects a window of mirrored requests whose copies went out after the
engine was ready (`GET /admin/shadow/{name}/stats?sent_after=...&detail=1`, polled), until
`requests` pairs came or `window_s` passed. The trial's timings are the shadow side's; the live
side of the same pairs comes with them (`live_timings`), so the study scores the candidate
against the live engine on the very same requests, and load that changes between trials does
not decide the ranking. The early-stop rule sees the shadow timings as they arrive.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from engine.config import EngineConfig
from protocol.measures import RequestTiming
from protocol.openai import server_root
from tuner.measures import StopRule
from tuner.remote import ReplayRunner, error_text, request_json
from tuner.traces import TraceRequest

POLL_S = 0.25


@dataclass(frozen=True)
class ShadowRun:
    timings: list[RequestTiming]  # the shadow side, in completion order
    live_timings: list[RequestTiming]  # the live side of the same pairs
    elapsed_s: float
    stopped: str | None
    wall_s: float
    steps: int = 0
    preemptions: int = 0


def timing_of(row: Sequence[Any]) -> RequestTiming:
    """[ttft, tpot, e2e, output tokens, ok, token times] (gateway.shadow.samples) as a
    RequestTiming on a clock starting at the request's send. A gateway from before the token
    times gives five fields: then only the first and the last token's times are known, the
    tokens between are spaced evenly, and the trial's per-gap ITL reads as its TPOT."""
    ttft, tpot, e2e, tokens, ok = row[:5]
    if not ok or ttft is None or e2e is None:
        return RequestTiming(0.0, [], 0, float(e2e or 0.0), ok=False)
    if len(row) > 5 and row[5]:
        return RequestTiming(0.0, [float(x) for x in row[5]], int(tokens), float(e2e), ok=True)
    gaps = int(tokens) - 1 if tpot is not None and int(tokens) >= 2 else 0
    stamps = [float(ttft) + float(tpot or 0.0) * i for i in range(gaps + 1)]  # evenly spaced
    return RequestTiming(0.0, stamps, int(tokens), float(e2e), ok=True)


class ShadowRunner:
    """A gateway's shadow target: its engine reconfigured per trial, scored on mirrored
    traffic. `admin_key` is the gateway's; `engine_api_key` and `engine_admin_key` (None: the
    api key) are the shadow engine's, which the gateway never shows."""

    def __init__(self, gateway: str, admin_key: str | None, shadow: str,
                 knobs: Sequence[str], requests: int, window_s: float,
                 engine_api_key: str | None = None,
                 engine_admin_key: str | None = None) -> None:
        self.gateway, self.admin_key, self.shadow = gateway.rstrip("/"), admin_key, shadow
        self.requests, self.window_s = requests, window_s
        target = find_target(self.gateway, admin_key, shadow)
        if target.get("kind") != "fairgate":
            raise ValueError(f"shadow target {shadow!r} is kind {target.get('kind')!r}: only a "
                             "fairgate engine can be reconfigured per trial")
        self.engine = ReplayRunner(server_root(str(target["url"])), engine_api_key, knobs,
                                   admin_key=engine_admin_key)

    def prepare(self, config: EngineConfig) -> EngineConfig:
        return config

    def finish(self, winner: EngineConfig | None) -> None:
        del winner  # each trial reconfigures the shadow engine; it serves no live traffic

    def run(self, config: EngineConfig, requests: Sequence[TraceRequest],
            stop: StopRule) -> ShadowRun:
        self.engine.reconfigure(config)  # ValueError: refused; waits until it is ready
        since = time.time()
        started = time.monotonic()
        shadow: list[RequestTiming] = []
        live: list[RequestTiming] = []
        stopped = None
        while True:
            elapsed = time.monotonic() - started
            shadow, live = self._window(since, elapsed)
            stopped = stop(shadow[:self.requests])
            if stopped is not None or len(shadow) >= self.requests:
                break
            if elapsed >= self.window_s:
                stopped = (f"only {len(shadow)} of {self.requests} mirrored requests came in "
                           f"{self.window_s:g} s: raise the shadow's sample or --shadow-window")
                break
            time.sleep(POLL_S)
        wall = time.monotonic() - started
        return ShadowRun(shadow[:self.requests], live[:self.requests], wall, stopped, wall)

    def _window(self, since: float, elapsed: float) -> tuple[list[RequestTiming],
                                                              list[RequestTiming]]:
        status, body = request_json(
            f"{self.gateway}/admin/shadow/{quote(self.shadow)}/stats?window="
            f"{max(elapsed + 60.0, 1.0):.3f}&sent_after={since:.6f}&detail=1", self.admin_key)
        if status != 200:
            raise ValueError(f"the gateway's shadow stats answered {status}: "
                             f"{error_text(body, status)}")
        rows = body.get("samples") or {}
        return ([timing_of(r) for r in rows.get("shadow", [])],
                [timing_of(r) for r in rows.get("live", [])])


def find_target(gateway: str, admin_key: str | None, shadow: str) -> dict[str, Any]:
    """The gateway's shadow target `shadow`; ValueError (one line) when it cannot be read."""
    try:
        status, body = request_json(f"{gateway}/admin/shadow", admin_key, timeout=5.0)
    except OSError as exc:
        raise ValueError(f"cannot reach --gateway {gateway}: {getattr(exc, 'reason', exc)}") \
            from None
    if status != 200:
        raise ValueError(f"--gateway {gateway}/admin/shadow answered {status}: "
                         f"{error_text(body, status)} (give the admin key with --admin-key)")
    for target in body.get("shadows") or []:
        if target.get("name") == shadow:
            return dict(target)
    names = ", ".join(t.get("name", "?") for t in body.get("shadows") or []) or "none"
    raise ValueError(f"the gateway has no shadow target {shadow!r} (it has: {names})")

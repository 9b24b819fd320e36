"""Apply a tune job's best config to one live engine as a canary, then promote it to the other
replicas or roll it back, on measured SLOs.

The gateway keeps every live request it served with the backend that served it (`Served`,
a bounded window). An apply (`run_apply`) drains the canary (no new dispatch; its streams
finish), reconfigures it (`/admin/reconfigure`: weights stay loaded) and puts it back, then
compares the canary with the other replicas over `canary_window_s` of live traffic (with one
replica: the same engine in the same length of time before the change). `judge` decides:

- roll back when the canary's SLO attainment is lower with 95% confidence (a bootstrap over
  requests), or its error rate is, or it serves clearly less than an even share of the good
  requests (the gateway dispatches by free room, so knobs that take capacity away show as a
  smaller share rather than as slower requests), or it burns the error budget faster than the
  others: its burn rate (misses over the budget, the SRE workbook's) is over 1 and over twice
  theirs;
- promote otherwise ("at least as good within the confidence interval"), replica by replica;
- roll back, too, when the window did not see `min_requests` on both sides: nothing was shown.

Every step, with the figures that decided it, is recorded in the job (`apply` state:
applying, canary, promoting, promoted, rolling_back, rolled_back, failed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from protocol.measures import SLO, RequestTiming, attainment

log = logging.getLogger("fairgate.gateway")
MAX_SERVED = 200_000  # live requests kept for canary windows (a few minutes at high rate)
RESAMPLES = 1000
FAST_BURN = 2.0  # a canary burning budget this many times faster than the others (and >1)
SHARE_TOLERANCE = 0.2  # a canary may serve this much less than an even share of good requests


@dataclass(frozen=True, slots=True)
class Served:
    at: float  # monotonic, when it ended
    backend: str
    tenant: str
    slo: SLO
    timing: RequestTiming


class ServedWindow:
    """The live requests served lately, by backend: what a canary is judged on."""

    def __init__(self, maxlen: int = MAX_SERVED) -> None:
        self.items: deque[Served] = deque(maxlen=maxlen)

    def record(self, backend: str, tenant: str, slo: SLO, timing: RequestTiming) -> None:
        self.items.append(Served(time.monotonic(), backend, tenant, slo, timing))

    def between(self, start: float, end: float, backends: set[str]) -> list[Served]:
        """Oldest first; only the part of the window at or after `start` is read (items are
        appended in time order)."""
        found = []
        for s in reversed(self.items):
            if s.at < start:
                break
            if s.at < end and s.backend in backends:
                found.append(s)
        found.reverse()
        return found


def _met(s: Served) -> bool | None:
    """Whether the request met its tenant's per-request targets (TTFT and TPOT: goodput);
    None for a tenant without either. ITL, pooled over gaps, is judged by `side`'s p99."""
    if s.slo.ttft_s is None and s.slo.tpot_s is None:
        return None
    return s.timing.meets(s.slo)


def _p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


def side(served: Sequence[Served]) -> dict[str, Any]:
    """One side's figures: requests, errors, SLO attainment (overall and per tenant) with its
    burn rate, p99 TTFT and TPOT (over requests), p99 ITL (over every gap of them) and the
    share of gaps within their tenants' ITL targets."""
    checked = [(s, m) for s in served if (m := _met(s)) is not None]
    met = sum(m for _, m in checked)
    target = min((s.slo.target for s, _ in checked), default=0.99)
    tenants: dict[str, list[int]] = {}
    for s, m in checked:
        entry = tenants.setdefault(s.tenant, [0, 0])
        entry[0] += m
        entry[1] += 1
    errors = sum(not s.timing.ok for s in served)
    return {"requests": len(served), "errors": errors,
            "error_rate": errors / len(served) if served else None,
            "slo_checked": len(checked), **attainment(met, len(checked), target),
            "tenants": {t: {"met": a, "requests": n, "fraction": a / n}
                        for t, (a, n) in sorted(tenants.items())},
            "ttft_p99_s": _p99([t for s in served if (t := s.timing.ttft) is not None
                                and s.timing.ok]),
            "tpot_p99_s": _p99([t for s in served if (t := s.timing.tpot) is not None
                                and s.timing.ok]),
            "itl_p99_s": _p99([gap for s in served if s.timing.ok for gap in s.timing.itls]),
            "itl_attainment": _gap_attainment(served, target)}


def _gap_attainment(served: Sequence[Served], target: float) -> float | None:
    """The share of the gaps of requests whose tenant sets an ITL target that were within it
    (protocol.measures' pooled ITL); None without such gaps."""
    met = gaps = 0
    for s in served:
        if s.slo.itl_s is not None:
            m, n = s.timing.gaps_within(s.slo)
            met, gaps = met + m, gaps + n
    return attainment(met, gaps, target)["fraction"]


def _difference(a: Sequence[bool], b: Sequence[bool], seed: int) -> dict[str, Any]:
    """The difference of two proportions (a's share of True minus b's) with a 95% bootstrap
    interval, each side resampled on its own: a resample of n yes/no outcomes is a binomial
    draw, so this costs the same for ten requests as for a million."""
    if not len(a) or not len(b):
        return {"difference": None, "ci95": [None, None]}
    rng = np.random.default_rng(seed)
    pa, pb = sum(a) / len(a), sum(b) / len(b)
    diffs = (rng.binomial(len(a), pa, RESAMPLES) / len(a)
             - rng.binomial(len(b), pb, RESAMPLES) / len(b))
    low, high = np.percentile(diffs, [2.5, 97.5])
    return {"difference": pa - pb, "ci95": [float(low), float(high)]}


def _share(canary: int, baseline: int, replicas: int) -> dict[str, Any]:
    """The canary's share of the good requests against an even share among `replicas` + 1
    engines; `low`: below it by more than SHARE_TOLERANCE, with 95% confidence (a normal
    approximation to the binomial: equal engines split good requests evenly)."""
    n = canary + baseline
    even = 1.0 / (replicas + 1)
    if n == 0:
        return {"share": None, "even": even, "low": False}
    share = canary / n
    z = (share - even) / math.sqrt(even * (1 - even) / n)
    return {"share": share, "even": even, "z": z,
            "low": bool(z < -1.96 and share < (1 - SHARE_TOLERANCE) * even)}


def judge(canary: Sequence[Served], baseline: Sequence[Served], min_requests: int,
          seed: int = 0, replicas: int = 1, compare_share: bool = True) -> dict[str, Any]:
    """The verdict (`promote` or `roll_back`), why, and the figures of both sides; `baseline`
    is what `replicas` engines served over the same span (`compare_share`), or one engine over
    as long a time before the change (then traffic volume says nothing of the knobs)."""
    figures = {"canary": side(canary), "baseline": side(baseline)}
    met_c = [m for s in canary if (m := _met(s)) is not None]
    met_b = [m for s in baseline if (m := _met(s)) is not None]
    figures["attainment_difference"] = _difference(met_c, met_b, seed)
    figures["error_rate_difference"] = _difference([not s.timing.ok for s in canary],
                                                   [not s.timing.ok for s in baseline], seed + 1)
    c, b = figures["canary"], figures["baseline"]
    if c["requests"] < min_requests or b["requests"] < min_requests:
        return {"verdict": "roll_back", "figures": figures,
                "reason": f"not enough traffic to judge: {c['requests']} canary and "
                          f"{b['requests']} baseline requests, {min_requests} wanted on each"}
    worse = figures["attainment_difference"]["ci95"][1]
    if worse is not None and worse < 0:
        return {"verdict": "roll_back", "figures": figures,
                "reason": f"SLO attainment {_f(c['fraction'])} against {_f(b['fraction'])}: "
                          "lower with 95% confidence"}
    figures["tenant_differences"] = {}
    for tenant in sorted(set(c["tenants"]) & set(b["tenants"])):
        mine = [m for s in canary if s.tenant == tenant and (m := _met(s)) is not None]
        theirs = [m for s in baseline if s.tenant == tenant and (m := _met(s)) is not None]
        if len(mine) < min_requests or len(theirs) < min_requests:
            continue
        diff = figures["tenant_differences"][tenant] = _difference(mine, theirs, seed + 2)
        if diff["ci95"][1] < 0:
            return {"verdict": "roll_back", "figures": figures,
                    "reason": f"tenant {tenant}'s SLO attainment "
                              f"{_f(c['tenants'][tenant]['fraction'])} against "
                              f"{_f(b['tenants'][tenant]['fraction'])}: lower with 95% "
                              "confidence"}
    errors = figures["error_rate_difference"]["ci95"][0]
    if errors is not None and errors > 0:
        return {"verdict": "roll_back", "figures": figures,
                "reason": f"error rate {c['error_rate']:.3f} against {b['error_rate']:.3f}: "
                          "higher with 95% confidence"}
    good_c = sum(1 for s in canary if _met(s) is not False and s.timing.ok)
    good_b = sum(1 for s in baseline if _met(s) is not False and s.timing.ok)
    figures["good_share"] = _share(good_c, good_b, replicas)
    if compare_share and figures["good_share"]["low"]:
        return {"verdict": "roll_back", "figures": figures,
                "reason": f"serves {figures['good_share']['share']:.0%} of the good requests "
                          f"where an even share is {figures['good_share']['even']:.0%}: its "
                          "knobs take capacity away"}
    burn_c, burn_b = c["burn_rate"], b["burn_rate"]
    if burn_c is not None and burn_c > 1 and burn_c > FAST_BURN * (burn_b or 0.0):
        return {"verdict": "roll_back", "figures": figures,
                "reason": f"burns its error budget at {burn_c:.1f}x against the others' "
                          f"{burn_b or 0.0:.1f}x"}
    return {"verdict": "promote", "figures": figures,
            "reason": "at least as good as the others within the 95% interval (SLO attainment "
                      f"{_f(c['fraction'])} against {_f(b['fraction'])})"}


def _f(fraction: float | None) -> str:
    return "n/a" if fraction is None else f"{fraction:.3f}"


# ---- the procedure --------------------------------------------------------------------------------
Reconfigure = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
Record = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class ApplyPlan:
    job_id: str
    canary: str  # the backend's name (its base URL)
    others: list[str]  # the pool's other fairgate replicas, promoted one at a time
    config: dict[str, Any]  # the knobs to apply
    previous: dict[str, dict[str, Any]]  # every replica's knobs before, to roll back to
    canary_window_s: float
    min_requests: int
    max_wait_s: float  # how long the window may grow to see min_requests


class Apply:
    """One apply, run as a task: its record is what the job shows."""

    def __init__(self, plan: ApplyPlan, window: ServedWindow, drain: Callable[[str], Any],
                 undrain: Callable[[str], None], reconfigure: Reconfigure,
                 record: Record, clock: Callable[[], float] = time.monotonic) -> None:
        self.plan = plan
        self.window = window
        self.drain, self.undrain = drain, undrain
        self.reconfigure = reconfigure
        self.persist = record
        self.clock = clock
        self.record: dict[str, Any] = {
            "state": "applying", "backend": plan.canary, "config": plan.config,
            "previous": plan.previous, "canary_window_s": plan.canary_window_s,
            "min_requests": plan.min_requests, "switched": [], "steps": []}
        self.switched: list[str] = []  # replicas on the new knobs, in order

    async def step(self, state: str, step: str, **detail: Any) -> None:
        self.record["state"] = state
        self.record["steps"].append({"at": time.time(), "step": step, **detail})
        log.info("tune job %s apply: %s (%s)", self.plan.job_id, step, state)
        await self.persist(self.record)

    async def _switch(self, backend: str, knobs: dict[str, Any]) -> None:
        """Drain `backend` (its streams finish, nothing new goes to it), reconfigure it, put it
        back."""
        forward = knobs is self.plan.config
        if forward and backend not in self.switched:
            # before the call: one cut short may still have landed, and going back is safe
            # to repeat
            self.switched.append(backend)
            self.record["switched"] = list(self.switched)
        await self.drain(backend)
        try:
            await self.reconfigure(backend, knobs)
        finally:
            self.undrain(backend)
        if not forward and backend in self.switched:
            self.switched.remove(backend)
            self.record["switched"] = list(self.switched)

    async def run(self) -> dict[str, Any]:
        plan = self.plan
        try:
            before = self.clock()
            await self.step("applying", f"draining and reconfiguring {plan.canary}",
                            knobs=plan.config)
            await self._switch(plan.canary, plan.config)
            applied = self.clock()
            await self.step("canary", f"{plan.canary} runs the new knobs; watching live "
                            f"traffic for {plan.canary_window_s:g} s")
            verdict = await self._watch(before, applied)
            await self.step("canary", f"verdict: {verdict['verdict']}: {verdict['reason']}",
                            figures=verdict["figures"], verdict=verdict["verdict"])
            if verdict["verdict"] == "promote":
                for backend in plan.others:
                    await self.step("promoting", f"draining and reconfiguring {backend}")
                    await self._switch(backend, plan.config)
                await self.step("promoted", "every replica runs the new knobs")
            else:
                await self._roll_back()
        except asyncio.CancelledError:  # the gateway stops: the knobs go back first
            with contextlib.suppress(Exception):
                await self._roll_back()
            raise
        except Exception as exc:  # noqa: BLE001 - whatever broke, the replicas go back
            log.exception("tune job %s apply failed", plan.job_id)
            try:
                await self._roll_back()
            except Exception as again:  # noqa: BLE001
                await self._final("failed", f"stopped: {exc}; the rollback failed too: {again}")
            else:
                await self._final("failed", f"stopped: {exc}; every replica was put back")
        return self.record

    async def _final(self, state: str, step: str) -> None:
        with contextlib.suppress(Exception):  # the database may be what broke
            await self.step(state, step)

    async def _watch(self, before: float, applied: float) -> dict[str, Any]:
        plan = self.plan
        deadline = applied + max(plan.canary_window_s, plan.max_wait_s)
        while True:
            now = self.clock()
            elapsed = now - applied
            canary = self.window.between(applied, now, {plan.canary})
            if plan.others:
                baseline = self.window.between(applied, now, set(plan.others))
            else:  # one engine: itself, in as long a time before the change
                baseline = self.window.between(before - max(elapsed, plan.canary_window_s),
                                               before, {plan.canary})
            enough = len(canary) >= plan.min_requests and len(baseline) >= plan.min_requests
            if (elapsed >= plan.canary_window_s and enough) or now >= deadline:
                return await asyncio.to_thread(judge, canary, baseline, plan.min_requests, 0,
                                               max(1, len(plan.others)), bool(plan.others))
            await asyncio.sleep(min(1.0, max(0.01, plan.canary_window_s / 20)))

    async def _roll_back(self) -> None:
        """Every replica that got the new knobs goes back to its own, the last one first."""
        for backend in reversed(list(self.switched)):
            await self.step("rolling_back", f"putting {backend} back on its knobs",
                            knobs=self.plan.previous.get(backend))
            await self._switch(backend, self.plan.previous.get(backend, {}))
        await self.step("rolled_back", "every replica runs its previous knobs")

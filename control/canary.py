"""Apply a tune job's best config to one live engine as a canary, then promote it to the other
replicas or roll it back, on measured SLOs.

The gateway keeps every live request it served with the backend that served it (`Served`),
and while an apply runs every attempt a remote replica made, failed or not (`Attempt`: a
request that failed before its first byte and was retried elsewhere is one failed attempt
here, though its client saw an answer); both in a bounded window. An apply (`Apply.run`)
drains the canary (no new dispatch; its streams finish), reconfigures it
(`/admin/reconfigure`: weights stay loaded) and puts it back with at most `canary_weight` of
its model's requests (the pool's share limit; one replica takes all of them), then watches it
against the other replicas (with one replica: the same engine in as long a time before the
change).

From the first request it serves, `sequential` runs Wald's sequential probability ratio test
on three measures, after every failed attempt and every `TICK_S`:

- errors: each attempt on the canary failed or not; H0: at the others' failure rate so far,
  at least 1% (one replica: 1%);
- p99 TTFT: each first token is over the old knobs' p99 TTFT or not; p99 ITL: each gap
  between two tokens, pooled over the canary's requests, is over the old knobs' p99 ITL or
  not. The old knobs' figures are a fixed reference, `REFERENCE` requests the replicas
  served just before the change (a gateway that had not served as many: the others' first
  ones after it), and H0 is the share of the reference's own outcomes over its p99 (Laplace's
  rule of succession: a new value exceeds a p99 of n values more often than 1%). A reference
  that moved with every look would give every look another chance of a false alarm.

Each tests H0 against H1 "clearly worse": twice H0's share of bad outcomes and at least 20
points more. alpha = 0.001 (rolling back a canary as good as the others) and beta = 0.05
(missing one at H1), per measure: a log likelihood ratio reaching log((1 - beta) / alpha) =
6.86 rolls the canary back at once; reaching log(beta / (1 - alpha)) = -3.00 ends that
measure's test (not clearly worse: the window decides, and so it does for a canary that turns
worse only later). Outcomes that end within `BURST_S` of each other on one replica count once,
a bad one if any is: one engine step seen by several streams, whose figures move together (a
single slow step would otherwise read as several independent misses).

In seeded simulations (tests/gateway/test_canary.py: Poisson arrivals, lognormal TTFTs and
gaps, a canary with 25% of the requests, 40 runs each): one failing every attempt is rolled
back after 3 failures, one failing half of them after at most 3 (within 3 s), one whose
TTFTs are 3x the others' within its first 18 requests, 3x gaps within its first 4; of 500
runs of a canary as good as the others, 496 were promoted (1 rolled back by the sequential
test, 3 by the window's share check).

When `canary_window_s` ends with `min_requests` on both sides (or `max_wait_s` passes),
`judge` decides on the whole window:

- roll back when the canary's SLO attainment is lower with 95% confidence (a bootstrap over
  requests), or its error rate is, or it serves clearly less than its share of the good
  requests (the smaller of `canary_weight` and an even share: the gateway dispatches by free
  room, so knobs that take capacity away show as a smaller share rather than as slower
  requests), or it burns the error budget faster than the others: its burn rate (misses over
  the budget, the SRE workbook's) is over 1 and over twice theirs;
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
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.events import RequestFinished, RequestObserver
from protocol.measures import (
    SLO,
    SLO_FIELDS,
    TIMING_FIELDS,
    RequestTiming,
    attainment,
    slo_fields,
    timing_fields,
)
from protocol.serving import wait_event
from protocol.stats import percentile, percentile_of_sorted, share_difference_interval

log = logging.getLogger("fairgate.gateway")
MAX_SERVED = 200_000  # live requests kept for canary windows (a few minutes at high rate)
RESAMPLES = 1000
FAST_BURN = 2.0  # a canary burning budget this many times faster than the others (and >1)
SHARE_TOLERANCE = 0.2  # a canary may serve this much less than its share of good requests
MAX_CANARY_WEIGHT = 0.25  # the most of its model's requests a canary is sent
# the sequential test (the module's docstring)
ALPHA = 0.001
BETA = 0.05
WORSE = math.log((1 - BETA) / ALPHA)
NOT_WORSE = math.log(BETA / (1 - ALPHA))
FLOOR = 0.01  # H0's failure rate is at least this (the others' may be 0 so far)
CLEARLY_WORSE = 0.2  # H1: at least this much more than H0 (and twice as much)
BURST_S = 0.01  # outcomes this close count once: one engine step
REFERENCE = 200  # requests of the old knobs whose p99s the canary's are compared with
REFERENCE_AGE_S = 600.0  # ... served at most this long before the change
MAX_EVENTS = 5000  # the canary's values a latency test looks at (it costs no more after)
TICK_S = 0.25  # the sequential test runs this often, and after every failed attempt


@dataclass(frozen=True, slots=True)
class Served:
    at: float  # monotonic, when it ended
    backend: str
    tenant: str
    slo: SLO
    timing: RequestTiming


@dataclass(frozen=True, slots=True)
class Attempt:
    """One try of a request on one remote replica, as the pool heard it end (outlier
    detection's verdict: failed is a 5xx other than overload, no connection, a reset, a
    timeout)."""

    at: float  # monotonic
    backend: str
    failed: bool


# A window's entry as it is kept: a flat tuple the collector stops tracking
# (protocol.measures.timing_fields), so the window's 200,000 requests are not walked by every
# full collection of a busy gateway's heap.
#   served:  (at, backend, tenant, *slo_fields(slo), *timing_fields(timing))
#   attempt: (at, backend, failed)
Row = tuple[Any, ...]
_TIMING = 3 + SLO_FIELDS  # where a served row's timing begins


def served_row(at: float, backend: str, tenant: str, slo: SLO, timing: RequestTiming) -> Row:
    return (at, backend, tenant, *slo_fields(slo), *timing_fields(timing))


def served_from_row(row: Row) -> Served:
    return Served(row[0], row[1], row[2], SLO(*row[3:_TIMING]),
                  RequestTiming(*row[_TIMING:_TIMING + TIMING_FIELDS]))


class ServedWindow(RequestObserver):
    """The live requests served lately, by backend, and the attempts heard while an apply
    runs: what a canary is judged on. `failure` is set at each failed attempt. Subscribed to
    the gateway's finished requests (those that reached a backend). Entries are kept as rows
    (`served_row`) and read back as Served and Attempt objects."""

    def __init__(self, maxlen: int = MAX_SERVED) -> None:
        self.items: deque[Row] = deque(maxlen=maxlen)
        self.attempts: deque[Row] = deque(maxlen=maxlen)
        self.failure = asyncio.Event()

    def record(self, backend: str, tenant: str, slo: SLO, timing: RequestTiming) -> None:
        self.items.append(served_row(time.monotonic(), backend, tenant, slo, timing))

    def finished(self, event: RequestFinished) -> None:
        if event.backend is not None:
            self.record(event.backend, event.tenant, event.slo, event.timing)

    def attempt(self, backend: str, failed: bool) -> None:
        self.attempts.append((time.monotonic(), backend, failed))
        if failed:
            self.failure.set()

    def between(self, start: float, end: float, backends: set[str]) -> list[Row]:
        """The served rows in [start, end) of `backends` (a filter: cheap on the event loop;
        `served_from_row` reads one back)."""
        return _between(self.items, start, end, backends)

    def attempts_between(self, start: float, end: float, backends: set[str]) -> list[Row]:
        """The attempts' rows likewise (`Attempt(*row)` reads one back)."""
        return _between(self.attempts, start, end, backends)


def _between(rows: deque[Row], start: float, end: float, backends: set[str]) -> list[Row]:
    """Oldest first; only the part of the window at or after `start` is read (rows are
    appended in time order; each begins with its time and backend)."""
    found = []
    for row in reversed(rows):
        if row[0] < start:
            break
        if row[0] < end and row[1] in backends:
            found.append(row)
    found.reverse()
    return found


def _met(s: Served) -> bool | None:
    """Whether the request met its tenant's per-request targets (TTFT and TPOT: goodput);
    None for a tenant without either. ITL, pooled over gaps, is judged by `side`'s p99."""
    if s.slo.ttft_s is None and s.slo.tpot_s is None:
        return None
    return s.timing.meets(s.slo)


def _p99(values: Iterable[float]) -> float | None:
    p99 = percentile(values, 99)
    return None if math.isnan(p99) else p99


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
            "ttft_p99_s": _p99(t for s in served if (t := s.timing.ttft) is not None
                               and s.timing.ok),
            "tpot_p99_s": _p99(t for s in served if (t := s.timing.tpot) is not None
                               and s.timing.ok),
            "itl_p99_s": _p99(gap for s in served if s.timing.ok for gap in s.timing.itls),
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


# ---- the sequential test: a clearly worse canary rolled back within seconds ---------------------
def sprt(bad: Iterable[bool], p0: float) -> dict[str, Any]:
    """Wald's SPRT over outcomes in time order (True: bad) of H0 "P(bad) = p0" against H1
    "P(bad) = p1", p1 twice p0 and at least CLEARLY_WORSE more (short of 1): `decision`
    worse, not_worse (it stopped at a boundary) or undecided, with the figures."""
    p1 = min(1 - (1 - p0) / 2, max(2 * p0, p0 + CLEARLY_WORSE))
    up, down = math.log(p1 / p0), math.log((1 - p1) / (1 - p0))
    llr, n, k, decision = 0.0, 0, 0, "undecided"
    for outcome in bad:
        n, k = n + 1, k + outcome
        llr += up if outcome else down
        if llr >= WORSE or llr <= NOT_WORSE:
            decision = "worse" if llr >= WORSE else "not_worse"
            break
    return {"decision": decision, "observations": n, "bad": k, "p0": p0, "p1": p1,
            "llr": llr, "bounds": [NOT_WORSE, WORSE]}


def _bursts(events: Iterable[tuple[float, float]], limit: float) -> list[bool]:
    """One backend's (time, value) events merged into bursts, each the events within BURST_S
    of its first, in time order: whether each holds a value over `limit`."""
    bursts: list[bool] = []
    start = -math.inf
    for at, value in sorted(events):
        if at - start > BURST_S:
            bursts.append(False)
            start = at
        bursts[-1] = bursts[-1] or value > limit
    return bursts


def _first_token(s: Served) -> list[tuple[float, float]]:
    ttft = s.timing.ttft
    return [(s.timing.token_times[0], ttft)] if s.timing.ok and ttft is not None else []


def _gaps(s: Served) -> list[tuple[float, float]]:
    """Each gap between two of the request's tokens, at the time it ended."""
    return list(zip(s.timing.token_times[1:], s.timing.itls, strict=True)) if s.timing.ok else []


def _latency_test(events: Callable[[Served], list[tuple[float, float]]],
                  canary: Sequence[Served], reference: Sequence[Served]) -> dict[str, Any]:
    """The canary's bursts over the reference's p99 against H0: as often as the reference's
    own bursts (per backend) are over it (Laplace's rule of succession: a p99 of n values is
    exceeded by a new one from the same distribution more often than 1%), at least FLOOR."""
    values = sorted(v for s in reference for _, v in events(s))
    if len(reference) < REFERENCE or not values:
        return {"decision": "undecided", "observations": 0,
                "note": f"a reference of {len(reference)} requests, {REFERENCE} wanted"}
    limit = percentile_of_sorted(values, 99)
    theirs = [b for name in {s.backend for s in reference}
              for b in _bursts((e for s in reference if s.backend == name for e in events(s)),
                               limit)]
    p0 = max(FLOOR, (sum(theirs) + 1) / (len(theirs) + 2))
    mine: list[tuple[float, float]] = []
    for s in canary:  # a truncated SPRT: undecided after MAX_EVENTS, the window decides
        if len(mine) >= MAX_EVENTS:
            break
        mine.extend(events(s))
    return {"limit_s": limit, **sprt(_bursts(mine, limit), p0)}


def sequential(canary: Sequence[Served], reference: Sequence[Served],
               canary_attempts: Sequence[Attempt],
               baseline_attempts: Sequence[Attempt]) -> dict[str, Any]:
    """The sequential tests of the canary so far: its attempts' failures against the
    others' failure rate (at least FLOOR), its first tokens and its gaps (pooled over its
    requests) over the p99 TTFT and ITL of `reference`, fixed requests of the old knobs (a
    reference that moved would make every look another chance of a false alarm): `verdict`
    roll_back when one says worse, else continue; `tests`, each one's figures."""
    failed = sum(a.failed for a in baseline_attempts)
    tests = {"errors": sprt((a.failed for a in canary_attempts),
                            max(FLOOR, failed / max(1, len(baseline_attempts)))),
             "ttft_p99": _latency_test(_first_token, canary, reference),
             "itl_p99": _latency_test(_gaps, canary, reference)}
    worse = next((name for name, t in tests.items() if t["decision"] == "worse"), None)
    if worse is None:
        return {"verdict": "continue", "tests": tests}
    t = tests[worse]
    if worse == "errors":
        what = (f"{t['bad']} of {t['observations']} attempts failed where the others fail "
                f"{t['p0']:.1%} (at least {FLOOR:.0%})")
    else:
        measure, unit = ("TTFT", "first tokens") if worse == "ttft_p99" else ("ITL", "gaps")
        what = (f"{t['bad']} of {t['observations']} bursts of {unit} over the old knobs' p99 "
                f"{measure} ({t['limit_s'] * 1000:.0f} ms) where they had {t['p0']:.1%}")
    return {"verdict": "roll_back", "tests": tests, "measure": worse,
            "reason": f"{what}: clearly worse (Wald's SPRT, log likelihood ratio "
                      f"{t['llr']:.2f} >= {WORSE:.2f})"}


# ---- the window's judgement ---------------------------------------------------------------------
def _difference(a: Sequence[bool], b: Sequence[bool], seed: int) -> dict[str, Any]:
    """The difference of two proportions (a's share of True minus b's) with a 95% bootstrap
    interval, each side resampled on its own."""
    if not len(a) or not len(b):
        return {"difference": None, "ci95": [None, None]}
    low, high = share_difference_interval(a, b, resamples=RESAMPLES, seed=seed)
    return {"difference": sum(a) / len(a) - sum(b) / len(b), "ci95": [low, high]}


def _share(canary: int, baseline: int, expected: float) -> dict[str, Any]:
    """The canary's share of the good requests against `expected`; `low`: below it by more
    than SHARE_TOLERANCE, with 95% confidence (a normal approximation to the binomial)."""
    n = canary + baseline
    if n == 0:
        return {"share": None, "even": expected, "low": False}
    share = canary / n
    z = (share - expected) / math.sqrt(expected * (1 - expected) / n)
    return {"share": share, "even": expected, "z": z,
            "low": bool(z < -1.96 and share < (1 - SHARE_TOLERANCE) * expected)}


def judge(canary: Sequence[Served], baseline: Sequence[Served], min_requests: int,
          seed: int = 0, share: float = 0.5, compare_share: bool = True) -> dict[str, Any]:
    """The verdict (`promote` or `roll_back`), why, and the figures of both sides; `baseline`
    is what the other engines served over the same span (`compare_share`: the canary should
    serve `share` of the good requests), or one engine over as long a time before the change
    (then traffic volume says nothing of the knobs)."""
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
    figures["good_share"] = _share(good_c, good_b, share)
    if compare_share and figures["good_share"]["low"]:
        return {"verdict": "roll_back", "figures": figures,
                "reason": f"serves {figures['good_share']['share']:.0%} of the good requests "
                          f"where its share is {figures['good_share']['even']:.0%}: its "
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


def canary_weight(asked: float | None, replicas: int) -> float:
    """The share of its model's requests a canary is sent: `asked`, else an even share among
    `replicas` (the canary among them), at most MAX_CANARY_WEIGHT; all of them when it is the
    model's one replica (no other could take the rest)."""
    if replicas <= 1:
        return 1.0
    return min(1.0 / replicas, MAX_CANARY_WEIGHT) if asked is None else asked


# ---- the procedure --------------------------------------------------------------------------------
Reconfigure = Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]]
Record = Callable[[dict[str, Any]], Awaitable[None]]
LimitShare = Callable[[str, "float | None"], None]


def _no_limit(backend: str, share: float | None) -> None:
    pass


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
    canary_weight: float = MAX_CANARY_WEIGHT  # the most of its model's requests it is sent


class Apply:
    """One apply, run as a task: its record is what the job shows. `limit_share(name,
    share)` bounds the share of its model's requests the gateway sends `name` (None: lifts
    it)."""

    def __init__(self, plan: ApplyPlan, window: ServedWindow, drain: Callable[[str], Any],
                 undrain: Callable[[str], None], reconfigure: Reconfigure,
                 record: Record, *, limit_share: LimitShare = _no_limit,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.plan = plan
        self.window = window
        self.drain, self.undrain = drain, undrain
        self.reconfigure = reconfigure
        self.limit_share = limit_share
        self.persist = record
        self.clock = clock
        self.record: dict[str, Any] = {
            "state": "applying", "backend": plan.canary, "config": plan.config,
            "previous": plan.previous, "canary_window_s": plan.canary_window_s,
            "min_requests": plan.min_requests, "canary_weight": plan.canary_weight,
            "switched": [], "steps": []}
        self.switched: list[str] = []  # replicas on the new knobs, in order

    async def step(self, state: str, step: str, **detail: Any) -> None:
        self.record["state"] = state
        self.record["steps"].append({"at": time.time(), "step": step, **detail})
        log.info("tune job %s apply: %s (%s)", self.plan.job_id, step, state)
        await self.persist(self.record)

    async def _switch(self, backend: str, knobs: dict[str, Any],
                      share: float | None = None) -> None:
        """Drain `backend` (its streams finish, nothing new goes to it), reconfigure it, put it
        back (with at most `share` of the requests)."""
        forward = knobs is self.plan.config
        if forward and backend not in self.switched:
            # before the call: one cut short may still have landed, and going back is safe
            # to repeat
            self.switched.append(backend)
            self.record["switched"] = list(self.switched)
        await self.drain(backend)
        try:
            await self.reconfigure(backend, knobs)
            self.limit_share(backend, share)
        finally:
            self.undrain(backend)
        if not forward and backend in self.switched:
            self.switched.remove(backend)
            self.record["switched"] = list(self.switched)

    async def run(self) -> dict[str, Any]:
        plan = self.plan
        try:
            await self._canary()
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
        finally:
            self.limit_share(plan.canary, None)
        return self.record

    async def _canary(self) -> None:
        plan = self.plan
        before = self.clock()
        await self.step("applying", f"draining and reconfiguring {plan.canary}",
                        knobs=plan.config)
        await self._switch(plan.canary, plan.config, plan.canary_weight)
        applied = self.clock()
        await self.step("canary", f"{plan.canary} runs the new knobs with at most "
                        f"{plan.canary_weight:.0%} of the requests; watching live traffic for "
                        f"{plan.canary_window_s:g} s")
        verdict = await self._watch(before, applied)
        await self.step("canary", f"verdict: {verdict['verdict']}: {verdict['reason']}",
                        figures=verdict["figures"], verdict=verdict["verdict"],
                        after_s=round(self.clock() - applied, 3))
        if verdict["verdict"] != "promote":
            await self._roll_back()
            return
        self.limit_share(plan.canary, None)
        for backend in plan.others:
            await self.step("promoting", f"draining and reconfiguring {backend}")
            await self._switch(backend, plan.config)
        await self.step("promoted", "every replica runs the new knobs")

    async def _final(self, state: str, step: str) -> None:
        with contextlib.suppress(Exception):  # the database may be what broke
            await self.step(state, step)

    def _sides(self, before: float, applied: float,
               now: float) -> tuple[list[Row], list[Row], list[Row], list[Row]]:
        """The canary's requests and attempts since the change, and the baseline's: the
        others' over the same span, or (one engine) its own in as long a time before it; as
        the window keeps them (read back as objects in `_judge`, off the event loop)."""
        plan, window = self.plan, self.window
        mine = {plan.canary}
        if plan.others:
            start, end, theirs = applied, now, set(plan.others)
        else:
            start, end, theirs = before - max(now - applied, plan.canary_window_s), before, mine
        return (window.between(applied, now, mine), window.between(start, end, theirs),
                window.attempts_between(applied, now, mine),
                window.attempts_between(start, end, theirs))

    async def _watch(self, before: float, applied: float) -> dict[str, Any]:
        """The sequential tests after every failed attempt and every TICK_S, until one rolls
        the canary back or the window's judgement is due."""
        plan = self.plan
        deadline = applied + max(plan.canary_window_s, plan.max_wait_s)
        share = min(plan.canary_weight, 1.0 / (len(plan.others) + 1))
        tick = min(TICK_S, max(0.01, plan.canary_window_s / 20))
        # the old knobs' last REFERENCE requests; a gateway that had not served as many: the
        # others' first ones after the change
        old = self.window.between(before - REFERENCE_AGE_S, before,
                                  {plan.canary, *plan.others})[-REFERENCE:]
        while True:
            self.window.failure.clear()
            now = self.clock()
            canary, baseline, tried, others_tried = self._sides(before, applied, now)
            reference = old if len(old) == REFERENCE or not plan.others else baseline[:REFERENCE]
            enough = len(canary) >= plan.min_requests and len(baseline) >= plan.min_requests
            due = (now - applied >= plan.canary_window_s and enough) or now >= deadline
            verdict = await asyncio.to_thread(self._judge, canary, baseline, reference, tried,
                                              others_tried, due, share)
            if verdict is not None:
                return verdict
            await wait_event(self.window.failure, tick)

    def _judge(self, canary_rows: list[Row], baseline_rows: list[Row], reference_rows: list[Row],
               tried_rows: list[Row], others_tried_rows: list[Row], due: bool,
               share: float) -> dict[str, Any] | None:
        """One look, in a thread: the sequential tests, then the window's judgement when it is
        `due`; None: neither decided yet."""
        canary, baseline, reference = ([served_from_row(row) for row in rows] for rows in (
            canary_rows, baseline_rows, reference_rows))
        tried, others_tried = ([Attempt(*row) for row in rows]
                               for rows in (tried_rows, others_tried_rows))
        early = sequential(canary, reference, tried, others_tried)
        if early["verdict"] == "roll_back":
            return {"verdict": "roll_back", "reason": early["reason"], "figures": {
                "canary": side(canary), "baseline": side(baseline),
                "sequential": early["tests"], "decided_by": early["measure"]}}
        if not due:
            return None
        verdict = judge(canary, baseline, self.plan.min_requests, 0, share,
                        bool(self.plan.others))
        verdict["figures"]["sequential"] = early["tests"]
        return verdict

    async def _roll_back(self) -> None:
        """Every replica that got the new knobs goes back to its own, the last one first."""
        for backend in reversed(list(self.switched)):
            await self.step("rolling_back", f"putting {backend} back on its knobs",
                            knobs=self.plan.previous.get(backend))
            await self._switch(backend, self.plan.previous.get(backend, {}))
        await self.step("rolled_back", "every replica runs its previous knobs")

"""TTFT, ITL, TPOT, e2e, goodput and SLO attainment: the one definition the engine's `/stats`,
the gateway's metrics and `fairgate bench` all compute through.

A request's timing, as one surface saw it, is its `start` (arrival at that surface), the times
its tokens were seen (one per token in the engine; one per token-bearing chunk or network read
at the gateway and the benchmark client), its number of output tokens and its `end`.

- TTFT = first token time - start.
- ITL = every gap between two consecutive token times.
- TPOT = (last token time - first token time) / (num_output_tokens - 1), for requests with at
  least two output tokens. When the last token ends the stream this equals vLLM's bench
  definition (e2e - TTFT) / (n - 1); measuring to the last token instead keeps the time spent
  after it (the finish event, usage, `[DONE]`) out of the per-token figure.
- e2e = end - start.

The three latency SLOs, named as vLLM's benchmark names them:
- `SLO.ttft_s` bounds each request's TTFT and `SLO.tpot_s` each request's TPOT. A request meets
  its SLO (counts toward goodput) when it succeeded and is within both; an unset target does not
  constrain. A request without a token misses a TTFT target; one with a single token has no TPOT
  to miss.
- `SLO.itl_s` bounds every gap between two tokens, pooled over all requests of the period (vLLM's
  ITL, `vllm:inter_token_latency_seconds`): "p99 ITL <= X" means at least 99% of all gaps are
  <= X. It is not a per-request criterion: one long prefill chunk that stalls every decode for
  a step shows here and hardly in TPOT. `RequestTiming.gaps_within` counts one request's part.

SLO attainment: "p99 TTFT <= X" means at least 99% (`SLO.target`) of the period's requests
have TTFT <= X, and a rejected or failed request is a miss; the same for TPOT, and for ITL over
gaps. The error budget is 1 - target; the burn rate is the observed miss fraction divided by the
budget (1.0: spending it exactly as fast as allowed).

Before these names, a stored or configured "ITL" SLO (`slo_itl_p99_s`, `--slo-itl-p99`) bounded
each request's TPOT; such values are TPOT targets now (tenants migration 0005).

Percentiles are protocol.stats' (the nearest rank: "p99 <= X" exactly when 99% are <= X).
Standard library only: this is the bottom layer.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from protocol.stats import percentile_of_sorted

QUANTILES = (50, 90, 95, 99)


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets of one tenant or run; None leaves that measure unconstrained."""

    ttft_s: float | None = None
    tpot_s: float | None = None  # each request's mean inter-token gap
    itl_s: float | None = None  # every gap between two tokens, pooled over the period
    target: float = 0.99  # the fraction of requests (of gaps, for ITL) that must meet it ("p99")

    def __post_init__(self) -> None:
        error_budget(self.target)

    @property
    def unset(self) -> bool:
        return self.ttft_s is None and self.tpot_s is None and self.itl_s is None


def error_budget(target: float) -> float:
    """The fraction of requests allowed to miss a target that `target` of them must meet."""
    if not 0.0 < target < 1.0:
        raise ValueError(f"SLO target ({target}) must be between 0 and 1 (exclusive): the error "
                         "budget is 1 - target")
    return 1.0 - target


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """When one request started, saw its tokens and ended, on one clock (seconds)."""

    start: float
    token_times: Sequence[float]  # ascending; held, not copied (the gateway passes its list)
    num_output_tokens: int
    end: float
    ok: bool = True  # succeeded (finished normally, HTTP 200)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.start if self.token_times else None

    @property
    def itls(self) -> Iterator[float]:
        """Each gap, lazily: the gateway observes them without building a list (the
        subtraction mapped in C: a generator expression took 1.6 times as long)."""
        times = self.token_times
        return map(operator.sub, itertools.islice(times, 1, None), times)

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2 or not self.token_times:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.num_output_tokens - 1)

    @property
    def e2e(self) -> float:
        return self.end - self.start

    def meets_ttft(self, slo: SLO) -> bool:
        ttft = self.ttft
        return self.ok and (slo.ttft_s is None or (ttft is not None and ttft <= slo.ttft_s))

    def meets_tpot(self, slo: SLO) -> bool:
        tpot = self.tpot
        return self.ok and (slo.tpot_s is None or tpot is None or tpot <= slo.tpot_s)

    def meets(self, slo: SLO) -> bool:
        """Counts toward goodput: succeeded and within its TTFT and TPOT targets (ITL is pooled
        over the period's gaps, not a per-request criterion)."""
        return self.meets_ttft(slo) and self.meets_tpot(slo)

    def gaps_within(self, slo: SLO) -> tuple[int, int]:
        """(gaps <= `slo.itl_s`, gaps) of this request, for pooled ITL attainment: a request that
        failed counts every gap it had as a miss, plus one for the answer it never finished."""
        gaps = max(0, len(self.token_times) - 1)
        if not self.ok:
            return 0, gaps + 1
        if slo.itl_s is None:
            return gaps, gaps
        limit = slo.itl_s
        return sum(gap <= limit for gap in self.itls), gaps


# Kept records as plain tuples of numbers, strings and tuples of them: CPython's collector
# stops tracking such a tuple after a collection or two, so a window of many thousands of
# requests (a canary's, a shadow target's pairs) is not walked by each full collection of a
# server's heap, as dataclass instances holding a list of token times were (bench/gc_pause.py:
# hundreds of ms a full collection, a stall of every request in flight; issue 28). Flat on
# purpose: a tuple is let go only after what it holds was, one collection each level.
def slo_fields(slo: SLO) -> tuple[float | None, float | None, float | None, float]:
    """`SLO(*fields)` gives it back."""
    return slo.ttft_s, slo.tpot_s, slo.itl_s, slo.target


def timing_fields(timing: RequestTiming) -> tuple[float, tuple[float, ...], int, float, bool]:
    """`RequestTiming(*fields)` gives it back (its token times as a tuple)."""
    return (timing.start, tuple(timing.token_times), timing.num_output_tokens, timing.end,
            timing.ok)


SLO_FIELDS = 4  # len(slo_fields(...))
TIMING_FIELDS = 5  # len(timing_fields(...))


def summarize(values: Iterable[float]) -> dict[str, float | int | None]:
    """count, mean, max and p50/p90/p95/p99 (protocol.stats' percentile rule); None instead of
    NaN so the result is valid JSON."""
    ordered = sorted(values)
    if not ordered:
        return {"count": 0, "mean": None, "max": None, **{f"p{q}": None for q in QUANTILES}}
    summary: dict[str, float | int | None] = {"count": len(ordered),
                                              "mean": sum(ordered) / len(ordered),
                                              "max": ordered[-1]}
    summary.update({f"p{q}": percentile_of_sorted(ordered, q) for q in QUANTILES})
    return summary


@dataclass(frozen=True, slots=True)
class Goodput:
    requests: int  # requests that met the SLO
    requests_per_s: float
    output_tokens_per_s: float  # their output tokens
    fraction: float | None  # of the requests given; None when none were


def goodput(timings: Sequence[RequestTiming], elapsed_s: float, slo: SLO) -> Goodput:
    """The requests among `timings` that met `slo`, per second of `elapsed_s`."""
    good = [t for t in timings if t.meets(slo)]
    per_s = 1.0 / elapsed_s if elapsed_s > 0 else 0.0
    return Goodput(requests=len(good), requests_per_s=len(good) * per_s,
                   output_tokens_per_s=sum(t.num_output_tokens for t in good) * per_s,
                   fraction=len(good) / len(timings) if timings else None)


def attainment(met: int, total: int, target: float = 0.99) -> dict[str, float | None]:
    """`met` of `total` requests met a target that `target` of them should meet. Rejected and
    failed requests belong in `total` as misses. fraction and burn_rate are None for no
    requests; a burn rate above 1 spends the error budget faster than allowed."""
    if not 0 <= met <= total:
        raise ValueError(f"met ({met}) must be between 0 and total ({total})")
    budget = error_budget(target)
    fraction = met / total if total else None
    burn_rate = None if fraction is None else (1.0 - fraction) / budget
    return {"fraction": fraction, "target": target, "budget": budget, "burn_rate": burn_rate}


# ---- SLO periods: attainment, error budget, burn rate (the dashboard's and the alerts') ------
# The SRE workbook's multiwindow, multi-burn-rate thresholds: a burn rate at or above these over
# the window (and its short companion) spends a 30-day budget in 2 days (14.4x over 1 h) or 5
# days (6x over 6 h); deploy/prometheus/rules use the same.
PAGE_BURN_1H = 14.4
PAGE_BURN_6H = 6.0


def budget_left(met: int, total: int, target: float = 0.99) -> float | None:
    """The share of the period's error budget not yet spent: 1 - misses / (budget x total).
    1.0 with no miss, 0.0 when exactly spent, negative when overspent; None for no requests.
    (The budget is a share of the requests the period saw, so it grows with traffic.)"""
    if not 0 <= met <= total:
        raise ValueError(f"met ({met}) must be between 0 and total ({total})")
    if total == 0:
        return None
    return 1.0 - (total - met) / (error_budget(target) * total)


def slo_state(budget_left_30d: float | None, burn_1h: float | None,
              burn_6h: float | None) -> str:
    """`breaching`: the period's budget is spent, or it burns at a paging rate (14.4x over 1 h
    or 6x over 6 h); `at_risk`: burning faster than the budget allows (over 1x) over either
    window, or less than a quarter of the budget left; `ok` otherwise; `no_data` without
    requests checked against a target."""
    if budget_left_30d is None and burn_1h is None and burn_6h is None:
        return "no_data"
    if (budget_left_30d is not None and budget_left_30d <= 0) or \
            (burn_1h or 0.0) >= PAGE_BURN_1H or (burn_6h or 0.0) >= PAGE_BURN_6H:
        return "breaching"
    if (burn_1h or 0.0) > 1.0 or (burn_6h or 0.0) > 1.0 or \
            (budget_left_30d is not None and budget_left_30d < 0.25):
        return "at_risk"
    return "ok"

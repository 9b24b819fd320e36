"""Prometheus metrics of one gateway app, in the app's own CollectorRegistry (so two apps in one
process, as in tests, never share counters). Children per tenant are cached: labels() costs a
dict lookup and a lock, which adds up at one ITL observation per token.

The series are prometheus_client's own classes with one change (`LoopCounter`, `LoopGauge`,
`LoopHistogram`): a child keeps its numbers as plain floats, without the lock prometheus_client
takes on every change. A gateway changes its series on its event loop alone and serves /metrics
from the same loop, so the lock bought nothing, and a streamed request takes 13 counter
increments, 4 histogram observations, one more per gap between its tokens, and a few gauge sets
(bench/RESULTS.md, issue 28). The exposition is prometheus_client's, unchanged
(tests/gateway/test_loop_metrics.py holds the two to each other).
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import Exemplar

from protocol.measures import SLO, RequestTiming

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.metrics import EngineMetrics

log = logging.getLogger("fairgate.gateway")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)


class _Unlocked:
    """A series' number without a lock, in the interface prometheus_client's values have (what
    a child's samples are read from at a scrape)."""

    __slots__ = ("exemplar", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.exemplar: Exemplar | None = None

    def inc(self, amount: float) -> None:
        self.value += amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self.value = value

    def get(self) -> float:
        return self.value

    def set_exemplar(self, exemplar: Exemplar) -> None:
        self.exemplar = exemplar

    def get_exemplar(self) -> Exemplar | None:
        return self.exemplar


class LoopCounter(Counter):
    """A Counter whose children change on one event loop only (see the module doc)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _Unlocked()

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        if amount < 0 or exemplar:  # the checks and the exemplar, as prometheus_client has them
            super().inc(amount, exemplar)
            return
        self._value.value += amount


class LoopGauge(Gauge):
    """A Gauge whose children change on one event loop only (see the module doc)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._value = _Unlocked()

    def set(self, value: float) -> None:
        self._value.value = float(value)


class LoopHistogram(Histogram):
    """A Histogram whose children change on one event loop only (see the module doc)."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._sum = _Unlocked()
        self._buckets = [_Unlocked() for _ in self._upper_bounds]

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        if exemplar or amount != amount:  # NaN falls in no bucket: prometheus_client's own way
            super().observe(amount, exemplar)
            return
        self._sum.value += amount
        self._buckets[bisect_left(self._upper_bounds, amount)].value += 1  # first bound >= it

    def observe_all(self, amounts: Iterable[float]) -> None:
        """`observe` of each amount, in one call: a stream's gaps (one a token) were a call
        each."""
        total, bounds, buckets = self._sum, self._upper_bounds, self._buckets
        for amount in amounts:
            if amount != amount:
                super().observe(amount)
                continue
            total.value += amount
            buckets[bisect_left(bounds, amount)].value += 1


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = LoopCounter("fairgate_gateway_requests_total",
                                    "Requests answered, by tenant and HTTP status",
                                    ["tenant", "status"], registry=r)
        self.rejections = LoopCounter("fairgate_gateway_rejections_total",
                                      "429s and 503s by reason (requests_per_min, tokens_per_min, "
                                      "queue_requests, queue_tokens, queue_timeout, backend)",
                                      ["tenant", "reason"], registry=r)
        self.queue_depth = LoopGauge("fairgate_gateway_queue_depth",
                                     "Requests waiting in the gateway", ["tenant", "priority"],
                                     registry=r)
        self.queue_time = LoopHistogram("fairgate_gateway_queue_time_seconds",
                                        "Time from admission to dispatch", ["tenant"],
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = LoopHistogram("fairgate_gateway_ttft_seconds", "Time to first token (arrival "
                                  "to first token sent)", ["tenant"], buckets=LATENCY_BUCKETS,
                                  registry=r)
        self.tpot = LoopHistogram("fairgate_gateway_tpot_seconds", "Time per output token of "
                                  "each stream: (last token - first token) / (tokens - 1)",
                                  ["tenant"], buckets=ITL_BUCKETS, registry=r)
        self.itl = LoopHistogram("fairgate_gateway_itl_seconds",
                                 "Every gap between streamed tokens", ["tenant"],
                                 buckets=ITL_BUCKETS, registry=r)
        self.e2e = LoopHistogram("fairgate_gateway_e2e_seconds", "Arrival to last byte",
                                 ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.tokens = LoopCounter("fairgate_gateway_tokens_total", "Tokens by direction (in: "
                                  "prompt, out: completion)", ["tenant", "direction"], registry=r)
        # Requests and gaps are counted apart: a gap rate is some hundred times a request
        # rate, and a series named for requests should count nothing else.
        self.slo_checked = LoopCounter("fairgate_gateway_slo_requests_total",
                                       "Requests checked against the tenant's per-request SLO "
                                       "targets (slo: ttft, tpot)", ["tenant", "slo", "met"],
                                       registry=r)
        self.slo_gaps = LoopCounter("fairgate_gateway_slo_gaps_total",
                                    "Gaps between streamed tokens checked against the tenant's "
                                    "ITL target, pooled over requests (a failed or turned-away "
                                    "request: each gap it had and one more, missed)",
                                    ["tenant", "met"], registry=r)
        self.slo_attainment = LoopGauge("fairgate_gateway_slo_attainment",
                                        "Share of requests (slo: ttft, tpot) or of gaps (slo: "
                                        "itl) that met the tenant's target since start",
                                        ["tenant", "slo"], registry=r)
        self.inflight = LoopGauge("fairgate_gateway_backend_inflight",
                                  "Requests dispatched to a backend and unfinished", ["backend"],
                                  registry=r)
        self.failovers = LoopCounter("fairgate_gateway_failovers_total",
                                     "Requests moved to another replica after theirs failed "
                                     "before any byte of an answer", ["backend"], registry=r)
        self.retries = LoopCounter("fairgate_gateway_retries_total",
                                   "Requests retried on another replica after theirs failed "
                                   "before any byte of an answer, by how (5xx, "
                                   "connect_failure, reset)", ["reason"], registry=r)
        self.retries_refused = LoopCounter("fairgate_gateway_retries_refused_total",
                                           "Failed requests not retried (budget: the retry "
                                           "budget was spent; no_replica: no other replica "
                                           "serves them)", ["reason"], registry=r)
        self.outliers = BackendOutliers()  # ejected replicas (gateway/outlier.py)
        r.register(self.outliers)
        self._children: dict[tuple[str, ...], Any] = {}
        self._gauge_values: dict[tuple[str, ...], float] = {}  # what set_gauge set last
        self._slo_counts: dict[tuple[str, str], list[int]] = {}
        self._read = _ReadAtScrape()
        r.register(self._read)
        self._engine_metrics: EngineMetrics | None = None

    def read_at_scrape(self, name: str, help_text: str, value: Callable[[], float],
                       kind: str = "counter") -> None:
        """A series another object keeps (the ledger's, the authenticator's), read per scrape."""
        self._read.series.append((name, help_text, value, kind))

    def add_engine(self, engine: AsyncEngine) -> None:
        """The embedded engine's fairgate_engine_* series (engine/metrics.py), as its own server
        would export them: in embedded mode no engine server does. One engine: a second one's
        series would have the same names and labels."""
        if self._engine_metrics is not None:
            log.warning("engine metrics are exported for the first embedded engine only")
            return
        from engine.metrics import EngineMetrics  # not in the shadow sender process

        self._engine_metrics = EngineMetrics(engine, registry=self.registry)
        engine.add_observer(self._engine_metrics)

    def child(self, metric: str, *labels: str) -> Any:
        """The labelled child of `metric`, cached: this runs several times per request."""
        key = (metric, *labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = getattr(self, metric).labels(*labels)
        return found

    def set_gauge(self, metric: str, value: float, *labels: str) -> None:
        """The labelled child of gauge `metric` set to `value`, skipped when it holds it already
        (a queue depth stays 0 request after request on a gateway with room)."""
        key = (metric, *labels)
        if self._gauge_values.get(key) != value:
            self._gauge_values[key] = value
            self.child(metric, *labels).set(value)

    def observe_stream(self, tenant: str, timing: RequestTiming, slo: SLO) -> None:
        """One streamed request: its TTFT, TPOT and ITL gaps when it succeeded (as the engine's and the
        benchmark's latencies are), and a check against each target the tenant has set, which a
        failed or turned-away request misses: TTFT and TPOT once per request, ITL per gap."""
        ttft = timing.ttft
        if timing.ok and ttft is not None:
            self.child("ttft", tenant).observe(ttft)
            tpot = timing.tpot
            if tpot is not None:
                self.child("tpot", tenant).observe(tpot)
            self.child("itl", tenant).observe_all(timing.itls)  # a gap per token
        if slo.ttft_s is not None:
            self.observe_slo(tenant, "ttft", timing.meets_ttft(slo))
        if slo.tpot_s is not None:
            self.observe_slo(tenant, "tpot", timing.meets_tpot(slo))
        if slo.itl_s is not None:
            self.observe_gaps(tenant, *timing.gaps_within(slo))

    def observe_slo(self, tenant: str, slo: str, met: bool) -> None:
        """One request checked against its tenant's `slo` target ("ttft" or "tpot")."""
        self.child("slo_checked", tenant, slo, "true" if met else "false").inc()
        self._attain(tenant, slo, int(met), 1)

    def observe_gaps(self, tenant: str, met: int, gaps: int) -> None:
        """One request's gaps checked against its tenant's ITL target: `met` of `gaps`."""
        if met:
            self.child("slo_gaps", tenant, "true").inc(met)
        if gaps - met:
            self.child("slo_gaps", tenant, "false").inc(gaps - met)
        self._attain(tenant, "itl", met, gaps)

    def _attain(self, tenant: str, slo: str, met: int, checked: int) -> None:
        counts = self._slo_counts.setdefault((tenant, slo), [0, 0])
        counts[0] += met
        counts[1] += checked
        if counts[1]:  # attainment's fraction, without its budget and burn rate per request
            self.child("slo_attainment", tenant, slo).set(counts[0] / counts[1])


class BackendOutliers(Collector):
    """fairgate_gateway_backend_ejected{backend} (1 while outlier detection keeps it out of
    dispatch) and fairgate_gateway_backend_ejections_total{backend}, read at each scrape from
    `read` ((backend, ejected, ejections so far) rows): an ejection ends by the clock, with no
    event to set a gauge on."""

    def __init__(self) -> None:
        self.read: Callable[[], Iterable[tuple[str, bool, int]]] = tuple

    def collect(self) -> Iterator[Metric]:
        ejected = GaugeMetricFamily("fairgate_gateway_backend_ejected", "1 while the backend is "
                                    "ejected (its requests kept failing), else 0",
                                    labels=["backend"])
        ejections = CounterMetricFamily("fairgate_gateway_backend_ejections", "Times the "
                                        "backend was ejected", labels=["backend"])
        for backend, out, count in self.read():
            ejected.add_metric([backend], float(out))
            ejections.add_metric([backend], count)
        yield ejected
        yield ejections


class _ReadAtScrape(Collector):
    def __init__(self) -> None:
        self.series: list[tuple[str, str, Callable[[], float], str]] = []

    def collect(self) -> Iterator[Metric]:
        for name, help_text, value, kind in self.series:
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(name, help_text, value=value())

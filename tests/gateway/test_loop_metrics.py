"""The gateway's series keep their numbers without a lock (gateway/metrics.py's LoopCounter,
LoopGauge, LoopHistogram): what a scrape reads must be what prometheus_client's own classes give
for the same changes, in both exposition formats."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from gateway.metrics import (
    ITL_BUCKETS,
    LATENCY_BUCKETS,
    GatewayMetrics,
    LoopCounter,
    LoopGauge,
    LoopHistogram,
)

TENANTS = st.sampled_from(["acme", "beta", 'q"uote'])
AMOUNTS = st.one_of(st.integers(min_value=0, max_value=10**6),
                    st.floats(min_value=0.0, max_value=1e9, allow_nan=False))
# the buckets' bounds (an observation exactly on one falls in it), around them, beyond the last,
# below zero, and the values a float can take that are not numbers
OBSERVED = st.one_of(st.sampled_from(LATENCY_BUCKETS + ITL_BUCKETS),
                     st.floats(allow_nan=True, allow_infinity=True),
                     st.sampled_from([0.0, -0.0, -1.0, 1e-9, 60.0000001, math.inf, -math.inf]))
OPERATIONS = st.lists(st.one_of(
    st.tuples(st.just("inc"), TENANTS, AMOUNTS),
    st.tuples(st.just("inc"), TENANTS, st.floats(max_value=-1e-9, allow_nan=False)),
    st.tuples(st.just("set"), TENANTS, st.floats(allow_nan=True, allow_infinity=True)),
    st.tuples(st.just("set"), TENANTS, st.integers(min_value=-10**6, max_value=10**6)),
    st.tuples(st.just("observe"), TENANTS, OBSERVED),
    st.tuples(st.just("gaps"), TENANTS, st.lists(OBSERVED, max_size=20)),
), max_size=60)


def _series(counter: type[Counter], gauge: type[Gauge],
            histogram: type[Histogram]) -> tuple[CollectorRegistry, dict[str, Any]]:
    registry = CollectorRegistry()
    return registry, {
        "inc": counter("things_total", "Things", ["tenant"], registry=registry),
        "set": gauge("level", "A level", ["tenant"], registry=registry),
        "observe": histogram("wait_seconds", "Waits", ["tenant"], buckets=LATENCY_BUCKETS,
                             registry=registry),
        "gaps": histogram("gap_seconds", "Gaps", ["tenant"], buckets=ITL_BUCKETS,
                          registry=registry),
    }


def _apply(series: dict[str, Any], operation: tuple[str, str, Any]) -> str | None:
    """One change; the error it raised, by type, if any (it must raise the same in both)."""
    kind, tenant, value = operation
    child = series[kind].labels(tenant)
    try:
        if kind == "gaps" and isinstance(child, LoopHistogram):  # as observe_stream has them
            child.observe_all(iter(value))
        elif kind == "gaps":  # prometheus_client's: one observe a gap
            for gap in value:
                child.observe(gap)
        else:
            getattr(child, kind)(value)
    except ValueError as exc:
        return type(exc).__name__
    return None


def _scraped(registry: CollectorRegistry) -> list[str]:
    """Both formats, without the children's creation times (each child's own clock read)."""
    lines = [*generate_latest(registry).decode().splitlines(),
             *generate_openmetrics(registry).decode().splitlines()]
    return [line for line in lines if "_created" not in line]


@settings(max_examples=300, deadline=None)
@given(OPERATIONS)
def test_a_scrape_reads_what_prometheus_clients_own_classes_give(
        operations: list[tuple[str, str, Any]]) -> None:
    reference, theirs = _series(Counter, Gauge, Histogram)
    registry, ours = _series(LoopCounter, LoopGauge, LoopHistogram)
    for operation in operations:
        assert _apply(ours, operation) == _apply(theirs, operation), operation
    assert _scraped(registry) == _scraped(reference)


def test_an_exemplar_is_kept_as_prometheus_client_keeps_it() -> None:
    reference, theirs = _series(Counter, Gauge, Histogram)
    registry, ours = _series(LoopCounter, LoopGauge, LoopHistogram)
    for series in (theirs, ours):
        series["inc"].labels("acme").inc(2, exemplar={"trace_id": "abc"})
        series["observe"].labels("acme").observe(0.3, exemplar={"trace_id": "def"})
    ours_text, theirs_text = (generate_openmetrics(r).decode() for r in (registry, reference))
    assert "trace_id" in ours_text
    # the exemplars' own timestamps are the only difference: each was stamped when it was set
    assert [line.split(" # ")[0] for line in _scraped(registry)] == \
        [line.split(" # ")[0] for line in _scraped(reference)]
    assert ours_text.count("trace_id") == theirs_text.count("trace_id")


def test_a_counter_refuses_to_go_down_and_keeps_its_count() -> None:
    registry = CollectorRegistry()
    child = LoopCounter("things_total", "Things", ["tenant"], registry=registry).labels("acme")
    child.inc(3)
    with pytest.raises(ValueError, match="non-negative"):
        child.inc(-1)
    assert registry.get_sample_value("things_total", {"tenant": "acme"}) == 3.0


def test_every_gateway_series_is_a_loop_series() -> None:
    """A series added to GatewayMetrics with prometheus_client's own class would take the lock
    on every change again: each of them is one of the three classes tested above."""
    metrics = GatewayMetrics()
    wrapped = [v for v in vars(metrics).values() if isinstance(v, (Counter, Gauge, Histogram))]
    assert len(wrapped) >= 16
    assert all(isinstance(v, (LoopCounter, LoopGauge, LoopHistogram)) for v in wrapped)

"""A stream's ITL gaps go into the gateway's histogram as one addition per bucket: the series
must read as if each gap had been observed on its own."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.metrics import ITL_BUCKETS, observe_all

# the buckets' own bounds (a gap exactly on one falls in it), around them, and beyond the last
VALUES = st.one_of(st.sampled_from(ITL_BUCKETS),
                   st.floats(min_value=0.0, max_value=5.0, allow_nan=False),
                   st.sampled_from([0.0, 1e-9, 1.0000001, 1e6]))


def _histogram() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    return registry, Histogram("gaps_seconds", "gaps", ["tenant"], buckets=ITL_BUCKETS,
                               registry=registry)


def _exposition(registry: CollectorRegistry) -> tuple[list[str], float]:
    """The series as scraped, but the sum (added in another order: rounding differs) and the
    creation time; and the sum."""
    lines = generate_latest(registry).decode().splitlines()
    total = registry.get_sample_value("gaps_seconds_sum", {"tenant": "acme"})
    assert total is not None
    return [line for line in lines if "_created" not in line and "_sum" not in line], total


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(VALUES, max_size=40), max_size=5))
def test_a_batch_reads_as_its_observations_one_by_one(streams: list[list[float]]) -> None:
    one_by_one, expected = _histogram()
    batched, got = _histogram()
    expected_child, got_child = expected.labels("acme"), got.labels("acme")
    for gaps in streams:
        for gap in gaps:
            expected_child.observe(gap)
        observe_all(got_child, ITL_BUCKETS, iter(gaps))  # a generator, as itls is
    (got_lines, got_sum), (want_lines, want_sum) = _exposition(batched), _exposition(one_by_one)
    assert got_lines == want_lines and any("_bucket" in line for line in got_lines)
    assert got_sum == pytest.approx(want_sum, rel=1e-12, abs=1e-12)

"""protocol.stats: the one percentile rule (the nearest rank) and the intervals, checked against
its definition, against numpy, and through the surfaces that compute it (the tuner, the canary,
the shadow, the gateway's admission); the SQL side is tests/tenants/test_sql_percentiles.py."""

from __future__ import annotations

import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from control.canary import Served, side
from control.shadow import Pair, paired_stats
from gateway.admission import OutputEstimator
from protocol.measures import SLO, RequestTiming
from protocol.stats import (
    bootstrap_interval,
    min_samples,
    nearest_rank,
    percentile,
    percentile_interval,
    percentile_of_sorted,
    row_percentiles,
    tail_samples,
)
from tuner.measures import measure

values_lists = st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=60)
qs = st.floats(0, 100) | st.sampled_from([0, 1, 7, 25, 50, 90, 95, 99, 99.9, 100])


def by_definition(values: list[float], q: float) -> float:
    """The smallest value with at least q% of the values at or below it, in exact arithmetic
    (q as written in decimal: 7 is 7/100, not the float nearest 0.07)."""
    share = Fraction(str(q)) / 100
    return min(v for v in values if Fraction(sum(x <= v for x in values)) >= share * len(values))


@given(values_lists, qs)
def test_the_percentile_is_the_smallest_value_with_q_percent_at_or_below(
        values: list[float], q: float) -> None:
    assert percentile(values, q) == by_definition(values, q)
    assert percentile_of_sorted(sorted(values), q) == percentile(values, q)


@given(values_lists, qs)
def test_the_percentile_is_numpys_inverted_cdf(values: list[float], q: float) -> None:
    # numpy works on the float q / 100: where q% of n is an integer its product may land a hair
    # either side of it, and ties there go either way (by_definition says which is meant)
    assume(Fraction(str(q)) * len(values) % 100 != 0)
    assert percentile(values, q) == np.percentile(values, q, method="inverted_cdf")


@given(values_lists, qs, qs)
def test_monotone_in_q_and_within_the_values(values: list[float], a: float, b: float) -> None:
    low, high = sorted((a, b))
    assert min(values) <= percentile(values, low) <= percentile(values, high) <= max(values)
    assert percentile(values, low) in values  # always one of them
    assert percentile(values, 0) == min(values) and percentile(values, 100) == max(values)


@given(st.integers(1, 10_000), st.integers(1, 100))  # q > 0: "at least 0% are" says nothing
def test_p_at_most_x_exactly_when_q_percent_are(n: int, q: int) -> None:
    """With failures as infinite values: the SLO attainment definition, at every budget edge."""
    for misses in {0, n * (100 - q) // 100, n * (100 - q) // 100 + 1, n}:
        if misses > n:
            continue
        values = [0.5] * (n - misses) + [math.inf] * misses
        assert (percentile(values, q) <= 1.0) == (100 * (n - misses) >= q * n), (n, misses)


def test_edge_cases() -> None:
    assert math.isnan(percentile([], 50)) and math.isnan(percentile_of_sorted([], 99))
    assert percentile([3.0], 0) == percentile([3.0], 99) == 3.0
    assert percentile([2.0, 1.0], 50) == 1.0  # the first of two: at least half at or below
    assert percentile([0.0, 10.0], 99) == 10.0
    assert nearest_rank(100, 7) == 7 and nearest_rank(100, 99) == 99 and nearest_rank(1000, 99.9) == 999
    assert nearest_rank(5, 0) == 1 and nearest_rank(5, 100) == 5
    for bad in (-1, 100.5, math.nan):
        with pytest.raises(ValueError, match="between 0 and 100"):
            percentile([1.0], bad)
    with pytest.raises(ValueError, match="at least one value"):
        nearest_rank(0, 50)


def test_tail_samples_and_the_fewest_values_a_percentile_rests_on() -> None:
    assert min_samples(99) == 1000 and min_samples(90) == 100 and min_samples(99.9) == 10_000
    assert min_samples(100 * 0.999) == 10_000  # a fraction's percent, a hair off
    assert tail_samples(1000, 99) == pytest.approx(10)
    with pytest.raises(ValueError, match="below 100"):
        min_samples(100)


@given(st.lists(st.floats(0, 100), min_size=1, max_size=40), st.sampled_from([50, 90, 99]))
def test_row_percentiles_are_each_rows_percentile(values: list[float], q: int) -> None:
    rows = np.asarray([values, values[::-1], sorted(values)])
    assert list(row_percentiles(rows, q)) == [percentile(values, q)] * 3


@given(st.lists(st.floats(0, 10), min_size=1, max_size=300), st.sampled_from([50, 90, 99]))
def test_the_percentile_interval_holds_the_percentile(values: list[float], q: int) -> None:
    point, (low, high) = percentile_interval(values, q)
    assert point == percentile(values, q)
    assert low <= point <= high and low in values and high in values


def test_the_percentile_interval_of_nothing_is_nan() -> None:
    point, (low, high) = percentile_interval([], 99)
    assert math.isnan(point) and math.isnan(low) and math.isnan(high)


def mean_rows(rows: np.ndarray) -> np.ndarray:
    return rows.mean(axis=1)


@given(st.lists(st.floats(0, 10), min_size=1, max_size=200), st.integers(0, 2**32 - 1))
def test_a_bootstrap_interval_is_deterministic_for_a_seed_and_within_the_data(
        values: list[float], seed: int) -> None:
    interval = bootstrap_interval(mean_rows, values, resamples=200, seed=seed)
    assert interval == bootstrap_interval(mean_rows, values, resamples=200, seed=seed)
    low, high = interval
    assert min(values) - 1e-9 <= low <= high <= max(values) + 1e-9


@given(st.integers(50, 500), st.floats(0.1, 10), st.integers(0, 2**32 - 1))
def test_a_bootstrap_interval_holds_the_estimate_of_reasonable_data(
        n: int, spread: float, seed: int) -> None:
    values = np.random.default_rng(seed).normal(5.0, spread, n)
    low, high = bootstrap_interval(mean_rows, values, resamples=200, seed=seed)
    assert low < float(np.mean(values)) < high
    low, high = bootstrap_interval(lambda rows: row_percentiles(rows, 90), values,
                                   resamples=200, seed=seed)
    assert low <= percentile(values, 90) <= high


def test_a_bootstrap_interval_narrows_with_more_data_and_widens_with_confidence() -> None:
    rng = np.random.default_rng(7)
    small, large = rng.normal(1.0, 1.0, 100), rng.normal(1.0, 1.0, 10_000)
    a = bootstrap_interval(mean_rows, small)
    b = bootstrap_interval(mean_rows, large)
    assert a[0] < 1.0 < a[1] and b[0] < 1.0 < b[1]
    assert b[1] - b[0] < (a[1] - a[0]) / 5  # ~1/sqrt(100) as wide
    wide = bootstrap_interval(mean_rows, small, confidence=0.99)
    assert wide[0] <= a[0] and a[1] <= wide[1]


def test_a_paired_bootstrap_cancels_what_the_pairs_share() -> None:
    """shadow = live + 50 ms, live spread wide: the paired difference of p99s is sure of its
    50 ms; drawn apart, it is not."""
    live = np.random.default_rng(3).lognormal(0.0, 1.0, 2000)
    shadow = live + 0.05

    def difference(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return row_percentiles(b, 99) - row_percentiles(a, 99)

    paired = bootstrap_interval(difference, live, shadow, paired=True, resamples=300)
    apart = bootstrap_interval(difference, live, shadow, resamples=300)
    assert paired == pytest.approx((0.05, 0.05))
    assert apart[0] < 0 < 0.05 < apart[1]


def test_a_two_sample_bootstrap_of_proportions() -> None:
    a, b = [True] * 90 + [False] * 10, [True] * 60 + [False] * 40
    low, high = bootstrap_interval(lambda x, y: x.mean(axis=1) - y.mean(axis=1), a, b)
    assert 0 < low < 0.3 < high < 0.5


def test_bootstrap_edges() -> None:
    assert all(math.isnan(v) for v in bootstrap_interval(mean_rows, []))
    with pytest.raises(ValueError, match="as long as each other"):
        bootstrap_interval(lambda a, b: a[:, 0], [1.0], [1.0, 2.0], paired=True)
    with pytest.raises(ValueError, match="confidence"):
        bootstrap_interval(mean_rows, [1.0], confidence=1.0)
    with pytest.raises(ValueError, match="resamples"):
        bootstrap_interval(mean_rows, [1.0], resamples=0)


# ---------------------------------------------------------------- the surfaces, one answer

def timings(ttfts: list[float]) -> list[RequestTiming]:
    """One request per TTFT, with two tokens 20 ms apart."""
    return [RequestTiming(0.0, (t, t + 0.02), 2, t + 0.02) for t in ttfts]


@given(st.lists(st.floats(0.001, 10), min_size=1, max_size=150))
def test_the_canary_the_tuner_and_the_shadow_have_one_p99(ttfts: list[float]) -> None:
    runs = timings(ttfts)
    tuner = measure(Run(runs), len(runs), SLO(ttft_s=1.0))
    canary = side([Served(at=1.0, backend="c", tenant="t", slo=SLO(ttft_s=1.0), timing=t)
                   for t in runs])
    shadow = paired_stats([Pair(tenant="t", slo=SLO(ttft_s=1.0), live=t, shadow=t) for t in runs])
    assert tuner.p99_ttft_s == canary["ttft_p99_s"] == percentile(ttfts_of(runs), 99)
    assert shadow["live"]["ttft"]["p99"] == tuner.p99_ttft_s


def ttfts_of(runs: list[RequestTiming]) -> list[float]:
    return [t.ttft for t in runs if t.ttft is not None]


class Run:
    """A finished trial run, as tuner.measures reads one."""

    def __init__(self, timings: list[RequestTiming]) -> None:
        self.timings, self.elapsed_s, self.stopped, self.wall_s = timings, 1.0, None, 0.0
        self.refused: Counter[str] = Counter()


@given(st.lists(st.integers(0, 4000), min_size=45, max_size=120),  # past every window below
       st.sampled_from([1, 2, 5, 17, 33, 40]), st.sampled_from([50, 90, 99]))
def test_admission_estimates_the_output_length_by_the_same_rule(lengths: list[int], samples: int,
                                                                q: int) -> None:
    """After every request, the percentile of the tenant's last `samples` lengths, as
    protocol.stats computes it (the window slides: the oldest leaves first)."""
    estimator = OutputEstimator(samples=samples, percentile=q)
    for i, n in enumerate(lengths):
        estimator.observe("t", n)
        assert estimator.estimate("t") == percentile(lengths[:i + 1][-samples:], q)


def test_the_share_difference_interval_is_the_bootstrap_of_the_shares() -> None:
    """The binomial draws are the bootstrap of 0/1 samples: the same interval as resampling
    every value, within the draws' own noise, deterministic, NaN for an empty side."""
    import numpy as np

    from protocol.stats import share_difference_interval

    rng = np.random.default_rng(7)
    a, b = list(rng.random(3000) < 0.9), list(rng.random(5000) < 0.8)
    fast = share_difference_interval(a, b, resamples=4000, seed=1)
    full = bootstrap_interval(lambda x, y: x.mean(axis=1) - y.mean(axis=1), a, b,
                              resamples=4000, seed=1)
    assert fast == share_difference_interval(a, b, resamples=4000, seed=1)
    assert fast[0] < 0.1 < fast[1]
    assert abs(fast[0] - full[0]) < 0.005 and abs(fast[1] - full[1]) < 0.005
    assert all(math.isnan(v) for v in share_difference_interval([], b))

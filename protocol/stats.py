"""Percentiles and their intervals: the one rule the engine's `/stats`, the gateway's admission,
the usage ledger, the SLO views, the tuner, the canary, the shadow and the benchmarks compute
through.

The percentile rule is the nearest rank: the q-th percentile of n values is the smallest of them
with at least q% of the n at or below it, the ceil(q/100 x n)-th smallest (the smallest for
q = 0). It is always one of the values, so "p99 <= X" holds exactly when at least 99% of the
values are <= X: protocol.measures' SLO attainment, also with a failed request counted as an
infinite value. Linear interpolation (numpy's default) would not keep that: the p99 of 100
requests with one failure would be infinite, and that of 99 at 1.0 s and one at 2.0 s 1.01 s,
over a 1 s target that 99% of them met. The same rule is numpy's `method="inverted_cdf"` and
PostgreSQL's `percentile_disc`; in SQL without it, ORDER BY the column OFFSET
`nearest_rank(n, q) - 1`.

Two intervals: `percentile_interval`, a percentile's distribution-free interval from the order
statistics (cheap for the hundreds of thousands of gaps an ITL p99 pools, and exact in what it
assumes), and `bootstrap_interval`, any statistic of one or more samples by the percentile
bootstrap, seeded.

Standard library at import: the functions over arrays import numpy when called, so the serving
path, which only ranks, never loads it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from statistics import NormalDist
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

MIN_TAIL_SAMPLES = 10  # a percentile resting on fewer values beyond it is mostly noise
BATCH_VALUES = 1_000_000  # resampled values a bootstrap holds at once (8 MB of float64)


def _check(q: float) -> None:
    if not 0 <= q <= 100:
        raise ValueError(f"percentile ({q}) must be between 0 and 100")


def _ceil(x: float) -> int:
    """ceil for a float product that stands for an exact one: 7 x 100 / 100 may come out a
    hair over 7, and is 7."""
    return math.ceil(x * (1 - 1e-12))


def nearest_rank(n: int, q: float) -> int:
    """The 1-based rank among n values (n >= 1) of their q-th percentile (0 <= q <= 100)."""
    _check(q)
    if n < 1:
        raise ValueError(f"a percentile needs at least one value, got {n}")
    return max(1, _ceil(q * n / 100))


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0 <= q <= 100) of `values`, in any order; NaN for none."""
    return percentile_of_sorted(sorted(values), q)


def percentile_of_sorted(ascending: Sequence[float] | np.ndarray, q: float) -> float:
    """The q-th percentile of values already sorted ascending (not checked; `percentile`
    sorts them); NaN for none."""
    if len(ascending) == 0:
        _check(q)
        return math.nan
    return ascending[nearest_rank(len(ascending), q) - 1]


def row_percentiles(rows: np.ndarray, q: float) -> np.ndarray:
    """The q-th percentile of each row, [k, n] -> [k] (of a 1-D array, a 0-D one): a
    bootstrap's statistic over its resamples."""
    import numpy as np

    k = nearest_rank(rows.shape[-1], q) - 1
    return np.partition(rows, k, axis=-1)[..., k]


def tail_samples(n: int, q: float) -> float:
    """How many of n values lie beyond their q-th percentile: what its estimate rests on."""
    _check(q)
    return n * (100 - q) / 100


def min_samples(q: float) -> int:
    """The fewest values whose q-th percentile (q < 100) rests on MIN_TAIL_SAMPLES beyond it
    (1,000 for a p99)."""
    if not 0 <= q < 100:
        raise ValueError(f"percentile ({q}) must be at least 0 and below 100: nothing lies "
                         "beyond the largest value")
    return _ceil(MIN_TAIL_SAMPLES / ((100 - q) / 100))


def percentile_interval(values: Sequence[float] | np.ndarray, q: float,
                        confidence: float = 0.95) -> tuple[float, tuple[float, float]]:
    """The q-th percentile of `values` and its distribution-free `confidence` interval: the
    order statistics whose ranks bound where the true percentile's rank falls among n
    independent draws (binomial, normal approximation). Deterministic; NaN for no values."""
    import numpy as np

    _check_confidence(confidence)
    data = np.asarray(values, dtype=float)
    n = len(data)
    if n == 0:
        _check(q)
        return math.nan, (math.nan, math.nan)
    k = nearest_rank(n, q)
    share = q / 100
    spread = NormalDist().inv_cdf((1 + confidence) / 2) * math.sqrt(n * share * (1 - share))
    low_rank = max(1, math.floor(n * share - spread))
    high_rank = min(n, math.ceil(n * share + spread) + 1)
    ordered = np.partition(data, sorted({k - 1, low_rank - 1, high_rank - 1}))
    return float(ordered[k - 1]), (float(ordered[low_rank - 1]), float(ordered[high_rank - 1]))


def bootstrap_interval(statistic: Callable[..., np.ndarray],
                       *samples: Sequence[float] | Sequence[bool] | np.ndarray,
                       paired: bool = False, resamples: int = 1000, confidence: float = 0.95,
                       seed: int = 0) -> tuple[float, float]:
    """The percentile bootstrap `confidence` interval of `statistic` over `samples`.

    Each sample is drawn with replacement `resamples` times, each on its own, or (`paired`,
    samples of one length) with the same picks for all, so what a pair shares cancels out.
    `statistic` takes one array [k, len(sample)] per sample, k resamples at once, and returns
    the k values; the interval is the percentiles (1 -/+ confidence) / 2 of those values
    (`percentile`'s rule). The same samples and seed give the same interval. NaN, NaN when a
    sample is empty.
    """
    import numpy as np

    _check_confidence(confidence)
    if resamples < 1:
        raise ValueError(f"resamples ({resamples}) must be at least 1")
    arrays = [np.asarray(s) for s in samples]
    if not arrays or any(len(a) == 0 for a in arrays):
        return math.nan, math.nan
    if paired and len({len(a) for a in arrays}) > 1:
        raise ValueError(f"paired samples must be as long as each other, got "
                         f"{[len(a) for a in arrays]}")
    rng = np.random.default_rng(seed)
    batch = max(1, min(resamples, BATCH_VALUES // sum(len(a) for a in arrays)))
    draws = []
    for start in range(0, resamples, batch):
        count = min(batch, resamples - start)
        if paired:
            picks = rng.integers(0, len(arrays[0]), size=(count, len(arrays[0])))
            rows = [a[picks] for a in arrays]  # [count, n] each
        else:
            rows = [a[rng.integers(0, len(a), size=(count, len(a)))] for a in arrays]
        draws.append(np.asarray(statistic(*rows), dtype=float).reshape(count))
    return _percentile_ends(np.concatenate(draws), confidence)


def share_difference_interval(a: Sequence[bool], b: Sequence[bool], *, resamples: int = 1000,
                              confidence: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """`bootstrap_interval` of a's share of True minus b's, each resampled on its own, drawn
    as binomial counts: a resample's count of True is exactly Binomial(n, share), so this is
    the same bootstrap at a cost that does not grow with the samples (a canary judges windows
    of up to 200,000 requests). NaN, NaN when a sample is empty."""
    import numpy as np

    _check_confidence(confidence)
    if resamples < 1:
        raise ValueError(f"resamples ({resamples}) must be at least 1")
    if not len(a) or not len(b):
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    shares = [rng.binomial(len(x), sum(map(bool, x)) / len(x), resamples) / len(x)
              for x in (a, b)]
    return _percentile_ends(shares[0] - shares[1], confidence)


def _percentile_ends(draws: np.ndarray, confidence: float) -> tuple[float, float]:
    """The percentile interval of bootstrap draws: their (1 -/+ confidence) / 2 percentiles
    (`percentile`'s rule)."""
    import numpy as np

    ordered = np.sort(draws)
    tail = (1 - confidence) / 2 * 100
    return (float(ordered[nearest_rank(len(ordered), tail) - 1]),
            float(ordered[nearest_rank(len(ordered), 100 - tail) - 1]))


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence ({confidence}) must be between 0 and 1 (exclusive)")

"""Exact percentiles, windows and goodput of engine.stats (the percentile rule itself:
tests/protocol/test_stats.py)."""

from __future__ import annotations

import numpy as np

from engine.stats import RequestRecord, StatsRecorder, summarize


def record(i: int, arrival: float, ttft: float, itl: float, n: int,
           reason: str = "length") -> RequestRecord:
    first = arrival + ttft
    times = tuple(first + k * itl for k in range(n))
    return RequestRecord(f"r{i}", "t", "interactive", reason, arrival, times[-1] if times else first,
                         arrival + ttft / 2, first if times else None, times, 10, n)


def test_summary_of_nothing_is_json_safe() -> None:
    assert summarize([]) == {"count": 0, "mean": None, "max": None, "p50": None, "p90": None,
                             "p95": None, "p99": None}


def test_window_latencies_throughput_and_goodput() -> None:
    stats = StatsRecorder(start_time=0.0)
    stats.add(record(0, arrival=0.0, ttft=0.1, itl=0.01, n=11))  # finishes at 0.2: outside
    for i in range(1, 5):  # ttft 0.1 .. 0.4, itl 0.02
        stats.add(record(i, arrival=100.0, ttft=0.1 * i, itl=0.02, n=6))
    stats.add(record(9, arrival=101.0, ttft=0.1, itl=0.02, n=3, reason="abort"))
    stats.reject(105.0, "overloaded")
    out = stats.window(now=110.0, window_s=20.0, slo_ttft=0.25, slo_tpot=0.05, slo_itl=0.05)
    assert out["requests"] == {"finished": 5, "by_reason": {"length": 4, "abort": 1}}
    assert out["ttft"]["count"] == 4 and np.isclose(out["ttft"]["p50"], 0.2)  # the 2nd of 4
    assert out["itl"]["count"] == 4 * 5 and np.isclose(out["itl"]["p99"], 0.02)
    assert np.isclose(out["tpot"]["mean"], 0.02)
    assert np.isclose(out["queue_time"]["max"], 0.2)
    assert np.isclose(out["throughput"]["output_tokens_per_s"], 24 / 20)
    assert out["goodput"]["requests"] == 2 and out["goodput"]["fraction"] == 0.5
    assert (out["goodput"]["slo_ttft"], out["goodput"]["slo_tpot"]) == (0.25, 0.05)
    # ITL over the successes' 20 gaps of 20 ms, pooled
    assert out["itl_attainment"] == {"slo_itl": 0.05, "gaps": 20, "met": 20, "fraction": 1.0}
    assert out["rejections"] == {"total": 1, "by_reason": {"overloaded": 1}}


def test_tpot_bounds_goodput_and_itl_only_the_gaps() -> None:
    stats = StatsRecorder(start_time=0.0)
    for i in range(4):  # TPOT and every gap 20 ms
        stats.add(record(i, arrival=100.0, ttft=0.1, itl=0.02, n=6))
    slow = stats.window(now=110.0, window_s=20.0, slo_tpot=0.01)
    assert slow["goodput"]["requests"] == 0 and slow["itl_attainment"]["fraction"] == 1.0
    stalled = stats.window(now=110.0, window_s=20.0, slo_itl=0.01)
    assert stalled["goodput"]["requests"] == 4  # ITL is no request's criterion
    assert stalled["itl_attainment"] == {"slo_itl": 0.01, "gaps": 20, "met": 0, "fraction": 0.0}
    assert stats.window(now=200.0, window_s=1.0)["itl_attainment"]["fraction"] is None


def test_old_records_are_pruned() -> None:
    stats = StatsRecorder(start_time=0.0, retention_s=10.0)
    stats.add(record(0, 0.0, 0.1, 0.01, 3))
    stats.add(record(1, 100.0, 0.1, 0.01, 3))
    assert len(stats.recent(100.2, 1000.0)[0]) == 1

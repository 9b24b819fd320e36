"""Per-request latency records and exact percentiles over a time window (what `GET /stats`
returns). Histogram buckets blur the tail the tuner optimises, so the records are kept as they
are and sorted when asked."""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

QUANTILES = (50, 90, 95, 99)
SUCCESS_REASONS = ("stop", "length")


@dataclass(frozen=True)
class RequestRecord:
    """One finished request; times are engine-clock seconds."""

    request_id: str
    tenant: str
    priority: str
    finish_reason: str
    arrival_time: float
    finished_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    token_times: tuple[float, ...]
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float:
        return self.finished_time - self.arrival_time

    @property
    def itls(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)


def percentile(sorted_values: list[float], q: float) -> float:
    """Exact percentile with linear interpolation between order statistics (numpy's default)."""
    if not sorted_values:
        return math.nan
    rank = (len(sorted_values) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low)


def summarize(values: list[float]) -> dict[str, float | int | None]:
    """count, mean, max and p50/p90/p95/p99; None instead of NaN so the result is valid JSON."""
    if not values:
        return {"count": 0, "mean": None, "max": None, **{f"p{q}": None for q in QUANTILES}}
    ordered = sorted(values)
    summary: dict[str, float | int | None] = {"count": len(ordered),
                                              "mean": sum(ordered) / len(ordered),
                                              "max": ordered[-1]}
    summary.update({f"p{q}": percentile(ordered, q) for q in QUANTILES})
    return summary


class StatsRecorder:
    """Finished-request records and rejections, kept for `retention_s`; thread-safe (the engine
    thread adds, HTTP handlers read)."""

    def __init__(self, start_time: float, retention_s: float = 3600.0,
                 max_records: int = 200_000) -> None:
        self.start_time = start_time
        self.retention_s = retention_s
        self._records: deque[RequestRecord] = deque(maxlen=max_records)
        self._rejections: deque[tuple[float, str]] = deque(maxlen=max_records)
        self._lock = threading.Lock()

    def add(self, record: RequestRecord) -> None:
        with self._lock:
            self._records.append(record)
            self._prune(record.finished_time)

    def reject(self, now: float, reason: str) -> None:
        with self._lock:
            self._rejections.append((now, reason))

    def _prune(self, now: float) -> None:
        horizon = now - self.retention_s
        while self._records and self._records[0].finished_time < horizon:
            self._records.popleft()
        while self._rejections and self._rejections[0][0] < horizon:
            self._rejections.popleft()

    def recent(self, now: float, window_s: float) -> tuple[list[RequestRecord], list[str]]:
        since = now - window_s
        with self._lock:
            records = [r for r in self._records if r.finished_time >= since]
            rejections = [reason for t, reason in self._rejections if t >= since]
        return records, rejections

    def window(self, now: float, window_s: float, slo_ttft: float | None = None,
               slo_itl: float | None = None) -> dict[str, Any]:
        """Latency percentiles, throughput and goodput over requests finished in the window."""
        records, rejections = self.recent(now, window_s)
        done = [r for r in records if r.finish_reason in SUCCESS_REASONS]
        elapsed = max(min(window_s, now - self.start_time), 1e-9)
        reasons: dict[str, int] = {}
        for r in records:
            reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
        rejected: dict[str, int] = {}
        for reason in rejections:
            rejected[reason] = rejected.get(reason, 0) + 1
        return {
            "window_s": window_s,
            "elapsed_s": elapsed,
            "requests": {"finished": len(records), "by_reason": reasons},
            **latency_summaries(done),
            "throughput": throughput(done, elapsed),
            "goodput": goodput(done, elapsed, slo_ttft, slo_itl),
            "preemptions": sum(r.num_preemptions for r in records),
            "rejections": {"total": len(rejections), "by_reason": rejected},
        }


def latency_summaries(records: list[RequestRecord]) -> dict[str, dict[str, float | int | None]]:
    return {
        "ttft": summarize([t for r in records if (t := r.ttft) is not None]),
        "itl": summarize([x for r in records for x in r.itls]),
        "tpot": summarize([t for r in records if (t := r.tpot) is not None]),
        "e2e": summarize([r.e2e for r in records]),
        "queue_time": summarize([t for r in records if (t := r.queue_time) is not None]),
    }


def throughput(records: list[RequestRecord], elapsed: float) -> dict[str, float]:
    return {
        "requests_per_s": len(records) / elapsed,
        "output_tokens_per_s": sum(r.num_output_tokens for r in records) / elapsed,
        "prompt_tokens_per_s": sum(r.num_prompt_tokens for r in records) / elapsed,
    }


def meets_slo(record: RequestRecord, slo_ttft: float | None, slo_itl: float | None) -> bool:
    """Good: first token within slo_ttft and mean inter-token time (TPOT) within slo_itl."""
    ttft, tpot = record.ttft, record.tpot
    if slo_ttft is not None and (ttft is None or ttft > slo_ttft):
        return False
    return slo_itl is None or tpot is None or tpot <= slo_itl


def goodput(records: list[RequestRecord], elapsed: float, slo_ttft: float | None,
            slo_itl: float | None) -> dict[str, Any]:
    good = [r for r in records if meets_slo(r, slo_ttft, slo_itl)]
    return {
        "slo_ttft": slo_ttft,
        "slo_itl": slo_itl,
        "requests": len(good),
        "requests_per_s": len(good) / elapsed,
        "output_tokens_per_s": sum(r.num_output_tokens for r in good) / elapsed,
        "fraction": len(good) / len(records) if records else None,
    }

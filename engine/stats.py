"""Per-request latency records and exact percentiles over a time window (what `GET /stats`
returns). Histogram buckets blur the tail the tuner optimises, so the records are kept as they
are and sorted when asked. The measures themselves (TTFT, ITL, TPOT, goodput) are defined in
`protocol.measures`, the percentile rule in `protocol.stats`."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

from protocol import measures
from protocol.measures import summarize

__all__ = ["RequestRecord", "StatsRecorder", "summarize"]

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

    @cached_property
    def timing(self) -> measures.RequestTiming:
        return measures.RequestTiming(self.arrival_time, self.token_times, self.num_output_tokens,
                                      self.finished_time, self.finish_reason in SUCCESS_REASONS)

    @property
    def ttft(self) -> float | None:
        return self.timing.ttft

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e(self) -> float:
        return self.timing.e2e

    @property
    def itls(self) -> Iterator[float]:
        return self.timing.itls

    @property
    def tpot(self) -> float | None:
        return self.timing.tpot


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
               slo_tpot: float | None = None, slo_itl: float | None = None) -> dict[str, Any]:
        """Latency percentiles, throughput, goodput (requests within `slo_ttft` and `slo_tpot`)
        and ITL attainment (gaps within `slo_itl`, pooled) over the successful requests
        finished in the window."""
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
            "goodput": goodput(done, elapsed, slo_ttft, slo_tpot),
            "itl_attainment": itl_attainment(done, slo_itl),
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


def goodput(records: list[RequestRecord], elapsed: float, slo_ttft: float | None,
            slo_tpot: float | None) -> dict[str, Any]:
    slo = measures.SLO(ttft_s=slo_ttft, tpot_s=slo_tpot)
    good = measures.goodput([r.timing for r in records], elapsed, slo)
    return {"slo_ttft": slo_ttft, "slo_tpot": slo_tpot, **asdict(good)}


def itl_attainment(records: list[RequestRecord], slo_itl: float | None) -> dict[str, Any]:
    """The gaps between tokens of `records`, pooled, and how many were within `slo_itl`
    (every one when it is None): "p99 ITL <= slo_itl" holds when fraction >= 0.99."""
    slo = measures.SLO(itl_s=slo_itl)
    met = gaps = 0
    for r in records:
        m, n = r.timing.gaps_within(slo)
        met, gaps = met + m, gaps + n
    return {"slo_itl": slo_itl, "gaps": gaps, "met": met,
            "fraction": measures.attainment(met, gaps)["fraction"]}

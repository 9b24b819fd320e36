"""Shadow traffic's Prometheus series, on the gateway's registry (the names keep the gateway's
prefix: one scrape, one namespace). Copies, never part of a tenant's figures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from gateway.metrics import ITL_BUCKETS, LATENCY_BUCKETS


class ShadowMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.sent = Counter("fairgate_gateway_shadow_sent_total",
                            "Copies of live requests sent to a shadow target", ["shadow"],
                            registry=registry)
        self.dropped = Counter("fairgate_gateway_shadow_dropped_total",
                               "Copies not sent (queue_full: the target is behind)",
                               ["shadow", "reason"], registry=registry)
        self.failed = Counter("fairgate_gateway_shadow_failed_total",
                              "Copies the shadow target failed or did not finish", ["shadow"],
                              registry=registry)
        # observed in the shadow sender process, added here in batches
        self.latency = ShadowHistograms()
        registry.register(self.latency)


class ShadowHistograms(Collector):
    """fairgate_gateway_shadow_ttft_seconds and _itl_seconds: histograms whose observations are
    made in the shadow sender process (control/shadow_worker.py) and arrive here as bucket
    counts, one addition per batch instead of one observation per token on the live loop."""

    SERIES = (("fairgate_gateway_shadow_ttft_seconds",
               "A copy's time to first token, from its send", LATENCY_BUCKETS),
              ("fairgate_gateway_shadow_itl_seconds", "Gaps between a copy's tokens",
               ITL_BUCKETS))

    def __init__(self) -> None:
        # per series, per shadow name: [bucket counts (the last is +Inf), sum]
        self.data: tuple[dict[str, list[Any]], ...] = ({}, {})

    def add(self, series: int, shadow: str, counts: list[int], total: float) -> None:
        """Counts per bucket (not cumulative) and their sum, as the worker sends them."""
        entry = self.data[series].setdefault(shadow, [[0] * len(counts), 0.0])
        entry[0] = [a + b for a, b in zip(entry[0], counts, strict=True)]
        entry[1] += total

    def collect(self) -> Iterator[Metric]:
        for (name, help_text, bounds), data in zip(self.SERIES, self.data, strict=True):
            family = HistogramMetricFamily(name, help_text, labels=["shadow"])
            for shadow, (counts, total) in sorted(data.items()):
                cumulative, buckets = 0, []
                for bound, count in zip((*map(floatToGoString, bounds), "+Inf"), counts,
                                         strict=True):
                    cumulative += count
                    buckets.append((bound, cumulative))
                family.add_metric([shadow], buckets, total)
            yield family

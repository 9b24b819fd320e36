"""Prometheus metrics of one engine, in a per-app registry (tests build many apps).

Gauges and cumulative counters are read from the engine's load snapshot at scrape time;
latency histograms and token counters are fed per step and per finished request on the engine
thread. `compat="vllm"` also exports the same signals under vLLM's names, so dashboards built
for vLLM work unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.llm_engine import StepOutput
from engine.stats import RequestRecord

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine

COMPAT_CHOICES = ("vllm",)
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
TOKENS_PER_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# snapshot key -> (fairgate name, vLLM name or None, help); gauges
GAUGES = {
    "running": ("fairgate_engine_requests_running", "vllm:num_requests_running",
                "Requests in the running batch"),
    "waiting": ("fairgate_engine_requests_waiting", "vllm:num_requests_waiting",
                "Requests waiting to be scheduled"),
    "swapped": ("fairgate_engine_requests_swapped", "vllm:num_requests_swapped",
                "Requests preempted to host memory"),
    "kv_usage": ("fairgate_engine_kv_cache_usage_ratio", "vllm:kv_cache_usage_perc",
                 "Fraction of KV blocks held by requests (1 = full)"),
    "free_blocks": ("fairgate_engine_kv_cache_free_blocks", None, "Free KV blocks"),
    "num_blocks": ("fairgate_engine_kv_cache_blocks", None, "KV blocks in the pool"),
}
# snapshot key -> (fairgate name, vLLM name or None, help); counters (names without _total)
COUNTERS = {
    "num_preemptions": ("fairgate_engine_preemptions", "vllm:num_preemptions",
                        "Requests preempted"),
    "prefix_cache_queries": ("fairgate_engine_prefix_cache_queries", "vllm:prefix_cache_queries",
                             "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("fairgate_engine_prefix_cache_hits", "vllm:prefix_cache_hits",
                          "Prompt tokens found in the prefix cache"),
}


class _SnapshotCollector(Collector):
    def __init__(self, engine: AsyncEngine, compat: bool) -> None:
        self.engine = engine
        self.compat = compat

    def collect(self) -> Iterator[Metric]:
        load = self.engine.load()
        labels = {"model_name": self.engine.model_name}
        for key, (name, vllm_name, doc) in GAUGES.items():
            for metric_name in self._names(name, vllm_name):
                family = GaugeMetricFamily(metric_name, doc, labels=list(labels))
                family.add_metric(list(labels.values()), float(load[key]))
                yield family
        for key, (name, vllm_name, doc) in COUNTERS.items():
            for metric_name in self._names(name, vllm_name):
                counter = CounterMetricFamily(metric_name, doc, labels=list(labels))
                counter.add_metric(list(labels.values()), float(load[key]))
                yield counter

    def _names(self, name: str, vllm_name: str | None) -> list[str]:
        return [name, vllm_name] if self.compat and vllm_name else [name]


class EngineMetrics:
    """An EngineObserver that owns a CollectorRegistry."""

    def __init__(self, engine: AsyncEngine, compat: str | None = None) -> None:
        if compat not in (None, *COMPAT_CHOICES):
            raise ValueError(f"metrics compat must be one of: {', '.join(COMPAT_CHOICES)}")
        self.registry = CollectorRegistry()
        self.model = engine.model_name
        self.compat = compat == "vllm"
        self.registry.register(_SnapshotCollector(engine, self.compat))
        self._histograms = self._make_histograms()
        self._counters = self._make_counters()

    def _names(self, name: str, vllm_name: str) -> list[str]:
        return [name, vllm_name] if self.compat else [name]

    def _histogram(self, name: str, vllm_name: str, doc: str,
                   buckets: tuple[float, ...] = LATENCY_BUCKETS) -> list[Histogram]:
        return [Histogram(n, doc, ["model_name"], registry=self.registry, buckets=buckets)
                for n in self._names(name, vllm_name)]

    def _counter(self, name: str, vllm_name: str, doc: str,
                 labels: tuple[str, ...] = ("model_name",)) -> list[Counter]:
        return [Counter(n, doc, list(labels), registry=self.registry)
                for n in self._names(name, vllm_name)]

    def _make_histograms(self) -> dict[str, list[Histogram]]:
        hist = self._histogram
        return {
            "ttft": hist("fairgate_engine_time_to_first_token_seconds",
                         "vllm:time_to_first_token_seconds", "Time to first token"),
            "itl": hist("fairgate_engine_inter_token_latency_seconds",
                        "vllm:inter_token_latency_seconds", "Time between output tokens",
                        ITL_BUCKETS),
            "e2e": hist("fairgate_engine_e2e_request_latency_seconds",
                        "vllm:e2e_request_latency_seconds", "Arrival to finish"),
            "queue": hist("fairgate_engine_request_queue_time_seconds",
                          "vllm:request_queue_time_seconds", "Arrival to first scheduled"),
            "step": hist("fairgate_engine_step_time_seconds", "vllm:iteration_time_seconds",
                         "Time of one engine step", ITL_BUCKETS),
            "tokens_per_step": hist("fairgate_engine_tokens_per_step",
                                    "vllm:iteration_tokens_total",
                                    "Tokens processed in one step", TOKENS_PER_STEP_BUCKETS),
        }

    def _make_counters(self) -> dict[str, list[Counter]]:
        return {
            "prompt": self._counter("fairgate_engine_prompt_tokens", "vllm:prompt_tokens",
                                    "Prompt tokens of finished requests"),
            "generation": self._counter("fairgate_engine_generation_tokens",
                                        "vllm:generation_tokens", "Generated tokens"),
            "finished": self._counter("fairgate_engine_requests_finished",
                                      "vllm:request_success", "Finished requests by reason",
                                      ("model_name", "finished_reason")),
        }

    def _observe(self, key: str, value: float) -> None:
        for histogram in self._histograms[key]:
            histogram.labels(self.model).observe(value)

    def _count(self, key: str, value: float, *labels: str) -> None:
        for counter in self._counters[key]:
            counter.labels(self.model, *labels).inc(value)

    # ---- EngineObserver ----------------------------------------------------------------------
    def on_step(self, output: StepOutput) -> None:
        self._observe("step", output.step_time)
        self._observe("tokens_per_step", output.num_batched_tokens)
        self._count("generation", sum(len(tokens) for tokens in output.outputs.values()))

    def on_finished(self, record: RequestRecord) -> None:
        self._count("prompt", record.num_prompt_tokens)
        self._count("finished", 1, record.finish_reason)
        if record.ttft is not None:
            self._observe("ttft", record.ttft)
        if record.queue_time is not None:
            self._observe("queue", record.queue_time)
        self._observe("e2e", record.e2e)
        for gap in record.itls:
            self._observe("itl", gap)

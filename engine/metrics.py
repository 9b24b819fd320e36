"""Prometheus metrics of one engine, in a per-app registry (tests build many apps): the engine
server's, or the gateway's for its embedded engine.

Gauges and cumulative counters are read from the engine's load snapshot at scrape time;
latency histograms and token counters are fed per step and per finished request on the engine
thread. The engine's `metrics_compat: vllm` (EngineConfig) also exports the same signals under
vLLM's names, so dashboards built for vLLM work unchanged; it is read here, so the engine server
and the gateway's embedded engine export the same series.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.stats import RequestRecord

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import StepOutput

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                   5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
TOKENS_PER_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# snapshot key -> (fairgate name, vLLM names, help); gauges
GAUGES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "running": ("fairgate_engine_requests_running", ("vllm:num_requests_running",),
                "Requests in the running batch"),
    "waiting": ("fairgate_engine_requests_waiting", ("vllm:num_requests_waiting",),
                "Requests waiting to be scheduled"),
    "swapped": ("fairgate_engine_requests_swapped", ("vllm:num_requests_swapped",),
                "Requests preempted to host memory"),
    # vLLM V1's name, and V0's that its own Grafana dashboard still plots
    "kv_usage": ("fairgate_engine_kv_cache_usage_ratio",
                 ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
                 "Fraction of KV blocks held by requests (1 = full)"),
    "free_blocks": ("fairgate_engine_kv_cache_free_blocks", (), "Free KV blocks"),
    "num_blocks": ("fairgate_engine_kv_cache_blocks", (), "KV blocks in the pool"),
}
# snapshot key -> (fairgate name, vLLM names, help); counters (names without _total)
COUNTERS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "num_preemptions": ("fairgate_engine_preemptions", ("vllm:num_preemptions",),
                        "Requests preempted"),
    "prefix_cache_queries": ("fairgate_engine_prefix_cache_queries",
                             ("vllm:prefix_cache_queries",),
                             "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("fairgate_engine_prefix_cache_hits", ("vllm:prefix_cache_hits",),
                          "Prompt tokens found in the prefix cache"),
}


def one_two_five_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value`: vLLM's buckets for tokens per request."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


def register_process_metrics(registry: CollectorRegistry) -> None:
    """process_* (CPU, memory, file descriptors), python_info and python_gc_*: what
    prometheus_client's default registry has, for a process whose /metrics uses its own."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)


def request_phases(record: RequestRecord) -> dict[str, float]:
    """A finished request's per-request latencies (seconds), those it has: vLLM's phases,
    queue = first scheduled - arrival, prefill = first token - first scheduled, decode = last
    token - first token; and TTFT, TPOT (protocol.measures) and e2e."""
    phases = {"e2e": record.e2e}
    first_scheduled, first_token = record.first_scheduled_time, record.first_token_time
    if record.queue_time is not None:
        phases["queue"] = record.queue_time
    if record.ttft is not None:
        phases["ttft"] = record.ttft
    if first_scheduled is not None and first_token is not None:
        phases["prefill"] = first_token - first_scheduled
    if first_token is not None and record.token_times:
        phases["decode"] = record.token_times[-1] - first_token
    if record.tpot is not None:
        phases["tpot"] = record.tpot
    return phases


class _SnapshotCollector(Collector):
    def __init__(self, engine: AsyncEngine, compat: bool) -> None:
        self.engine = engine
        self.compat = compat

    def collect(self) -> Iterator[Metric]:
        load = self.engine.load()
        model = [self.engine.model_name]
        for table, family_type in ((GAUGES, GaugeMetricFamily), (COUNTERS, CounterMetricFamily)):
            for key, (name, vllm_names, doc) in table.items():
                for metric_name in (name, *vllm_names) if self.compat else (name,):
                    family = family_type(metric_name, doc, labels=["model_name"])
                    family.add_metric(model, float(load[key]))
                    yield family


class EngineMetrics:
    """An EngineObserver whose series live in `registry`: a new one by default; the gateway
    passes its own for its embedded engine. vLLM's names too when the engine's config says
    `metrics_compat: vllm`."""

    def __init__(self, engine: AsyncEngine, *,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry = CollectorRegistry() if registry is None else registry
        self.compat = engine.config.metrics_compat == "vllm"
        self.model = engine.model_name
        self.max_model_len = engine.config.resolved_max_model_len
        registry.register(_SnapshotCollector(engine, self.compat))
        self._histograms = {key: self._children(Histogram, names, doc, buckets=buckets)
                            for key, (names, doc, buckets) in self._histogram_specs().items()}
        self._counters = {key: self._children(Counter, names, doc)
                          for key, (names, doc) in self._counter_specs().items()}
        self._finished = [Counter(name, "Finished requests by reason",
                                  ["model_name", "finished_reason"], registry=registry)
                          for name in self._names("fairgate_engine_requests_finished",
                                                  "vllm:request_success")]

    def _names(self, name: str, *vllm_names: str) -> tuple[str, ...]:
        return (name, *vllm_names) if self.compat else (name,)

    def _children(self, kind: Any, names: tuple[str, ...], doc: str, **kwargs: Any) -> list[Any]:
        """This engine's child of each name's metric; created now, so every series is exported
        from the first scrape (zero until observed)."""
        return [kind(name, doc, ["model_name"], registry=self.registry, **kwargs)
                .labels(self.model) for name in names]

    def _histogram_specs(self) -> dict[str, tuple[tuple[str, ...], str, tuple[float, ...]]]:
        names, tokens = self._names, one_two_five_buckets(self.max_model_len)
        return {
            "ttft": (names("fairgate_engine_time_to_first_token_seconds",
                           "vllm:time_to_first_token_seconds"),
                     "Time to first token", LATENCY_BUCKETS),
            # vLLM's time_per_output_token_seconds is its older name of the same per-gap series
            "itl": (names("fairgate_engine_inter_token_latency_seconds",
                          "vllm:inter_token_latency_seconds",
                          "vllm:time_per_output_token_seconds"),
                    "Time between output tokens", ITL_BUCKETS),
            "tpot": (names("fairgate_engine_tpot_seconds",
                           "vllm:request_time_per_output_token_seconds"),
                     "Per request: (last token - first token) / (output tokens - 1)",
                     ITL_BUCKETS),
            "e2e": (names("fairgate_engine_e2e_request_latency_seconds",
                          "vllm:e2e_request_latency_seconds"), "Arrival to finish",
                    LATENCY_BUCKETS),
            "queue": (names("fairgate_engine_request_queue_time_seconds",
                            "vllm:request_queue_time_seconds"), "Arrival to first scheduled",
                      LATENCY_BUCKETS),
            "prefill": (names("fairgate_engine_request_prefill_time_seconds",
                              "vllm:request_prefill_time_seconds"),
                        "First scheduled to first token", LATENCY_BUCKETS),
            "decode": (names("fairgate_engine_request_decode_time_seconds",
                             "vllm:request_decode_time_seconds"), "First token to last token",
                       LATENCY_BUCKETS),
            "prompt_tokens": (names("fairgate_engine_request_prompt_tokens",
                                    "vllm:request_prompt_tokens"),
                              "Prompt tokens per finished request", tokens),
            # n is always 1, so a request's most tokens over its sequences is its own count
            "generation_tokens": (names("fairgate_engine_request_generation_tokens",
                                        "vllm:request_generation_tokens",
                                        "vllm:request_max_num_generation_tokens"),
                                  "Generated tokens per finished request", tokens),
            "step": (names("fairgate_engine_step_time_seconds", "vllm:iteration_time_seconds"),
                     "Time of one engine step", ITL_BUCKETS),
            "tokens_per_step": (names("fairgate_engine_tokens_per_step",
                                      "vllm:iteration_tokens_total"),
                                "Tokens processed in one step", TOKENS_PER_STEP_BUCKETS),
        }

    def _counter_specs(self) -> dict[str, tuple[tuple[str, ...], str]]:
        return {
            "prompt": (self._names("fairgate_engine_prompt_tokens", "vllm:prompt_tokens"),
                       "Prompt tokens of finished requests"),
            "generation": (self._names("fairgate_engine_generation_tokens",
                                       "vllm:generation_tokens"), "Generated tokens"),
        }

    def _observe(self, key: str, value: float) -> None:
        for histogram in self._histograms[key]:
            histogram.observe(value)

    def _count(self, key: str, value: float) -> None:
        for counter in self._counters[key]:
            counter.inc(value)

    # ---- EngineObserver ----------------------------------------------------------------------
    def on_step(self, output: StepOutput) -> None:
        self._observe("step", output.step_time)
        self._observe("tokens_per_step", output.num_batched_tokens)
        self._count("generation", len(output.sampled))

    def on_finished(self, record: RequestRecord) -> None:
        self._count("prompt", record.num_prompt_tokens)
        for counter in self._finished:
            counter.labels(self.model, record.finish_reason).inc()
        self._observe("prompt_tokens", record.num_prompt_tokens)
        self._observe("generation_tokens", record.num_output_tokens)
        for key, seconds in request_phases(record).items():
            self._observe(key, seconds)
        for gap in record.itls:
            self._observe("itl", gap)

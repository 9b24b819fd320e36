"""`metrics_compat: vllm` (the engine knob; `fairgate engine --metrics-compat vllm`): every
series vLLM's own Grafana dashboard plots is exported, with vLLM's meaning (checked against the
requests sent), beside its fairgate_engine_* counterpart and the process metrics; the whole
exposition parses. The knob is validated, and needs a restart to change."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from engine import EngineConfig
from engine.async_engine import AsyncEngine
from engine.metrics import one_two_five_buckets
from engine.server import make_app
from tests.deploy.vllm_dashboard import every_dashboard_sample

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]
MAX_MODEL_LEN = 1024
# (prompt length, max_tokens): one request of a single token (no TPOT, no inter-token gap)
REQUESTS = ((5, 7), (12, 3), (30, 1), (3, 16))
DASHBOARD_HISTOGRAMS = ("vllm:time_per_output_token_seconds", "vllm:request_prompt_tokens",
                        "vllm:request_generation_tokens", "vllm:request_prefill_time_seconds",
                        "vllm:request_decode_time_seconds",
                        "vllm:request_max_num_generation_tokens")
PROCESS_SERIES = ("process_cpu_seconds_total", "process_resident_memory_bytes",
                  "process_virtual_memory_bytes", "process_start_time_seconds",
                  "process_open_fds", "python_info")


class Scrape:
    """One /metrics body, parsed: the sample of `name` (a full sample name) for this model."""

    def __init__(self, text: str) -> None:
        self.families = list(text_string_to_metric_families(text))
        self.samples: dict[str, list[Sample]] = {}
        for family in self.families:
            for sample in family.samples:
                self.samples.setdefault(sample.name, []).append(sample)

    def value(self, name: str) -> float:
        [sample] = [s for s in self.samples[name] if s.labels.get("model_name") == "random:tiny"]
        return sample.value

    def bucket_bounds(self, histogram: str) -> list[str]:
        return [s.labels["le"] for s in self.samples[f"{histogram}_bucket"]]


@pytest.fixture
async def client(aiohttp_client: MakeClient) -> Client:
    config = EngineConfig(executor="sim", sim_model="tiny", max_model_len=MAX_MODEL_LEN,
                          num_kv_blocks=256, max_num_batched_tokens=1024, max_num_seqs=64,
                          metrics_compat="vllm")
    return await aiohttp_client(make_app(AsyncEngine(config)))


async def complete(client: Client, prompt_len: int, max_tokens: int) -> dict[str, Any]:
    resp = await client.post("/v1/completions", json={
        "prompt": list(range(10, 10 + prompt_len)), "max_tokens": max_tokens})
    assert resp.status == 200, await resp.text()
    usage: dict[str, Any] = (await resp.json())["usage"]
    assert usage["prompt_tokens"] == prompt_len
    return usage


async def test_vllm_dashboard_series_have_vllms_meaning(client: Client) -> None:
    usages = [await complete(client, *request) for request in REQUESTS]
    generated = [u["completion_tokens"] for u in usages]
    scrape = Scrape(await (await client.get("/metrics")).text())

    # every sample either version of vLLM's Grafana dashboard reads (its 12 panels, each
    # filtered on model_name); tests/deploy/test_vllm_dashboard runs it against real processes
    for name in every_dashboard_sample():
        assert any(sample.labels.get("model_name") == "random:tiny"
                   for sample in scrape.samples.get(name, ())), name
    for name in DASHBOARD_HISTOGRAMS:
        assert scrape.value(f"{name}_count") > 0, name
    assert 0.0 <= scrape.value("vllm:gpu_cache_usage_perc") <= 1.0
    assert scrape.value("vllm:gpu_cache_usage_perc") == scrape.value("vllm:kv_cache_usage_perc")

    # per finished request: one observation each, of its own token counts
    for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:request_max_num_generation_tokens", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds"):
        assert scrape.value(f"{name}_count") == len(REQUESTS), name
    assert scrape.value("vllm:request_prompt_tokens_sum") == sum(p for p, _ in REQUESTS)
    assert scrape.value("vllm:request_generation_tokens_sum") == sum(generated)
    assert scrape.value("vllm:request_max_num_generation_tokens_sum") == sum(generated)
    assert scrape.value("vllm:prompt_tokens_total") == sum(p for p, _ in REQUESTS)

    # time per output token is vLLM's per-gap series (inter_token_latency's older name);
    # the per-request TPOT is a request with at least two tokens
    gaps = sum(n - 1 for n in generated)
    assert scrape.value("vllm:time_per_output_token_seconds_count") == gaps
    assert scrape.value("vllm:time_per_output_token_seconds_sum") == pytest.approx(
        scrape.value("vllm:inter_token_latency_seconds_sum"))
    assert scrape.value("vllm:request_time_per_output_token_seconds_count") == sum(
        n >= 2 for n in generated)

    # prefill + queue = TTFT and decode <= e2e, summed over the requests (engine clock)
    prefill = scrape.value("vllm:request_prefill_time_seconds_sum")
    decode = scrape.value("vllm:request_decode_time_seconds_sum")
    assert prefill > 0 and decode > 0
    assert prefill + scrape.value("vllm:request_queue_time_seconds_sum") == pytest.approx(
        scrape.value("vllm:time_to_first_token_seconds_sum"))
    assert decode <= scrape.value("vllm:e2e_request_latency_seconds_sum")

    for name in PROCESS_SERIES:
        assert name in scrape.samples, name
    assert scrape.samples["process_resident_memory_bytes"][0].value > 0


async def test_fairgate_counterparts_match_the_vllm_series(client: Client) -> None:
    for request in REQUESTS:
        await complete(client, *request)
    scrape = Scrape(await (await client.get("/metrics")).text())
    pairs = {"fairgate_engine_tpot_seconds": "vllm:request_time_per_output_token_seconds",
             "fairgate_engine_request_prompt_tokens": "vllm:request_prompt_tokens",
             "fairgate_engine_request_generation_tokens": "vllm:request_generation_tokens",
             "fairgate_engine_request_prefill_time_seconds": "vllm:request_prefill_time_seconds",
             "fairgate_engine_request_decode_time_seconds": "vllm:request_decode_time_seconds"}
    for ours, theirs in pairs.items():
        for suffix in ("_count", "_sum"):
            assert scrape.value(ours + suffix) == scrape.value(theirs + suffix), ours + suffix
    assert scrape.value("fairgate_engine_kv_cache_usage_ratio") == scrape.value(
        "vllm:gpu_cache_usage_perc")


async def test_token_histograms_use_vllms_buckets_up_to_max_model_len(client: Client) -> None:
    scrape = Scrape(await (await client.get("/metrics")).text())
    expected = [*(f"{float(b)}" for b in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)), "+Inf"]
    for name in ("vllm:request_prompt_tokens", "vllm:request_max_num_generation_tokens"):
        assert scrape.bucket_bounds(name) == expected, name
    # series exist from the first scrape, before any request
    assert scrape.value("vllm:request_decode_time_seconds_count") == 0


def test_one_two_five_buckets() -> None:
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five_buckets(4096) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert one_two_five_buckets(1) == (1,)


async def test_without_compat_no_vllm_series_but_process_metrics(
        aiohttp_client: MakeClient) -> None:
    config = EngineConfig(executor="sim", sim_model="tiny", max_model_len=MAX_MODEL_LEN,
                          num_kv_blocks=256)
    client = await aiohttp_client(make_app(AsyncEngine(config)))
    await complete(client, 4, 3)
    scrape = Scrape(await (await client.get("/metrics")).text())
    assert not [name for name in scrape.samples if name.startswith("vllm:")]
    assert scrape.value("fairgate_engine_request_generation_tokens_sum") == 3
    assert "process_cpu_seconds_total" in scrape.samples


def test_metrics_compat_is_a_validated_engine_knob() -> None:
    assert EngineConfig().metrics_compat is None  # fairgate's names only, unless asked
    assert EngineConfig.from_dict({"metrics_compat": "vllm"}).metrics_compat == "vllm"
    assert EngineConfig.from_dict({"metrics_compat": None}).metrics_compat is None
    for wrong in ("vLLM", "sglang", True, 1):
        with pytest.raises(ValueError, match=r"metrics_compat must be one of vllm.*or null"):
            EngineConfig.from_dict({"metrics_compat": wrong})


async def test_metrics_compat_changes_only_with_a_restart(client: Client) -> None:
    resp = await client.post("/admin/reconfigure", json={"changes": {"metrics_compat": None}})
    assert resp.status == 400
    assert "metrics_compat without a restart" in (await resp.json())["error"]["message"]
    config = (await (await client.get("/admin/config")).json())["config"]
    assert config["metrics_compat"] == "vllm"
    scrape = Scrape(await (await client.get("/metrics")).text())
    assert "vllm:num_requests_running" in scrape.samples

"""With an embedded engine, the gateway's metrics carry the engine's fairgate_engine_* series (no
engine server exports them); with remote backends they do not (each engine server does)."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from engine.async_engine import AsyncEngine
from engine.server import make_app as make_engine_app
from gateway.app import make_metrics_app
from gateway.backends import EmbeddedBackend
from tests.gateway.helpers import SIM_ENGINE, completion, start_gateway

ENGINE_SERIES = ("fairgate_engine_kv_cache_usage_ratio", "fairgate_engine_requests_running",
                 "fairgate_engine_requests_waiting", "fairgate_engine_requests_swapped",
                 "fairgate_engine_preemptions_total", "fairgate_engine_prefix_cache_queries_total",
                 "fairgate_engine_prefix_cache_hits_total", "fairgate_engine_step_time_seconds_count")


async def scrape(aiohttp_client: Any, gateway_app: Any) -> dict[str, list[Any]]:
    """The metrics listener's series, parsed: sample name -> its samples."""
    listener = await aiohttp_client(make_metrics_app(gateway_app))
    resp = await listener.get("/metrics")
    assert resp.status == 200
    samples: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(await resp.text()):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list[Any]], name: str) -> float:
    [sample] = samples[name]
    assert sample.labels.get("model_name") == "random:tiny", sample
    return float(sample.value)


async def test_embedded_engine_series_on_the_gateway(aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    for max_tokens in (4, 6):
        resp = await h.post("acme", completion(max_tokens=max_tokens))
        assert resp.status == 200, await resp.text()
    samples = await scrape(aiohttp_client, h.app)
    for name in ENGINE_SERIES:
        assert name in samples, name
    assert 0.0 <= value(samples, "fairgate_engine_kv_cache_usage_ratio") <= 1.0
    assert value(samples, "fairgate_engine_requests_running") >= 0
    assert value(samples, "fairgate_engine_requests_waiting") >= 0
    assert value(samples, "fairgate_engine_preemptions_total") >= 0
    assert value(samples, "fairgate_engine_step_time_seconds_count") > 0
    assert value(samples, "fairgate_engine_generation_tokens_total") == 10
    assert value(samples, "fairgate_engine_request_generation_tokens_count") == 2
    assert not [name for name in samples if name.startswith("vllm:")]
    assert "fairgate_gateway_requests_total" in samples  # beside the gateway's own


async def test_an_embedded_backend_given_to_make_app_is_exported(aiohttp_client: Any,
                                                                 db_url: str) -> None:
    engine = AsyncEngine(SIM_ENGINE)
    h = await start_gateway(aiohttp_client, db_url, backends=[EmbeddedBackend(engine)])
    assert (await h.post("acme", completion())).status == 200
    samples = await scrape(aiohttp_client, h.app)
    assert value(samples, "fairgate_engine_step_time_seconds_count") > 0


async def test_remote_backends_export_no_engine_series(aiohttp_client: Any, aiohttp_server: Any,
                                                       db_url: str) -> None:
    server = await aiohttp_server(make_engine_app(AsyncEngine(SIM_ENGINE)))
    h = await start_gateway(aiohttp_client, db_url,
                            gateway={"backends": [{"url": str(server.make_url("/v1"))}]})
    assert (await h.post("acme", completion())).status == 200
    samples = await scrape(aiohttp_client, h.app)
    assert "fairgate_gateway_requests_total" in samples
    assert not [name for name in samples if name.startswith("fairgate_engine_")]

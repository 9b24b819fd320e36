"""The gateway end to end in-process, with an embedded AsyncEngine on the simulated executor."""

from __future__ import annotations

from typing import Any

from tests.gateway.helpers import collect, completion, start_gateway


async def test_completion_and_usage_recorded(aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url, tenants={"acme": {}, "other": {}})
    resp = await h.post("acme", completion("hello", max_tokens=5))
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["object"] == "text_completion" and body["model"] == "random:tiny"
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 5, "total_tokens": 11}
    assert body["choices"][0]["finish_reason"] == "length"
    usage = await (await h.client.get("/v1/usage", headers=h.auth("acme"))).json()
    assert usage["tenant"] == "acme" and usage["requests"] == 1
    assert usage["completion_tokens"] == 5
    other = await (await h.client.get("/v1/usage", headers=h.auth("other"))).json()
    assert other["tenant"] == "other" and other["requests"] == 0  # only its own


async def test_streaming_chat_with_usage(aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    body = {"model": "random:tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6, "stream": True, "stream_options": {"include_usage": True}}
    resp = await h.post("acme", body, "/v1/chat/completions")
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    events = [e async for e in collect(resp)]
    content = [e for e in events if e["choices"]]
    assert content[0]["choices"][0]["delta"]["role"] == "assistant"
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 6
    metrics = h.metrics()
    assert 'fairgate_gateway_requests_total{status="200",tenant="acme"} 1.0' in metrics
    assert 'fairgate_gateway_tokens_total{direction="out",tenant="acme"} 6.0' in metrics
    assert "fairgate_gateway_ttft_seconds_count" in metrics
    assert "fairgate_gateway_itl_seconds_bucket" in metrics


async def test_stream_without_usage_has_no_usage_event(aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    resp = await h.post("acme", completion(stream=True))
    events = [e async for e in collect(resp)]
    assert events and all(e["choices"] for e in events)
    assert "".join(e["choices"][0]["text"] for e in events)


async def test_max_tokens_absent_uses_openai_defaults(aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url,
                            tenants={"acme": {"limits": {"max_tokens": 7}}, "free": {}})
    resp = await h.post("free", {"model": "random:tiny", "prompt": "x"})
    assert (await resp.json())["usage"]["completion_tokens"] == 16  # OpenAI's default
    resp = await h.post("acme", {"model": "random:tiny", "prompt": "x"})
    body = await resp.json()
    assert body["usage"]["completion_tokens"] == 7  # capped by the tenant's max_tokens
    resp = await h.post("acme", {"messages": [{"role": "user", "content": "x"}]},
                        path="/v1/chat/completions")
    assert (await resp.json())["usage"]["completion_tokens"] == 7  # the context, capped


async def test_models_health_and_auth_on_models(aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    assert (await h.client.get("/v1/models")).status == 401
    models = await (await h.client.get("/v1/models", headers=h.auth("acme"))).json()
    assert [m["id"] for m in models["data"]] == ["random:tiny"]
    assert (await h.client.get("/healthz")).status == 200
    assert (await h.client.get("/readyz")).status == 200


async def test_admin_api(aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    admin = {"Authorization": "Bearer admin-key-0123456789"}
    assert (await h.client.get("/admin/tenants", headers=h.auth("acme"))).status == 401
    resp = await h.client.post("/admin/tenants", headers=admin,
                               json={"name": "new", "weight": 2.0,
                                     "limits": {"requests_per_min": 5}})
    assert resp.status == 201, await resp.text()
    key = (await (await h.client.post("/admin/tenants/new/keys", headers=admin)).json())["key"]
    h.keys["new"] = key
    assert (await h.post("new", completion())).status == 200
    usage = await (await h.client.get("/admin/usage/new", headers=admin)).json()
    assert usage["requests"] == 1
    names = [t["name"] for t in (await (await h.client.get("/admin/tenants",
                                                           headers=admin)).json())["data"]]
    assert names == ["acme", "new"]
    bad = await h.client.post("/admin/tenants", headers=admin, json={"name": "x", "weight": -1})
    assert bad.status == 400
    queues = await (await h.client.get("/admin/queues", headers=admin)).json()
    assert queues["policy"] == "fair"


async def test_demo_tenant_created_once(aiohttp_client: Any, db_url: str) -> None:
    printed: list[str] = []
    h = await start_gateway(aiohttp_client, db_url, tenants={}, gateway={"demo_tenant": True},
                            on_demo_key=printed.append)
    assert len(printed) == 1 and printed[0].startswith("fg-")
    h.keys["demo"] = printed[0]
    assert (await h.post("demo", completion())).status == 200


async def test_priority_and_tenant_reach_the_engine(aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url,
                            tenants={"acme": {"allowed_priorities": ["batch"],
                                              "default_priority": "batch"}})
    seen: list[tuple[str, str, float | None]] = []
    backend = h.gateway.pool.primary
    generate = backend.engine.generate

    def spy(rid: str, ids: list[int], params: Any, tenant: str = "",
            priority: str = "interactive", tenant_weight: float | None = None) -> Any:
        seen.append((tenant, priority, tenant_weight))
        return generate(rid, ids, params, tenant=tenant, priority=priority,
                        tenant_weight=tenant_weight)

    backend.engine.generate = spy
    assert (await h.post("acme", completion())).status == 200
    assert seen == [("acme", "batch", 1.0)]  # tenant is also the engine's prefix-cache salt
    resp = await h.post("acme", completion(priority="interactive"))
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "priority_not_allowed"

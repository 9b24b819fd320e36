"""`discover: dns`: one backend per address a host name resolves to (a Kubernetes headless
Service), found again as replicas come and go; one that leaves is drained, then closed."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp import web

import gateway.backends.discovery
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.server import make_app as make_engine_app
from gateway.config import GatewayConfig
from tests.gateway.helpers import collect, completion, start_gateway
from tests.support.processes import free_port
from tests.support.waiting import wait_for

ENGINE = EngineConfig(executor="sim", max_model_len=512)


async def _engine_on(host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(make_engine_app(AsyncEngine(ENGINE)))
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner


async def test_replicas_behind_one_name_are_found_and_leave_cleanly(
        aiohttp_client: Any, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    runners = [await _engine_on(host, port) for host in ("127.0.0.1", "127.0.0.2")]
    answer = ["127.0.0.1", "127.0.0.2"]
    asked: list[tuple[str, int]] = []

    async def resolver(host: str, p: int) -> list[str]:
        asked.append((host, p))
        return list(answer)

    monkeypatch.setattr(gateway.backends.discovery, "resolve", resolver)
    try:
        h = await start_gateway(aiohttp_client, db_url, gateway={"backends": [
            {"url": f"http://engines.example:{port}", "discover": "dns",
             "discover_interval_s": 3600}]})
        pool = h.gateway.pool
        (group,) = pool.groups
        assert asked[0] == ("engines.example", port)
        assert sorted(b.name for b in pool.backends) == [f"http://127.0.0.1:{port}",
                                                          f"http://127.0.0.2:{port}"]
        await wait_for(lambda: all(b.healthy for b in pool.backends), timeout=10)
        for _ in range(4):
            resp = await h.post("acme", completion("hi", stream=True))
            [_ async for _ in collect(resp)]
            assert resp.status == 200
        # one replica goes: it is drained, then closed and gone from the pool
        answer.remove("127.0.0.2")
        await group.refresh()
        assert [b.name for b in pool.backends] == [f"http://127.0.0.1:{port}"]
        assert not pool.draining
        resp = await h.post("acme", completion("hi"))
        assert resp.status == 200
        # and comes back
        answer.append("127.0.0.2")
        await group.refresh()
        assert len(pool.backends) == 2
        # a failed lookup keeps what is there
        async def broken(host: str, p: int) -> list[str]:
            raise OSError("name resolution failed")

        monkeypatch.setattr(gateway.backends.discovery, "resolve", broken)
        await group.refresh()
        assert len(pool.backends) == 2
    finally:
        for runner in runners:
            await runner.cleanup()


def test_discovery_settings_are_checked() -> None:
    for bad, message in (({"url": "http://x:1", "discover": "mdns"}, "discover"),
                         ({"url": "http://x:1", "discover_interval_s": 0},
                          "discover_interval_s")):
        with pytest.raises(ValueError, match=message):
            GatewayConfig.from_dict({"backends": [bad]})

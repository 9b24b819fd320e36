"""The gateway and keyed engines: a backend's api_key goes with every request (/v1/*, /load),
its admin_key (the api_key when not given) with the tune jobs' and the canary's /admin/* calls;
the environment's engine keys are every keyless fairgate backend's and shadow target's."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any

from control.jobs import EngineKeys, keys_for
from control.state import JOBS
from engine.async_engine import AsyncEngine
from engine.config import (
    ENGINE_ADMIN_KEY_ENV,
    ENGINE_KEY_ENV,
    EngineAccess,
    EngineConfig,
)
from engine.server import make_app as make_engine_app
from gateway.config import BackendConfig, GatewayConfig, ShadowConfig
from tests.gateway.helpers import (
    SIM_ENGINE,
    completion,
    leave_an_apply_mid_canary,
    start_gateway,
)

API_KEY = "engine-key-0123456789"
ADMIN_KEY = "engine-admin-0123456789"
GATEWAY_ADMIN = {"Authorization": "Bearer admin-key-0123456789"}  # start_gateway's


async def keyed_engine(aiohttp_server: Any, **config: Any) -> str:
    engine = AsyncEngine(EngineConfig(**{**SIM_ENGINE.to_dict(), **config}))
    server = await aiohttp_server(make_engine_app(engine, access=EngineAccess(API_KEY,
                                                                              ADMIN_KEY)))
    return str(server.make_url("")).rstrip("/")


def test_a_backends_admin_key_is_its_api_key_unless_given() -> None:
    assert BackendConfig("http://e:8100", api_key=API_KEY).effective_admin_key == API_KEY
    assert BackendConfig("http://e:8100", api_key=API_KEY,
                         admin_key=ADMIN_KEY).effective_admin_key == ADMIN_KEY
    assert ShadowConfig("s", "http://e:8100", api_key=API_KEY).effective_admin_key == API_KEY
    assert BackendConfig("http://e:8100").effective_admin_key is None


def test_the_environments_engine_keys_go_to_keyless_fairgate_engines_only() -> None:
    config = GatewayConfig.from_dict({
        "backends": [{"url": "http://a:8100"}, {"url": "http://b:8100", "api_key": "own-key"},
                     {"url": "http://c:8000", "kind": "openai"}],
        "shadow": [{"name": "s", "url": "http://d:8100"}]})
    env = {ENGINE_KEY_ENV: API_KEY, ENGINE_ADMIN_KEY_ENV: ADMIN_KEY}
    a, b, c = config.with_environment(env).backends
    assert (a.api_key, a.admin_key) == (API_KEY, ADMIN_KEY)
    assert (b.api_key, b.admin_key) == ("own-key", None)  # another engine than the env's
    assert (c.api_key, c.admin_key) == (None, None)  # someone else's server
    shadow = config.with_environment(env).shadow[0]
    assert (shadow.api_key, shadow.admin_key) == (API_KEY, ADMIN_KEY)
    assert config.with_environment({}) == config


def test_the_keys_for_an_engine_are_its_backends_or_shadows_else_the_environments() -> None:
    engines = [BackendConfig("http://a:8100/v1", api_key=API_KEY),
               ShadowConfig("s", "http://d:8100", api_key="shadow-key-0123456789",
                            admin_key=ADMIN_KEY)]
    assert keys_for("http://a:8100", engines, {}) == EngineKeys(API_KEY, API_KEY)
    assert keys_for("http://d:8100/v1", engines, {}) == EngineKeys("shadow-key-0123456789",
                                                                   ADMIN_KEY)
    env = {ENGINE_KEY_ENV: "env-key-0123456789"}
    assert keys_for("http://x:8100", engines, env) == EngineKeys("env-key-0123456789",
                                                                 "env-key-0123456789")
    assert keys_for("http://x:8100", engines, {}) == EngineKeys()
    # what a tune job's worker is given, as `fairgate tune` reads it
    assert EngineKeys(API_KEY, ADMIN_KEY).environment() == {ENGINE_KEY_ENV: API_KEY,
                                                            ENGINE_ADMIN_KEY_ENV: ADMIN_KEY}
    assert EngineKeys().environment() == {}


async def test_tenant_requests_reach_a_keyed_engine_with_the_backends_key(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    url = await keyed_engine(aiohttp_server)
    h = await start_gateway(aiohttp_client, db_url, gateway={"backends": [
        {"url": url, "api_key": API_KEY, "admin_key": ADMIN_KEY}]})
    backend = h.gateway.pool.primary
    assert backend.healthy and backend.load["max_num_seqs"] == 8  # its /load answered
    resp = await h.post("acme", completion("hello", max_tokens=3))
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["usage"]["completion_tokens"] == 3
    assert h.app[JOBS].engine_keys(url) == EngineKeys(API_KEY, ADMIN_KEY)


async def test_without_the_key_the_keyed_engine_is_no_healthy_backend(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    url = await keyed_engine(aiohttp_server)
    h = await start_gateway(aiohttp_client, db_url, gateway={"backends": [{"url": url}]})
    assert not h.gateway.pool.primary.healthy  # its /load answered 401


async def test_a_shadow_targets_keys_are_kept_by_the_admin_api_and_never_shown(
        aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    resp = await h.client.post("/admin/shadow", headers=GATEWAY_ADMIN, json={
        "name": "cand", "url": "http://127.0.0.1:9", "api_key": API_KEY,
        "admin_key": ADMIN_KEY, "sample": 0.0})
    assert resp.status == 201, await resp.text()
    resp = await h.client.patch("/admin/shadow/cand", headers=GATEWAY_ADMIN,
                                json={"sample": 0.5})
    assert resp.status == 200
    assert API_KEY not in await resp.text() and ADMIN_KEY not in await resp.text()
    assert h.app[JOBS].engine_keys("http://127.0.0.1:9") == EngineKeys(API_KEY, ADMIN_KEY)
    # the admin API's schema takes every field the target has, the keys too
    schema = await (await h.client.get("/openapi.json")).json()
    properties = schema["components"]["schemas"]["ShadowCreate"]["properties"]
    assert set(properties) == set(ShadowConfig.__dataclass_fields__)


def admin_config(url: str) -> dict[str, Any]:
    req = urllib.request.Request(f"{url}/admin/config",
                                 headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.load(resp)["config"])


async def test_a_cut_short_apply_is_rolled_back_on_a_keyed_engine_with_its_admin_key(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str, tmp_path: Path) -> None:
    url = await keyed_engine(aiohttp_server, max_num_seqs=32)  # the canary's new knobs
    await leave_an_apply_mid_canary(db_url, str(tmp_path), url)
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": url, "api_key": API_KEY, "admin_key": ADMIN_KEY}],
        "jobs": {"dir": str(tmp_path / "jobs")}})
    resp = await h.client.get("/admin/tune-jobs/job-cut", headers=GATEWAY_ADMIN)
    job = await resp.json()
    assert job["apply"]["state"] == "rolled_back", job["apply"]
    assert (await asyncio.to_thread(admin_config, url))["max_num_seqs"] == 4

"""Keyed engines in a real deployment: `fairgate engine` processes started with an api key and an
admin key (from the environment, as Kubernetes gives them), a `fairgate serve` whose backends
carry those keys. Tenants are served through the gateway; a client that reaches an engine
directly without its key gets 401, and the admin routes want the admin key, not the api key.
No process prints either key (the fleet's leak check)."""

from __future__ import annotations

import secrets
from typing import Any

import aiohttp
import pytest

from engine.config import ENGINE_ADMIN_KEY_ENV, ENGINE_KEY_ENV
from tests.faults.clients import completion, send
from tests.faults.cluster import Cluster, Fleet, StartCluster

pytestmark = pytest.mark.postgres


@pytest.fixture
def keys(monkeypatch: pytest.MonkeyPatch, fleet: Fleet) -> tuple[str, str]:
    """(api key, admin key) in the environment every process the test starts inherits."""
    api_key = "engine-" + secrets.token_urlsafe(24)
    admin_key = "engine-admin-" + secrets.token_urlsafe(24)
    fleet.secrets.extend([api_key, admin_key])
    monkeypatch.setenv(ENGINE_KEY_ENV, api_key)
    monkeypatch.setenv(ENGINE_ADMIN_KEY_ENV, admin_key)
    return api_key, admin_key


async def direct(session: aiohttp.ClientSession, method: str, url: str, key: str | None,
                 body: Any = None) -> tuple[int, dict[str, Any]]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    async with session.request(method, url, json=body, headers=headers) as resp:
        return resp.status, dict(await resp.json(content_type=None))


def code(answer: dict[str, Any]) -> str | None:
    return answer.get("error", {}).get("code")


async def test_keyed_engines_serve_the_gateway_and_refuse_everyone_else(
        cluster: StartCluster, session: aiohttp.ClientSession, keys: tuple[str, str]) -> None:
    api_key, admin_key = keys
    c: Cluster = await cluster(engines=1, backend={"api_key": api_key, "admin_key": admin_key})
    engine = c.engine_urls[0]

    seen = await send(session, c.url, c.tenants["acme"], c.keys["acme"], completion(8))
    assert seen.status == 200 and seen.done and seen.tokens == 8, seen
    assert (await c.backends(session)) == {engine: True}  # its /load answers the gateway

    # a client on the engine's network, without the key
    status, answer = await direct(session, "POST", f"{engine}/v1/completions", None,
                                  {"prompt": "hello", "max_tokens": 2})
    assert (status, code(answer)) == (401, "missing_api_key")
    status, answer = await direct(session, "GET", f"{engine}/load", c.keys["acme"])  # a tenant's
    assert (status, code(answer)) == (401, "invalid_api_key")
    change = {"changes": {"max_num_seqs": 8}}
    for key in (None, api_key):
        status, answer = await direct(session, "POST", f"{engine}/admin/reconfigure", key, change)
        assert (status, code(answer)) == (401, "invalid_admin_key"), key is None
    status, answer = await direct(session, "GET", f"{engine}/admin/config", admin_key)
    assert status == 200 and answer["config"]["max_num_seqs"] != 8

    # what a probe and a scraper read stays open
    for path in ("/health", "/readyz"):
        assert (await direct(session, "GET", f"{engine}{path}", None))[0] == 200
    async with session.get(f"{engine}/metrics") as resp:
        assert resp.status == 200 and "fairgate_engine_requests_running" in await resp.text()

    # and the engine still serves the gateway afterwards
    seen = await send(session, c.url, c.tenants["beta"], c.keys["beta"], completion(4))
    assert seen.status == 200 and seen.tokens == 4, seen

"""Issue 13: a request whose model name no database stores (NUL, a lone surrogate, control
characters, too long) must not stop usage recording for anyone, through the real gateway."""

from __future__ import annotations

import asyncio
import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import select

from gateway.app import make_app
from gateway.config import GatewayConfig
from tenants.models import UsageRow
from tests.gateway.helpers import (
    SIM_ENGINE,
    ServerThread,
    completion,
    create_tenants,
    start_gateway,
)

# The tenants tests' private PostgreSQL database (skipped, with the reason, when unreachable).
from tests.tenants.conftest import (  # noqa: F401
    postgres_database,
    postgres_unreachable,
    postgres_url,
)

POISON_MODELS = ["a\x00b", "a\ud800b", "\x01\x02\x1b[2J\x7f\x9f", "m" * 300]


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def any_db_url(request: pytest.FixtureRequest, db_url: str) -> str:
    if request.param == "sqlite":
        return db_url
    return str(request.getfixturevalue("postgres_url"))


async def test_poison_model_names_do_not_stop_usage(aiohttp_client: Any, any_db_url: str) -> None:
    h = await start_gateway(aiohttp_client, any_db_url)
    for model in POISON_MODELS:
        resp = await h.post("acme", completion(model=model))
        assert 400 <= resp.status < 500, await resp.text()  # unknown or invalid model
    for _ in range(3):
        resp = await h.post("acme", completion())
        assert resp.status == 200, await resp.text()

    resp = await h.client.get("/v1/usage", headers=h.auth("acme"))
    assert resp.status == 200, await resp.text()
    usage = await resp.json()
    assert usage["requests"] == len(POISON_MODELS) + 3
    assert usage["by_status"]["200"] == 3
    assert sum(usage["by_status"].values()) == usage["requests"]
    ledger = h.gateway.ledger
    assert ledger.pending == 0 and ledger.dead_lettered == 0  # normalised, none refused
    async with ledger.store.db.engine.connect() as conn:
        models = set((await conn.scalars(select(UsageRow.model))).all())
    assert all(m.isprintable() and len(m) <= 256 for m in models)  # e.g. "a\ufffdb"

    resp = await h.post("acme", completion())  # and recording goes on
    assert resp.status == 200
    usage = await (await h.client.get("/v1/usage", headers=h.auth("acme"))).json()
    assert usage["requests"] == len(POISON_MODELS) + 4


# ---- any value a client can put in a field that reaches the ledger ----------------------------
awkward_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=400)
field_values = awkward_text | st.integers(-(2**70), 2**70) | st.floats() | st.none() | \
    st.booleans() | st.lists(st.integers(), max_size=3)


@pytest.fixture
def served(any_db_url: str) -> Iterator[tuple[ServerThread, str]]:
    keys = asyncio.run(create_tenants(any_db_url, {"acme": {}}))
    config = GatewayConfig(demo_tenant=False, metrics_port=None)
    with ServerThread(make_app(config, engine=SIM_ENGINE, database=any_db_url)) as server:
        yield server, keys["acme"]


def _call(server: ServerThread, key: str, method: str, path: str,
          body: bytes = b"") -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request(method, path, body=body or None,
                     headers={"Authorization": f"Bearer {key}",
                              "Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(model=field_values, priority=field_values, user=field_values, raw_surrogate=st.booleans())
def test_any_field_values_leave_usage_correct(served: tuple[ServerThread, str], model: Any,
                                              priority: Any, user: Any,
                                              raw_surrogate: bool) -> None:
    """Random values (unencodable strings, NUL, huge and tiny numbers, long strings) in every
    request field that reaches the ledger, one request each, then a normal one: every request
    is in /v1/usage and the ledger keeps flushing."""
    server, key = served
    before = json.loads(_call(server, key, "GET", "/v1/usage")[1])["requests"]
    body = json.dumps({"model": model, "priority": priority, "user": user, "prompt": "hi",
                       "max_tokens": 2}, ensure_ascii=True).encode()
    if raw_surrogate:  # the escape JSON allows and no database stores
        body = body.replace(b'"prompt"', b'"m": "\\ud800", "prompt"', 1)
    status, answer = _call(server, key, "POST", "/v1/completions", body)
    assert status < 500, answer
    status, answer = _call(server, key, "POST", "/v1/completions",
                           json.dumps(completion()).encode())
    assert status == 200, answer
    status, answer = _call(server, key, "GET", "/v1/usage")
    assert status == 200, answer
    usage = json.loads(answer)
    assert usage["requests"] == before + 2 and sum(usage["by_status"].values()) == before + 2

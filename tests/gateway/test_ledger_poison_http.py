"""Issue 13: a request whose model name no database stores (NUL, a lone surrogate, control
characters, too long) must not stop usage recording for anyone, through the real gateway."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import select

from tenants.models import UsageRow
from tests.gateway.helpers import completion, start_gateway

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

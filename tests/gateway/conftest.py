"""Fixtures of the gateway tests; helpers live in tests/gateway/helpers.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.app import make_app
from gateway.config import GatewayConfig
from tenants import TenantStore
from tests.gateway.helpers import SIM_ENGINE, ServerThread, create_tenants


@pytest.fixture
def db_url(tmp_path: Any) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"


@pytest.fixture
async def store(db_url: str) -> Any:
    """A tenant store on this test's SQLite database."""
    store = TenantStore(db_url)
    await store.init()
    yield store
    await store.close()


@pytest.fixture
def served_gateway(tmp_path: Any) -> Iterator[tuple[ServerThread, str]]:
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'served.db'}"
    keys = asyncio.run(create_tenants(db_url, {"acme": {}}))
    config = GatewayConfig(demo_tenant=False, max_body_bytes=4096)
    with ServerThread(make_app(config, engine=SIM_ENGINE, database=db_url)) as server:
        yield server, keys["acme"]



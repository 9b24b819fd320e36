"""Fixtures of the fault suite: a PostgreSQL database per test module behind a proxy the test
controls, real `fairgate engine` and `fairgate serve` processes, and after every test a check
that no process printed a key.

Each test starts its own processes (a fault leaves them in a state no other test should
inherit); a module's tests share its database, each with its own tenants. The suite is skipped,
with the reason, when PostgreSQL (FAIRGATE_TEST_PG, default postgres@127.0.0.1:5432) is
unreachable.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.faults.cluster import Cluster, Fleet, StartCluster, leaked, start_cluster, stop_all
from tests.faults.proxy import TcpProxy
from tests.support import postgres
from tests.support.postgres import PG_HOST, PG_PORT, PG_USER


@pytest.fixture(scope="session")
def postgres_unreachable() -> str | None:
    reason = postgres.unreachable()
    return None if reason is None else f"{reason}; the fault suite needs it"


@pytest.fixture(scope="module")
def database(postgres_unreachable: str | None) -> Iterator[str]:
    """A fresh database for this module (and this xdist worker), dropped at the end."""
    with postgres.fresh_database_or_skip("fg_faults", postgres_unreachable) as name:
        yield name


@pytest.fixture
def database_url(database: str) -> str:
    """The database directly: for the tenants CLI and for reading fg_usage."""
    return f"postgresql://{PG_USER}@{PG_HOST}:{PG_PORT}/{database}"


@pytest.fixture
def pg_proxy() -> Iterator[TcpProxy]:
    with TcpProxy(PG_HOST, PG_PORT) as proxy:
        yield proxy


@pytest.fixture(autouse=True)
def fleet() -> Iterator[Fleet]:
    """Every process a test starts. Afterwards: all stopped, and none may have printed an API
    key or the admin key (nor their secret part, after the display prefix)."""
    started = Fleet()
    yield started
    stop_all(started.services)
    found = leaked(started.services, started.secrets)
    assert not found, "keys in the processes' output:\n" + "\n".join(found)


@pytest.fixture
async def cluster(fleet: Fleet, pg_proxy: TcpProxy, database: str, database_url: str,
                  tmp_path: Path) -> AsyncIterator[StartCluster]:
    """`await cluster(engines=2, settings={...}, backend={...})`: a running deployment with
    tenants `acme` and `beta` (named uniquely per test: `Cluster.tenants`), its gateway's
    database through `pg_proxy`. Its processes stop before the proxy does, so the gateway's
    last flush still gets through."""
    suffix = uuid.uuid4().hex[:8]

    async def start(engines: int = 1, tenants: tuple[str, ...] = ("acme", "beta"),
                    **kwargs: Any) -> Cluster:
        return await start_cluster(
            fleet, tmp_path, engines=engines, admin_database=database_url,
            gateway_database=f"postgresql://{PG_USER}@127.0.0.1:{pg_proxy.port}/{database}",
            tenants={t: f"{t}-{suffix}" for t in tenants}, **kwargs)

    yield start
    pg_proxy.up()
    stop_all(fleet.services)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
        yield s

"""Fixtures for the tenants tests: every store test runs on SQLite and on PostgreSQL.

Each pytest process (xdist worker) gets its own randomly named PostgreSQL database, dropped at the
end, so workers never collide; each test starts from an empty schema. PostgreSQL tests are skipped,
with the reason, when 127.0.0.1:5432 is unreachable.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tenants import TenantStore
from tests.support import postgres
from tests.support.postgres import PG_SERVER, pg_exec


@pytest.fixture(scope="session")
def postgres_unreachable() -> str | None:
    """None when PostgreSQL answers, else why not (the skip reason)."""
    return postgres.unreachable()


@pytest.fixture(scope="session")
def postgres_database(postgres_unreachable: str | None) -> Iterator[str]:
    """A database private to this pytest process (xdist worker), dropped at the end."""
    with postgres.fresh_database_or_skip("fg_test", postgres_unreachable) as name:
        yield name


@pytest.fixture
def postgres_url(postgres_database: str) -> str:
    """An empty database for this test: the worker's database with its schema recreated.

    (CREATE DATABASE costs ~1 s; recreating the schema costs milliseconds and leaves the same
    empty database for the migrations to build on.)
    """
    postgres.run(pg_exec("DROP SCHEMA public CASCADE; CREATE SCHEMA public", postgres_database))
    return f"postgresql+asyncpg://{PG_SERVER}/{postgres_database}"


@pytest.fixture
def sqlite_path(tmp_path: Path) -> Path:
    return tmp_path / "fairgate.db"


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, sqlite_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite+aiosqlite:///{sqlite_path}"
    return str(request.getfixturevalue("postgres_url"))


@pytest.fixture
async def store(database_url: str) -> AsyncIterator[TenantStore]:
    s = TenantStore(database_url)
    await s.init()
    try:
        yield s
    finally:
        await s.close()


@pytest.fixture
async def sqlite_store(sqlite_path: Path) -> AsyncIterator[TenantStore]:
    """For behaviour that never reaches the database (parsing, validation)."""
    s = TenantStore(f"sqlite+aiosqlite:///{sqlite_path}")
    await s.init()
    try:
        yield s
    finally:
        await s.close()

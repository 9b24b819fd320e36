"""Fixtures for the tenants tests: every store test runs on SQLite and on PostgreSQL.

Each pytest process (xdist worker) gets its own randomly named PostgreSQL database, dropped at the
end, so workers never collide; each test starts from an empty schema. PostgreSQL tests are skipped,
with the reason, when 127.0.0.1:5432 is unreachable.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tenants import TenantStore

PG_SERVER = os.environ.get("FAIRGATE_TEST_PG", "postgres@127.0.0.1:5432")


def _run(coro: object) -> object:
    # A private loop: asyncio.run() would clobber the loop pytest-asyncio manages.
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)  # type: ignore[arg-type]
    finally:
        loop.close()


async def _pg_exec(sql: str, database: str = "postgres") -> None:
    import asyncpg

    conn = await asyncpg.connect(f"postgresql://{PG_SERVER}/{database}", timeout=3)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


@pytest.fixture(scope="session")
def postgres_unreachable() -> str | None:
    """None when PostgreSQL answers, else why not (the skip reason)."""
    try:
        _run(_pg_exec("SELECT 1"))
    except Exception as exc:  # any failure means "cannot test against it here"
        return f"PostgreSQL at {PG_SERVER} is unreachable ({type(exc).__name__}: {exc})"
    return None


@pytest.fixture(scope="session")
def postgres_database(postgres_unreachable: str | None) -> Iterator[str]:
    """A database private to this pytest process (xdist worker), dropped at the end."""
    if postgres_unreachable:
        pytest.skip(postgres_unreachable)
    name = f"fg_test_{uuid.uuid4().hex[:12]}"
    _run(_pg_exec(f'CREATE DATABASE "{name}"'))
    try:
        yield name
    finally:
        _run(_pg_exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@pytest.fixture
def postgres_url(postgres_database: str) -> str:
    """An empty database for this test: the worker's database with its schema recreated.

    (CREATE DATABASE costs ~1 s; recreating the schema costs milliseconds and leaves the same
    empty database for the migrations to build on.)
    """
    _run(_pg_exec("DROP SCHEMA public CASCADE; CREATE SCHEMA public", postgres_database))
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

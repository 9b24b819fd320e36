"""The PostgreSQL the tests use (FAIRGATE_TEST_PG: user@host:port, trust auth; default
postgres@127.0.0.1:5432): reach it, tell why not, and make throwaway databases on it."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

T = TypeVar("T")

PG_SERVER = os.environ.get("FAIRGATE_TEST_PG", "postgres@127.0.0.1:5432")
PG_USER, _, _where = PG_SERVER.rpartition("@")
PG_HOST, _, _port = _where.partition(":")
PG_PORT = int(_port or 5432)


def run(coro: Coroutine[Any, Any, T]) -> T:
    """`coro` on a private loop: asyncio.run() would clobber the loop pytest-asyncio manages."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


async def pg_exec(sql: str, database: str = "postgres") -> None:
    import asyncpg

    conn = await asyncpg.connect(f"postgresql://{PG_SERVER}/{database}", timeout=3)
    try:
        await conn.execute(sql)
    finally:
        await conn.close()


def unreachable() -> str | None:
    """None when PostgreSQL answers, else why not (a skip reason)."""
    try:
        run(pg_exec("SELECT 1"))
    except Exception as exc:  # any failure means "cannot test against it here"
        return f"PostgreSQL at {PG_SERVER} is unreachable ({type(exc).__name__}: {exc})"
    return None


@contextmanager
def fresh_database(prefix: str) -> Iterator[str]:
    """A new, randomly named database for the block, dropped after it."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    run(pg_exec(f'CREATE DATABASE "{name}"'))
    try:
        yield name
    finally:
        run(pg_exec(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@contextmanager
def fresh_database_or_skip(prefix: str, unreachable: str | None) -> Iterator[str]:
    """fresh_database(prefix); the test skipped instead, with `unreachable` as the reason, when
    that is not None (what unreachable() said)."""
    if unreachable is not None:
        pytest.skip(unreachable)
    with fresh_database(prefix) as name:
        yield name

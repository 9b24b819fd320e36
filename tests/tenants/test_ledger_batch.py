"""The ledger's batch insert (RowInsert, compiled once: multi-row blocks on SQLite, one
executemany of tuples on PostgreSQL) stores every column of every row as the row was normalised,
and as SQLAlchemy's Core insert of dicts does."""

from __future__ import annotations

import dataclasses
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import event, select
from sqlalchemy.dialects.sqlite import aiosqlite
from sqlalchemy.ext.asyncio import AsyncSession

import tenants.ledger
from tenants import TenantStore, UsageEvent, UsageLedger
from tenants.ledger import _BLOCK_ROWS, RowInsert, _event_row, block_sizes, normalise_row
from tenants.models import UsageHourRow, UsageMinuteRow, UsageRow


def events() -> list[UsageEvent]:
    base: dict[str, Any] = dict(tenant="acme", key_id="key_1", model="random:tiny",
                                priority="interactive", prompt_tokens=10, completion_tokens=5,
                                status=200, queue_time=0.01, ttft=0.1, e2e=0.5,
                                created_at=1_700_000_000.25)
    return [
        UsageEvent(**base),
        UsageEvent(**{**base, "status": 429, "prompt_tokens": 0, "completion_tokens": 0,
                      "ttft": None, "e2e": None, "queue_time": None, "slo_ttft": False,
                      "slo_tpot": False, "itl_gaps": 1, "itl_gaps_met": 0}),
        UsageEvent(**{**base, "tenant": "other", "key_id": None, "tpot": 0.02,
                      "slo_ttft": True, "slo_tpot": False, "itl_gaps": 15, "itl_gaps_met": 14,
                      "backend": "http://engine-1:8000", "cached_tokens": 3,
                      "created_at": 1_700_000_100}),  # an int timestamp: stored as a float
    ]


async def stored(store: TenantStore) -> list[dict[str, Any]]:
    async def op(s: AsyncSession) -> list[dict[str, Any]]:
        rows = (await s.scalars(select(UsageRow).order_by(UsageRow.id))).all()
        return [{c: getattr(r, c) for c in RowInsert(store.db.engine.dialect).names}
                for r in rows]

    return await store.db.run(op, write=False)


async def test_batch_stores_the_normalised_rows(store: TenantStore) -> None:
    ledger = UsageLedger(store)
    batch = events()
    ledger.record_many(batch)
    assert await ledger.flush() == len(batch)
    assert await stored(store) == [normalise_row(_event_row(e)) for e in batch]
    assert RowInsert(store.db.engine.dialect).sql is not None  # the executemany of tuples ran
    await ledger.close()


async def test_batch_matches_sqlalchemy_core_insert(store: TenantStore) -> None:
    ledger = UsageLedger(store)
    ledger.record_many(events())
    await ledger.flush()
    fast = await stored(store)
    ledger._insert = RowInsert(store.db.engine.dialect)
    ledger._insert.sql = None  # SQLAlchemy's Core executemany of dicts instead
    ledger.record_many(events())
    await ledger.flush()
    both = await stored(store)
    assert both[len(fast):] == fast
    await ledger.close()


@given(st.integers(0, 10_000))
def test_block_sizes_cover_the_rows_in_few_distinct_statements(rows: int) -> None:
    sizes = block_sizes(rows)
    assert sum(sizes) == rows
    assert all(size & (size - 1) == 0 and 1 <= size <= _BLOCK_ROWS for size in sizes)
    assert sizes == sorted(sizes, reverse=True)
    rest = [size for size in sizes if size < _BLOCK_ROWS]
    assert len(rest) == len(set(rest))  # a power of two at most once: the statements stay few


def test_a_block_of_rows_fits_sqlites_parameter_limit() -> None:
    limit = 32_766 if sqlite3.sqlite_version_info >= (3, 32, 0) else 999  # SQLite's default
    columns = len(RowInsert(aiosqlite.dialect()).names)
    assert _BLOCK_ROWS * columns <= limit
    for model in (UsageMinuteRow, UsageHourRow):  # the rollups' upserts, in blocks too
        assert _BLOCK_ROWS * len(model.__table__.columns) <= limit
    blocks = RowInsert(aiosqlite.dialect()).blocks
    assert blocks is not None and blocks.sql(3).count("?") == 3 * columns


def numbered(rows: int) -> list[UsageEvent]:
    first = events()[2]
    return [dataclasses.replace(first, prompt_tokens=i, created_at=1_700_000_000 + i / 7)
            for i in range(rows)]


def inserts_seen(store: TenantStore, table: str = "fg_usage") -> list[tuple[bool, int]]:
    """(executemany, rows in the statement) of every INSERT into `table` from now on."""
    seen: list[tuple[bool, int]] = []

    def before(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any,
               executemany: bool) -> None:
        if statement.startswith(f"INSERT INTO {table} ("):
            seen.append((executemany, statement.count("), (") + 1))

    event.listen(store.db.engine.sync_engine, "before_cursor_execute", before)
    return seen


@pytest.mark.parametrize("rows", [1, 3, 255, 256, 257, 600])
async def test_a_flush_goes_in_blocks_on_sqlite_and_stores_every_row(store: TenantStore,
                                                                      rows: int) -> None:
    ledger = UsageLedger(store)
    batch = numbered(rows)
    seen = inserts_seen(store)
    ledger.record_many(batch)
    assert await ledger.flush() == rows
    assert await stored(store) == [normalise_row(_event_row(e)) for e in batch]
    if store.db.is_postgres:  # asyncpg: one executemany of one-row statements
        assert len(seen) == 1 and seen[0][1] == 1
    else:  # one multi-row statement per block, none an executemany
        assert seen == [(False, size) for size in block_sizes(rows)]
    await ledger.close()


async def test_a_refused_row_in_a_block_is_set_aside_alone(store: TenantStore,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path) -> None:
    monkeypatch.setattr(tenants.ledger, "normalise_row", dict)  # the rows as the events hold them
    batch = numbered(300)
    bad = "a\x00b" if store.db.is_postgres else "a\ud800b"  # a model name the database refuses
    batch[270] = dataclasses.replace(batch[270], model=bad)
    ledger = UsageLedger(store, dead_letter_path=tmp_path / "dead.jsonl")
    ledger.record_many(batch)
    assert await ledger.flush() == 299
    assert ledger.dead_lettered == 1 and ledger.pending == 0
    assert [row["prompt_tokens"] for row in await stored(store)] == [
        i for i in range(300) if i != 270]
    assert [d.row["prompt_tokens"] for d in await ledger.dead_letters()] == [270]
    await ledger.close()


async def test_rollups_go_in_blocks_on_sqlite_and_add_up(store: TenantStore) -> None:
    """A flush's rollups, one per tenant and period: many tenants' in blocks on SQLite, and a
    second flush of the same minute adds to what the first wrote (the upsert's update)."""
    tenants = [f"tenant-{i:03d}" for i in range(300)]
    batch = [dataclasses.replace(events()[0], tenant=t) for t in tenants]  # one minute, one hour
    seen = {table: inserts_seen(store, table) for table in ("fg_usage_minutes", "fg_usage_hours")}
    ledger = UsageLedger(store)
    for _ in range(2):
        ledger.record_many(batch)
        assert await ledger.flush() == len(batch)

    async def counts(s: AsyncSession) -> list[dict[str, int]]:
        return [{t: r for t, r in (await s.execute(select(model.tenant, model.requests))).all()}
                for model in (UsageMinuteRow, UsageHourRow)]

    assert await store.db.run(counts, write=False) == [dict.fromkeys(tenants, 2)] * 2
    for statements in seen.values():
        if store.db.is_postgres:  # one executemany a flush
            assert statements == [(True, 1)] * 2
        else:
            assert statements == [(False, size) for size in block_sizes(300)] * 2
    await ledger.close()

"""The ledger's batch insert (RowInsert: one executemany of tuples, compiled once) stores every
column of every row as the row was normalised, and as SQLAlchemy's Core insert of dicts does."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from tenants import TenantStore, UsageEvent, UsageLedger
from tenants.ledger import RowInsert, _event_row, normalise_row
from tenants.models import UsageRow


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

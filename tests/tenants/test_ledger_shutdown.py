"""Shutdown during a database outage loses no usage (issue 13's fault suite found it): `close`
keeps trying while the database is briefly away, and when it stays away the records are kept in
a spill file that the next start writes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tenants import TenantStore, UsageEvent, UsageLedger
from tests.faults.proxy import TcpProxy
from tests.support.waiting import wait_for


def event(n: int) -> UsageEvent:
    return UsageEvent(tenant="acme", key_id="k", model="m", priority="interactive",
                      prompt_tokens=n, completion_tokens=1, status=200)


@pytest.fixture
def proxy(postgres_database: str) -> Iterator[TcpProxy]:
    with TcpProxy("127.0.0.1", 5432) as p:
        yield p


def _url(proxy: TcpProxy, database: str) -> str:
    return f"postgresql+asyncpg://postgres@127.0.0.1:{proxy.port}/{database}"


@pytest.mark.postgres
async def test_close_waits_out_a_short_outage(proxy: TcpProxy, postgres_url: str,
                                              postgres_database: str, tmp_path: Path) -> None:
    store = TenantStore(_url(proxy, postgres_database))
    await store.init()
    ledger = UsageLedger(store, spill_path=tmp_path / "spill.jsonl")
    await ledger.start()
    ledger.record_many(event(n) for n in (1, 2, 3))
    proxy.down()
    refused = proxy.refused
    closing = asyncio.create_task(ledger.close(timeout=30))
    await wait_for(lambda: proxy.refused > refused, timeout=10)  # a write was tried and failed
    proxy.up()
    await closing
    assert ledger.pending == 0 and not (tmp_path / "spill.jsonl").exists()
    await store.close()
    check = TenantStore(postgres_url)
    await check.init()
    assert (await UsageLedger(check).totals("acme"))["prompt_tokens"] == 6
    await check.close()


@pytest.mark.postgres
async def test_a_long_outage_spills_and_the_next_start_writes_it(
        proxy: TcpProxy, postgres_url: str, postgres_database: str, tmp_path: Path) -> None:
    spill = tmp_path / "spill.jsonl"
    store = TenantStore(_url(proxy, postgres_database))
    await store.init()
    ledger = UsageLedger(store, spill_path=spill)
    await ledger.start()
    ledger.record_many(event(n) for n in (1, 2, 3))
    proxy.down()
    await ledger.close(timeout=0.3)
    assert ledger.pending == 0 and len(spill.read_text().splitlines()) == 3
    await store.close()

    proxy.up()
    again = TenantStore(_url(proxy, postgres_database))
    await again.init()
    restarted = UsageLedger(again, spill_path=spill)
    await restarted.start()
    assert not spill.exists()
    assert (await restarted.totals("acme"))["prompt_tokens"] == 6
    await restarted.close()
    await again.close()


@pytest.mark.postgres
async def test_without_a_spill_path_close_still_raises(proxy: TcpProxy,
                                                       postgres_database: str) -> None:
    store = TenantStore(_url(proxy, postgres_database))
    await store.init()
    ledger = UsageLedger(store)
    ledger.record(event(1))
    proxy.down()
    with pytest.raises(Exception):  # noqa: B017 - whatever the driver raises for a lost server
        await ledger.close(timeout=0.2)
    assert ledger.pending == 1  # kept, not dropped
    proxy.up()
    await store.close()

from __future__ import annotations

import asyncio
import time

import pytest

from tenants import LedgerFullError, TenantStore, UsageEvent, UsageLedger
from tests.support.waiting import wait_for


def event(tenant: str = "acme", **over: object) -> UsageEvent:
    fields: dict[str, object] = dict(
        tenant=tenant, key_id="key_1", model="random:tiny", priority="interactive",
        prompt_tokens=10, completion_tokens=5, status=200, queue_time=0.01, ttft=0.1, e2e=0.5,
    )
    fields.update(over)
    return UsageEvent(**fields)  # type: ignore[arg-type]


async def test_totals_by_status_and_tenant(store: TenantStore) -> None:
    ledger = UsageLedger(store)
    ledger.record_many([event(), event(prompt_tokens=20, completion_tokens=7), event(status=429,
                        completion_tokens=0, ttft=None, e2e=None), event("other")])
    assert ledger.pending == 4
    assert await ledger.flush() == 4 and ledger.pending == 0
    totals = await ledger.totals("acme", window_s=60)
    assert totals == {"requests": 3, "prompt_tokens": 40, "completion_tokens": 12,
                      "by_status": {200: 2, 429: 1}}
    assert (await ledger.totals("nobody", 60))["requests"] == 0
    await ledger.close()


async def test_window_excludes_old_records(store: TenantStore) -> None:
    ledger = UsageLedger(store)
    old = time.time() - 3600
    ledger.record(event(created_at=old, finished_at=old + 1))
    ledger.record(event())
    await ledger.close()
    assert (await ledger.totals("acme", window_s=60))["requests"] == 1
    assert (await ledger.totals("acme", window_s=None))["requests"] == 2


async def test_percentiles_nearest_rank(store: TenantStore) -> None:
    ledger = UsageLedger(store)
    for i in range(1, 101):  # ttft 0.01..1.00, completion tokens 1..100
        ledger.record(event(ttft=i / 100, e2e=i / 10, queue_time=i / 1000, completion_tokens=i))
    ledger.record(event(ttft=None, e2e=None, queue_time=None, status=500, completion_tokens=0))
    await ledger.close()
    p = await ledger.latency_percentiles("acme", 60)
    assert p["ttft"] == {50: 0.5, 90: 0.9, 99: 0.99}
    assert p["e2e"][99] == pytest.approx(9.9) and p["queue_time"][50] == pytest.approx(0.05)
    assert await ledger.output_tokens_percentile("acme", 60, 90) == 90  # the 500 is ignored
    assert await ledger.output_tokens_percentile("nobody", 60, 90) is None
    assert (await ledger.latency_percentiles("nobody", 60, (50,)))["ttft"] == {50: None}


async def test_background_flush_and_close_lose_nothing(store: TenantStore) -> None:
    ledger = UsageLedger(store, flush_interval=0.05)
    await ledger.start()
    ledger.record_many(event() for _ in range(10))
    # the timer flushes without being asked
    await wait_for(lambda: ledger.pending == 0 and ledger.flushed == 10, timeout=30)
    ledger.record_many(event() for _ in range(500))
    await ledger.close()  # graceful shutdown: everything still buffered is written
    assert (await ledger.totals("acme"))["requests"] == 510
    with pytest.raises(RuntimeError, match="closed"):
        ledger.record(event())


async def test_full_buffer_wakes_the_flusher(store: TenantStore) -> None:
    ledger = UsageLedger(store, flush_interval=60, max_pending=5)
    await ledger.start()
    ledger.record_many(event() for _ in range(5))  # reaching max_pending flushes now, not in 60 s
    await wait_for(lambda: ledger.flushed == 5, timeout=10)
    await ledger.close()


async def test_backpressure_when_database_does_not_keep_up(store: TenantStore) -> None:
    ledger = UsageLedger(store, max_pending=5)  # no flusher running: nothing drains the buffer
    ledger.record_many(event() for _ in range(10))
    with pytest.raises(LedgerFullError):
        ledger.record(event())  # refused loudly, never dropped silently
    await ledger.close()
    assert (await ledger.totals("acme"))["requests"] == 10


async def test_failed_flush_keeps_the_batch(store: TenantStore, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = UsageLedger(store)
    ledger.record_many(event(prompt_tokens=i) for i in range(3))
    real_write = ledger._write

    async def broken(batch: object) -> None:
        raise ConnectionError("database went away")

    monkeypatch.setattr(ledger, "_write", broken)
    with pytest.raises(ConnectionError):
        await ledger.flush()
    assert ledger.pending == 3
    ledger.record(event(prompt_tokens=3))
    monkeypatch.setattr(ledger, "_write", real_write)
    await ledger.close()
    assert (await ledger.totals("acme"))["prompt_tokens"] == 0 + 1 + 2 + 3


async def test_a_flush_writes_what_was_buffered_when_it_was_called(
        store: TenantStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Records that come while a flush writes wait for the next flush: under steady traffic a
    flush that took them too wrote a few rows at a time, back to back, and never returned."""
    ledger = UsageLedger(store)
    ledger.record_many(event(prompt_tokens=1) for _ in range(3))
    real_write = ledger._write
    batches: list[int] = []

    async def write_while_requests_finish(rows: list[dict[str, object]]) -> None:
        batches.append(len(rows))
        ledger.record(event(prompt_tokens=100))  # a request ends while the batch is written
        await real_write(rows)

    monkeypatch.setattr(ledger, "_write", write_while_requests_finish)
    async with asyncio.timeout(30):  # the flush that chased new records never returned here
        assert await ledger.flush() == 3
    assert batches == [3] and ledger.pending == 1
    # two flushes at once: the second takes, once it has the lock, what is buffered then
    async with asyncio.timeout(30):
        assert await asyncio.gather(ledger.flush(), ledger.flush()) == [1, 1]
    assert batches == [3, 1, 1] and ledger.pending == 1
    monkeypatch.setattr(ledger, "_write", real_write)
    await ledger.close()
    assert (await ledger.totals("acme"))["prompt_tokens"] == 3 + 3 * 100

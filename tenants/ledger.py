"""UsageLedger: write-behind usage records and the queries over them.

`record()` is synchronous and O(1): it appends to an in-memory buffer that a background task
writes in one transaction per batch every `flush_interval` seconds. At `max_pending` buffered
events the flusher is woken at once; if the database cannot keep up (or is down) and the buffer
reaches twice that, `record()` raises `LedgerFullError` - loud backpressure the gateway turns into
a 503, never a silent drop. A failed flush keeps its batch and retries. `close()` flushes
everything and raises if it cannot, so a graceful shutdown loses nothing.

Queries see flushed records only (call `flush()` first when that matters). Percentiles are
nearest-rank, computed in SQL with ORDER BY/OFFSET so they work alike on SQLite and PostgreSQL
and never load a whole window into memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.sql.elements import ColumnElement

from tenants.models import UsageRow
from tenants.store import TenantStore
from tenants.values import UsageEvent

log = logging.getLogger(__name__)

_INSERT_CHUNK = 2_000
LATENCY_COLUMNS = ("ttft", "e2e", "queue_time")


class LedgerFullError(RuntimeError):
    """The usage buffer is full because the database is not keeping up."""


def _event_row(e: UsageEvent) -> dict[str, Any]:
    return {
        "tenant": e.tenant,
        "key_id": e.key_id,
        "model": e.model,
        "priority": e.priority,
        "prompt_tokens": int(e.prompt_tokens),
        "completion_tokens": int(e.completion_tokens),
        "status": int(e.status),
        "queue_time": e.queue_time,
        "ttft": e.ttft,
        "e2e": e.e2e,
        "created_at": float(e.created_at),
        "finished_at": float(e.finished()),
    }


class UsageLedger:
    def __init__(
        self, store: TenantStore, flush_interval: float = 1.0, max_pending: int = 100_000
    ) -> None:
        if flush_interval <= 0 or max_pending <= 0:
            raise ValueError("flush_interval and max_pending must be > 0")
        self.store = store
        self.flush_interval = flush_interval
        self.max_pending = max_pending
        self._pending: list[UsageEvent] = []
        self._wake = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.flushed = 0  # records written so far, for metrics and tests

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="usage-ledger-flush")

    def record(self, event: UsageEvent) -> None:
        """Buffer one event; never blocks. Raises LedgerFullError rather than drop it."""
        if self._closed:
            raise RuntimeError("usage ledger is closed")
        if len(self._pending) >= 2 * self.max_pending:
            raise LedgerFullError(f"{len(self._pending)} usage records waiting for the database")
        self._pending.append(event)
        if len(self._pending) >= self.max_pending:
            self._wake.set()

    def record_many(self, events: Iterable[UsageEvent]) -> None:
        for e in events:
            self.record(e)

    async def flush(self) -> int:
        """Write everything buffered so far; returns how many records were written."""
        async with self._flush_lock:
            written = 0
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await self._write(batch)
                except BaseException:
                    self._pending[:0] = batch  # keep order; retried on the next flush
                    raise
                written += len(batch)
                self.flushed += len(batch)
            return written

    async def _write(self, batch: list[UsageEvent]) -> None:
        rows = [_event_row(e) for e in batch]

        async def op(s: AsyncSession) -> None:
            for i in range(0, len(rows), _INSERT_CHUNK):
                await s.execute(insert(UsageRow), rows[i : i + _INSERT_CHUNK])

        await self.store.db.run(op)

    async def _run(self) -> None:
        while not self._closed:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.flush_interval)
            self._wake.clear()
            try:
                await self.flush()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the loop alive; the batch stays buffered
                log.warning("usage flush failed (%d pending): %s", self.pending, exc)

    async def close(self) -> None:
        """Stop the background task and write everything; raises if that fails."""
        self._closed = True
        if self._task is not None:
            # Let the loop finish on its own: cancelling it mid-commit could leave a batch both
            # written and back in the buffer, i.e. recorded twice.
            self._wake.set()
            await self._task
            self._task = None
        await self.flush()

    # -- queries ------------------------------------------------------------------------------

    @staticmethod
    def _where(tenant: str, window_s: float | None) -> list[ColumnElement[bool]]:
        clauses = [UsageRow.tenant == tenant]
        if window_s is not None:
            clauses.append(UsageRow.finished_at >= time.time() - window_s)
        return clauses

    async def totals(self, tenant: str, window_s: float | None = None) -> dict[str, Any]:
        """Requests and tokens of `tenant` over the last `window_s` seconds (None: all time)."""
        where = self._where(tenant, window_s)

        async def op(s: AsyncSession) -> dict[str, Any]:
            by_status = (
                await s.execute(
                    select(
                        UsageRow.status,
                        func.count(),
                        func.coalesce(func.sum(UsageRow.prompt_tokens), 0),
                        func.coalesce(func.sum(UsageRow.completion_tokens), 0),
                    )
                    .where(*where)
                    .group_by(UsageRow.status)
                )
            ).all()
            return {
                "requests": sum(int(r[1]) for r in by_status),
                "prompt_tokens": sum(int(r[2]) for r in by_status),
                "completion_tokens": sum(int(r[3]) for r in by_status),
                "by_status": {int(r[0]): int(r[1]) for r in by_status},
            }

        return await self.store.db.run(op, write=False)

    async def latency_percentiles(
        self,
        tenant: str,
        window_s: float | None = None,
        percentiles: Sequence[float] = (50, 90, 99),
    ) -> dict[str, dict[float, float | None]]:
        """{"ttft"|"e2e"|"queue_time": {p: seconds or None when no data}}."""
        where = self._where(tenant, window_s)

        async def op(s: AsyncSession) -> dict[str, dict[float, float | None]]:
            return {
                name: await _percentiles(s, getattr(UsageRow, name), where, percentiles)
                for name in LATENCY_COLUMNS
            }

        return await self.store.db.run(op, write=False)

    async def output_tokens_percentile(
        self, tenant: str, window_s: float | None, percentile: float = 90
    ) -> float | None:
        """Completion tokens at `percentile` over successful (2xx) requests; None if none.

        Errors are left out: their near-zero outputs would make cost estimates too low.
        """
        where = [*self._where(tenant, window_s), UsageRow.status.between(200, 299)]

        async def op(s: AsyncSession) -> float | None:
            found = await _percentiles(s, UsageRow.completion_tokens, where, (percentile,))
            return found[percentile]

        return await self.store.db.run(op, write=False)


async def _percentiles(
    s: AsyncSession, column: Any, where: list[ColumnElement[bool]], percentiles: Sequence[float]
) -> dict[float, float | None]:
    where = [*where, column.is_not(None)]
    count = int(await s.scalar(select(func.count()).select_from(UsageRow).where(*where)) or 0)
    result: dict[float, float | None] = {}
    for p in percentiles:
        if not 0 < p <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {p}")
        if count == 0:
            result[p] = None
            continue
        rank = max(1, math.ceil(p / 100 * count))  # nearest-rank definition
        value = await s.scalar(
            select(column).where(*where).order_by(column).offset(rank - 1).limit(1)
        )
        result[p] = float(value) if value is not None else None
    return result

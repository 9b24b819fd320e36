"""Tuning jobs' rows (`fg_tune_jobs`): what control/jobs.py keeps so that a job outlives the
gateway process that runs it. A state change is one conditional UPDATE (`transition`), so two
callers racing (a cancel and a worker's exit, two gateways) cannot both win."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.db import Database
from tenants.models import TuneJobRow

JOB_STATES = ("queued", "running", "succeeded", "failed", "cancelled", "interrupted")
ACTIVE_STATES = ("queued", "running")


@dataclass(frozen=True)
class JobRecord:
    id: str
    spec: dict[str, Any]
    state: str
    target: str | None
    study: str
    out_dir: str
    planned_trials: int | None
    runs: int
    owner: str | None
    error: str | None
    apply: dict[str, Any] | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    updated_at: float

    @classmethod
    def of(cls, row: TuneJobRow) -> JobRecord:
        return cls(row.id, json.loads(row.spec_json), row.state, row.target, row.study,
                   row.out_dir, row.planned_trials, row.runs, row.owner, row.error,
                   None if row.apply_json is None else json.loads(row.apply_json),
                   row.created_at, row.started_at, row.finished_at, row.updated_at)


class JobStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def create(self, job_id: str, spec: dict[str, Any], target: str | None, study: str,
                     out_dir: str, planned_trials: int | None) -> JobRecord:
        now = time.time()
        row = TuneJobRow(id=job_id, spec_json=json.dumps(spec, sort_keys=True), state="queued",
                         target=target, study=study, out_dir=out_dir,
                         planned_trials=planned_trials, runs=0, created_at=now, updated_at=now)

        async def op(s: AsyncSession) -> JobRecord:
            s.add(row)
            await s.flush()
            return JobRecord.of(row)

        return await self.db.run(op)

    async def get(self, job_id: str) -> JobRecord | None:
        async def op(s: AsyncSession) -> JobRecord | None:
            row = await s.get(TuneJobRow, job_id)
            return None if row is None else JobRecord.of(row)

        return await self.db.run(op, write=False)

    async def jobs(self, states: Iterable[str] | None = None) -> list[JobRecord]:
        async def op(s: AsyncSession) -> list[JobRecord]:
            query = select(TuneJobRow).order_by(TuneJobRow.created_at, TuneJobRow.id)
            if states is not None:
                query = query.where(TuneJobRow.state.in_(list(states)))
            return [JobRecord.of(r) for r in (await s.scalars(query)).all()]

        return await self.db.run(op, write=False)

    async def transition(self, job_id: str, from_states: Iterable[str], to: str,
                         **fields: Any) -> bool:
        """Move the job to `to` only if it is in one of `from_states` now; whether it moved."""
        values = {"state": to, "updated_at": time.time(), **_columns(fields)}

        async def op(s: AsyncSession) -> bool:
            result = await s.execute(update(TuneJobRow).where(
                TuneJobRow.id == job_id, TuneJobRow.state.in_(list(from_states))).values(**values))
            return bool(result.rowcount)  # type: ignore[attr-defined]

        return await self.db.run(op)

    async def update(self, job_id: str, **fields: Any) -> None:
        values = {"updated_at": time.time(), **_columns(fields)}

        async def op(s: AsyncSession) -> None:
            await s.execute(update(TuneJobRow).where(TuneJobRow.id == job_id).values(**values))

        await self.db.run(op)

    async def renew(self, job_ids: Iterable[str], owner: str) -> None:
        """The owner's lease on its running jobs: their updated_at, now."""
        ids = list(job_ids)
        if not ids:
            return

        async def op(s: AsyncSession) -> None:
            await s.execute(update(TuneJobRow).where(
                TuneJobRow.id.in_(ids), TuneJobRow.owner == owner,
                TuneJobRow.state == "running").values(updated_at=time.time()))

        await self.db.run(op)

    async def interrupt_orphans(self, gone: Callable[[JobRecord], bool], reason: str) -> list[str]:
        """Jobs `running` whose gateway is gone (`gone(job)`: its process died, or its lease
        ran out): `interrupted`, to be resumed. Their ids."""
        moved = []
        for job in await self.jobs(["running"]):
            if gone(job) and await self.transition(job.id, ["running"], "interrupted",
                                                   error=reason, owner=None):
                moved.append(job.id)
        return moved


def _columns(fields: dict[str, Any]) -> dict[str, Any]:
    out = dict(fields)
    if "apply" in out:
        value = out.pop("apply")
        out["apply_json"] = None if value is None else json.dumps(value, sort_keys=True)
    return out

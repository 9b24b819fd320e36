"""Two OS processes migrate, import and record usage into one database at once; none is lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from sqlalchemy import func, select

from tenants import TenantStore
from tenants.models import UsageHourRow, UsageMinuteRow, UsageRow

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("usage_worker.py")
EVENTS = 2000
TENANTS = "tenants:\n" + "".join(
    f"  - name: t{i}\n    weight: {i + 1}\n    keys: [{{create: true}}]\n" for i in range(3)
)


async def test_two_processes_lose_no_usage(database_url: str, tmp_path: Path) -> None:
    yaml_path = tmp_path / "tenants.yaml"
    yaml_path.write_text(TENANTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), database_url, str(yaml_path), name, str(EVENTS), "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        )
        for name in ("w1", "w2")
    ]
    outputs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, err[-6000:]  # the first frames say where
    reports = [json.loads(out) for out, _ in outputs]
    assert [r["flushed"] for r in reports] == [EVENTS, EVENTS]
    assert sum(r["new_keys"] for r in reports) == 3  # one key per tenant, whoever imported first

    store = TenantStore(database_url)
    try:
        async def count(s: object) -> dict[str, int]:
            rows = await s.execute(  # type: ignore[attr-defined]
                select(UsageRow.key_id, func.count()).group_by(UsageRow.key_id))
            return {k: int(n) for k, n in rows.all()}

        assert await store.db.run(count, write=False) == {"w1": EVENTS, "w2": EVENTS}

        async def rolled_up(s: object) -> tuple[int, int]:
            minutes = await s.execute(select(func.sum(UsageMinuteRow.requests)))  # type: ignore[attr-defined]
            hours = await s.execute(select(func.sum(UsageHourRow.requests)))  # type: ignore[attr-defined]
            return int(minutes.scalar() or 0), int(hours.scalar() or 0)

        # both processes upserted the same tenants' minutes and hours at once: no update lost,
        # no deadlock (each transaction takes its rollup rows in one sorted order)
        assert await store.db.run(rolled_up, write=False) == (2 * EVENTS, 2 * EVENTS)
        assert await store.count_tenants() == 3
        assert len(await store.list_keys()) == 3
    finally:
        await store.close()

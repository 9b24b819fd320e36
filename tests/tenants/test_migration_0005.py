"""Migration 0005 on SQLite and PostgreSQL: what a database at 0004 held as an "ITL" SLO (each
request's TPOT) is a TPOT SLO after it, the new per-gap ITL columns start empty, and the
downgrade puts everything back."""

from __future__ import annotations

import json
from typing import Any

from alembic import command
from sqlalchemy import text

from tenants import TenantStore, UsageEvent, UsageLedger
from tenants.db import Database
from tenants.migrate import alembic_config, migrate
from tenants.slo_views import period_counts

NOW = 1_796_000_000.0
MINUTE = int(NOW // 60)


async def _at_0004(url: str) -> None:
    """A database at 0004 with one tenant, one usage row, its rollups and one tune job, as the
    gateway wrote them then."""
    await migrate(url, "0004")
    db = Database(url)
    try:
        async with db.engine.begin() as conn:
            await conn.execute(text(
                "INSERT INTO fg_tenants (name, weight, default_priority, allowed_priorities, "
                "slo_ttft_p99_s, slo_itl_p99_s, enabled, created_at, updated_at) VALUES "
                "('acme', 1.0, 'interactive', 'interactive,batch', 0.5, 0.1, true, 0, 0)"))
            await conn.execute(text(
                "INSERT INTO fg_usage (tenant, model, priority, prompt_tokens, "
                "completion_tokens, status, created_at, finished_at, tpot, slo_ttft, slo_itl) "
                "VALUES ('acme', 'm', 'interactive', 10, 5, 200, :t, :t, 0.2, 1, 0)"),
                {"t": NOW - 10})
            for table, column, at in (("fg_usage_minutes", "minute", MINUTE),
                                      ("fg_usage_hours", "hour", int(NOW // 3600))):
                await conn.execute(text(
                    f"INSERT INTO {table} (tenant, {column}, requests, ok, rejected, failed, "
                    "prompt_tokens, completion_tokens, ttft_checked, ttft_met, itl_checked, "
                    f"itl_met, slo_checked, slo_met) VALUES ('acme', {at}, 1, 1, 0, 0, 10, 5, "
                    "1, 1, 1, 0, 1, 0)"))
            await conn.execute(text(
                "INSERT INTO fg_tune_jobs (id, spec_json, state, study, out_dir, runs, "
                "created_at, updated_at) VALUES ('job-000000000001', :spec, 'queued', 's', "
                "'/tmp/j', 0, 0, 0)"),
                {"spec": json.dumps({"mode": "sim", "slo_ttft_p99_s": 0.5,
                                     "slo_itl_p99_s": 0.05}, sort_keys=True)})
    finally:
        await db.dispose()


async def _rows(url: str, sql: str) -> list[dict[str, Any]]:
    db = Database(url)
    try:
        async with db.engine.connect() as conn:
            return [dict(r) for r in (await conn.execute(text(sql))).mappings()]
    finally:
        await db.dispose()


async def test_an_old_itl_slo_becomes_tpot_and_itl_starts_unset(database_url: str) -> None:
    await _at_0004(database_url)
    store = TenantStore(database_url)
    try:
        await store.init()  # migrates to the newest
        acme = await store.get_tenant("acme")
        assert acme is not None
        assert (acme.slo_ttft_p99_s, acme.slo_tpot_p99_s, acme.slo_itl_p99_s) == (0.5, 0.1, None)
        assert (acme.slo.tpot_s, acme.slo.itl_s) == (0.1, None)
        # what was measured against it moved with it; no gap was counted before
        [usage] = await _rows(database_url, "SELECT slo_ttft, slo_tpot, itl_gaps, itl_gaps_met "
                                            "FROM fg_usage")
        assert usage == {"slo_ttft": 1, "slo_tpot": 0, "itl_gaps": None, "itl_gaps_met": None}
        counts = (await period_counts(store.db, NOW))["acme"]["1h"]
        assert (counts["tpot_checked"], counts["tpot_met"], counts["slo_met"]) == (1, 0, 0)
        assert (counts["itl_gaps"], counts["itl_gaps_met"]) == (0, 0)
        [job] = await _rows(database_url, "SELECT spec_json FROM fg_tune_jobs")
        assert json.loads(job["spec_json"]) == {"mode": "sim", "slo_ttft_p99_s": 0.5,
                                                "slo_tpot_p99_s": 0.05}
        # the new columns take new rows: a tenant with all three, and the ledger's rollups
        await store.update_tenant("acme", slo_itl_p99_s=0.25)
        again = await store.get_tenant("acme")
        assert again is not None and again.slo_itl_p99_s == 0.25 and again.slo_tpot_p99_s == 0.1
        ledger = UsageLedger(store)
        ledger.record(UsageEvent(tenant="acme", key_id=None, model="m", priority="interactive",
                                 prompt_tokens=1, completion_tokens=4, status=200,
                                 created_at=NOW - 5, finished_at=NOW - 5, slo_tpot=True,
                                 itl_gaps_met=2, itl_gaps=3))
        await ledger.flush()
        counts = (await period_counts(store.db, NOW))["acme"]["1h"]
        assert (counts["tpot_checked"], counts["tpot_met"]) == (2, 1)
        assert (counts["itl_gaps"], counts["itl_gaps_met"]) == (3, 2)
    finally:
        await store.close()


async def test_the_downgrade_puts_the_old_names_back(database_url: str) -> None:
    await _at_0004(database_url)
    await migrate(database_url, "0005")
    db = Database(database_url)
    try:
        async with db.engine.begin() as conn:
            def downgrade(sync_conn: Any) -> None:
                cfg = alembic_config()
                cfg.attributes["connection"] = sync_conn
                command.downgrade(cfg, "0004")

            await conn.run_sync(downgrade)
    finally:
        await db.dispose()
    [tenant] = await _rows(database_url, "SELECT slo_ttft_p99_s, slo_itl_p99_s FROM fg_tenants")
    assert tenant == {"slo_ttft_p99_s": 0.5, "slo_itl_p99_s": 0.1}
    [usage] = await _rows(database_url, "SELECT slo_ttft, slo_itl FROM fg_usage")
    assert usage == {"slo_ttft": 1, "slo_itl": 0}
    [minute] = await _rows(database_url, "SELECT itl_checked, itl_met FROM fg_usage_minutes")
    assert minute == {"itl_checked": 1, "itl_met": 0}
    [job] = await _rows(database_url, "SELECT spec_json FROM fg_tune_jobs")
    assert json.loads(job["spec_json"])["slo_itl_p99_s"] == 0.05

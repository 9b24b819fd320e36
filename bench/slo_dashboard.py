"""How fast does the SLO dashboard's tenants view answer with 10 million usage rows in
PostgreSQL? The view reads the per-minute rollups (30 days of them) and the last hour of raw
rows; the baseline computes the same 30-day figures from the raw rows, in the same run.

    .venv/bin/python bench/slo_dashboard.py [--rows 10000000] [--tenants 20] [--repeats 5]
    .venv/bin/python bench/slo_dashboard.py --rows 200000        (a smoke run, seconds)

A fresh database `fg_bench_slo` on the test server (FAIRGATE_TEST_PG, default
postgres@127.0.0.1:5432) gets the schema by the project's migrations, then rows spread over 30
days and their rollups, both generated inside PostgreSQL (INSERT ... SELECT over
generate_series): the data a ledger would have written. Goal (issue 17): the tenants view in
<= 300 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from sqlalchemy import text  # noqa: E402

from tenants.db import Database  # noqa: E402
from tenants.migrate import migrate  # noqa: E402
from tenants.slo_views import hour_p99s, period_counts, tenant_slo  # noqa: E402
from tests.support.postgres import PG_SERVER, pg_exec  # noqa: E402

NAME = "fg_bench_slo"
GOAL_MS = 300.0
DAY = 86400


async def fill(rows: int, tenants: int, now: float) -> None:
    """`rows` usage rows over the last 30 days (a fifth of one tenant's requests miss their
    TTFT target, the others' one in two hundred), then their minute rollups. On a connection
    of its own: the gateway's engine bounds each statement, and these take minutes."""
    import asyncpg

    conn = await asyncpg.connect(f"postgresql://{PG_SERVER}/{NAME}", command_timeout=None)
    try:
        await conn.execute(f"""
            INSERT INTO fg_usage (tenant, key_id, model, priority, prompt_tokens,
                completion_tokens, status, queue_time, ttft, e2e, created_at, finished_at,
                tpot, slo_ttft, slo_itl, cached_tokens, backend)
            SELECT 't' || (i % {tenants}), NULL, 'm', 'interactive', 100, 20,
                   CASE WHEN i % 97 = 0 THEN 429 ELSE 200 END, 0.001, 0.05 + (i % 13) * 0.01,
                   0.5, f - 0.5, f, 0.02,
                   CASE WHEN i % {tenants} = 0 THEN (CASE WHEN (i / {tenants}) % 5 = 0 THEN 0 ELSE 1 END)
                        ELSE (CASE WHEN (i / {tenants}) % 200 = 0 THEN 0 ELSE 1 END) END,
                   1, 0, 'http://engine:8100'
            FROM (SELECT i, {now} - (i::float8 / {rows}) * {30 * DAY} AS f
                  FROM generate_series(1, {rows}) AS i) AS g""")
        for table, unit, column in (("fg_usage_minutes", 60, "minute"),
                                    ("fg_usage_hours", 3600, "hour")):
            await conn.execute(f"""
                INSERT INTO {table} (tenant, {column}, requests, ok, rejected, failed,
                    prompt_tokens, completion_tokens, ttft_checked, ttft_met, itl_checked,
                    itl_met, slo_checked, slo_met)
                SELECT tenant, CAST(FLOOR(finished_at / {unit}) AS INTEGER), COUNT(*),
                       SUM(CASE WHEN status = 200 THEN 1 ELSE 0 END),
                       SUM(CASE WHEN status = 429 THEN 1 ELSE 0 END),
                       SUM(CASE WHEN status >= 500 THEN 1 ELSE 0 END),
                       SUM(prompt_tokens), SUM(completion_tokens),
                       COUNT(slo_ttft), SUM(COALESCE(slo_ttft, 0)), COUNT(slo_itl),
                       SUM(COALESCE(slo_itl, 0)), COUNT(*),
                       SUM(CASE WHEN COALESCE(slo_ttft, 1) = 1 AND COALESCE(slo_itl, 1) = 1
                           THEN 1 ELSE 0 END)
                FROM fg_usage GROUP BY tenant, CAST(FLOOR(finished_at / {unit}) AS INTEGER)""")
        await conn.execute("ANALYZE fg_usage_hours")
        await conn.execute("ANALYZE fg_usage")
        await conn.execute("ANALYZE fg_usage_minutes")
    finally:
        await conn.close()


async def view(db: Database, now: float) -> dict[str, dict[str, object]]:
    """What GET /admin/slo/tenants computes from the database."""
    counts = await period_counts(db, now)
    p99s = await hour_p99s(db, now)
    return {t: {**tenant_slo(c), "p99": p99s.get(t)} for t, c in counts.items()}


async def from_raw_rows(db: Database, now: float) -> dict[str, float]:
    """The baseline: each tenant's 30-day attainment straight from the raw rows (the hours the
    rollups' 30 days cover)."""
    import asyncpg

    conn = await asyncpg.connect(f"postgresql://{PG_SERVER}/{NAME}", command_timeout=None)
    try:
        rows = await conn.fetch(
            "SELECT tenant, SUM(CASE WHEN COALESCE(slo_ttft, 1) = 1 AND COALESCE(slo_itl, 1) "
            "= 1 THEN 1 ELSE 0 END)::float8 / COUNT(*) FROM fg_usage WHERE "
            f"FLOOR(finished_at / 3600) > {int(now // 3600) - 720} GROUP BY tenant")
        return {r[0]: float(r[1]) for r in rows}
    finally:
        await conn.close()


async def timed(fn: object, repeats: int, *args: object) -> tuple[list[float], object]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = await fn(*args)  # type: ignore[operator]
        times.append(1000 * (time.perf_counter() - started))
    return times, result


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--tenants", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    await pg_exec(f"DROP DATABASE IF EXISTS {NAME}")
    await pg_exec(f"CREATE DATABASE {NAME}")
    url = f"postgresql+asyncpg://{PG_SERVER}/{NAME}"
    db = Database(url)
    try:
        await migrate(db)
        now = time.time()
        started = time.perf_counter()
        await fill(args.rows, args.tenants, now)
        print(f"{args.rows:,} usage rows over 30 days for {args.tenants} tenants, and their "
              f"rollups: generated in {time.perf_counter() - started:.0f} s")
        async with db.engine.connect() as conn:
            minutes = (await conn.execute(text("SELECT COUNT(*) FROM fg_usage_minutes"))
                       ).scalar()
        print(f"rollup rows: {minutes:,}")
        await view(db, now)  # warm the connection pool and the caches, as a served page is
        view_ms, figures = await timed(view, args.repeats, db, now)
        raw_ms, raw = await timed(from_raw_rows, max(1, args.repeats // 2), db, now)
        worst = min(figures.items(), key=lambda kv: kv[1]["attainment"]["30d"])  # type: ignore
        for tenant, value in raw.items():  # the same figure both ways
            assert abs(value - figures[tenant]["attainment"]["30d"]) < 1e-9, tenant  # type: ignore
        median = statistics.median(view_ms)
        print(f"tenants view (rollups + last hour's raw rows): median {median:.0f} ms "
              f"(runs: {', '.join(f'{t:.0f}' for t in view_ms)})")
        print(f"baseline, 30-day attainment from raw rows: median "
              f"{statistics.median(raw_ms):.0f} ms; ratio {statistics.median(raw_ms) / median:.1f}x")
        print(f"breaching tenant: {worst[0]} at {worst[1]['attainment']['30d']:.4f}, state "
              f"{worst[1]['state']}")
        print(f"goal <= {GOAL_MS:.0f} ms: {'PASS' if median <= GOAL_MS else 'FAIL'}")
    finally:
        await db.dispose()
        await pg_exec(f"DROP DATABASE IF EXISTS {NAME}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

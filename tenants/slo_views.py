"""What the SLO dashboard reads: per tenant, its requests and SLO outcomes over the periods
(from the rollups: per minute up to a day, per hour for 30 days, so 30 days cost as much at 10
million rows as at ten thousand),
its p99 TTFT and TPOT over the last hour (from the raw rows of that hour), and a tenant's series
minute by minute. The arithmetic (attainment, budget left, burn rate, state) is
protocol.measures'; this module only counts.

Two kinds of count, as protocol.measures defines the SLOs: requests checked against TTFT and
TPOT targets (each, and both: `slo_*`, a request's goodput), and gaps between tokens checked
against an ITL target, pooled (`itl_gaps*`). The gaps themselves are not stored, so the hour's
ITL is shown as the share of its gaps within the target, which is what "p99 ITL <= X" asks."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import and_, case, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from protocol.measures import attainment, budget_left, slo_state
from protocol.stats import percentile
from tenants.db import Database
from tenants.models import UsageHourRow, UsageMinuteRow, UsageRow

# the periods the dashboard shows, in minutes (the current, partial minute included)
PERIODS: dict[str, int] = {"5m": 5, "1h": 60, "6h": 360, "24h": 1440, "30d": 43200}
COUNTS = ("requests", "ok", "rejected", "failed", "slo_checked", "slo_met", "ttft_checked",
          "ttft_met", "tpot_checked", "tpot_met", "itl_gaps", "itl_gaps_met")
STATES = ("no_data", "ok", "at_risk", "breaching")  # slo_state's answers, the worst last


async def period_counts(db: Database, now: float) -> dict[str, dict[str, dict[str, int]]]:
    """tenant -> period -> count name -> sum, over the rollups: the longest period by plain
    sums, the others (a day at most) by conditional sums over the last day's minutes only."""
    here = int(now // 60)
    t, h = UsageMinuteRow, UsageHourRow
    longest = max(PERIODS, key=PERIODS.__getitem__)
    short = {p: m for p, m in PERIODS.items() if p != longest}
    span = max(short.values())
    # the longest from the hourly rollups: its whole hours and the current one (30 days to
    # within an hour, 720 rows a tenant instead of 43,200)
    long_query = select(h.tenant, *[func.sum(getattr(h, name)).label(f"{longest}:{name}")
                                    for name in COUNTS]
                        ).where(h.hour > int(now // 3600) - PERIODS[longest] // 60
                                ).group_by(h.tenant)
    columns: list[Any] = [t.tenant]
    for period, minutes in short.items():
        within = t.minute > here - minutes
        columns += [func.sum(case((within, getattr(t, name)), else_=0)).label(f"{period}:{name}")
                    for name in COUNTS]
    short_query = select(*columns).where(t.minute > here - span).group_by(t.tenant)

    async def op(s: AsyncSession) -> dict[str, dict[str, dict[str, int]]]:
        out: dict[str, dict[str, dict[str, int]]] = {}
        for query in (long_query, short_query):
            for row in (await s.execute(query)).mappings():
                periods = out.setdefault(row["tenant"], {p: {} for p in PERIODS})
                for key, value in row.items():
                    if key != "tenant":
                        period, name = key.split(":")
                        periods[period][name] = int(value or 0)
        for periods in out.values():  # a tenant quiet for the last day: zeros, not gaps
            for period in short:
                for name in COUNTS:
                    periods[period].setdefault(name, 0)
        return out

    return await db.run(op, write=False)


async def hour_p99s(db: Database, now: float) -> dict[str, dict[str, float | None]]:
    """tenant -> p99 TTFT and p99 TPOT of its successful requests that finished in the last
    hour (protocol.stats' rule: PostgreSQL's percentile_disc, or the rows ranked here)."""
    since = now - 3600
    u = UsageRow
    recent = and_(u.finished_at >= since, u.status == 200)

    async def op(s: AsyncSession) -> dict[str, dict[str, float | None]]:
        out: dict[str, dict[str, float | None]] = {}
        if db.is_postgres:
            query = select(u.tenant,
                           func.percentile_disc(0.99).within_group(u.ttft).label("ttft"),
                           func.percentile_disc(0.99).within_group(u.tpot).label("tpot")
                           ).where(recent).group_by(u.tenant)
            for row in (await s.execute(query)).mappings():
                out[row["tenant"]] = {"ttft": _finite(row["ttft"]), "tpot": _finite(row["tpot"])}
            return out
        values: dict[str, tuple[list[float], list[float]]] = {}
        for tenant, ttft, tpot in await s.execute(select(u.tenant, u.ttft, u.tpot).where(recent)):
            ttfts, tpots = values.setdefault(tenant, ([], []))
            if ttft is not None:
                ttfts.append(ttft)
            if tpot is not None:
                tpots.append(tpot)
        return {tenant: {"ttft": _finite(percentile(a, 99)), "tpot": _finite(percentile(b, 99))}
                for tenant, (a, b) in values.items()}

    return await db.run(op, write=False)


def _finite(value: Any) -> float | None:
    return float(value) if value is not None and math.isfinite(float(value)) else None


def tenant_slo(counts: dict[str, dict[str, int]], target: float = 0.99) -> dict[str, Any]:
    """One tenant's SLO figures from its period counts. Per request: attainment over 1 h / 24 h
    / 30 d of its TTFT and TPOT targets together (`attainment`, a request's goodput) and each,
    the 30-day budget left and burn rates over 1 h and 6 h. Per gap: the same for its ITL target
    (`itl_*`). `state`: the worse of the two."""
    def att(period: str, met: str, checked: str) -> dict[str, float | None]:
        c = counts.get(period, {})
        return attainment(c.get(met, 0), c.get(checked, 0), target)

    kinds = {"": ("slo_met", "slo_checked"), "ttft_": ("ttft_met", "ttft_checked"),
             "tpot_": ("tpot_met", "tpot_checked"), "itl_": ("itl_gaps_met", "itl_gaps")}
    out: dict[str, Any] = {"target": target}
    for kind, names in kinds.items():
        out[f"{kind}attainment"] = {p: att(p, *names)["fraction"] for p in ("1h", "24h", "30d")}
    month = counts.get("30d", {})
    states = []
    for kind in ("", "itl_"):  # the requests' budget and the gaps'
        met, checked = (month.get(name, 0) for name in kinds[kind])
        budget = out[f"{kind}budget_left_30d"] = budget_left(met, checked, target)
        burn = out[f"{kind}burn_rate"] = {p: att(p, *kinds[kind])["burn_rate"]
                                          for p in ("1h", "6h")}
        states.append(slo_state(budget, burn["1h"], burn["6h"]))
    out["checked_30d"] = month.get("slo_checked", 0)
    out["missed_30d"] = month.get("slo_checked", 0) - month.get("slo_met", 0)
    out["itl_gaps_30d"] = month.get("itl_gaps", 0)
    out["itl_missed_30d"] = month.get("itl_gaps", 0) - month.get("itl_gaps_met", 0)
    out["state"] = max(states, key=STATES.index)
    return out


async def tenant_series(db: Database, tenant: str, now: float, minutes: int) -> list[dict[str, Any]]:
    """The tenant's rollups minute by minute over the last `minutes` (only minutes with
    traffic; the page fills the gaps)."""
    here = int(now // 60)
    t = UsageMinuteRow
    query = select(t).where(t.tenant == tenant, t.minute > here - minutes).order_by(t.minute)

    async def op(s: AsyncSession) -> list[dict[str, Any]]:
        rows = (await s.scalars(query)).all()
        return [{"minute": r.minute, **{name: getattr(r, name) for name in COUNTS},
                 "completion_tokens": r.completion_tokens} for r in rows]

    return await db.run(op, write=False)

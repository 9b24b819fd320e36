"""The ledger's per-minute rollups agree with its raw rows (written in one transaction), the
periods count the right minutes, and pruning raw rows keeps the rollups."""

from __future__ import annotations

import time
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select

from tenants import TenantStore, UsageEvent, UsageLedger
from tenants.ledger import MINUTE_COUNTS
from tenants.models import UsageHourRow, UsageMinuteRow, UsageRow
from tenants.slo_views import hour_p99s, period_counts, tenant_series

NOW = 1_796_000_000.0  # a fixed clock: minute boundaries are the test's to choose


def _event(tenant: str, finished: float, status: int = 200, ttft: bool | None = True,
           tpot: bool | None = True, latency: float = 0.1,
           gaps: tuple[int, int] | None = None) -> UsageEvent:
    """`gaps`: (within the ITL target, of all), None for a tenant without one."""
    met, total = gaps if gaps is not None else (None, None)
    return UsageEvent(tenant=tenant, key_id=None, model="m", priority="interactive",
                      prompt_tokens=10, completion_tokens=5, status=status, ttft=latency,
                      e2e=latency, created_at=finished - latency, finished_at=finished,
                      tpot=latency / 10, slo_ttft=ttft, slo_tpot=tpot, itl_gaps_met=met,
                      itl_gaps=total)


async def test_periods_count_the_minutes_they_span(store: TenantStore) -> None:
    ledger = UsageLedger(store)
    events = [
        _event("a", NOW - 10, gaps=(4, 4)),  # this minute: every period
        _event("a", NOW - 2 * 3600, ttft=False, gaps=(1, 4)),  # 2 h ago: 6 h, 24 h, 30 d
        _event("a", NOW - 3 * 86400, status=429, ttft=False, tpot=False,
               gaps=(0, 1)),  # 3 days: 30 d only
        _event("a", NOW - 31 * 86400, gaps=(4, 4)),  # past 30 days: nowhere
        _event("b", NOW - 30, ttft=None, tpot=None),  # no SLO: counted, never checked
    ]
    ledger.record_many(events)
    await ledger.flush()
    counts = await period_counts(store.db, NOW)
    a = counts["a"]
    assert (a["5m"]["requests"], a["1h"]["requests"], a["6h"]["requests"],
            a["24h"]["requests"], a["30d"]["requests"]) == (1, 1, 2, 2, 3)
    assert (a["6h"]["slo_checked"], a["6h"]["slo_met"]) == (2, 1)
    assert (a["30d"]["slo_checked"], a["30d"]["slo_met"], a["30d"]["rejected"]) == (3, 1, 1)
    assert (a["30d"]["ttft_checked"], a["30d"]["ttft_met"]) == (3, 1)
    assert (a["30d"]["tpot_checked"], a["30d"]["tpot_met"]) == (3, 2)
    # ITL counts gaps, not requests: 4 of 4 this minute, 5 of 8 in 6 h, 5 of 9 in 30 days
    assert (a["1h"]["itl_gaps"], a["1h"]["itl_gaps_met"]) == (4, 4)
    assert (a["6h"]["itl_gaps"], a["6h"]["itl_gaps_met"]) == (8, 5)
    assert (a["30d"]["itl_gaps"], a["30d"]["itl_gaps_met"]) == (9, 5)
    assert counts["b"]["1h"]["requests"] == 1 and counts["b"]["1h"]["slo_checked"] == 0
    assert counts["b"]["1h"]["itl_gaps"] == 0
    series = await tenant_series(store.db, "a", NOW, 180)
    assert [s["requests"] for s in series] == [1, 1]
    assert [(s["itl_gaps_met"], s["itl_gaps"]) for s in series] == [(1, 4), (4, 4)]


async def test_pruning_raw_rows_keeps_the_rollups(store: TenantStore) -> None:
    ledger = UsageLedger(store)
    ledger.record_many([_event("a", NOW - 40 * 86400), _event("a", NOW - 60)])
    await ledger.flush()
    assert await ledger.prune(NOW - 35 * 86400) == 1

    async def count(s: Any) -> tuple[int, int]:
        rows = (await s.execute(select(func.count()).select_from(UsageRow))).scalar()
        minutes = (await s.execute(select(func.count()).select_from(UsageMinuteRow))).scalar()
        return int(rows), int(minutes)

    assert await store.db.run(count, write=False) == (1, 2)


async def test_the_hours_p99_is_of_the_last_hours_successes(store: TenantStore) -> None:
    ledger = UsageLedger(store)
    now = time.time()
    ledger.record_many([_event("a", now - 5, latency=0.01 * i) for i in range(1, 101)]
                       + [_event("a", now - 7200, latency=9.0),  # too old
                          _event("a", now - 5, status=503, latency=7.0)])  # failed
    await ledger.flush()
    p99 = (await hour_p99s(store.db, now))["a"]
    # the nearest rank (protocol.stats): the 99th of 100
    assert p99["ttft"] == 0.99 and p99["tpot"] == 0.099
    assert set(p99) == {"ttft", "tpot"}  # a pooled ITL has no per-request value to rank


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 600),
                          st.sampled_from([200, 200, 429, 503]),
                          st.sampled_from([True, False, None]),
                          st.sampled_from([True, False, None]),
                          st.none() | st.tuples(st.integers(0, 9), st.integers(0, 9))),
                min_size=1, max_size=40))
async def test_rollups_always_equal_the_raw_rows(store: TenantStore,
                                                 events: list[tuple[Any, ...]]) -> None:
    ledger = UsageLedger(store)
    before = await period_counts(store.db, NOW)
    ledger.record_many([_event(t, NOW - s, status, ttft, tpot,
                               gaps=None if g is None else (min(g), max(g)))
                        for t, s, status, ttft, tpot, g in events])
    await ledger.flush()
    after = await period_counts(store.db, NOW)
    for tenant in ("a", "b"):
        mine = [e for e in events if e[0] == tenant]
        got = {k: after.get(tenant, {}).get("1h", {}).get(k, 0)
               - before.get(tenant, {}).get("1h", {}).get(k, 0)
               for k in ("requests", "rejected", "failed", "slo_checked", "slo_met",
                         "itl_gaps", "itl_gaps_met")}
        checked = [e for e in mine if e[3] is not None or e[4] is not None]
        assert got == {
            "requests": len(mine), "rejected": sum(e[2] == 429 for e in mine),
            "failed": sum(e[2] >= 500 for e in mine), "slo_checked": len(checked),
            "slo_met": sum(e[3] is not False and e[4] is not False for e in checked),
            "itl_gaps": sum(max(e[5]) for e in mine if e[5] is not None),
            "itl_gaps_met": sum(min(e[5]) for e in mine if e[5] is not None)}


Counts = dict[tuple[str, int], dict[str, int]]  # (tenant, minute or hour) -> its counts


async def _rollups(store: TenantStore, model: Any, column: str) -> Counts:
    async def read(s: Any) -> Counts:
        rows = (await s.execute(select(model))).scalars()
        return {(r.tenant, getattr(r, column)): {k: getattr(r, k) for k in MINUTE_COUNTS}
                for r in rows}

    return await store.db.run(read, write=False)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.lists(st.tuples(st.sampled_from(["a", "b"]), st.integers(0, 4 * 3600),
                                   st.sampled_from([200, 429, 503]),
                                   st.sampled_from([True, False, None])),
                         min_size=1, max_size=30), min_size=1, max_size=3))
async def test_the_hours_sum_the_minutes_and_the_raw_rows(store: TenantStore,
                                                          flushes: list[list[Any]]) -> None:
    """fg_usage_hours is summed from a flush's minute rollups (not from its rows again): each
    hour holds what its 60 minutes hold, and the requests that finished in it."""
    ledger = UsageLedger(store)
    before_hours = await _rollups(store, UsageHourRow, "hour")
    before_minutes = await _rollups(store, UsageMinuteRow, "minute")
    finished: list[tuple[str, int]] = []
    for events in flushes:  # a flush adds to the hours the earlier ones wrote
        ledger.record_many([_event(t, NOW - s, status, ok) for t, s, status, ok in events])
        finished += [(t, int((NOW - s) // 3600)) for t, s, _, _ in events]
        await ledger.flush()

    def added(now: Counts, before: Counts) -> Counts:
        zero = dict.fromkeys(MINUTE_COUNTS, 0)
        return {key: {k: v - before.get(key, zero)[k] for k, v in counts.items()}
                for key, counts in now.items() if counts != before.get(key)}

    hours = added(await _rollups(store, UsageHourRow, "hour"), before_hours)
    minutes = added(await _rollups(store, UsageMinuteRow, "minute"), before_minutes)
    summed: Counts = {}
    for (tenant, minute), counts in minutes.items():
        into = summed.setdefault((tenant, minute // 60), dict.fromkeys(MINUTE_COUNTS, 0))
        for k, v in counts.items():
            into[k] += v
    assert hours == summed
    assert {key: c["requests"] for key, c in hours.items()} == {
        key: finished.count(key) for key in set(finished)}


async def test_a_finish_beyond_the_minutes_counts_in_the_last_minutes_hour(
        store: TenantStore) -> None:
    ledger = UsageLedger(store)
    ledger.record(_event("far", 1e12))  # minute 1.7e10: past the 32-bit column
    await ledger.flush()
    minutes = await _rollups(store, UsageMinuteRow, "minute")
    hours = await _rollups(store, UsageHourRow, "hour")
    assert [key for key in minutes if key[0] == "far"] == [("far", 2**31 - 1)]
    assert [key for key in hours if key[0] == "far"] == [("far", (2**31 - 1) // 60)]

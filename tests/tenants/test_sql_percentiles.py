"""The percentiles SQL computes are protocol.stats': the same rows through the usage ledger
(ORDER BY/OFFSET), the SLO views (PostgreSQL's percentile_disc, or the rows ranked in Python
on SQLite) and protocol.stats.percentile give the same answers, on SQLite and on PostgreSQL."""

from __future__ import annotations

import time
import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol.stats import percentile
from tenants import TenantStore, UsageEvent, UsageLedger
from tenants.slo_views import hour_p99s

QUANTILES = (1, 7, 25, 50, 90, 95, 99, 100)


def _event(tenant: str, ttft: float, tpot: float, tokens: int, now: float,
           status: int = 200) -> UsageEvent:
    return UsageEvent(tenant=tenant, key_id=None, model="m", priority="interactive",
                      prompt_tokens=10, completion_tokens=tokens, status=status, queue_time=0.0,
                      ttft=ttft, e2e=ttft + 1.0, tpot=tpot, created_at=now - 10,
                      finished_at=now - 5)


@settings(max_examples=15, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.floats(0.001, 100.0), st.floats(0.0, 1.0), st.integers(0, 4000)),
                min_size=1, max_size=150))
async def test_sql_and_protocol_stats_rank_alike(store: TenantStore,
                                                 rows: list[tuple[float, float, int]]) -> None:
    tenant = f"t{uuid.uuid4().hex[:8]}"  # one per example: the store outlives them
    now = time.time()
    ledger = UsageLedger(store)
    ledger.record_many([_event(tenant, ttft, tpot, tokens, now) for ttft, tpot, tokens in rows]
                       + [_event(tenant, 999.0, 9.0, 0, now, status=503)])  # not a success
    await ledger.flush()
    ttfts, tpots, tokens = ([r[i] for r in rows] for i in range(3))

    views = (await hour_p99s(store.db, now))[tenant]
    assert views == {"ttft": percentile(ttfts, 99), "tpot": percentile(tpots, 99)}
    for q in QUANTILES:
        assert await ledger.output_tokens_percentile(tenant, 60, q) == percentile(tokens, q)
    ledgers = (await ledger.latency_percentiles(tenant, 60, QUANTILES))["ttft"]
    assert ledgers == {q: percentile([*ttfts, 999.0], q) for q in QUANTILES}
    await ledger.close()

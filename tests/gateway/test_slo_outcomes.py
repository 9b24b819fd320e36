"""The three SLOs through the gateway in-process: each streamed request's TTFT and TPOT checked
once, its gaps checked one by one for ITL, and the same outcomes in the metrics, in the usage
ledger's rows and rollups and in the dashboard's JSON (the writer and the readers of one seam)."""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest

from tests.gateway.helpers import collect, completion, start_gateway

ADMIN = {"Authorization": "Bearer admin-key-0123456789"}
# TTFT and TPOT met by any stream (30 s), ITL missed by every gap but an instant one (1 ns)
TENANTS = {"acme": {"slo_ttft_p99_s": 30.0, "slo_tpot_p99_s": 30.0, "slo_itl_p99_s": 1e-9},
           "plain": {}}
REQUESTS = 4


async def test_each_slo_is_counted_in_its_own_unit(aiohttp_client: Any, db_url: str,
                                                   tmp_path: Any) -> None:
    h = await start_gateway(aiohttp_client, db_url, tenants=TENANTS)
    for tenant in ("acme", "plain"):
        for i in range(REQUESTS):
            resp = await h.post(tenant, completion(f"hello {i}", max_tokens=6, stream=True))
            assert resp.status == 200
            [_ async for _ in collect(resp)]
    await h.gateway.ledger.flush()
    read = h.gateway.metrics.registry.get_sample_value

    db = db_url.removeprefix("sqlite+aiosqlite:///")
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT tenant, slo_ttft, slo_tpot, itl_gaps, itl_gaps_met "
                            "FROM fg_usage ORDER BY id").fetchall()
    acme = [r for r in rows if r[0] == "acme"]
    assert [r[1:3] for r in acme] == [(1, 1)] * REQUESTS  # per request: met
    gaps = sum(r[3] for r in acme)
    met = sum(r[4] for r in acme)
    # every gap the gateway timed is one checked: the ITL histogram saw the same gaps
    assert gaps == read("fairgate_gateway_itl_seconds_count", {"tenant": "acme"}) > 0
    assert read("fairgate_gateway_slo_gaps_total", {"tenant": "acme", "met": "false"}) == \
        gaps - met > 0
    for slo in ("ttft", "tpot"):
        assert read("fairgate_gateway_slo_requests_total",
                    {"tenant": "acme", "slo": slo, "met": "true"}) == REQUESTS
    assert read("fairgate_gateway_slo_requests_total",
                {"tenant": "acme", "slo": "itl", "met": "false"}) is None  # not requests
    assert read("fairgate_gateway_tpot_seconds_count", {"tenant": "acme"}) == REQUESTS
    # a tenant without targets: timed, never checked
    assert [r[1:] for r in rows if r[0] == "plain"] == [(None, None, None, None)] * REQUESTS
    assert read("fairgate_gateway_slo_gaps_total", {"tenant": "plain", "met": "true"}) is None

    body = await (await h.client.get("/admin/slo/tenants", headers=ADMIN)).json()
    shown = {t["name"]: t for t in body["tenants"]}["acme"]
    assert shown["slo"] == {"ttft_p99_s": 30.0, "tpot_p99_s": 30.0, "itl_p99_s": 1e-9}
    assert shown["attainment"]["1h"] == shown["tpot_attainment"]["1h"] == 1.0
    assert shown["itl_attainment"]["1h"] == pytest.approx(met / gaps)
    assert shown["p99_1h"]["tpot"] is not None and set(shown["p99_1h"]) == {"ttft", "tpot"}
    assert shown["itl_burn_rate"]["1h"] == pytest.approx((1 - met / gaps) / 0.01)
    assert shown["state"] == "breaching"  # the gaps' budget, though every request met its own
    detail = await (await h.client.get("/admin/slo/tenants/acme", headers=ADMIN)).json()
    assert detail["slo"] == shown["slo"]
    assert sum(m["itl_gaps"] for m in detail["series"]) == gaps

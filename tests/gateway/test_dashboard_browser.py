"""The SLO dashboard in a real browser (playwright driving Debian's chromium): `fairgate serve`
with two tenants whose SLOs differ, one breaching; log in; the page shows both, with the
attainment and budget figures the usage ledger holds (requests against TTFT and TPOT, gaps
against ITL), the breaching one flagged; a screenshot is saved."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import sqlite3
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.helpers import completion, create_tenants
from tests.support.processes import ROOT, drain, free_port, spawn_fairgate, stop
from tests.support.waiting import poll_until

CHROMIUM = "/usr/bin/chromium"
ADMIN_KEY = "admin-key-0123456789"
TENANTS = {"roomy": {"slo_ttft_p99_s": 5.0, "slo_tpot_p99_s": 1.0, "slo_itl_p99_s": 1.0},
           # nothing meets 1 us: every request misses its TTFT, every gap (but an instant one)
           # its ITL
           "strict": {"slo_ttft_p99_s": 0.000001, "slo_tpot_p99_s": 1.0,
                      "slo_itl_p99_s": 0.000001}}
REQUESTS = {"roomy": 12, "strict": 8}
ARTIFACTS = Path(os.environ.get("FAIRGATE_TEST_ARTIFACTS", ROOT / ".test-artifacts"))

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not "
                                     "installed (pip install -e '.[dev]')")
if not shutil.which(CHROMIUM):
    pytest.skip(f"no browser: {CHROMIUM} is missing (apt-get install chromium; "
                "deploy/ci/install-tools.sh does it)", allow_module_level=True)


def _stream(url: str, key: str) -> None:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(completion(
        "hello", max_tokens=6, stream=True)).encode(), headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
        assert resp.status == 200


def _admin(url: str, path: str) -> Any:
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def _ledger(db: Path, tenant: str) -> tuple[int, int, int, int]:
    """(checked, met, gaps, gaps met) counted from the raw usage rows, by hand: a request is
    checked when it has an outcome for a TTFT or TPOT target, met when no checked target
    missed; gaps are its own counts for the ITL target."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT slo_ttft, slo_tpot, itl_gaps, itl_gaps_met FROM fg_usage "
                            "WHERE tenant = ?", (tenant,)).fetchall()
    checked = [r for r in rows if r[0] is not None or r[1] is not None]
    met = [r for r in checked if r[0] in (None, 1) and r[1] in (None, 1)]
    return (len(checked), len(met), sum(r[2] or 0 for r in rows),
            sum(r[3] or 0 for r in rows))


def test_the_dashboard_shows_each_tenant_against_its_slo(tmp_path: Path) -> None:
    db = tmp_path / "gateway.db"
    keys = asyncio.run(create_tenants(f"sqlite+aiosqlite:///{db}", TENANTS))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = tmp_path / "fairgate.yaml"
    config.write_text(json.dumps({
        "database": f"sqlite:///{db}",
        "engine": {"executor": "sim", "max_model_len": 512},
        "gateway": {"port": port, "admin_key": ADMIN_KEY, "demo_tenant": False,
                    "metrics_port": None}}))
    server = spawn_fairgate("serve", "-c", str(config), "--log-level", "WARNING")
    drain(server)
    try:
        poll_until(lambda: _admin(url, "/admin/slo/tenants"), 60, "fairgate serve answers")
        for tenant, n in REQUESTS.items():
            for _ in range(n):
                _stream(url, keys[tenant])
        # the ledger writes every second: wait until the rollups hold every request
        poll_until(lambda: {t["name"]: t["requests_1h"] for t in _admin(
            url, "/admin/slo/tenants")["tenants"]} == REQUESTS, 60,
            "the ledger recorded the traffic")
        figures = _browse(url, tmp_path)
    finally:
        stop(server, signal.SIGTERM, 30)
    for tenant in TENANTS:
        checked, met, gaps, gaps_met = _ledger(db, tenant)
        assert checked == REQUESTS[tenant] and gaps >= REQUESTS[tenant]
        attainment = met / checked
        budget_left = 1 - (checked - met) / (0.01 * checked)
        shown = figures[tenant]
        assert shown["attainment_30d"] == pytest.approx(attainment)
        assert shown["attainment_1h"] == pytest.approx(attainment)
        assert shown["budget_left_30d"] == pytest.approx(budget_left)
        assert shown["itl_attainment_1h"] == pytest.approx(gaps_met / gaps)
        assert shown["p99_tpot"] > 0 and shown["text"]["p99_tpot"].endswith("/ 1000.0 ms")
    assert figures["strict"]["state"] == "breaching" and figures["roomy"]["state"] == "ok"
    assert figures["strict"]["burn_1h"] == pytest.approx(100.0)  # every request missed: 1/0.01
    assert figures["strict"]["text"]["attainment_30d"] == "0.00%"
    assert figures["roomy"]["text"]["attainment_30d"] == "100.00%"
    # ITL is shown as the share of gaps within the target, flagged when under 99%
    assert figures["roomy"]["text"]["itl_attainment_1h"] == "100.00% \u2264 1000.0 ms"
    assert figures["roomy"]["classes"]["itl_attainment_1h"] == ""
    assert figures["strict"]["itl_attainment_1h"] < 0.99
    assert figures["strict"]["classes"]["itl_attainment_1h"] == "miss"


def _browse(url: str, tmp_path: Path) -> dict[str, dict[str, Any]]:
    """Log in through the form and read the tenants table as a person sees it."""
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(f"{url}/dashboard")
            assert page.url.endswith("/dashboard/login")  # no session: the login form
            page.fill("#key", "not-the-key-at-all")
            page.click("button[type=submit]")
            assert "not the admin key" in page.content()
            page.fill("#key", ADMIN_KEY)
            page.click("button[type=submit]")
            page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
            cookie = next(c for c in page.context.cookies() if c["name"] == "fairgate_session")
            assert cookie["httpOnly"] and cookie["secure"] and cookie["sameSite"] == "Strict"
            figures: dict[str, dict[str, Any]] = {}
            for row in page.query_selector_all("tr.tenant"):
                name = row.get_attribute("data-tenant") or ""
                cells = {c.get_attribute("data-field"): c for c in
                         row.query_selector_all("td[data-field]")}
                figures[name] = {
                    "state": row.get_attribute("data-state"),
                    **{field: float(c.get_attribute("data-value") or "nan")
                       for field, c in cells.items() if field},
                    "text": {field: c.inner_text() for field, c in cells.items() if field},
                    "classes": {field: c.get_attribute("class") or ""
                                for field, c in cells.items() if field}}
            page.click("tr.tenant[data-tenant='strict']")  # its page: the series plots
            page.wait_for_selector("#plot-requests rect", timeout=10_000)
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            for target in (tmp_path / "dashboard.png", ARTIFACTS / "dashboard.png"):
                page.screenshot(path=str(target), full_page=True)
            assert (tmp_path / "dashboard.png").stat().st_size > 10_000
            # a cookie reads, never changes: a POST with it alone is refused
            status = page.evaluate("""async () => (await fetch('/admin/tune-jobs', {method:
                'POST', headers: {'Content-Type': 'application/json'}, body: '{}'})).status""")
            assert status == 401
            return figures
        finally:
            browser.close()

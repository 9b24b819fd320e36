"""The dashboard in a real browser (playwright driving Debian's chromium) with real data behind
every part of it: tenants with traffic (one of them turned away, its error budget overspent; one
with none), one engine, one shadow target with pairs and one whose every copy fails (404: the
model it is sent does not exist there), a finished tune job.

Two seams are read from both sides:
- every table and every plot that has data draws it: each plot's points are counted in the SVG
  the page's script drew, against the number the API's answer holds;
- every field the page's script reads exists in the API's answer: the JSON of every fetch is
  handed to app.js through a Proxy that records each property it reads that the answer does not
  have (so the list of fields is app.js's own, as it runs, not one kept here). A rename on
  either side (app.js read `measures.ttft_p99_s` where the API writes `p99_ttft_s`, and the
  plot stayed empty) fails here with the path of the field.

And its layout at 1400x900, measured in the page, with screenshots to look at.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from control.app import make_app
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.server import make_app as make_engine_app
from gateway.config import GatewayConfig
from tests.gateway.helpers import SIM_ENGINE, ServerThread, completion, create_tenants
from tests.support.waiting import poll_until

CHROMIUM = "/usr/bin/chromium"
ADMIN_KEY = "admin-key-0123456789"
TENANTS = {"roomy": {"slo_ttft_p99_s": 5.0, "slo_tpot_p99_s": 1.0, "slo_itl_p99_s": 1.0},
           "tight": {"slo_ttft_p99_s": 5.0, "slo_itl_p99_s": 1.0,
                     "limits": {"requests_per_min": 3}},
           "quiet": {"slo_ttft_p99_s": 5.0}}
# tight: 3 served, 2 turned away (429): 40% missed, its 1% budget spent 40 times over;
# quiet: no traffic, so no burn rate
SENT = {"roomy": 6, "tight": 5, "quiet": 0}
SERVED = {"roomy": 6, "tight": 3, "quiet": 0}
# six knobs: a best config as wide as a real tune's, for the jobs table's layout
JOB = {"mode": "sim", "workload": "uniform", "rate": 2, "duration": 4, "trials": 3,
       "robustness": 0, "slo_ttft_p99_s": 30, "slo_tpot_p99_s": 5,
       "set": {"max_num_seqs": 8}, "space": {
           "max_num_seqs": {"choices": [4, 8, 16]},
           "max_num_batched_tokens": {"choices": [1024, 2048]},
           "long_prefill_token_threshold": {"choices": [0, 128]},
           "max_num_partial_prefills": {"choices": [1, 2]},
           "enable_prefix_caching": {"choices": [True, False]},
           "block_size": {"choices": [16, 32]}}}

playwright_api = pytest.importorskip("playwright.sync_api", reason="playwright is not "
                                     "installed (pip install -e '.[dev]')")
if not shutil.which(CHROMIUM):
    pytest.skip(f"no browser: {CHROMIUM} is missing (apt-get install chromium; "
                "deploy/ci/install-tools.sh does it)", allow_module_level=True)

# Runs in the page before its script: every fetched JSON answer, read through a Proxy that
# records the path of each property read that the answer lacks (and counts those it has).
WATCH_READS = """
window.__missing = []; window.__reads = 0;
const watch = (value, path) => {
  if (value === null || typeof value !== "object") return value;
  return new Proxy(value, {get(target, key, receiver) {
    const found = Reflect.get(target, key, receiver);
    // a Promise asks any value it resolves with for `then`: not the page reading a field
    if (typeof key !== "string" || key === "then" || key === "toJSON") return found;
    if (key in target) window.__reads++; else window.__missing.push(path + "." + key);
    return watch(found, Array.isArray(target) ? path + "[]" : path + "." + key);
  }});
};
const json = Response.prototype.json;
Response.prototype.json = async function () {
  return watch(await json.call(this), new URL(this.url).pathname);
};
"""


def _call(url: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={
        "Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _stream(url: str, key: str) -> int:
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(completion(
        "hello", max_tokens=6, stream=True)).encode(), headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway with its control plane on a real port (an embedded engine), one shadow target
    (an engine server of its own), tenants with traffic and a finished tune job: its URL.
    Every test here reads it and none changes it, so they share one."""
    tmp_path = tmp_path_factory.mktemp("deployment")
    db = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    keys = asyncio.run(create_tenants(db, TENANTS))
    shadow_engine = AsyncEngine(EngineConfig(executor="sim", max_model_len=512, max_num_seqs=8))
    with ServerThread(make_engine_app(shadow_engine)) as shadow:
        config = GatewayConfig.from_dict({
            "demo_tenant": False, "admin_key": ADMIN_KEY,
            "shadow": [{"name": "cand", "url": shadow.url},
                       {"name": "wrong", "url": shadow.url, "model": "no-such-model"}],
            "jobs": {"dir": str(tmp_path / "jobs")}})
        with ServerThread(make_app(config, engine=SIM_ENGINE, database=db)) as gateway:
            url = gateway.url
            status, job = _call(url, "/admin/tune-jobs", JOB)
            assert status == 201, job
            statuses = {t: [_stream(url, keys[t]) for _ in range(n)] for t, n in SENT.items()}
            assert statuses == {t: [200] * SERVED[t] + [429] * (n - SERVED[t])
                                for t, n in SENT.items()}
            # the ledger writes every second; the copies are paired as they end
            poll_until(lambda: {t["name"]: t["requests_1h"] for t in _call(
                url, "/admin/slo/tenants")[1]["tenants"]} == SENT, 60, "the ledger has it all")
            poll_until(lambda: [s["pairs"] for s in _call(url, "/admin/shadow")[1]["shadows"]]
                       == [sum(SERVED.values())] * 2, 30,
                       "every served request paired, on both targets")
            poll_until(lambda: _call(url, f"/admin/tune-jobs/{job['id']}")[1]["state"]
                       == "succeeded", 120, "the tune job succeeded")
            yield url


def test_every_table_and_plot_draws_the_data_the_api_holds(deployment: str,
                                                            tmp_path: Path) -> None:
    url = deployment
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.add_init_script(WATCH_READS)
            page.goto(f"{url}/dashboard")
            page.fill("#key", ADMIN_KEY)
            page.click("button[type=submit]")
            page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
            tables = _tables(page)
            page.click("tr.tenant[data-tenant='tight']")  # its page: the series plots
            page.wait_for_selector("#plot-requests rect", timeout=10_000)
            drawn = {name: _points(page, name) for name in PLOTS}
            page.screenshot(path=str(tmp_path / "dashboard-data.png"), full_page=True)
            missing, reads = page.evaluate("[window.__missing, window.__reads]")
        finally:
            browser.close()
    # every field the page read was in the answer it read it from
    assert reads > 100  # the watch saw the page read its data
    assert not missing, "app.js read fields the API does not answer:\n" + "\n".join(
        sorted(set(missing)))

    tenants = _call(url, "/admin/slo/tenants")[1]["tenants"]
    assert tables["tenants"] == sorted(t["name"] for t in tenants) == sorted(TENANTS)
    assert tables["engines"] == [e["name"] for e in _call(url, "/admin/engines")[1]["engines"]]
    shadows = _call(url, "/admin/shadow")[1]["shadows"]
    assert tables["shadows"] == [(s["name"], s["model"], str(s["sent"]), str(s["pairs"]))
                                 for s in shadows]
    assert [s["model"] for s in shadows] == ["random:tiny", "no-such-model"]  # asked, configured
    # why the copies failed: in the API, and in the shadow table's row of that target
    assert [(f["status"], f["code"], f["count"]) for s in shadows for f in s["failures"]] == [
        (404, "model_not_found", 9)]
    assert tables["failures"] == {"cand": [], "wrong": [("404", "model_not_found",
                                                         "9 x 404 model_not_found")]}
    [job] = _call(url, "/admin/tune-jobs")[1]["jobs"]
    assert tables["jobs"] == [(job["id"], "succeeded")]

    expected = _expected_points(url, job["id"])
    assert all(n > 0 for n in expected.values()), expected  # each plot has data to draw
    assert drawn == expected


# plot -> the SVG elements that are its points (bars, or a line's dots)
PLOTS = {"plot-requests": "rect", "plot-attainment": "circle", "plot-history": "circle",
         "plot-pareto": "circle"}


def _points(page: Any, plot: str) -> int:
    return int(page.locator(f"#{plot} {PLOTS[plot]}").count())


def _tables(page: Any) -> dict[str, Any]:
    def rows(table: str) -> list[list[str]]:
        return [[c.inner_text() for c in row.query_selector_all("td")]
                for row in page.query_selector_all(f"#{table} tbody tr")]

    header = [h.inner_text() for h in page.query_selector_all("#shadows thead th")]
    model, sent, pairs = (header.index(h) for h in ("model", "sent", "pairs"))
    return {"tenants": sorted(r.get_attribute("data-tenant") for r in
                              page.query_selector_all("tr.tenant")),
            "engines": [r.get_attribute("data-engine") for r in
                        page.query_selector_all("#engines tbody tr")],
            "shadows": [(r[0], r[model], r[sent], r[pairs]) for r in rows("shadows")],
            "failures": {r.get_attribute("data-shadow"): [
                (f.get_attribute("data-status"), f.get_attribute("data-code"), f.inner_text())
                for f in r.query_selector_all(".failure")]
                for r in page.query_selector_all("#shadows tbody tr")},
            "jobs": [(r[0], r[1]) for r in rows("jobs")]}


def _expected_points(url: str, job_id: str) -> dict[str, int]:
    """How many points each plot has to draw, from the API's answers: a bar per minute with
    requests (and one per minute with rejections), a dot per minute with checked requests (and
    per minute with gaps), a dot per trial with a value (and per trial once a feasible best
    exists), a dot per trial with a p99 TTFT."""
    series = _call(url, "/admin/slo/tenants/tight?hours=6")[1]["series"]
    trials = [t for t in _call(url, f"/admin/tune-jobs/{job_id}")[1]["trials"]
              if t["value"] is not None]
    best, best_so_far = -math.inf, 0
    for t in trials:
        best = max(best, t["value"]) if t["feasible"] else best
        best_so_far += math.isfinite(best)
    return {"plot-requests": len(series) + sum(1 for m in series if m["rejected"]),
            "plot-attainment": sum(1 for m in series if m["slo_checked"])
            + sum(1 for m in series if m["itl_gaps"]),
            "plot-history": len(trials) + best_so_far,
            "plot-pareto": sum(1 for t in trials if t["measures"]
                               and math.isfinite(t["measures"]["p99_ttft_s"]))}


# ---- the page's layout at 1400x900, as a person on a laptop sees it ---------------------------
VIEWPORT = {"width": 1400, "height": 900}
SECTIONS = ("tenants-section", "detail", "engines-section", "shadows-section", "jobs-section")
# Where each box is, measured in the page: each table against its card's content box (the card
# scrolling sideways counts as overflowing), each plot's labels and target line against its box.
LAYOUT = """() => {
  const box = (el) => el.getBoundingClientRect();
  const tables = [...document.querySelectorAll("section table")].map((t) => {
    const card = t.closest("section"), style = getComputedStyle(card);
    const lastHeader = [...t.querySelectorAll("thead th")].at(-1);
    return {id: t.id, right: box(t).right, width: box(t).width, scrollWidth: t.scrollWidth,
            lastHeaderRight: box(lastHeader).right,
            cardRight: box(card).right - parseFloat(style.paddingRight),
            cardScrolls: card.scrollWidth > card.clientWidth};
  });
  const plots = [...document.querySelectorAll("section svg")].map((svg) => {
    const frame = box(svg), text = (sel) => [...svg.querySelectorAll(sel)].map((e) => {
      const b = box(e); return {text: e.textContent, left: b.left, right: b.right, top: b.top,
                                bottom: b.bottom};
    });
    const target = svg.querySelector("line.target");
    return {id: svg.id, frame: {left: frame.left, right: frame.right, top: frame.top,
            bottom: frame.bottom}, xLabel: text(".x-label"), yLabel: text(".y-label"),
            texts: text("text"), xTicks: text(".x-tick"),
            target: target && {y: box(target).top, label: text(".target-label")[0]}};
  });
  return {tables, plots, pageWidth: document.documentElement.scrollWidth};
}"""


def test_the_page_fits_1400_px_and_reads_at_a_glance(deployment: str, tmp_path: Path) -> None:
    """No table wider than its card (the jobs table's canary column in sight), no console
    error (the favicon included), an exhausted budget read as exhausted with its overspend,
    a burn rate without data read as such, each plot's x axis labelled and every label inside
    its plot, the 99% target line inside the attainment plot. Screenshots of the page and each
    section go to tmp_path, and to $FAIRGATE_SCREENSHOTS when set."""
    url = deployment
    errors: list[str] = []
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport=VIEWPORT)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("response", lambda r: errors.append(f"{r.status} {r.url}")
                    if r.status >= 400 else None)
            page.goto(f"{url}/dashboard")
            page.fill("#key", ADMIN_KEY)
            page.click("button[type=submit]")
            page.wait_for_selector("body[data-loaded='1']", timeout=30_000)
            page.click("tr.tenant[data-tenant='tight']")
            page.wait_for_selector("#plot-requests rect", timeout=10_000)
            layout = page.evaluate(LAYOUT)
            cells = {(r.get_attribute("data-tenant"), c.get_attribute("data-field")):
                     " ".join(c.inner_text().split())
                     for r in page.query_selector_all("tr.tenant")
                     for c in r.query_selector_all("td[data-field]")}
            _screenshots(page, tmp_path / "screenshots")
        finally:
            browser.close()
    assert errors == []

    assert layout["pageWidth"] <= VIEWPORT["width"]  # no sideways scrolling
    assert [t["id"] for t in layout["tables"]] == ["tenants", "engines", "shadows", "jobs"]
    for t in layout["tables"]:
        assert t["scrollWidth"] <= math.ceil(t["width"]) and not t["cardScrolls"], t
        assert t["right"] <= t["cardRight"] + 0.5 and t["lastHeaderRight"] <= t["cardRight"] \
            + 0.5, t

    # tight missed 2 of 5 against a 1% budget: spent 40 times over, read as exhausted
    budgets = {t["name"]: t["budget_left_30d"] for t in _call(url, "/admin/slo/tenants")[1][
        "tenants"]}
    spent = (SENT["tight"] - SERVED["tight"]) / (0.01 * SENT["tight"])
    assert 1 - budgets["tight"] == pytest.approx(spent)
    assert cells["tight", "budget_left_30d"] == f"exhausted ({spent:.1f}x spent)"
    assert cells["roomy", "budget_left_30d"] == "100.00%"
    assert budgets["quiet"] is None
    assert [cells["quiet", f] for f in ("budget_left_30d", "burn_1h", "burn_6h")] == \
        ["no data"] * 3

    _assert_plots_read_plainly({plot["id"]: plot for plot in layout["plots"]})


def _assert_plots_read_plainly(plots: dict[str, Any]) -> None:
    """Each plot's x axis labelled, no label over its edge, its x ticks apart; the target line
    inside the attainment plot, clear of its top, labelled above the line."""
    assert sorted(plots) == sorted(PLOTS)
    for plot in plots.values():
        frame = plot["frame"]
        [x_label] = plot["xLabel"]
        assert x_label["text"].strip(), plot["id"]
        if plot["id"] in ("plot-requests", "plot-attainment"):  # over the clock's minutes
            assert x_label["text"].startswith("time"), x_label
        for text in plot["texts"]:  # no label clipped by its plot's edge
            assert frame["left"] <= text["left"] and text["right"] <= frame["right"] and \
                frame["top"] <= text["top"] and text["bottom"] <= frame["bottom"], (plot["id"],
                                                                                     text)
        ticks = sorted(plot["xTicks"], key=lambda t: t["left"])
        assert len(ticks) >= 2 and all(a["right"] < b["left"] for a, b in pairwise(ticks)), \
            ticks  # at least two times (or trials, or seconds), none over the next
    target = plots["plot-attainment"]["target"]
    frame = plots["plot-attainment"]["frame"]
    # clear of the top edge, with its label above it, inside the plot
    assert frame["top"] + 10 < target["y"] < frame["bottom"] - 10, (target, frame)
    assert target["label"]["text"] == "99% target"
    assert frame["top"] < target["label"]["top"] and target["label"]["bottom"] <= target["y"]


def _screenshots(page: Any, folder: Path) -> None:
    """The whole page and each section, into `folder` and $FAIRGATE_SCREENSHOTS if set."""
    folder.mkdir(parents=True)
    page.screenshot(path=str(folder / "dashboard.png"), full_page=True)
    for section in SECTIONS:
        page.locator(f"#{section}").screenshot(path=str(folder / f"{section}.png"))
    assert (folder / "dashboard.png").stat().st_size > 10_000
    if os.environ.get("FAIRGATE_SCREENSHOTS"):
        shutil.copytree(folder, os.environ["FAIRGATE_SCREENSHOTS"], dirs_exist_ok=True)

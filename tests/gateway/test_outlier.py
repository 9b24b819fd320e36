"""Outlier ejection (gateway/outlier.py) and the retry budget (gateway/dispatch.py): the rules
on a test clock, a property test that never more than max_ejection_percent of a model's
replicas are out, what each engine answer counts as, and a gateway in front of a replica that
answers 500: its clients are served by the other one, and the ejection shows in /admin/engines,
/readyz, the dashboard's script and the metrics."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.backends import BackendPool
from gateway.config import GatewayConfig, OutlierDetectionConfig, RetryBudgetConfig
from gateway.dispatch import Dispatcher
from gateway.fairqueue import FairQueue, QueueBounds, QueuedRequest
from gateway.metrics import GatewayMetrics
from gateway.outlier import OutlierDetector, Verdict, max_ejected
from tests.gateway.helpers import ControlledBackend, collect, completion, start_gateway
from tests.support.waiting import wait_for
from tuner.fake_server import SCRIPT, make_fake_app

FAILED, OK = Verdict.FAILED, Verdict.OK
PAIR = ("a", "b")
ADMIN = {"Authorization": "Bearer admin-key-0123456789"}  # tests.gateway.helpers' admin key
APP_JS = Path(__file__).resolve().parents[2] / "control" / "dashboard_assets" / "app.js"
# the page's script in node, a stub DOM around it: renderEngines(stdin's JSON), the rows written
RENDER_ENGINES = """
const fs = require("fs"), vm = require("vm");
const tbody = {innerHTML: ""};
const page = {location: {hash: ""}, document: {querySelector: () => tbody,
  getElementById: () => ({})}, fetch: () => new Promise(() => {}), setInterval: () => 0};
vm.createContext(page);
vm.runInContext(fs.readFileSync(process.argv[1], "utf8"), page);
page.renderEngines(JSON.parse(fs.readFileSync(0, "utf8")));
process.stdout.write(tbody.innerHTML);
"""


def rendered_engines(engines: dict[str, Any]) -> str | None:
    """The dashboard's engine rows for `engines` (/admin/engines' JSON); None without node."""
    if shutil.which("node") is None:
        return None
    done = subprocess.run(["node", "-e", RENDER_ENGINES, str(APP_JS)], check=True,
                          input=json.dumps(engines), capture_output=True, text=True, timeout=30)
    return done.stdout


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def detector(**settings: Any) -> tuple[OutlierDetector, Clock]:
    clock = Clock()
    return OutlierDetector(OutlierDetectionConfig(**settings), clock), clock


def fail(d: OutlierDetector, name: str, times: int, replicas: tuple[str, ...] = PAIR) -> bool:
    """`times` failures on `name`; whether the last one ejected it."""
    return [d.record(name, FAILED, replicas) for _ in range(times)][-1]


# ---- the rules -------------------------------------------------------------------------------
def test_five_failures_in_a_row_eject_for_the_base_time() -> None:
    d, clock = detector()
    assert not fail(d, "a", 4)
    assert d.record("a", FAILED, PAIR) and d.ejected("a") and not d.ejected("b")
    clock.now += 29.9
    assert d.ejected("a")
    clock.now += 0.2
    assert not d.ejected("a")
    assert d.state("a")["ejections"] == 1 and d.state("a")["consecutive_failures"] == 0


def test_an_answer_between_failures_starts_the_count_again() -> None:
    d, _ = detector()
    fail(d, "a", 4)
    d.record("a", OK, PAIR)
    assert not fail(d, "a", 4) and not d.ejected("a")
    assert d.state("a")["consecutive_failures"] == 4


def test_half_of_twenty_requests_in_the_window_failing_ejects() -> None:
    d, clock = detector()
    for i in range(19):  # never two failures in a row
        d.record("a", FAILED if i % 2 else OK, PAIR)
        clock.now += 0.25
    assert not d.ejected("a") and d.state("a")["error_rate"] == pytest.approx(9 / 19)
    assert d.record("a", FAILED, PAIR) and d.ejected("a")


def test_failures_older_than_the_window_are_forgotten() -> None:
    d, clock = detector()
    for i in range(40):  # half failed, but 10 s hold only ~11 of them
        d.record("a", FAILED if i % 2 else OK, PAIR)
        clock.now += 1.0
    assert not d.ejected("a")
    assert d.state("a")["window_requests"] <= 11


def test_each_ejection_lasts_longer_up_to_the_cap_and_the_count_decays_in_service() -> None:
    d, clock = detector(base_ejection_time_s=30, max_ejection_time_s=75)
    lengths = []
    for _ in range(3):
        fail(d, "a", 5)
        start = clock.now
        while d.ejected("a"):
            clock.now += 1
        lengths.append(clock.now - start)
    assert lengths == [30, 60, 75]
    assert d.state("a")["ejections"] == 3
    d.record("a", OK, PAIR)  # back at once: too soon to decay
    assert d.state("a")["ejections"] == 3
    clock.now += 30
    d.record("a", OK, PAIR)  # it served for a base ejection time
    assert d.state("a")["ejections"] == 2
    fail(d, "a", 5)
    assert d.state("a")["ejections"] == 3 and d.state("a")["ejections_total"] == 4


def test_requests_that_end_while_it_is_ejected_do_not_count() -> None:
    d, clock = detector()
    fail(d, "a", 5)
    fail(d, "a", 10)  # under way when it was ejected
    clock.now += 30
    assert not d.ejected("a") and d.state("a")["consecutive_failures"] == 0
    assert not fail(d, "a", 4)


def test_at_most_half_of_a_models_replicas_are_out_and_a_lone_one_never() -> None:
    d, _ = detector()
    assert fail(d, "a", 5) and not fail(d, "b", 5)
    assert [d.ejected(n) for n in PAIR] == [True, False]
    assert not fail(d, "solo", 20, ("solo",)) and not d.ejected("solo")
    four = ("w", "x", "y", "z")
    assert [fail(d, n, 5, four) for n in four] == [True, True, False, False]


@pytest.mark.parametrize(("replicas", "percent", "allowed"), [
    (1, 50, 0), (1, 100, 1), (2, 50, 1), (3, 50, 1), (4, 50, 2), (3, 10, 1), (10, 25, 2),
    (5, 0, 0), (2, 100, 2)])
def test_max_ejected(replicas: int, percent: float, allowed: int) -> None:
    assert max_ejected(replicas, percent) == allowed


STEPS = st.lists(st.tuples(st.integers(0, 5), st.booleans(), st.sampled_from([0, 0.5, 7, 31])),
                 max_size=200)


@settings(max_examples=300, deadline=None)
@given(replicas=st.integers(1, 6), percent=st.integers(0, 100), steps=STEPS)
def test_never_more_than_max_ejection_percent_are_out(replicas: int, percent: int,
                                                      steps: list[tuple[int, bool, float]]) -> None:
    d, clock = detector(max_ejection_percent=percent, base_ejection_time_s=30,
                        max_ejection_time_s=90, consecutive_5xx=3)
    names = tuple(f"r{i}" for i in range(replicas))
    limit = replicas * percent // 100 or (1 if replicas > 1 and percent else 0)
    for index, failed, advance in steps:
        clock.now += advance
        d.record(names[index % replicas], FAILED if failed else OK, names)
        out = [n for n in names if d.ejected(n)]
        assert len(out) <= limit, (out, percent)
        for n in out:
            assert d.records[n].ejected_until - clock.now <= 90


# ---- config ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("section", "values", "names"), [
    ("outlier_detection", {"consecutive_5xx": -1}, "consecutive_5xx"),
    ("outlier_detection", {"max_ejection_percent": 101}, "max_ejection_percent"),
    ("outlier_detection", {"failure_percentage_threshold": 0}, "failure_percentage_threshold"),
    ("outlier_detection", {"interval_s": 0}, "interval_s"),
    ("outlier_detection", {"max_ejection_time_s": 10}, "max_ejection_time_s"),
    ("outlier_detection", {"base_ejection": 10}, "base_ejection_time_s"),  # did you mean
    ("retry_budget", {"budget_percent": -1}, "budget_percent"),
    ("retry_budget", {"min_retry_concurrency": 1.5}, "min_retry_concurrency"),
])
def test_bad_settings_are_refused_naming_the_key(section: str, values: dict[str, Any],
                                                 names: str) -> None:
    with pytest.raises(ValueError, match=f"{names}"):
        GatewayConfig.from_dict({section: values})


def test_settings_reach_the_pool_and_the_dispatcher() -> None:
    config = GatewayConfig.from_dict({"outlier_detection": {"consecutive_5xx": 2},
                                      "retry_budget": {"min_retry_concurrency": 7}})
    assert config.outlier_detection.consecutive_5xx == 2
    assert GatewayConfig.from_dict({"outlier_detection": None}).outlier_detection == (
        OutlierDetectionConfig())
    pool = BackendPool([ControlledBackend()], outlier_detection=config.outlier_detection)
    dispatcher = Dispatcher(FairQueue(), pool, GatewayMetrics(), retry_budget=config.retry_budget)
    assert pool.outliers.config.consecutive_5xx == 2
    assert dispatcher.retries.config.min_retry_concurrency == 7


# ---- the retry budget -------------------------------------------------------------------------
async def test_retries_under_way_stay_within_the_budget() -> None:
    a, b = ControlledBackend(100, name="a"), ControlledBackend(100, name="b")
    metrics = GatewayMetrics()
    dispatcher = Dispatcher(FairQueue(), BackendPool([a, b]), metrics,
                            retry_budget=RetryBudgetConfig(budget_percent=20,
                                                           min_retry_concurrency=1))
    items = [QueuedRequest("acme", 1, 1) for _ in range(10)]
    for item in items:
        dispatcher.submit(item, QueueBounds())
    assert a.inflight + b.inflight == 10
    failed = [item.payload.result() for item in items]
    # 10 active: 2 retries at once
    assert dispatcher.failover(items[0], failed[0], None, "5xx") is not None
    assert dispatcher.failover(items[1], failed[1], None, "reset") is not None
    assert dispatcher.failover(items[2], failed[2], None, "5xx") is None
    text = metrics_text(metrics)
    assert 'fairgate_gateway_retries_total{reason="5xx"} 1.0' in text
    assert 'fairgate_gateway_retries_refused_total{reason="budget"} 1.0' in text
    for item in items[:2]:  # both retries ended (8 active: room for one)
        dispatcher.release(item, a if item.payload.result() is b else b, 1, 1)
    assert dispatcher.failover(items[2], failed[2], None, "5xx") is not None
    assert dispatcher.failover(items[3], failed[3], None, "5xx") is None


def metrics_text(metrics: GatewayMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


# ---- what each engine answer counts as ---------------------------------------------------------
@pytest.mark.parametrize(("status", "verdict", "client_sees"), [
    (200, OK, 200), (400, OK, 400), (500, FAILED, 502), (502, FAILED, 502),
    (429, None, 503), (503, None, 503)])
async def test_what_each_engine_answer_counts_as(aiohttp_client: Any, aiohttp_server: Any,
                                                 db_url: str, status: int,
                                                 verdict: Verdict | None,
                                                 client_sees: int) -> None:
    engine = await aiohttp_server(make_fake_app(statuses=(status,), output_tokens=2))
    h = await start_gateway(aiohttp_client, db_url, gateway={"backends": [
        {"url": str(engine.make_url("/")), "kind": "openai", "model": "fake-model"}]})
    await wait_for(lambda: h.gateway.pool.backends[0].healthy, timeout=10)
    resp = await h.post("acme", {**completion(stream=True), "model": "fake-model"})
    [_ async for _ in collect(resp)]
    assert resp.status == client_sees
    record = h.gateway.pool.outliers.records.get(h.gateway.pool.backends[0].name)
    noted = None if record is None or not record.window()[0] else (
        FAILED if record.window()[1] else OK)
    assert noted is verdict


# ---- a gateway in front of a replica that answers 500 --------------------------------------------
async def test_a_replica_answering_500_is_ejected_and_its_requests_served_elsewhere(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    good = await aiohttp_server(make_fake_app(output_tokens=3))
    bad = await aiohttp_server(make_fake_app(statuses=(500,)))
    h = await start_gateway(aiohttp_client, db_url, gateway={"backends": [
        {"url": str(s.make_url("/")), "kind": "openai", "model": "fake-model"}
        for s in (good, bad)]})
    pool = h.gateway.pool
    await wait_for(lambda: all(b.healthy for b in pool.backends), timeout=10)
    bad_name = pool.backends[1].name

    async def client() -> list[int]:
        statuses = []
        for _ in range(10):
            resp = await h.post("acme", {**completion(stream=True), "model": "fake-model"})
            [_ async for _ in collect(resp)]
            statuses.append(resp.status)
        return statuses

    results = await asyncio.gather(*(client() for _ in range(4)))
    assert [s for r in results for s in r] == [200] * 40
    assert 5 <= len(bad.app[SCRIPT].received) <= 5 + 4  # the 5th ejects; at most 4 at once
    engines = await (await h.client.get("/admin/engines", headers=ADMIN)).json()
    rows = {e["name"]: e for e in engines["engines"]}
    assert rows[bad_name]["outlier"]["ejected"] is True
    assert rows[bad_name]["outlier"]["ejections"] == 1
    assert rows[bad_name]["outlier"]["ejected_until"] > engines["generated_at"]
    assert rows[pool.backends[0].name]["outlier"]["ejected"] is False
    # every field the dashboard's engine health reads is in what /admin/engines writes
    read = set(re.findall(r"\bo\.([a-z_]+)", APP_JS.read_text()))
    assert read and read <= set(rows[bad_name]["outlier"]), read
    until = rows[bad_name]["outlier"]["ejected_until"]
    assert until - engines["generated_at"] <= 30  # the first ejection's 30 s
    before = time.time()
    page = rendered_engines(engines)
    after = time.time()
    if page is not None:  # and the page shows it: the seconds left when it rendered
        row = next(r for r in page.split("</tr>") if f'data-engine="{bad_name}"' in r)
        shown = re.search(r">ejected (\d+) s<", row)
        assert shown and "100.00% of 5" in row, row
        assert round(until - after) <= int(shown.group(1)) <= round(until - before), row
    ready = await h.client.get("/readyz")
    body = await ready.json()
    assert ready.status == 200 and body["checks"]["backends"]["ok"] is True
    assert "degraded" in body["checks"]["backends"]["detail"]
    assert body["checks"]["backends"]["models"]["fake-model"] == {
        "replicas": 2, "available": 1, "ejected": 1}
    text = h.metrics()
    assert f'fairgate_gateway_backend_ejected{{backend="{bad_name}"}} 1.0' in text
    assert f'fairgate_gateway_backend_ejections_total{{backend="{bad_name}"}} 1.0' in text
    retried = re.findall(r'^fairgate_gateway_retries_total\{reason="5xx"\} (\S+)$', text,
                         re.MULTILINE)
    # each one, once, labelled with how it failed
    assert sum(map(float, retried)) == len(bad.app[SCRIPT].received)


async def test_a_model_whose_every_replica_is_ejected_is_not_ready(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    bad = [await aiohttp_server(make_fake_app(statuses=(500,))) for _ in range(2)]
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "outlier_detection": {"max_ejection_percent": 100, "consecutive_5xx": 1},
        "backends": [{"url": str(s.make_url("/")), "kind": "openai", "model": "fake-model"}
                     for s in bad]})
    pool = h.gateway.pool
    await wait_for(lambda: all(b.healthy for b in pool.backends), timeout=10)
    resp = await h.post("acme", {**completion(stream=True), "model": "fake-model"})
    assert resp.status == 502  # the first replica failed, then the one it was retried on
    assert all(pool.outliers.ejected(b.name) for b in pool.backends)
    ready = await h.client.get("/readyz")
    body = await ready.json()
    assert ready.status == 503 and body["checks"]["backends"]["ok"] is False
    assert "no replica can serve" in body["checks"]["backends"]["detail"]
    refused = await h.post("acme", {**completion(stream=True), "model": "fake-model"})
    assert refused.status == 503
    assert (await refused.json())["error"]["code"] == "model_unavailable"

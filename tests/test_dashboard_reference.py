"""docs/dashboard.md against the gateway an operator runs (built in-process, no browser: the
page in Chromium and the fields its script reads are tests/control/test_dashboard_data.py's):
every route the page names is served with the method it says and is in GET /openapi.json, and
every /dashboard, /admin/slo and /admin/engines route served is named; every JSON route the
page's script fetches is named, with the query parameters it sends; the fields the page lists
for the tenant routes and /admin/engines are the fields the real answers have, both ways; each
query parameter it names is taken by its route (and a bad `hours` is a 400 naming it); the
sections it names are the served page's; the login, its cookie, the refresh and the
no-CDN rule are as it says; the states, paging rates and files it cites are the code's.
"""

from __future__ import annotations

import dataclasses
import re
from html.parser import HTMLParser
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import pytest

from control.dashboard import MAX_SERIES_HOURS, PROBLEMS
from gateway.auth import SESSION_TTL_S
from protocol.measures import PAGE_BURN_1H, PAGE_BURN_6H
from tenants import TenantLimits
from tenants.slo_views import STATES
from tests.gateway.helpers import ControlledBackend, Harness, collect, start_gateway
from tests.test_docs import DOCS, ROOT, section
from tuner.fake_server import make_fake_app

PAGE = DOCS / "dashboard.md"
ASSETS = ROOT / "control" / "dashboard_assets"
ADMIN_KEY = "admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SLOS = {"slo_ttft_p99_s": 5.0, "slo_tpot_p99_s": 5.0, "slo_itl_p99_s": 5.0}
OWN = ("/dashboard", "/admin/slo/", "/admin/engines")  # the routes only this page documents
# below these keys: rows by reason, the tenant's limits (tenants.md's), the engine's own load
OPAQUE = frozenset({"rejections_since_start", "limits", "load"})
ROUTE = re.compile(r"`(GET|POST) (/[^`?\s]*)`")
QUERY = re.compile(r"`\?(\w+)=[^`]*`")
NAME = re.compile(r"[a-z_][a-z0-9_]*")
PERIOD = re.compile(r"[0-9]+[hd]")
FETCH = re.compile(r'getJSON\(["`]([^"`]+)["`]\)')


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"


def page() -> str:
    return PAGE.read_text()


def spans(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def names(text: str) -> set[str]:
    """The field names the text shows as code (`ttft`; not `GET /x`, `a.b` or `1h`)."""
    return {code for code in spans(text) if NAME.fullmatch(code)}


def periods(text: str) -> set[str]:
    return {code for code in spans(text) if PERIOD.fullmatch(code)}


def bullet(text: str, route: str) -> str:
    """The `- `route`...` item of the page's list of the JSON behind it."""
    start = text.index(f"\n- `{route}`")
    end = text.find("\n- ", start + 1)
    return text[start:text.find("\n\n", start) if end == -1 else end]


def figures(text: str) -> str:
    """The paragraph naming the figures both tenant routes answer."""
    start = text.index("Both tenant routes answer")
    return text[start:text.index("\n\n", start)]


def keys(value: Any, opaque: frozenset[str] = OPAQUE) -> set[str]:
    """Every key of a JSON value at any depth (not below an `opaque` key)."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, child in value.items():
            found.add(key)
            if key not in opaque:
                found |= keys(child, opaque)
    elif isinstance(value, list):
        for item in value:
            found |= keys(item, opaque)
    return found


def fields(value: Any, opaque: frozenset[str] = OPAQUE) -> set[str]:
    return {key for key in keys(value, opaque) if NAME.fullmatch(key)}


def route_pattern(path: str) -> str:
    """/admin/x/{name}/stats and the script's /admin/x/${...}/stats both as /admin/x/{}/stats."""
    return re.sub(r"\$?\{[^}]*\}", "{}", path)


async def gateway(aiohttp_client: Any, db_url: str, **settings: Any) -> Harness:
    backend = ControlledBackend(capacity_=4)
    backend.release()  # every request streams at once
    return await start_gateway(aiohttp_client, db_url, tenants={"acme": SLOS, "quiet": {}},
                               gateway=settings, backends=[backend])


async def served(h: Harness) -> None:
    """One streamed request of acme's, in the ledger's rollups."""
    resp = await h.post("acme", {"model": ControlledBackend.model_name, "prompt": "hi",
                                 "max_tokens": 3, "stream": True})
    assert resp.status == 200, await resp.text()
    [_ async for _ in collect(resp)]
    await h.gateway.ledger.flush()


async def get(h: Harness, path: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    resp = await h.client.get(path, headers=ADMIN if headers is None else headers,
                              allow_redirects=False)
    body = await resp.json() if resp.content_type == "application/json" else await resp.text()
    return resp.status, body


async def test_each_route_the_page_names_is_served_and_each_fetch_is_named(
        aiohttp_client: Any, db_url: str) -> None:
    named = set(ROUTE.findall(page()))
    h = await gateway(aiohttp_client, db_url)
    served_routes = {(r.method, r.resource.canonical) for r in h.app.router.routes()
                     if r.resource is not None and r.method != "HEAD"}  # HEAD: aiohttp's own
    assert named - served_routes == set()
    own = {route for route in served_routes if route[1].startswith(OWN)}
    assert own - named == set()  # every dashboard route an operator can reach is on the page
    paths = (await (await h.client.get("/openapi.json")).json())["paths"]
    for method, path in named:
        assert method.lower() in paths.get(path, {}), (method, path)

    script = (ASSETS / "app.js").read_text()
    fetched = FETCH.findall(script)
    assert "/admin/slo/tenants" in fetched and len(fetched) >= 6, fetched
    documented = {route_pattern(path) for method, path in named if method == "GET"}
    queries = set(QUERY.findall(page()))
    for url in fetched:
        path, _, query = url.partition("?")
        assert route_pattern(path) in documented, f"the page's script fetches {path}"
        sent = set(re.findall(r"(\w+)=", query))
        assert sent <= queries, f"{path} is sent {sent - queries}, not on the page"


async def test_the_tenant_routes_answer_the_fields_the_page_names(aiohttp_client: Any,
                                                                  db_url: str) -> None:
    h = await gateway(aiohttp_client, db_url)
    await served(h)
    text = page()
    both = names(figures(text))
    status, listed = await get(h, "/admin/slo/tenants")
    assert status == 200
    rows = {t["name"]: t for t in listed["tenants"]}
    acme = rows["acme"]
    assert acme["queue"] is not None and acme["p99_1h"]["ttft"] is not None  # all shown
    assert "null before its first request" in " ".join(text.split())
    assert (rows["quiet"]["queue"], rows["quiet"]["budget_left_30d"]) == (None, None)
    assert names(bullet(text, "GET /admin/slo/tenants")) | both == fields(listed)
    assert periods(figures(text)) == keys(listed) - fields(listed)  # 1h, 24h, 30d, 6h

    status, detail = await get(h, "/admin/slo/tenants/acme?hours=6")
    assert status == 200 and detail["hours"] == 6 and detail["series"], detail
    as_in_a_row = frozenset({"slo", "queue", "p99_1h"})  # the page: as in a row above
    assert names(bullet(text, "GET /admin/slo/tenants/{name}")) | both == fields(
        detail, OPAQUE | as_in_a_row)
    assert all(set(detail[key]) == set(acme[key]) for key in as_in_a_row)
    assert set(detail["limits"]) == {f.name for f in dataclasses.fields(TenantLimits)}


async def test_the_hours_the_page_names_are_taken_and_others_refused(aiohttp_client: Any,
                                                                     db_url: str) -> None:
    h = await gateway(aiohttp_client, db_url)
    text = bullet(page(), "GET /admin/slo/tenants/{name}")
    most = re.search(r"at\s+most\s+(\d+)", text)
    assert most is not None and float(most.group(1)) == MAX_SERIES_HOURS
    for hours in ("6", "0.5", most.group(1)):
        status, body = await get(h, f"/admin/slo/tenants/quiet?hours={hours}")
        assert (status, body["hours"]) == (200, float(hours))
    assert "a 400 naming `hours`" in " ".join(text.split())
    for bad in ("0", "-1", str(int(most.group(1)) + 1), "six"):
        status, body = await get(h, f"/admin/slo/tenants/quiet?hours={bad}")
        assert (status, body["error"]["param"]) == (400, "hours"), (bad, body)
    assert "an unknown tenant a 404" in " ".join(text.split())
    status, body = await get(h, "/admin/slo/tenants/nobody")
    assert (status, body["error"]["code"]) == (404, "tenant_not_found")


async def test_the_shadow_stats_take_the_window_the_page_asks(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    text = bullet(page(), "GET /admin/shadow")
    asked = re.search(r"`\?window=(\d+)`", text)
    assert asked is not None
    h = await gateway(aiohttp_client, db_url)
    server = await aiohttp_server(make_fake_app(model=ControlledBackend.model_name))
    target = {"name": "t", "url": str(server.make_url("/v1")), "kind": "openai"}
    resp = await h.client.post("/admin/shadow", json=target, headers=ADMIN)
    assert resp.status == 201, await resp.text()
    status, stats = await get(h, f"/admin/shadow/t/stats?window={asked.group(1)}")
    assert (status, stats["window_s"]) == (200, float(asked.group(1)))
    status, jobs = await get(h, "/admin/tune-jobs")
    assert (status, jobs) == (200, {"jobs": []})


async def test_the_engine_rows_have_the_fields_the_page_names(aiohttp_client: Any,
                                                              tmp_path: Path) -> None:
    # the embedded engine's load, as /admin/engines shows it: the fields the page reads
    embedded = await start_gateway(aiohttp_client, f"sqlite+aiosqlite:///{tmp_path / 'e.db'}")
    status, answer = await get(embedded, "/admin/engines")
    assert status == 200
    load = answer["engines"][0]["load"]
    assert load
    # a remote backend with requests waiting while KV has room: one sign of trouble
    backend = ControlledBackend()
    backend.load = {**load, "waiting": 2, "kv_usage": 0.1}  # type: ignore[attr-defined]
    h = await start_gateway(aiohttp_client, f"sqlite+aiosqlite:///{tmp_path / 'c.db'}",
                            backends=[backend])
    status, troubled = await get(h, "/admin/engines")
    assert status == 200 and troubled["engines"][0]["problems"], troubled
    row = troubled["engines"][0]
    assert row["outlier"]["window_s"] == h.gateway.pool.outliers.config.interval_s

    text = bullet(page(), "GET /admin/engines")
    documented = names(text)
    signs = re.search(r"`sign`, (.*?), and `what`", text, re.S)
    assert signs is not None and names(signs.group(1)) == {sign for sign, _ in PROBLEMS}
    reads = re.search(r"the page shows (.*?)\)", text, re.S)
    assert reads is not None
    shown = names(reads.group(1))
    assert shown - set(load) == set(), "load fields the page names that the engine lacks"
    real = fields(answer) | fields(troubled)
    assert real - documented == set()
    assert documented - real - shown - names(signs.group(1)) == set()
    script = (ASSETS / "app.js").read_text()
    assert set(re.findall(r"\bl\.(\w+)", script)) == shown  # what the page shows of a load


class Headings(HTMLParser):
    """The text of each h2 and h3, and the ids of the elements, of a served page."""

    def __init__(self) -> None:
        super().__init__()
        self.headings: dict[str, list[str]] = {"h2": [], "h3": []}
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.open: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if found.get("id"):
            self.ids.add(str(found["id"]))
        self.links += [str(found[a]) for a in ("src", "href", "action") if found.get(a)]
        if tag in self.headings:
            self.open = tag
            self.headings[tag].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == self.open:
            self.open = None

    def handle_data(self, data: str) -> None:
        if self.open:
            self.headings[self.open][-1] += data


async def test_the_sections_and_the_refresh_the_page_names_are_served(aiohttp_client: Any,
                                                                      db_url: str) -> None:
    h = await gateway(aiohttp_client, db_url)
    resp = await h.client.get("/dashboard", headers=ADMIN)
    assert resp.status == 200 and resp.content_type == "text/html"
    assert "default-src 'self'" in resp.headers["Content-Security-Policy"]
    html = Headings()
    html.feed(await resp.text())
    shown = section(page(), "What it shows")
    sections = re.findall(r"^- \*\*(.+?)\*\*:", shown, re.M)
    titles = [t for t in html.headings["h2"] if t]  # the tenant detail's is filled in later
    assert len(sections) == len(titles) == 4, (sections, titles)
    for name, title in zip(sections, titles, strict=True):
        assert title.startswith(name), (name, title)
    # a click on a tenant: its requests and attainment per minute, as plots
    assert "requests and attainment per minute as plots" in " ".join(shown.split())
    assert {"detail", "plot-requests", "plot-attainment"} <= html.ids
    plots = html.headings["h3"]
    assert any(t.startswith("requests per minute") for t in plots), plots
    assert any(t.startswith("SLO attainment per minute") for t in plots), plots

    # everything from fairgate: no other origin in the page or its script
    assert all(link.startswith(("/", "data:", "#")) for link in html.links), html.links
    resp = await h.client.get("/dashboard/app.js")
    script = await resp.text()
    assert resp.status == 200 and not re.search(r"https?://", script)
    every = re.search(r"refreshes itself every (\d+) s", " ".join(page().split()))
    assert every is not None
    assert re.findall(r"setInterval\(refresh, (\d+)\)", script) == [
        str(int(every.group(1)) * 1000)]


async def test_the_login_and_its_cookie_are_as_the_page_says(aiohttp_client: Any,
                                                             db_url: str) -> None:
    text = " ".join(section(page(), "Logging in").split())
    h = await gateway(aiohttp_client, db_url)
    jar = h.client.session.cookie_jar  # cleared: each request here carries what it says
    resp = await h.client.get("/dashboard", allow_redirects=False)
    assert (resp.status, resp.headers["Location"]) == (303, "/dashboard/login")
    login = await (await h.client.get("/dashboard/login")).text()
    assert 'action="/dashboard/login"' in login and 'name="key"' in login

    resp = await h.client.post("/dashboard/login", data={"key": ADMIN_KEY},
                               allow_redirects=False)
    jar.clear()
    assert (resp.status, resp.headers["Location"]) == (303, "/dashboard")
    cookie = SimpleCookie(resp.headers["Set-Cookie"])
    name = re.search(r"session cookie \(`(\w+)`: HTTP-only, SameSite=Strict, (\d+) hours",
                     text)
    assert name is not None and list(cookie) == [name.group(1)]
    morsel = cookie[name.group(1)]
    assert morsel["httponly"] and morsel["samesite"] == "Strict"
    assert "or on localhost" in text and morsel["secure"]  # the test server is on 127.0.0.1
    assert int(morsel["max-age"]) == int(name.group(2)) * 3600 == SESSION_TTL_S
    session = {"Cookie": f"{name.group(1)}={morsel.value}"}

    # the cookie reads; a change still needs the bearer key
    assert (await get(h, "/dashboard", session))[0] == 200
    assert (await get(h, "/admin/slo/tenants", session))[0] == 200
    assert "only ever authorises reading" in text
    change = {"name": "t", "url": "http://127.0.0.1:9/v1", "kind": "openai"}
    resp = await h.client.post("/admin/shadow", json=change, headers=session)
    assert resp.status == 401 and h.shadows.mirrors == {}
    assert (await get(h, "/dashboard", ADMIN))[0] == 200  # or the key as a bearer token

    resp = await h.client.post("/dashboard/logout", headers=session, allow_redirects=False)
    jar.clear()
    assert (resp.status, resp.headers["Location"]) == (303, "/dashboard/login")
    assert (await get(h, "/admin/slo/tenants", session))[0] == 401  # logging out ends it
    assert (await get(h, "/dashboard", session))[0] == 303

    assert "an `admin_key` is needed: without one it is a 404" in text
    keyless = await start_gateway(aiohttp_client, db_url, tenants={},
                                  gateway={"admin_key": None})
    assert (await get(keyless, "/dashboard", {}))[0] == 404


def test_the_states_rates_and_files_the_page_cites_are_the_codes() -> None:
    text = page()
    tenants = " ".join(section(text, "What it shows").split())
    assert names(tenants) & set(STATES) == set(STATES)
    rates = re.search(r"burning at ([\d.]+)x over 1 h or ([\d.]+)x over 6 h", tenants)
    assert rates is not None
    assert (float(rates.group(1)), float(rates.group(2))) == (PAGE_BURN_1H, PAGE_BURN_6H)
    for path in {c for c in spans(text) if re.fullmatch(r"(tests|bench)/[\w/.]+", c)}:
        assert (ROOT / path).is_file(), path
    assert "FAIRGATE_SCREENSHOTS" in (ROOT / "tests/control/test_dashboard_data.py").read_text()
    assert '"fg_usage_minutes"' in (ROOT / "tenants" / "models.py").read_text()
    bench = re.search(r"median of (\d+) ms, ([\d.]+)x faster", " ".join(text.split()))
    assert bench is not None
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    assert re.search(rf"tenants view .*: median {bench.group(1)} ms", results)
    assert f"ratio {bench.group(2)}x" in results

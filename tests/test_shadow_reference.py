"""docs/shadow.md against the gateway an operator runs: every admin route the page names is
served with the method it says (and is in GET /openapi.json); the fields the page names for a
target in GET /admin/shadow, for the stats of GET /admin/shadow/{name}/stats and for a line of
GET /admin/capture are the fields the real answers have, read from a gateway built in-process
with live requests mirrored to real shadow servers on 127.0.0.1; a PATCH takes the fields the
page says it may change and refuses every other one as the page says; POST, DELETE and an
unknown name answer as the page says. The `gateway.shadow` and `gateway.capture` keys of
docs/configuration.md are tests/test_config_reference.py's.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from control.openapi import document
from gateway.config import CaptureConfig, ShadowConfig
from tests.gateway.helpers import ControlledBackend, Harness, collect, start_gateway
from tests.support.waiting import wait_for
from tests.test_docs import DOCS, ROOT, section
from tuner.fake_server import make_fake_app

PAGE = DOCS / "shadow.md"
ADMIN = {"Authorization": "Bearer admin-key-0123456789"}
MODEL = ControlledBackend.model_name  # the live backend's, and the shadow servers'
# acme's own targets: each side's slo_attainment and itl_attainment have a row for it
SLOS = {"slo_ttft_p99_s": 5.0, "slo_tpot_p99_s": 5.0, "slo_itl_p99_s": 5.0}
NEVER_SHOWN = ("api_key", "admin_key")  # a target's secrets: the page says they are not
# a valid new value for each field a PATCH may change (the page's list, checked below)
CHANGES: dict[str, Any] = {"sample": 0.5, "tenants": ["acme"], "max_inflight": 4,
                           "max_queue": 8, "timeout_s": 30.0}
ROUTE = re.compile(r"`(GET|POST|PATCH|DELETE) (/admin/(?:shadow|capture)[^`?\s]*)")
NAME = re.compile(r"([a-z_][a-z0-9_]*)(?:: \S+)?")  # `ttft`, `prompt_text: true`


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"


def page() -> str:
    return PAGE.read_text()


def names(text: str) -> set[str]:
    """The field names the text shows as code (`ttft`, `prompt_text: true`; not `GET /x`,
    `404 code`, `a.b`)."""
    return {found.group(1) for code in re.findall(r"`([^`]+)`", text)
            if (found := NAME.fullmatch(code))}


def bullet(text: str, route: str) -> str:
    """The `- `METHOD /path`...` item of the page's list of admin routes."""
    start = text.index(f"\n- `{route}`")
    end = text.find("\n- ", start + 1)
    return text[start:text.index("\n\n", start) if end == -1 else end]


def keys(value: Any, skip: frozenset[str] = frozenset()) -> set[str]:
    """Every key of a JSON value at any depth; below a key in `skip` (rows by tenant), only
    the keys of the rows, not the tenants' names."""
    found: set[str] = set()
    if isinstance(value, dict):
        for key, child in value.items():
            found.add(key)
            rows = child.values() if key in skip and isinstance(child, dict) else [child]
            for row in rows:
                found |= keys(row, skip)
    elif isinstance(value, list):
        for item in value:
            found |= keys(item, skip)
    return found


def worker_codes(text: str) -> set[str]:
    """The failure codes of ours the page names that the sender gives a failed copy
    (control/shadow_worker.py): the rest of the target's item is its answer's fields."""
    source = (ROOT / "control" / "shadow_worker.py").read_text()
    written = set(re.findall(r'CopyFailure\([\w.]+, "(\w+)"', source))
    written |= set(re.findall(r'code = "(\w+)"', source))
    return names(text) & written


async def gateway(aiohttp_client: Any, db_url: str, **settings: Any) -> Harness:
    backend = ControlledBackend(capacity_=8)
    backend.release()  # every request streams at once
    return await start_gateway(aiohttp_client, db_url, tenants={"acme": SLOS},
                               gateway=settings, backends=[backend])


async def shadow_url(aiohttp_server: Any, **fake: Any) -> str:
    server = await aiohttp_server(make_fake_app(model=MODEL, **fake))
    return str(server.make_url("/v1"))


async def served(h: Harness, prompts: list[str]) -> None:
    for prompt in prompts:  # one after another: arrival order is prompt order
        resp = await h.post("acme", {"model": MODEL, "prompt": prompt, "max_tokens": 3,
                                     "stream": True})
        assert resp.status == 200, await resp.text()
        [_ async for _ in collect(resp)]


async def admin(h: Harness, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    resp = await h.client.request(method, path, json=body, headers=ADMIN)
    return resp.status, await resp.json()


async def test_each_admin_route_the_page_names_is_served_with_its_method(
        aiohttp_client: Any, db_url: str) -> None:
    named = set(ROUTE.findall(page()))
    assert {path for _, path in named} >= {"/admin/shadow", "/admin/shadow/{name}",
                                           "/admin/shadow/{name}/stats", "/admin/capture"}
    h = await gateway(aiohttp_client, db_url)
    served_routes = {(r.method, r.resource.canonical) for r in h.app.router.routes()
                     if r.resource is not None and r.method != "HEAD"  # aiohttp's own
                     and r.resource.canonical.startswith(("/admin/shadow", "/admin/capture"))}
    assert named == served_routes  # none the page names is missing, none served is unnamed
    paths = (await (await h.client.get("/openapi.json")).json())["paths"]
    for method, path in named:
        assert method.lower() in paths.get(path, {}), (method, path)


async def test_a_target_and_its_stats_have_the_fields_the_page_names(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    h = await gateway(aiohttp_client, db_url)
    targets = {"ok": await shadow_url(aiohttp_server),
               "broken": await shadow_url(aiohttp_server, statuses=(500,))}
    for name, url in targets.items():
        status, _ = await admin(h, "POST", "/admin/shadow",
                                {"name": name, "url": url, "kind": "openai"})
        assert status == 201
    await served(h, ["one", "two"])
    mirrors = h.shadows.mirrors
    await wait_for(lambda: all(len(m.pairs) == 2 for m in mirrors.values()), timeout=30)

    status, listed = await admin(h, "GET", "/admin/shadow")
    assert status == 200
    target = next(t for t in listed["shadows"] if t["name"] == "broken")
    assert target["failed"] == 2 and target["failures"][0]["status"] == 500
    text = bullet(page(), "GET /admin/shadow")
    ours = worker_codes(text)
    assert ours >= {"connect_failed", "timeout", "stream_incomplete"}, ours
    assert not set(NEVER_SHOWN) & set(target)
    assert set(NEVER_SHOWN) <= {f.name for f in dataclasses.fields(ShadowConfig)}
    assert names(text) - ours - set(NEVER_SHOWN) == keys(listed)

    status, stats = await admin(h, "GET", "/admin/shadow/ok/stats?window=60&detail=1")
    assert status == 200 and stats["pairs"] == 2
    assert set(stats["live"]["itl_attainment"]) == {"acme"}  # the tenants' rows are there
    text = section(page(), "Paired statistics")
    assert names(text) == keys(stats, frozenset({"slo_attainment", "itl_attainment"}))
    row = re.search(r"`\[(ttft[^\]]*)\]`", text)
    assert row is not None, "the page shows a pair's row"
    assert len(row.group(1).split(", ")) == len(stats["samples"]["fields"])
    assert {len(r) for side in ("live", "shadow") for r in stats["samples"][side]} == {
        len(stats["samples"]["fields"])}


async def test_post_patch_and_delete_answer_as_the_page_says(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    h = await gateway(aiohttp_client, db_url)
    url = await shadow_url(aiohttp_server)
    target = {"name": "c", "url": url, "kind": "openai"}
    status, started = await admin(h, "POST", "/admin/shadow", target)
    assert status == 201
    await served(h, ["one"])
    await wait_for(lambda: len(h.shadows.mirrors["c"].pairs) == 1, timeout=30)
    _, listed = await admin(h, "GET", "/admin/shadow")
    assert set(started) == set(listed["shadows"][0])  # the target as GET shows it

    # replaced: the same url/kind/model keeps its pairs and counters; another model does not
    status, replaced = await admin(h, "POST", "/admin/shadow", {**target, "sample": 0.5})
    assert (status, replaced["pairs"], replaced["sent"]) == (200, 1, 1)

    text = bullet(page(), "PATCH /admin/shadow/{name}")
    changeable = re.search(r"changes (.*?), keeps", text, re.S)
    assert changeable is not None and names(changeable.group(1)) == set(CHANGES)
    for field, value in CHANGES.items():
        status, changed = await admin(h, "PATCH", "/admin/shadow/c", {field: value})
        assert (status, changed["pairs"]) == (200, 1), (field, changed)
        assert changed[field] == value, field  # the answer shows what was set
    others = {f.name for f in dataclasses.fields(ShadowConfig)} - set(CHANGES)
    assert "url" in others and "name" in others
    for field in sorted(others):
        status, refused = await admin(h, "PATCH", "/admin/shadow/c", {field: "x"})
        assert (status, refused["error"]["param"]) == (400, field), refused
        assert "POST /admin/shadow" in refused["error"]["message"]

    status, other = await admin(h, "POST", "/admin/shadow", {**target, "model": "other"})
    assert (status, other["pairs"], other["sent"]) == (200, 0, 0)

    deleted = re.search(r"answers `(\w+)` \(its name\)",
                        bullet(page(), "DELETE /admin/shadow/{name}"))
    assert deleted is not None
    assert await admin(h, "DELETE", "/admin/shadow/c") == (200, {deleted.group(1): "c"})
    code = re.search(r"a name no target has is a (\d+)\s+`(\w+)`", page())
    assert code is not None
    for method, path in [("PATCH", "/admin/shadow/c"), ("DELETE", "/admin/shadow/c"),
                         ("GET", "/admin/shadow/c/stats")]:
        status, answer = await admin(h, method, path, {"sample": 1} if method == "PATCH"
                                     else None)
        assert (status, answer["error"]["code"]) == (int(code.group(1)), code.group(2))


async def test_the_capture_answers_the_lines_and_the_errors_the_page_names(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    text = section(page(), "Trace capture")
    settings = {f.name for f in dataclasses.fields(CaptureConfig)}
    assert settings <= names(text)  # the page names each of the capture's settings
    h = await gateway(aiohttp_client, db_url, capture={
        "path": str(tmp_path / "capture.jsonl"), "prompt_text": True})
    await served(h, ["one", "two", "three"])
    resp = await h.client.get("/admin/capture?since=0", headers=ADMIN)
    assert resp.status == 200
    header, *lines = (await resp.text()).splitlines()
    epoch = re.search(r"\(epoch (\d+\.\d+)\)", header)
    assert header.startswith("# ") and epoch is not None
    rows = [json.loads(line) for line in lines]
    assert [row["prompt"] for row in rows] == ["one", "two", "three"]
    assert rows[0]["arrival"] == 0  # the first request, at the header's epoch
    line = text.split("\n\n")[1]  # the paragraph that writes a line (after the heading)
    assert names(line) - settings == {key for row in rows for key in row}

    resp = await h.client.get("/admin/capture?since=0&limit=2", headers=ADMIN)
    latest = [json.loads(x) for x in (await resp.text()).splitlines()[1:]]
    assert [row["prompt"] for row in latest] == ["two", "three"]  # the most recent N

    absent = re.search(r"Without `gateway.capture` it answers (\d+)\s+`(\w+)`", text)
    assert absent is not None
    bare = await gateway(aiohttp_client, str(db_url).replace(".db", "-bare.db"))
    resp = await bare.client.get("/admin/capture", headers=ADMIN)
    error = (await resp.json())["error"]
    assert (resp.status, error["code"]) == (int(absent.group(1)), absent.group(2))


def test_the_openapi_target_schema_has_the_fields_the_page_names() -> None:
    schemas = document()["components"]["schemas"]
    shadow = schemas["Shadow"]["properties"]
    failure = shadow["failures"]["items"]["properties"]
    text = bullet(page(), "GET /admin/shadow")
    fields = names(text) - worker_codes(text) - set(NEVER_SHOWN)
    assert fields == set(schemas["ShadowList"]["properties"]) | set(shadow) | set(failure)

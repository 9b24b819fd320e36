"""The SLO dashboard (`GET /dashboard`) and the JSON it reads (`/admin/slo/*`, `/admin/engines`).

Behind the admin key: a login form sets an HTTP-only, SameSite=Strict session cookie, Secure
wherever the browser can keep it so (`_secure`; held server-side: logging out or a restart ends
it), or the key comes as a bearer token. The
cookie only ever authorises reading (gateway/auth.py), so no page elsewhere can make a
logged-in browser change anything. Everything the page needs is in the one HTML document
(styles, script, plots drawn as inline SVG): no CDN, nothing from the internet.

SLO semantics are protocol.measures': a tenant's "p99 TTFT <= X" means at least 99% of its
requests over the period had TTFT <= X (a failed or refused request misses), the same for TPOT;
"p99 ITL <= X" means at least 99% of all its gaps between two tokens were <= X. The error budget
is the 1% allowed to miss; the burn rate is the miss fraction over the budget fraction. The
counts come from the usage ledger's per-minute rollups (tenants/slo_views.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from html import escape as html_escape
from importlib import resources
from typing import Any

from aiohttp import web

from control.state import JOBS
from gateway.admin import database_calls, path_tenant
from gateway.auth import SESSION_COOKIE, SESSION_TTL_S
from gateway.state import AUTH, GATEWAY, METRICS, SETTINGS, STORE
from protocol.errors import ApiError
from protocol.http import bearer, query_float, read_form
from tenants import TenantInfo
from tenants.slo_views import hour_p99s, period_counts, tenant_series, tenant_slo

log = logging.getLogger("fairgate.gateway")
MAX_SERIES_HOURS = 24 * 7
# the engine signs of trouble (README, "what to watch"): each a test on one backend's /load
PROBLEMS = (
    ("kv_pinned", "KV cache over 95% with preemptions: raise memory_fraction or lower "
     "max_num_seqs"),
    ("waiting", "requests waiting while KV has room: raise max_num_seqs or the token budget"),
    ("preempting", "preemptions since the last look: memory is short for this load"),
)


def add_routes(app: web.Application) -> None:
    app.router.add_get("/dashboard", page)
    app.router.add_get("/dashboard/app.js", script)
    app.router.add_get("/dashboard/login", login_form)
    app.router.add_post("/dashboard/login", login)
    app.router.add_post("/dashboard/logout", logout)
    app.router.add_get("/admin/slo/tenants", slo_tenants)
    app.router.add_get("/admin/slo/tenants/{name}", slo_tenant)
    app.router.add_get("/admin/engines", engines)


# ---- the page and its login ----------------------------------------------------------------------
def _page_text(name: str) -> str:
    return resources.files("control").joinpath("dashboard_assets", name).read_text()


_HEADERS = {"Cache-Control": "no-store", "X-Frame-Options": "DENY",
            # scripts only from this gateway's own file: no inline script, no handler attribute
            "Content-Security-Policy": "default-src 'self'; script-src 'self'; "
                                       "style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
                                       "frame-ancestors 'none'; form-action 'self'",
            "Referrer-Policy": "same-origin"}  # "no-referrer" makes a form's Origin "null"


async def page(request: web.Request) -> web.StreamResponse:
    auth = request.app[AUTH]
    if auth.admin_key is None:
        raise ApiError(404, "the dashboard needs the admin API (set gateway.admin_key)",
                       code="admin_disabled")
    token = bearer(request)
    if token is not None:
        auth.check_admin(request)  # 401 for a wrong key
    elif not auth.session_valid(request.cookies.get(SESSION_COOKIE)):
        raise web.HTTPSeeOther("/dashboard/login")
    html = await asyncio.to_thread(_dashboard_html)
    return web.Response(text=html, content_type="text/html", headers=_HEADERS)


def _dashboard_html() -> str:
    """The page, with the tune objectives' units (the tuner's table) for its plots' axes."""
    from tuner.spec import OBJECTIVE_UNIT  # here, not at the top: it imports Optuna (big)

    units = html_escape(json.dumps(OBJECTIVE_UNIT), quote=True)
    return _page_text("dashboard.html").replace('data-objective-units="{}"',
                                                f'data-objective-units="{units}"', 1)


async def script(request: web.Request) -> web.Response:
    """The page's script (no secrets in it: served to anyone, as the login form is)."""
    text = await asyncio.to_thread(_page_text, "app.js")
    return web.Response(text=text, content_type="text/javascript", headers=_HEADERS)


async def login_form(request: web.Request) -> web.Response:
    failed = request.query.get("failed") == "1"
    html = (await asyncio.to_thread(_page_text, "login.html")).replace(
        "<!--message-->", '<p class="error">That is not the admin key.</p>' if failed else "")
    return web.Response(text=html, content_type="text/html", headers=_HEADERS)


def _same_origin(request: web.Request) -> bool:
    """A form posted from this gateway's own page (Origin, when the browser sends it): the
    same host and port; the scheme may differ behind a proxy that ends TLS."""
    origin = request.headers.get("Origin")
    if origin is None:
        return True
    scheme, _, rest = origin.partition("://")
    return scheme in ("http", "https") and rest == request.host


def _secure(request: web.Request) -> bool:
    """Whether the browser reached us over HTTPS (directly or through a proxy that says so),
    or on a loopback address (which browsers treat as secure): then the cookie is Secure."""
    forwarded = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    host = (request.host or "").rsplit(":", 1)[0].strip("[]")
    return request.secure or forwarded == "https" or host in ("localhost", "127.0.0.1", "::1")


async def login(request: web.Request) -> web.Response:
    auth = request.app[AUTH]
    if auth.admin_key is None:
        raise ApiError(404, "the dashboard needs the admin API (set gateway.admin_key)",
                       code="admin_disabled")
    if not _same_origin(request):
        raise ApiError(403, "a login from another site's page", code="cross_origin")
    form = await read_form(request, request.app[SETTINGS].client_timeout_s)
    # the failed-attempt budget per address that /admin/*'s bearer keys and API keys spend
    if not auth.admin_key_matches(request.remote or "", form.get("key")):
        raise web.HTTPSeeOther("/dashboard/login?failed=1")
    response = web.HTTPSeeOther("/dashboard")
    secure = _secure(request)
    if not secure:
        log.warning("dashboard login over plain HTTP from %s: the session cookie is not Secure "
                    "(serve the gateway behind HTTPS)", request.remote)
    response.set_cookie(SESSION_COOKIE, auth.open_session(), max_age=int(SESSION_TTL_S),
                        path="/", httponly=True, secure=secure, samesite="Strict")
    raise response


async def logout(request: web.Request) -> web.Response:
    if not _same_origin(request):
        raise ApiError(403, "a logout from another site's page", code="cross_origin")
    request.app[AUTH].close_session(request.cookies.get(SESSION_COOKIE))
    response = web.HTTPSeeOther("/dashboard/login")
    response.del_cookie(SESSION_COOKIE, path="/")
    raise response


# ---- the JSON behind it ----------------------------------------------------------------------------
NO_P99S: dict[str, float | None] = {"ttft": None, "tpot": None}  # a tenant quiet for an hour


def slo_targets(info: TenantInfo) -> dict[str, float | None]:
    """The tenant's targets as the page reads them: p99 TTFT and TPOT per request, p99 ITL per
    gap."""
    return {"ttft_p99_s": info.slo_ttft_p99_s, "tpot_p99_s": info.slo_tpot_p99_s,
            "itl_p99_s": info.slo_itl_p99_s}


def _rejection_reasons(request: web.Request) -> dict[str, dict[str, float]]:
    """tenant -> reason -> rejections since the gateway started (the metrics' counter)."""
    out: dict[str, dict[str, float]] = {}
    for family in request.app[METRICS].rejections.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out.setdefault(sample.labels["tenant"], {})[sample.labels["reason"]] = \
                    sample.value
    return out


async def slo_tenants(request: web.Request) -> web.Response:
    """GET /admin/slo/tenants: every tenant's latency against its SLO, attainment over 1 h,
    24 h and 30 days, the 30-day error budget left, burn rates over 1 h and 6 h, its state."""
    request.app[AUTH].check_admin(request)
    now = time.time()
    db = request.app[STORE].db
    async with database_calls():
        infos = await request.app[STORE].list_tenants()
        counts = await period_counts(db, now)
        p99s = await hour_p99s(db, now)
    reasons = _rejection_reasons(request)
    queues = request.app[GATEWAY].queue.snapshot()
    rows = []
    for info in sorted(infos, key=lambda t: t.name):
        c = counts.get(info.name, {})
        five = c.get("5m", {})
        rows.append({
            "name": info.name, "enabled": info.enabled, "weight": info.weight,
            "slo": slo_targets(info),
            "requests_per_s": five.get("requests", 0) / 300.0,
            "requests_1h": c.get("1h", {}).get("requests", 0),
            "rejected_1h": c.get("1h", {}).get("rejected", 0),
            "failed_1h": c.get("1h", {}).get("failed", 0),
            "rejections_since_start": reasons.get(info.name, {}),
            "p99_1h": p99s.get(info.name, NO_P99S),
            "queue": queues.get(info.name) if isinstance(queues, dict) else None,
            **tenant_slo(c)})
    return web.json_response({"generated_at": now, "target": 0.99, "tenants": rows,
                              "note": "attainment: the share of requests that met the TTFT "
                                      "and TPOT targets the tenant set (a failed or refused "
                                      "request misses); ITL: the share of all gaps between "
                                      "tokens within its target; burn rate: the miss share "
                                      "over the 1% budget"})


async def slo_tenant(request: web.Request) -> web.Response:
    """GET /admin/slo/tenants/{name}?hours=6: the tenant's figures, its limits, its queue
    now, and its series minute by minute."""
    request.app[AUTH].check_admin(request)
    name = path_tenant(request)
    hours = query_float(request, "hours", 6.0, "hours must be a number",
                        lambda h: 0 < h <= MAX_SERIES_HOURS,
                        f"hours must be in (0, {MAX_SERIES_HOURS}]")
    assert hours is not None
    now = time.time()
    db = request.app[STORE].db
    async with database_calls():
        info = await request.app[STORE].get_tenant(name)
        if info is None:
            raise ApiError(404, f"no tenant named {name!r}", code="tenant_not_found")
        counts = (await period_counts(db, now)).get(name, {})
        series = await tenant_series(db, name, now, int(hours * 60))
        p99s = (await hour_p99s(db, now)).get(name, NO_P99S)
    queues = request.app[GATEWAY].queue.snapshot()
    limits = dataclasses.asdict(info.limits)
    return web.json_response({"name": name, "slo": slo_targets(info),
                              "limits": limits, "queue": queues.get(name) if isinstance(
                                  queues, dict) else None, "p99_1h": p99s,
                              "hours": hours, "series": series, **tenant_slo(counts)})


def _problems(load: dict[str, Any], previous: dict[str, Any] | None) -> list[dict[str, str]]:
    kv = float(load.get("kv_usage") or 0.0)
    preemptions = int(load.get("num_preemptions") or 0)
    # none seen before: nothing to compare with; 0 before is a count like any other
    earlier = preemptions if previous is None else int(previous.get("num_preemptions") or 0)
    found = []
    if kv > 0.95 and preemptions > earlier:
        found.append("kv_pinned")
    if int(load.get("waiting") or 0) > 0 and kv < 0.8:
        found.append("waiting")
    if preemptions > earlier:
        found.append("preempting")
    text = dict(PROBLEMS)
    return [{"sign": sign, "what": text[sign]} for sign in found]


_LAST_LOADS: dict[tuple[int, str], dict[str, Any]] = {}  # the load each engine showed last


async def engines(request: web.Request) -> web.Response:
    """GET /admin/engines: per backend, healthy or not, draining, its load (running, waiting,
    swapped, KV usage, preemptions), its knobs as it reports them, the signs of trouble, and
    its outlier state (ejected and until when, ejections, failures in a row, recent error
    rate: gateway/outlier.py)."""
    request.app[AUTH].check_admin(request)
    gw = request.app[GATEWAY]
    rows = []
    for b in gw.pool.backends:
        load = dict(getattr(b, "load", None) or {})
        if not load and hasattr(b, "engine"):  # embedded: the engine's own snapshot
            load = dict(b.engine.load())
        key = (id(gw), b.name)  # per gateway: tests run several in one process
        previous = _LAST_LOADS.get(key)
        _LAST_LOADS[key] = load
        rows.append({"name": b.name, "healthy": b.healthy, "draining": b.name in
                     gw.pool.draining, "inflight": b.inflight, "model": b.model_name,
                     "load": load, "problems": _problems(load, previous),
                     "outlier": gw.pool.outliers.state(b.name)})
    jobs = request.app[JOBS]
    return web.json_response({"generated_at": time.time(), "engines": rows,
                              "jobs_running": len(jobs.running)})

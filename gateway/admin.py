"""`/admin/*` (admin key) and the per-tenant read-only endpoints (`/v1/models`, `/v1/usage`).

A tenant sees only its own usage: `/v1/usage` takes no tenant parameter, it answers for the
caller's key. Other tenants' figures are behind the admin key.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from aiohttp import web

from gateway.proxy import read_json
from gateway.state import AUTH, GATEWAY, STORE
from protocol.errors import ApiError, bad_request
from tenants import TenantError, TenantInfo, TenantLimits


def _window(request: web.Request) -> float | None:
    raw = request.query.get("window_s")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise bad_request("window_s must be a number of seconds", "window_s") from None
    if not 0 < value < float("inf"):
        raise bad_request("window_s must be > 0", "window_s")
    return value


async def _totals(request: web.Request, tenant: str) -> dict[str, Any]:
    ledger = request.app[GATEWAY].ledger
    if ledger is None:
        raise ApiError(404, "usage is not recorded by this gateway", code="no_ledger")
    window = _window(request)
    await ledger.flush()  # queries see flushed records only
    totals = await ledger.totals(tenant, window)
    return {"object": "usage", "tenant": tenant, "window_s": window, **totals,
            "by_status": {str(k): v for k, v in totals["by_status"].items()}}


async def usage(request: web.Request) -> web.Response:
    principal = await request.app[AUTH].tenant(request)
    return web.json_response(await _totals(request, principal.tenant.name))


async def models(request: web.Request) -> web.Response:
    await request.app[AUTH].tenant(request)
    names = request.app[GATEWAY].pool.model_names()
    data = [{"id": n, "object": "model", "created": 0, "owned_by": "fairgate"} for n in names]
    return web.json_response({"object": "list", "data": data})


def tenant_json(info: TenantInfo) -> dict[str, Any]:
    out = dataclasses.asdict(info)
    out["allowed_priorities"] = list(info.allowed_priorities)
    return out


async def list_tenants(request: web.Request) -> web.Response:
    request.app[AUTH].check_admin(request)
    tenants = await request.app[STORE].list_tenants()
    return web.json_response({"data": [tenant_json(t) for t in tenants]})


async def create_tenant(request: web.Request) -> web.Response:
    request.app[AUTH].check_admin(request)
    body = await read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("name"), str):
        raise bad_request("body must be an object with a tenant 'name'", "name")
    fields = dict(body)
    name = fields.pop("name")
    try:
        limits = TenantLimits(**(fields.pop("limits", None) or {}))
        info = await request.app[STORE].create_tenant(name, limits=limits, **fields)
    except (TenantError, TypeError) as exc:
        raise bad_request(str(exc)) from None
    return web.json_response(tenant_json(info), status=201)


async def create_key(request: web.Request) -> web.Response:
    request.app[AUTH].check_admin(request)
    try:
        info, plaintext = await request.app[STORE].create_key(request.match_info["name"])
    except TenantError as exc:
        raise ApiError(404, str(exc), code="tenant_not_found") from None
    return web.json_response({"id": info.id, "tenant": info.tenant, "key": plaintext},
                             status=201)


async def tenant_usage(request: web.Request) -> web.Response:
    request.app[AUTH].check_admin(request)
    return web.json_response(await _totals(request, request.match_info["name"]))


async def queues(request: web.Request) -> web.Response:
    request.app[AUTH].check_admin(request)
    gw = request.app[GATEWAY]
    backends = [{"name": b.name, "healthy": b.healthy, "inflight": b.inflight}
                for b in gw.pool.backends]
    return web.json_response({"policy": gw.queue.policy, "tenants": gw.queue.snapshot(),
                              "backends": backends})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/usage", usage)
    app.router.add_get("/admin/tenants", list_tenants)
    app.router.add_post("/admin/tenants", create_tenant)
    app.router.add_post("/admin/tenants/{name}/keys", create_key)
    app.router.add_get("/admin/usage/{name}", tenant_usage)
    app.router.add_get("/admin/queues", queues)

"""`/admin/*` (admin key) and the per-tenant read-only endpoints (`/v1/models`, `/v1/usage`).

A tenant sees only its own usage: `/v1/usage` takes no tenant parameter, it answers for the
caller's key. Other tenants' figures are behind the admin key.

Everything here that reads or writes the database does it within `DATABASE_TIMEOUT_S`: a
database that is down or does not answer is a retryable 503 `database_unavailable`, never a 500
or a request that hangs on the driver's connect timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web
from sqlalchemy.exc import SQLAlchemyError

from gateway.proxy import read_json
from gateway.state import AUTH, GATEWAY, STORE
from protocol.errors import ApiError, bad_request
from protocol.http import query_float
from tenants import (
    DuplicateTenantError,
    KeyNotFoundError,
    TenantError,
    TenantInfo,
    TenantNotFoundError,
)
from tenants.values import check_tenant_name, tenant_from_mapping

DATABASE_TIMEOUT_S = 5.0
RETRY_AFTER_S = 5.0


@contextlib.asynccontextmanager
async def database_calls() -> AsyncIterator[None]:
    """The database calls of one handler: bounded in time, their outages a retryable 503."""
    try:
        async with asyncio.timeout(DATABASE_TIMEOUT_S):
            yield
    except TimeoutError:
        raise ApiError(503, f"the tenant database did not answer within "
                       f"{DATABASE_TIMEOUT_S:g} s; try again shortly",
                       code="database_unavailable", retry_after=RETRY_AFTER_S) from None
    except (SQLAlchemyError, OSError) as exc:  # OSError: connections refused or reset
        raise ApiError(503, f"the tenant database is unavailable ({type(exc).__name__}); try "
                       "again shortly", code="database_unavailable",
                       retry_after=RETRY_AFTER_S) from None


def is_positive(value: float) -> bool:
    return 0 < value < math.inf


def _window(request: web.Request) -> float | None:
    return query_float(request, "window_s", None, "window_s must be a number of seconds",
                       is_positive, "window_s must be > 0")


async def _totals(request: web.Request, tenant: str) -> dict[str, Any]:
    ledger = request.app[GATEWAY].ledger
    if ledger is None:
        raise ApiError(404, "usage is not recorded by this gateway", code="no_ledger")
    window = _window(request)
    async with database_calls():
        # Queries see flushed records only. Shielded: a flush cut off mid-commit could leave
        # its batch both written and buffered; past the timeout it goes on in the background
        # (one, shared by every query meanwhile), its failure already answered here.
        await asyncio.shield(ledger.shared_flush())
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
    async with database_calls():
        tenants = await request.app[STORE].list_tenants()
    return web.json_response({"data": [tenant_json(t) for t in tenants]})


def path_tenant(request: web.Request) -> str:
    """The `{name}` of the path; 400 when it is not a valid tenant name (not a silent miss)."""
    try:
        return check_tenant_name(request.match_info["name"])
    except TenantError as exc:
        raise bad_request(str(exc), exc.field) from None


async def create_tenant(request: web.Request) -> web.Response:
    request.app[AUTH].check_admin(request)
    body = await read_json(request)
    try:
        info = tenant_from_mapping(body)
        async with database_calls():
            created = await request.app[STORE].create_tenant(info.name, **info.settings())
    except DuplicateTenantError as exc:
        raise ApiError(409, str(exc), code="tenant_exists", param="name") from None
    except TenantError as exc:
        raise bad_request(str(exc), exc.field) from None
    return web.json_response(tenant_json(created), status=201)


async def create_key(request: web.Request) -> web.Response:
    request.app[AUTH].check_admin(request)
    name = path_tenant(request)
    try:
        async with database_calls():
            info, plaintext = await request.app[STORE].create_key(name)
    except TenantNotFoundError as exc:
        raise ApiError(404, str(exc), code="tenant_not_found", param="name") from None
    return web.json_response({"id": info.id, "tenant": info.tenant, "key": plaintext},
                             status=201)


async def revoke_key(request: web.Request) -> web.Response:
    """DELETE /admin/keys/{id}: revoke a key (idempotent). Refused at once here, and on the
    other replicas at once through Redis when gateway.redis is set, else once their cache of it
    expires (5 s)."""
    request.app[AUTH].check_admin(request)
    try:
        async with database_calls():
            info = await request.app[STORE].revoke_key(request.match_info["id"])
    except KeyNotFoundError as exc:
        raise ApiError(404, str(exc), code="key_not_found", param="id") from None
    return web.json_response(dataclasses.asdict(info))


async def tenant_usage(request: web.Request) -> web.Response:
    """A tenant's usage; a deleted tenant's history too (usage names the tenant, it outlives
    it). 404 for a name that is no tenant and has no usage: a misspelt name is not a tenant
    that used nothing."""
    request.app[AUTH].check_admin(request)
    name = path_tenant(request)
    totals = await _totals(request, name)
    if not totals["requests"]:
        async with database_calls():
            known = await request.app[STORE].get_tenant(name) is not None
        if not known:
            within = "" if totals["window_s"] is None else f" in the last {totals['window_s']:g} s"
            raise ApiError(404, f"no tenant {name!r} and no usage recorded for it{within}",
                           code="tenant_not_found", param="name")
    return web.json_response(totals)


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
    app.router.add_delete("/admin/keys/{id}", revoke_key)
    app.router.add_get("/admin/usage/{name}", tenant_usage)
    app.router.add_get("/admin/queues", queues)

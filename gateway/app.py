"""`make_app(config, engine=, database=)`: the serving path as an aiohttp application.

The control plane (tune jobs, canary, shadow traffic, capture, dashboard) is not built here:
`control.app.make_app` builds this app and attaches it, subscribed to the gateway's request
events (gateway/events.py). Everything is built here, synchronously; cleanup contexts start and stop what needs the event
loop (database, usage ledger, engine or remote pollers, the dispatch ticker) in that order and
stop them in reverse, so requests in flight at shutdown still find their backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.exc import SQLAlchemyError

from engine.config import EngineConfig
from gateway import admin, openapi, proxy
from gateway.auth import Authenticator, bearer
from gateway.backends import Backend, BackendPool, DnsGroup, EmbeddedBackend, RemoteBackend
from gateway.config import BackendConfig, GatewayConfig
from gateway.dispatch import tick
from gateway.metrics import GatewayMetrics
from gateway.replicas.redis_fair_share import SharedFairState
from gateway.replicas.redis_limits import KeyRevocations, SharedRateLimiter, make_limiter
from gateway.service import Gateway
from gateway.state import AUTH, GATEWAY, METRICS, SETTINGS, STORE
from protocol.errors import ApiError
from protocol.http import error_middleware
from tenants import DEFAULT_DATABASE_URL, TenantStore, UsageLedger
from tenants.db import unusable

log = logging.getLogger("fairgate.gateway")
SECRET_ENV = "FAIRGATE_KEY_SECRET"  # the same variable the tenants CLI reads
DEMO_TENANT = "demo"
# a remote backend's max_model_len when neither its /load, its backends[] entry nor the engine
# section says (engine.max_model_len unset means "the model's context", which only the engine
# that loads the model knows); the value EngineConfig used before it followed the model
DEFAULT_REMOTE_MAX_MODEL_LEN = 2048


def make_app(config: GatewayConfig | None = None, *, engine: EngineConfig | None = None,
             database: str = DEFAULT_DATABASE_URL, backends: list[Backend] | None = None,
             store: TenantStore | None = None,
             on_demo_key: Callable[[str], None] | None = None) -> web.Application:
    """The gateway. `engine`: the embedded engine when `config.backends` is empty, else the
    remote backends' default max_model_len. `backends` replaces the configured ones (tests);
    `store` replaces the one opened on `database`; `on_demo_key` receives the demo tenant's key
    when one is created at first start (`fairgate serve` prints it)."""
    settings = config or GatewayConfig()
    engine = engine or EngineConfig()
    app = web.Application(middlewares=[error_middleware(log)],
                          client_max_size=settings.max_body_bytes)
    store = store or TenantStore(database, secret=os.environ.get(SECRET_ENV) or None)
    metrics = GatewayMetrics()
    pool = _pool(settings, engine, backends, lambda: gw.dispatcher.pump())
    limiter, shared_state = make_limiter(settings.redis, metrics)
    gw = Gateway(settings, pool, _ledger(store, settings, database), metrics, limiter)
    if isinstance(limiter, SharedRateLimiter):  # queue bounds and fair share over replicas
        gw.replica_fair_share = SharedFairState(limiter, gw.queue, metrics,
                                         on_change=lambda: gw.dispatcher.pump())
    app[SETTINGS], app[STORE], app[METRICS] = settings, store, metrics
    app[GATEWAY] = gw
    app[AUTH] = Authenticator(store, settings.admin_key,
                              failures_per_s=settings.auth_failures_per_s,
                              failure_burst=settings.auth_failure_burst,
                              outage_grace_s=settings.auth_outage_grace_s)
    _read_at_scrape(metrics, gw, app[AUTH])
    app.cleanup_ctx.extend([_database(on_demo_key), _backends_ctx, _ticker])
    if shared_state is not None:  # Redis for the rate windows: stopped first, settles drained
        app.cleanup_ctx.append(shared_state)
    if gw.replica_fair_share is not None:  # starts once Redis is connected, stops before it closes
        app.cleanup_ctx.append(gw.replica_fair_share.lifespan)
    if isinstance(limiter, SharedRateLimiter):  # revoked keys refused on every replica at once
        revocations = KeyRevocations(limiter, on_revoked=store.forget_key)
        store.on_revoke(revocations.publish)
        app.cleanup_ctx.append(revocations.lifespan)
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.chat_completions)
    admin.add_routes(app)
    app[openapi.OPENAPI_PARTS] = openapi.NO_PARTS  # control.app adds the control plane's
    app.router.add_get("/metrics", metrics_on_main_port)
    app.router.add_get("/health", healthz)  # the path vLLM and SGLang serve
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/openapi.json", openapi.openapi_json)  # no auth, as vLLM's
    return app


def server_options(settings: GatewayConfig) -> dict[str, Any]:
    """How the gateway's aiohttp server runs (protocol.serving.Runner's keywords, which
    `fairgate serve` passes to `serve`): a client that hangs up cancels its handler, which
    removes it from the queue or aborts its engine request at once (handler_cancellation);
    a connection whose request headers take longer than `header_timeout_s` is closed; no
    access log (`log_requests` logs what may be logged)."""
    return {"handler_cancellation": True, "access_log": None,
            "header_timeout": settings.header_timeout_s}


def _ledger(store: TenantStore, settings: GatewayConfig, database: str) -> UsageLedger:
    """Its files in `usage_spill_dir`, named per database, so a gateway never replays another
    database's records: the spill (records a shutdown could not write) and the dead letters
    the database refused twice over."""
    digest = hashlib.sha256(database.encode()).hexdigest()[:12]
    folder = Path(settings.usage_spill_dir)
    days = settings.usage_retention_days
    return UsageLedger(store, spill_path=folder / f"fairgate-usage-spill-{digest}.jsonl",
                       dead_letter_path=folder / f"fairgate-usage-dead-letters-{digest}.jsonl",
                       retention_s=None if days is None else days * 86400)


def _read_at_scrape(metrics: GatewayMetrics, gw: Gateway, auth: Authenticator) -> None:
    ledger = gw.ledger
    if ledger is not None:
        metrics.read_at_scrape("fairgate_gateway_usage_pending", "Usage records waiting for the "
                               "database", lambda: ledger.pending, kind="gauge")
        metrics.read_at_scrape("fairgate_gateway_usage_dead_letters", "Usage records the "
                               "database refused, set aside with the reason",
                               lambda: ledger.dead_lettered)
    metrics.read_at_scrape("fairgate_gateway_observer_errors", "Request observers (shadow, "
                           "canary window, capture) that raised on a request event; the request "
                           "went on", lambda: gw.observer_errors)
    metrics.read_at_scrape("fairgate_gateway_auth_lookup_failures", "Key lookups the tenant "
                           "database did not answer", lambda: auth.lookup_failures)
    metrics.read_at_scrape("fairgate_gateway_auth_held_back", "Unseen keys answered 429 because "
                           "their address spent its failed-lookup budget", lambda: auth.held_back)
    metrics.read_at_scrape("fairgate_gateway_auth_outage_answers", "Keys answered with their "
                           "last known tenant because the tenant database was away",
                           lambda: auth.outage_answers)
    for backend in gw.pool.backends:
        if isinstance(backend, EmbeddedBackend):
            metrics.add_engine(backend.engine)


def _pool(settings: GatewayConfig, engine: EngineConfig, backends: list[Backend] | None,
          on_change: Callable[[], None]) -> BackendPool:
    """The backends: `backends` (tests), or the configured ones (a `discover: dns` entry is
    a group of them, one per address), or the embedded engine."""
    if backends:
        return BackendPool(backends, headroom=settings.dispatch_headroom,
                           outlier_detection=settings.outlier_detection)
    if not settings.backends:
        from engine.async_engine import AsyncEngine  # torch is imported only when embedded

        return BackendPool([EmbeddedBackend(AsyncEngine(engine), settings.backend_waiting_slack)],
                           headroom=settings.dispatch_headroom)
    default_max_model_len = engine.max_model_len or DEFAULT_REMOTE_MAX_MODEL_LEN

    def remote(b: BackendConfig) -> Backend:
        return RemoteBackend(b, default_max_model_len=default_max_model_len,
                             tokenizer_file=settings.tokenizer,
                             poll_interval=settings.backend_poll_interval_s,
                             retry_after=settings.backend_retry_after_s,
                             slack=settings.backend_waiting_slack, on_change=on_change,
                             first_byte_timeout=settings.backend_first_byte_timeout_s,
                             stall_timeout=settings.backend_stall_timeout_s)

    groups = [DnsGroup(b, remote) for b in settings.backends if b.discover == "dns"]
    pool = BackendPool([remote(b) for b in settings.backends if b.discover is None],
                       headroom=settings.dispatch_headroom, groups=groups,
                       outlier_detection=settings.outlier_detection)
    for group in groups:
        group.pool = pool
    return pool


def _database(on_demo_key: Callable[[str], None] | None) -> Callable[
        [web.Application], contextlib.AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def ctx(app: web.Application) -> AsyncIterator[None]:
        store, ledger = app[STORE], app[GATEWAY].ledger
        assert ledger is not None
        try:
            await store.init()
            if app[SETTINGS].demo_tenant and await store.count_tenants() == 0:
                await store.create_tenant(DEMO_TENANT)
                _, key = await store.create_key(DEMO_TENANT)
                if on_demo_key is not None:
                    on_demo_key(key)
        except SQLAlchemyError as exc:  # not started: one line for `fairgate serve`
            await store.close()
            raise unusable(store.url, exc) from None
        await ledger.start()
        try:
            yield
        finally:
            try:
                await ledger.close(timeout=app[SETTINGS].usage_shutdown_flush_s)
            finally:
                await store.close()

    return ctx


async def _backends_ctx(app: web.Application) -> AsyncIterator[None]:
    pool = app[GATEWAY].pool
    await pool.start()
    try:
        yield
    finally:
        await pool.close()


async def _ticker(app: web.Application) -> AsyncIterator[None]:
    gw = app[GATEWAY]
    task = asyncio.create_task(tick(gw.dispatcher, gw.config.backend_poll_interval_s))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# ---- metrics: per-tenant series, so never where tenants can read them -----------------------
_GATEWAY_APP = web.AppKey("gateway_app", web.Application)


def make_metrics_app(gateway_app: web.Application) -> web.Application:
    """The metrics listener (`gateway.metrics_host:metrics_port`, loopback by default): only
    /metrics, behind `gateway.metrics_token` when one is set."""
    app = web.Application(middlewares=[error_middleware(log)])
    app[_GATEWAY_APP] = gateway_app
    app.router.add_get("/metrics", _metrics_listener)
    return app


async def _metrics_listener(request: web.Request) -> web.Response:
    gateway_app = request.app[_GATEWAY_APP]
    token = gateway_app[SETTINGS].metrics_token
    if token is not None:
        _check_metrics_token(request, token)
    return _metrics(gateway_app)


async def metrics_on_main_port(request: web.Request) -> web.Response:
    """Tenants reach this port: metrics only for a bearer of `gateway.metrics_token`."""
    token = request.app[SETTINGS].metrics_token
    if token is None:
        raise ApiError(404, "metrics are not served on this port: scrape the metrics listener "
                       "(gateway.metrics_host:metrics_port) or set gateway.metrics_token",
                       code="not_found")
    _check_metrics_token(request, token)
    return _metrics(request.app)


def _check_metrics_token(request: web.Request, token: str) -> None:
    if not hmac.compare_digest((bearer(request) or "").encode(), token.encode()):
        raise ApiError(401, "a metrics token is required (Authorization: Bearer ...)",
                       code="invalid_metrics_token")


def _metrics(app: web.Application) -> web.Response:
    body = generate_latest(app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


# ---- health -------------------------------------------------------------------------------
async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def _shared_state(gw: Gateway) -> dict[str, Any]:
    status = gw.limiter.shared_state_status()
    if gw.replica_fair_share is not None:
        status = {**status, "detail": f"{status['detail']}; {gw.replica_fair_share.status()}"}
    return status


def _database_check(auth: Authenticator, reason: str | None) -> dict[str, Any]:
    if reason is None:
        return {"ok": True}
    return {"ok": False, "detail": f"degraded: database: {reason}; keys seen in the last "
            f"{auth.outage_grace_s:g} s keep working, unknown keys get 503 until it answers"}


def _backends_check(pool: BackendPool) -> dict[str, Any]:
    """Ok while a backend can serve (reachable, not ejected); per model, its replicas and how
    many are ejected. A model with some ejected is degraded (still ok), one with none left that
    can serve is not ready."""
    models = pool.replica_counts()
    notes = [f"model {m}: no replica can serve (down or ejected)" for m, c in models.items()
             if not c["available"]]
    notes += [f"degraded: model {m}: {c['ejected']} of {c['replicas']} replicas ejected"
              for m, c in models.items() if c["available"] and c["ejected"]]
    ok = any(pool.available(b) for b in pool.backends)
    if not pool.healthy:
        notes.insert(0, "no engine backend is reachable")
    return {"ok": ok, "models": models, **({"detail": "; ".join(notes)} if notes else {})}


async def readyz(request: web.Request) -> web.Response:
    """Ready when a backend is reachable and not ejected, with what is wrong when not. The
    tenant database away is a degraded state, reported but not a reason to be unready: keys
    seen lately keep working (gateway/auth.py), and failing every replica's pod would fail
    every tenant; so are ejected replicas while another serves their model."""
    backends_check = _backends_check(request.app[GATEWAY].pool)
    backends = backends_check["ok"]
    auth = request.app[AUTH]
    checks = {"backends": backends_check,
              "database": _database_check(auth, await auth.database_ready()),
              # reported, not a reason to be unready: without Redis, limits are local
              "shared_state": _shared_state(request.app[GATEWAY])}
    ready = backends
    return web.json_response({"ready": ready, "checks": checks}, status=200 if ready else 503)

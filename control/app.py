"""`make_app(config, engine=, database=)`: the gateway with its control plane attached.

`gateway.app.make_app` builds the serving path; this adds, above it, what steers and watches
it: tune jobs and the canary that applies their result, shadow targets, the trace capture, the
SLO dashboard, and their admin routes. The shadow set, the canary's window and the capture
subscribe to the gateway's request events (gateway/events.py): the serving path never calls
them. Their cleanup contexts start after the gateway's and stop before them, so a shadow copy,
a captured line or a tune job's call back into the admin API always finds a running gateway.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web

from control import admin, dashboard
from control.capture import TraceCapture
from control.jobs import JobManager
from control.openapi import PARTS
from control.shadow import ShadowSet
from control.shadow_metrics import ShadowMetrics
from control.state import CAPTURE, JOBS, SHADOWS
from engine.config import EngineConfig
from gateway import app as serving
from gateway.backends import Backend
from gateway.config import GatewayConfig
from gateway.openapi import OPENAPI_PARTS
from gateway.state import GATEWAY, METRICS, SETTINGS, STORE
from tenants import DEFAULT_DATABASE_URL, TenantStore
from tenants.jobs import JobStore


def make_app(config: GatewayConfig | None = None, *, engine: EngineConfig | None = None,
             database: str = DEFAULT_DATABASE_URL, backends: list[Backend] | None = None,
             store: TenantStore | None = None,
             on_demo_key: Callable[[str], None] | None = None) -> web.Application:
    """The gateway (`gateway.app.make_app`, the same arguments) and its control plane."""
    app = serving.make_app(config, engine=engine, database=database, backends=backends,
                           store=store, on_demo_key=on_demo_key)
    attach(app, database)
    return app


def attach(app: web.Application, database: str) -> None:
    """The control plane onto a serving app that `gateway.app.make_app` built (not started)."""
    settings, gw = app[SETTINGS], app[GATEWAY]
    shadows = ShadowSet(settings.shadow, ShadowMetrics(app[METRICS].registry))
    capture = None if settings.capture is None else TraceCapture(settings.capture)
    jobs = JobManager(JobStore(app[STORE].db), settings.jobs.storage or database,
                      Path(settings.jobs.dir), settings.jobs.max_running, settings.admin_key,
                      None if capture is None else capture.window)
    jobs.pool = gw.pool  # an apply's replicas
    jobs.shadows = shadows  # a shadow job's engine keys
    app[SHADOWS], app[CAPTURE], app[JOBS] = shadows, capture, jobs
    gw.add_observer(shadows)
    gw.add_observer(jobs.served)
    if capture is not None:
        gw.add_observer(capture)
    app.cleanup_ctx.extend([_shadows, _jobs])
    admin.add_routes(app)
    dashboard.add_routes(app)
    app[OPENAPI_PARTS] = PARTS  # its routes in /openapi.json


async def _shadows(app: web.Application) -> AsyncIterator[None]:
    """Shadow targets and the trace capture: started after the gateway, stopped before it (the
    capture's last lines are written after the requests in flight have settled)."""
    shadows, capture = app[SHADOWS], app[CAPTURE]
    await shadows.start()
    if capture is not None:
        capture.start()
    try:
        yield
    finally:
        await shadows.close()
        if capture is not None:
            await capture.close()


async def _jobs(app: web.Application) -> AsyncIterator[None]:
    """Tune jobs: started last (a job's worker may call this gateway's admin API), stopped
    first; their workers stop with the gateway and their jobs resume as `interrupted`."""
    await app[JOBS].start()
    try:
        yield
    finally:
        await app[JOBS].close()

"""The control plane's admin routes (admin key): shadow targets, the trace capture's window,
tune jobs and their files, sim profiles. gateway/admin.py has the serving path's (tenants, keys,
usage, models, queues); the same rules hold here: database calls within DATABASE_TIMEOUT_S, their
outages a retryable 503.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
from pathlib import Path
from typing import Any

from aiohttp import web
from sqlalchemy.exc import SQLAlchemyError

from control.jobs import (
    JOB_FILES,
    MAX_PROFILE_BYTES,
    is_profile_name,
    parse_spec,
    profile_from_upload,
    profile_summary,
)
from control.state import CAPTURE, JOBS, SHADOWS
from gateway.admin import RETRY_AFTER_S, database_calls, is_positive
from gateway.config import ShadowConfig
from gateway.proxy import read_json
from gateway.state import AUTH, GATEWAY, SETTINGS, STORE
from protocol.errors import ApiError, bad_request
from protocol.http import query_float
from tenants.values import strictest_slos


# ---- shadow traffic (control/shadow.py) -------------------------------------------------------
def _mirror(request: web.Request) -> Any:
    name = request.match_info["name"]
    mirror = request.app[SHADOWS].mirrors.get(name)
    if mirror is None:
        raise ApiError(404, f"no shadow target named {name!r}", code="shadow_not_found")
    return mirror


async def list_shadows(request: web.Request) -> web.Response:
    request.app[AUTH].check_admin(request)
    shadows = request.app[SHADOWS]
    return web.json_response({"shadows": [m.describe() for m in shadows.mirrors.values()]})


async def put_shadow(request: web.Request) -> web.Response:
    """POST /admin/shadow {name, url, kind?, model?, sample?, tenants?, ...}: start a target,
    or replace the one of that name (a changed sample or tenant list keeps its pairs)."""
    request.app[AUTH].check_admin(request)
    body = await read_json(request)
    try:
        config = ShadowConfig.from_dict(body)
    except ValueError as exc:
        raise bad_request(str(exc), _field_of(str(exc))) from None
    existed = config.name in request.app[SHADOWS].mirrors
    mirror = await request.app[SHADOWS].put(config)
    return web.json_response(mirror.describe(), status=200 if existed else 201)


async def patch_shadow(request: web.Request) -> web.Response:
    """PATCH /admin/shadow/{name} {sample?, tenants?, max_inflight?, max_queue?, timeout_s?}"""
    request.app[AUTH].check_admin(request)
    mirror = _mirror(request)
    body = await read_json(request)
    allowed = ("sample", "tenants", "max_inflight", "max_queue", "timeout_s")
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise bad_request(f"cannot change {', '.join(unknown)} here (only "
                          f"{', '.join(allowed)}); POST /admin/shadow to replace the target",
                          unknown[0])
    current = dataclasses.asdict(mirror.config)
    current["tenants"] = "all" if mirror.config.tenants == ("all",) else list(
        mirror.config.tenants)
    try:
        config = ShadowConfig.from_dict({**current, **body})
    except ValueError as exc:
        raise bad_request(str(exc), _field_of(str(exc))) from None
    return web.json_response((await request.app[SHADOWS].put(config)).describe())


async def delete_shadow(request: web.Request) -> web.Response:
    request.app[AUTH].check_admin(request)
    name = _mirror(request).name
    await request.app[SHADOWS].remove(name)
    return web.json_response({"deleted": name})


async def shadow_stats(request: web.Request) -> web.Response:
    """GET /admin/shadow/{name}/stats?window=S (default 300 s)[&sent_after=EPOCH][&detail=1]:
    the pairs completed in the last S seconds (whose copy went out after sent_after), both
    sides side by side; detail adds every pair's figures."""
    request.app[AUTH].check_admin(request)
    mirror = _mirror(request)
    window = query_float(request, "window", 300.0, "window must be a number of seconds",
                         is_positive, "window must be > 0 seconds")
    assert window is not None
    sent_after = query_float(request, "sent_after", None,
                             "sent_after must be a time in epoch seconds")
    detail = request.query.get("detail", "0") in ("1", "true")
    # up to 50,000 pairs and their bootstrap: in a thread, never on the event loop (the
    # window's pairs are copied here first, while nothing else touches them)
    rows = mirror.window(window, sent_after)
    return web.json_response(await asyncio.to_thread(mirror.stats, window, rows, 0, detail))


# ---- trace capture (control/capture.py) -------------------------------------------------------
CAPTURE_MEDIA_TYPE = "application/x-ndjson"
MAX_CAPTURE_LIMIT = 1_000_000


def _epoch(request: web.Request, name: str, default: float) -> float:
    value = query_float(request, name, default, f"{name} must be a time in epoch seconds",
                        lambda v: math.isfinite(v) and v >= 0,
                        f"{name} must be a time in epoch seconds (>= 0)")
    assert value is not None
    return value


def _limit(request: web.Request) -> int | None:
    raw = request.query.get("limit")
    if raw is None:
        return None
    if not raw.isascii() or not raw.isdigit() or not 1 <= int(raw) <= MAX_CAPTURE_LIMIT:
        raise bad_request(f"limit must be a whole number of requests, 1..{MAX_CAPTURE_LIMIT}",
                          "limit")
    return int(raw)


async def capture_window(request: web.Request) -> web.Response:
    """GET /admin/capture?since=EPOCH&until=EPOCH[&limit=N]: the captured requests that arrived
    in [since, until) (the most recent N), as a fairgate JSONL trace whose first request is at
    arrival 0 (its header comment names that request's epoch); empty when none did."""
    request.app[AUTH].check_admin(request)
    capture = request.app[CAPTURE]
    if capture is None:
        raise ApiError(404, "this gateway captures no traffic: set gateway.capture.path in its "
                       "config (gateway.capture: {path: FILE})", code="no_capture")
    since = _epoch(request, "since", 0.0)
    until = _epoch(request, "until", math.inf)
    if until <= since:
        raise bad_request("until must be after since", "until")
    limit = _limit(request)
    try:
        text = await capture.window(since, until, limit)
    except OSError as exc:
        raise ApiError(503, f"cannot read the trace capture ({exc.strerror or exc}); try again "
                       "shortly", code="capture_unavailable", retry_after=RETRY_AFTER_S) from None
    return web.Response(text=text, content_type=CAPTURE_MEDIA_TYPE)


def _field_of(message: str) -> str | None:
    """`gateway.shadow[x].sample must ...` -> `sample`, for the error's param."""
    head = message.split(" ", 1)[0]
    return head.rsplit(".", 1)[-1] if "." in head else None


# ---- tune jobs (control/jobs.py) ---------------------------------------------------------------
async def _default_slos(request: web.Request) -> dict[str, float]:
    """The strictest of each p99 target an enabled tenant sets, by its field name
    (slo_ttft_p99_s, slo_tpot_p99_s, slo_itl_p99_s): a job's SLOs where it names none."""
    async with database_calls():
        tenants = await request.app[STORE].list_tenants()
    return {name: value for name, (value, _) in strictest_slos(tenants).items()}


def _own_url(request: web.Request) -> str | None:
    """This gateway's address as the request reached it (a shadow job's worker calls back)."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    if not sockname:
        return None
    host, port = sockname[0], sockname[1]
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def create_tune_job(request: web.Request) -> web.Response:
    """POST /admin/tune-jobs {mode, workload | captured_minutes, space, SLOs, ...}: 201 with
    the job; a bad spec is a 400 naming its field."""
    request.app[AUTH].check_admin(request)
    body = await read_json(request)
    jobs = request.app[JOBS]
    shadows = {name: m.config.url for name, m in request.app[SHADOWS].mirrors.items()}
    spec = parse_spec(body, shadows, await _default_slos(request))
    jobs.gateway_url = jobs.gateway_url or _own_url(request)
    async with database_calls():
        job = await jobs.submit(spec)
    return web.json_response(await jobs.describe(job, detail=False), status=201)


async def list_tune_jobs(request: web.Request) -> web.Response:
    request.app[AUTH].check_admin(request)
    jobs = request.app[JOBS]
    async with database_calls():
        records = await jobs.store.jobs()
    return web.json_response({"jobs": [await jobs.describe(j, detail=False) for j in records]})


async def show_tune_job(request: web.Request) -> web.Response:
    request.app[AUTH].check_admin(request)
    jobs = request.app[JOBS]
    async with database_calls():
        job = await jobs.get(request.match_info["id"])
    return web.json_response(await jobs.describe(job))


async def cancel_tune_job(request: web.Request) -> web.Response:
    """DELETE /admin/tune-jobs/{id}: a queued job is dropped; a running one's trial is stopped
    and its engine put back on the knobs it had before the job."""
    request.app[AUTH].check_admin(request)
    jobs = request.app[JOBS]
    try:
        job = await jobs.cancel(request.match_info["id"])
    except (SQLAlchemyError, OSError) as exc:
        raise ApiError(503, f"the database is unavailable ({type(exc).__name__}); try again "
                       "shortly", code="database_unavailable", retry_after=RETRY_AFTER_S) from None
    return web.json_response(await jobs.describe(job, detail=False))


async def resume_tune_job(request: web.Request) -> web.Response:
    """POST /admin/tune-jobs/{id}/resume: an interrupted (or failed, or cancelled) job queued
    again; its study keeps every finished trial."""
    request.app[AUTH].check_admin(request)
    jobs = request.app[JOBS]
    async with database_calls():
        job = await jobs.resume(request.match_info["id"])
    return web.json_response(await jobs.describe(job, detail=False))


async def apply_tune_job(request: web.Request) -> web.Response:
    """POST /admin/tune-jobs/{id}/apply {backend, canary_window_s, min_requests}: the job's best
    config onto one replica as a canary, then promoted or rolled back (202: it runs on; the
    job's `apply` shows each step)."""
    request.app[AUTH].check_admin(request)
    body = await read_json(request)
    jobs = request.app[JOBS]
    async with database_calls():
        record = await jobs.apply(request.match_info["id"], body, request.app[GATEWAY])
    return web.json_response(record, status=202)


async def tune_job_file(request: web.Request) -> web.StreamResponse:
    """GET /admin/tune-jobs/{id}/files/{name}: the report, best.yaml, trials.csv, the log."""
    request.app[AUTH].check_admin(request)
    name = request.match_info["name"]
    if name not in JOB_FILES:
        raise ApiError(404, f"a job's files are {', '.join(JOB_FILES)}", code="file_not_found")
    async with database_calls():
        job = await request.app[JOBS].get(request.match_info["id"])
    path = Path(job.out_dir) / name
    if not await asyncio.to_thread(path.is_file):
        raise ApiError(404, f"job {job.id} has no {name} (yet)", code="file_not_found")
    types = {".html": "text/html", ".md": "text/markdown", ".yaml": "application/yaml",
             ".csv": "text/csv", ".log": "text/plain"}
    return web.FileResponse(path, headers={  # streamed: a worker's log may be long
        "Content-Type": f"{types[path.suffix]}; charset=utf-8"})


# ---- sim profiles (control/jobs.py: SimProfiles) ----------------------------------------------
async def list_sim_profiles(request: web.Request) -> web.Response:
    """GET /admin/sim-profiles: the profiles a job may name in set.sim_profile."""
    request.app[AUTH].check_admin(request)
    profiles = request.app[JOBS].profiles
    return web.json_response({"profiles": await asyncio.to_thread(profiles.describe)})


async def put_sim_profile(request: web.Request) -> web.Response:
    """PUT /admin/sim-profiles/{name} with a `fairgate tune calibrate` profile (YAML, or JSON):
    checked as the simulator loads it and kept 0600 in jobs.dir/sim-profiles (201; 200 when it
    replaced one)."""
    request.app[AUTH].check_admin(request)
    name = request.match_info["name"]
    if not is_profile_name(name):
        raise bad_request("a sim profile's name is letters, digits, '.', '_' and '-' (at most "
                          "64, not starting with '.')", "name")
    body = await _read_body(request, MAX_PROFILE_BYTES)
    profile = await asyncio.to_thread(profile_from_upload, body,
                                      request.content_type == "application/json")
    profiles = request.app[JOBS].profiles
    try:
        replaced = await asyncio.to_thread(profiles.put, name, profile)
    except OSError as exc:
        raise ApiError(503, f"cannot write the sim profile ({exc.strerror or exc})",
                       code="profiles_unavailable", retry_after=RETRY_AFTER_S) from None
    return web.json_response(profile_summary(name, profile), status=200 if replaced else 201)


async def _read_body(request: web.Request, limit: int) -> bytes:
    """The body, at most `limit` bytes (413 past it), within gateway.client_timeout_s (408)."""
    too_large = ApiError(413, f"the request body is larger than {limit} bytes",
                         code="request_too_large")
    if request.content_length is not None and request.content_length > limit:
        raise too_large
    try:
        async with asyncio.timeout(request.app[SETTINGS].client_timeout_s):
            body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_large from None
    except TimeoutError:
        raise ApiError(408, "the request body did not arrive in time",
                       code="client_timeout") from None
    if len(body) > limit:
        raise too_large
    return body


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/shadow", list_shadows)
    app.router.add_post("/admin/shadow", put_shadow)
    app.router.add_patch("/admin/shadow/{name}", patch_shadow)
    app.router.add_delete("/admin/shadow/{name}", delete_shadow)
    app.router.add_get("/admin/shadow/{name}/stats", shadow_stats)
    app.router.add_get("/admin/capture", capture_window)
    app.router.add_post("/admin/tune-jobs", create_tune_job)
    app.router.add_get("/admin/tune-jobs", list_tune_jobs)
    app.router.add_get("/admin/tune-jobs/{id}", show_tune_job)
    app.router.add_delete("/admin/tune-jobs/{id}", cancel_tune_job)
    app.router.add_post("/admin/tune-jobs/{id}/resume", resume_tune_job)
    app.router.add_post("/admin/tune-jobs/{id}/apply", apply_tune_job)
    app.router.add_get("/admin/tune-jobs/{id}/files/{name}", tune_job_file)
    app.router.add_get("/admin/sim-profiles", list_sim_profiles)
    app.router.add_put("/admin/sim-profiles/{name}", put_sim_profile)

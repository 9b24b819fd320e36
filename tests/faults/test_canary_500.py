"""A canary whose new knobs make it answer 500 (issue 25, item 4: it was judged only when its
window ended, and 38 of 77 live requests failed in that window).

A real gateway process in front of two real `fairgate engine` processes; one of them is
reached through a faulting proxy (this module run as a script) that passes everything on, and
answers 500 to every completion while the engine runs `max_num_seqs=POISON` (set by an
`/admin/reconfigure` through it): the knob value that breaks the replica. A tune job whose
best config is that value is applied to it as the canary while clients stream. The sequential
test rolls it back within seconds, at most 5 client requests fail (those the canary failed
before a byte were retried on the other engine), and the job says what decided it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from protocol.errors import error_body
from tests.faults.clients import Seen, completion, send
from tests.faults.cluster import (
    BACKEND_TIMEOUTS,
    Cluster,
    Fleet,
    StartCluster,
    start_engine,
)
from tests.faults.services import fake_process, get_json, serve_forever
from tests.support.processes import free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.postgres
POISON = 3  # the max_num_seqs that breaks the proxied engine
# Each client sends its next request when its last one ends: at most CLIENTS retries are under
# way, within gateway.retry_budget's min_retry_concurrency (3).
CLIENTS = 3
WARM_REQUESTS = 60  # streamed before the apply: both engines serve, the canary's reference
CANARY_WINDOW_S = 30.0  # the window the rollback must not wait for
STATE = web.AppKey("state", dict[str, Any])
SESSION = web.AppKey("session", aiohttp.ClientSession)
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


# ---- the faulting proxy (run as `python -m tests.faults.test_canary_500 --port P --to URL`) ---
def make_faulting_proxy(target: str) -> web.Application:
    """Everything passed on to `target` (streams as they come), except completions while
    the engine runs max_num_seqs=POISON: 500. GET /fault says how many it failed."""
    app = web.Application()
    app[STATE] = {"broken": False, "failed": 0}

    async def session_context(app: web.Application) -> AsyncIterator[None]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            app[SESSION] = s
            yield

    async def fault(request: web.Request) -> web.Response:
        return web.json_response(request.app[STATE])

    async def forward(request: web.Request) -> web.StreamResponse:
        state, body = request.app[STATE], await request.read()
        if request.path in COMPLETION_PATHS and state["broken"]:
            state["failed"] += 1
            return web.json_response(error_body("max_num_seqs=3 breaks this replica",
                                                "server_error", code="internal_error"),
                                     status=500)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type")}
        async with request.app[SESSION].request(request.method, target + request.path_qs,
                                                data=body, headers=headers) as upstream:
            resp = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items()
                if k.lower() in ("content-type", "retry-after", "cache-control")})
            await resp.prepare(request)
            async for chunk in upstream.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
        if request.path == "/admin/reconfigure" and upstream.status == 200:
            state["broken"] = json.loads(body)["changes"].get("max_num_seqs") == POISON
        return resp

    app.cleanup_ctx.append(session_context)
    app.router.add_get("/fault", fault)
    app.router.add_route("*", "/{tail:.*}", forward)
    return app


async def serve(port: int, target: str) -> None:
    await serve_forever(make_faulting_proxy(target), port,
                        f"{target} on port {port} (500 while max_num_seqs={POISON})")


def faulting_proxy(target: str, cwd: Path) -> contextlib.AbstractContextManager[str]:
    """The proxy in its own process, listening: its URL; stopped afterwards."""
    return fake_process("tests.faults.test_canary_500", free_port(), ["--to", target], cwd)


# ---- the test -------------------------------------------------------------------------------------
async def poisoned_job(c: Cluster, session: aiohttp.ClientSession) -> str:
    """A sim tune job whose space holds only max_num_seqs=POISON: its best config."""
    spec = {"mode": "sim", "workload": "uniform", "rate": 2, "duration": 4, "trials": 1,
            "robustness": 0, "slo_ttft_p99_s": 30, "slo_tpot_p99_s": 5,
            "set": {"max_num_seqs": POISON}, "space": {"max_num_seqs": {"choices": [POISON]}}}
    async with session.post(f"{c.url}/admin/tune-jobs", json=spec, headers=c.admin) as resp:
        assert resp.status == 201, await resp.text()
        job_id = str((await resp.json())["id"])

    async def succeeded() -> bool:
        job = await get_json(session, f"{c.url}/admin/tune-jobs/{job_id}", c.admin)
        assert job["state"] in ("queued", "running", "succeeded"), job
        return bool(job["state"] == "succeeded")

    await wait_until(succeeded, 180, f"job {job_id} succeeded", every=0.2)
    return job_id


@asynccontextmanager
async def streaming_clients(c: Cluster, session: aiohttp.ClientSession) -> AsyncIterator[
        tuple[list[Seen], asyncio.Event]]:
    """CLIENTS clients (of two tenants) streaming short completions back to back until the
    block ends: what each saw, and an event set once WARM_REQUESTS were answered."""
    seen: list[Seen] = []
    warm, stop = asyncio.Event(), asyncio.Event()

    async def client(i: int) -> None:
        tenant = ("acme", "beta")[i % 2]
        while not stop.is_set():
            seen.append(await send(session, c.url, c.tenants[tenant], c.keys[tenant],
                                   completion(8)))
            if len(seen) >= WARM_REQUESTS:
                warm.set()

    tasks = [asyncio.create_task(client(i)) for i in range(CLIENTS)]
    try:
        yield seen, warm
    finally:
        stop.set()
        await asyncio.gather(*tasks)


def counted(text: str, counter: str) -> float:
    """fairgate_gateway_<counter>_total summed over its reasons."""
    pattern = rf'^fairgate_gateway_{counter}_total\{{reason="\w+"\}} (\S+)$'
    return sum(map(float, re.findall(pattern, text, re.MULTILINE)))


async def test_a_canary_answering_500_is_rolled_back_within_seconds(
        cluster: StartCluster, fleet: Fleet, session: aiohttp.ClientSession,
        tmp_path: Path) -> None:
    engines = [start_engine(f"engine-{i}", tmp_path) for i in range(2)]
    fleet.services.extend(e for e, _ in engines)
    for engine, _ in engines:
        await engine.wait_line("serving ")
    (_, stable_url), (_, target_url) = engines
    token = "metrics-" + secrets.token_urlsafe(24)
    fleet.secrets.append(token)
    with faulting_proxy(target_url, tmp_path) as canary_url:
        c = await cluster(engines=0, settings={
            "metrics_token": token, "jobs": {"dir": str(tmp_path / "jobs")},
            "backends": [{"url": u, **BACKEND_TIMEOUTS} for u in (stable_url, canary_url)]})
        before = (await get_json(session, f"{target_url}/admin/config"))["config"]
        job_id = await poisoned_job(c, session)

        async with streaming_clients(c, session) as (seen, warm):
            await asyncio.wait_for(warm.wait(), 60)
            async with session.post(f"{c.url}/admin/tune-jobs/{job_id}/apply", json={
                    "backend": canary_url, "canary_window_s": CANARY_WINDOW_S,
                    "min_requests": 10}, headers=c.admin) as resp:
                assert resp.status == 202, await resp.text()
            record: dict[str, Any] = {}

            async def ended() -> bool:
                job = await get_json(session, f"{c.url}/admin/tune-jobs/{job_id}", c.admin)
                record.update(job["apply"])
                return record["state"] in ("promoted", "rolled_back", "failed")

            await wait_until(ended, 60, "the apply ended", every=0.1)
            after = len(seen)

            async def more_served() -> bool:  # the healed replica serves again afterwards
                return len(seen) >= after + 2 * CLIENTS

            await wait_until(more_served, 30, "clients served after the rollback")
        fault = await get_json(session, f"{canary_url}/fault")
        async with session.get(f"{c.url}/metrics",
                               headers={"Authorization": f"Bearer {token}"}) as resp:
            metrics = await resp.text()
        knobs = await get_json(session, f"{target_url}/admin/config")

    assert record["state"] == "rolled_back", record["steps"]
    started = next(s for s in record["steps"] if s["step"].endswith(
        f"watching live traffic for {CANARY_WINDOW_S:g} s"))
    verdict = next(s for s in record["steps"] if "verdict" in s)
    done = record["steps"][-1]
    assert done["step"] == "every replica runs its previous knobs", record["steps"]
    assert done["at"] - started["at"] <= 5.0, record["steps"]
    assert verdict["verdict"] == "roll_back" and verdict["after_s"] < CANARY_WINDOW_S / 2
    assert verdict["figures"]["decided_by"] == "errors", verdict
    errors = verdict["figures"]["sequential"]["errors"]
    assert errors["decision"] == "worse" and errors["bad"] >= 3 and errors["p0"] == 0.01
    # the replica did fail requests, and no client saw more than 5 of them: a failure before
    # the first byte went on to the other engine
    assert not fault["broken"] and errors["bad"] <= fault["failed"] <= errors["bad"] + CLIENTS
    failed = [s for s in seen if not s.ok]
    assert len(failed) <= 5, failed
    assert counted(metrics, "retries") + counted(metrics, "retries_refused") == fault["failed"]
    assert len(failed) == counted(metrics, "retries_refused"), (failed, metrics)
    assert knobs["config"]["max_num_seqs"] == before["max_num_seqs"] != POISON  # put back


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a proxy that fails completions on a knob")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--to", required=True, metavar="URL")
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.to))

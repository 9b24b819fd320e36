"""A replica that passes its health checks but answers 500 to every completion (issue 25: it used
to keep half the traffic, 50 of 100 clients got 502 and /readyz stayed 200 without a word).

A real gateway process in front of a real `fairgate engine` and a fake replica process (this
module run as a script: /health and /load like an idle fairgate engine, 500 to completions).
The failed requests are retried on the good engine before any byte reached their clients, the
fake replica is ejected after its fifth failure, and /admin/engines, the metrics and /readyz
(still ready, degraded) say so. Each client request has exactly one usage row.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import secrets
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from protocol.errors import error_body
from tests.faults.clients import Seen, assert_usage_matches, completion, send
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
REQUESTS = 100
# Each client sends its next request when the last one ends, so at most CLIENTS retries are
# ever under way: within gateway.retry_budget's min_retry_concurrency (3), every request the
# fake replica fails is retried. (A fourth client can find the budget spent: its request goes
# to the fake replica, which looks idle to least-loaded routing, while the three retries of
# the others run.) The budget's own rule is tested in tests/gateway/test_outlier.py.
CLIENTS = 3
CONSECUTIVE_5XX = 5  # gateway.outlier_detection's default
IDLE_LOAD = {"running": 0, "waiting": 0, "swapped": 0, "max_num_seqs": 64, "kv_usage": 0.0,
             "outstanding_tokens": 0, "max_model_len": 1024, "num_preemptions": 0}
COMPLETIONS = web.AppKey("completions", list[int])


# ---- the fake replica (run as `python -m tests.faults.test_replica_500 --port P --model M`) -----
def make_failing_replica(model: str) -> web.Application:
    """Healthy and idle to every health check, 500 to every completion; GET /fake/completions
    says how many it was sent."""
    app = web.Application()
    app[COMPLETIONS] = [0]

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def load(request: web.Request) -> web.Response:
        return web.json_response(IDLE_LOAD)

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": model, "object": "model", "created": 0, "owned_by": "fake",
             "max_model_len": IDLE_LOAD["max_model_len"]}]})

    async def fail(request: web.Request) -> web.Response:
        request.app[COMPLETIONS][0] += 1
        return web.json_response(error_body("the replica is broken", "server_error",
                                            code="internal_error"), status=500)

    async def sent(request: web.Request) -> web.Response:
        return web.json_response({"completions": request.app[COMPLETIONS][0]})

    for path, handler in (("/health", health), ("/healthz", health), ("/load", load),
                          ("/v1/models", models), ("/fake/completions", sent)):
        app.router.add_get(path, handler)
    app.router.add_post("/v1/completions", fail)
    app.router.add_post("/v1/chat/completions", fail)
    return app


async def serve(port: int, model: str) -> None:
    await serve_forever(make_failing_replica(model), port,
                        f"{model} on port {port} (500 to every completion)")


def failing_replica(model: str, cwd: Path) -> contextlib.AbstractContextManager[str]:
    """The fake replica in its own process, listening: its URL; stopped afterwards."""
    return fake_process("tests.faults.test_replica_500", free_port(), ["--model", model], cwd)


# ---- the test -------------------------------------------------------------------------------------
async def gateway_metrics(c: Cluster, session: aiohttp.ClientSession, token: str) -> str:
    async with session.get(f"{c.url}/metrics",
                           headers={"Authorization": f"Bearer {token}"}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.text()


def counted(text: str, counter: str) -> float:
    """fairgate_gateway_<counter>_total summed over its reasons."""
    pattern = rf'^fairgate_gateway_{counter}_total\{{reason="\w+"\}} (\S+)$'
    return sum(map(float, re.findall(pattern, text, re.MULTILINE)))


async def clients(c: Cluster, session: aiohttp.ClientSession) -> list[Seen]:
    """REQUESTS short streams from CLIENTS clients (of two tenants), each one at a time."""

    async def one_client(i: int) -> list[Seen]:
        tenant = ("acme", "beta")[i % 2]
        return [await send(session, c.url, c.tenants[tenant], c.keys[tenant], completion(8))
                for _ in range(i, REQUESTS, CLIENTS)]

    return [s for seen in await asyncio.gather(*map(one_client, range(CLIENTS))) for s in seen]


async def test_a_replica_answering_500_is_ejected_and_its_clients_served(
        cluster: StartCluster, fleet: Fleet, session: aiohttp.ClientSession,
        database_url: str, tmp_path: Path) -> None:
    engine, engine_url = start_engine("engine-good", tmp_path)
    fleet.services.append(engine)
    await engine.wait_line("serving ")
    model = (await get_json(session, f"{engine_url}/v1/models"))["data"][0]["id"]
    token = "metrics-" + secrets.token_urlsafe(24)
    fleet.secrets.append(token)
    with failing_replica(model, tmp_path) as bad_url:
        c = await cluster(engines=0, settings={"metrics_token": token, "backends": [
            {"url": url, **BACKEND_TIMEOUTS} for url in (engine_url, bad_url)]})

        async def both_up() -> bool:
            return await c.backends(session) == {engine_url: True, bad_url: True}

        await wait_until(both_up, 10, "the gateway sees both replicas healthy")
        seen = await clients(c, session)
        served = sum(s.ok and s.tokens == 8 for s in seen)
        assert len(seen) == REQUESTS and served >= 98, [s for s in seen if not s.ok]
        sent_bad = (await get_json(session, f"{bad_url}/fake/completions"))["completions"]
        # the fifth failure in a row ejects it; requests already under way there end too
        assert CONSECUTIVE_5XX <= sent_bad <= CONSECUTIVE_5XX + CLIENTS - 1, sent_bad

        engines = await get_json(session, f"{c.url}/admin/engines", c.admin)
        outlier = {e["name"]: e["outlier"] for e in engines["engines"]}
        assert outlier[bad_url]["ejected"] is True and outlier[bad_url]["ejections"] == 1
        assert outlier[engine_url]["ejected"] is False

        text = await gateway_metrics(c, session, token)
        assert f'fairgate_gateway_backend_ejected{{backend="{bad_url}"}} 1.0' in text
        assert f'fairgate_gateway_backend_ejected{{backend="{engine_url}"}} 0.0' in text
        assert f'fairgate_gateway_backend_ejections_total{{backend="{bad_url}"}} 1.0' in text
        # every request it failed went on to the good engine, or was refused a retry
        assert counted(text, "retries") + counted(text, "retries_refused") == sent_bad, text

        async with session.get(f"{c.url}/readyz") as resp:
            ready = await resp.json()
            assert resp.status == 200, ready
        backends = ready["checks"]["backends"]
        assert backends["ok"] is True and "degraded" in backends["detail"], backends
        assert backends["models"][model] == {"replicas": 2, "available": 1, "ejected": 1}
    await assert_usage_matches(database_url, seen)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a replica that answers 500 to completions")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.model))

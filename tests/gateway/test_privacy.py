"""Tenant privacy (issue 13, defects 3 and 4): metrics name every tenant, so tenants cannot
read them; no endpoint shows one tenant another's series; credentials never reach a log line,
even in the errors aiohttp answers before any handler runs."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from gateway.app import make_metrics_app
from tenants.keys import generate_key
from tests.gateway.helpers import completion, create_tenants, start_gateway
from tests.support.processes import free_port, spawn_fairgate, wait_for_output

SECRET_TENANT = "zebra-private-co"  # a name that appears nowhere but in its own series
TOKEN = "metrics-token-0123456789"


async def test_tenant_key_reads_no_other_tenants_series_from_any_endpoint(
        aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url, tenants={"acme": {}, SECRET_TENANT: {}})
    assert (await h.post(SECRET_TENANT, completion())).status == 200
    assert SECRET_TENANT in h.metrics()  # the series exist; the operator sees them
    for route in h.app.router.routes():
        info = route.resource.get_info() if route.resource else {}
        path = info.get("path") or info.get("formatter", "").replace("{name}", SECRET_TENANT)
        if route.method == "HEAD" or not path:
            continue
        resp = await h.client.request(route.method, path, headers=h.auth("acme"),
                                      data=json.dumps(completion()))
        body = await resp.text()
        assert SECRET_TENANT not in body, (route.method, path, resp.status)
        assert resp.status < 500, (route.method, path, body)


async def test_main_port_metrics_need_the_metrics_token(aiohttp_client: Any,
                                                        db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url, gateway={"metrics_token": TOKEN})
    assert (await h.post("acme", completion())).status == 200
    for headers in ({}, h.auth("acme"), {"Authorization": "Bearer admin-key-0123456789"}):
        resp = await h.client.get("/metrics", headers=headers)
        assert resp.status == 401 and (await resp.json())["error"]["code"] == \
            "invalid_metrics_token"
    resp = await h.client.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status == 200 and 'tenant="acme"' in await resp.text()


async def test_main_port_serves_no_metrics_without_a_token(aiohttp_client: Any,
                                                           db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    resp = await h.client.get("/metrics", headers=h.auth("acme"))
    assert resp.status == 404 and "metrics listener" in (await resp.json())["error"]["message"]


async def test_metrics_listener_serves_the_gateways_series(aiohttp_client: Any,
                                                           db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    assert (await h.post("acme", completion())).status == 200
    listener = await aiohttp_client(make_metrics_app(h.app))
    resp = await listener.get("/metrics")
    assert resp.status == 200
    assert 'fairgate_gateway_requests_total{status="200",tenant="acme"} 1.0' in await resp.text()
    assert (await listener.get("/v1/usage")).status == 404  # nothing else lives there


async def test_metrics_listener_checks_the_token_when_one_is_set(aiohttp_client: Any,
                                                                 db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url, gateway={"metrics_token": TOKEN})
    listener = await aiohttp_client(make_metrics_app(h.app))
    assert (await listener.get("/metrics")).status == 401
    ok = await listener.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert ok.status == 200


# ---- `fairgate serve` as users run it --------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("privacy")
    db = f"sqlite:///{tmp / 'fg.db'}"
    keys = asyncio.run(create_tenants(db, {"acme": {}}))
    port = free_port()
    config = tmp / "fairgate.yaml"
    config.write_text(json.dumps({
        "database": db, "engine": {"executor": "sim", "max_model_len": 512},
        "gateway": {"port": port, "metrics_port": 0, "demo_tenant": False,
                    "admin_key": "admin-key-0123456789"}}))
    proc = spawn_fairgate("serve", "-c", str(config))
    try:
        line = wait_for_output(proc, b"metrics on http://", timeout=120)
        metrics_url = re.search(rb"(http://\S+/metrics)", line).group(1).decode()  # type: ignore[union-attr]
        yield {"proc": proc, "url": f"http://127.0.0.1:{port}", "metrics": metrics_url,
               "key": keys["acme"], "port": port}
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


@pytest.mark.xdist_group("privacy-serve")
def test_serve_puts_metrics_on_a_loopback_listener(served: dict[str, Any]) -> None:
    assert served["metrics"].startswith("http://127.0.0.1:")
    status, body = _get(served["metrics"])
    assert status == 200 and b"fairgate_gateway_requests_total" in body
    status, _ = _get(served["url"] + "/metrics", {"Authorization": f"Bearer {served['key']}"})
    assert status == 404


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.xdist_group("privacy-serve")
def test_an_oversized_authorization_header_is_an_openai_error_and_no_key_is_logged(
        served: dict[str, Any]) -> None:
    key = generate_key()
    header = f"Bearer {key}" + "x" * 9000  # over aiohttp's 8190-byte header limit
    answer = _raw(served["port"], (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                                   f"Authorization: {header}\r\nContent-Length: 2\r\n\r\n{{}}")
                  .encode())
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].endswith(b" 400 Bad Request") and b"application/json" in head
    error = json.loads(body)["error"]
    assert error["code"] == "bad_request" and "too long" in error["message"]
    assert key.encode() not in answer
    # the process is still serving, and then stopped: everything it logged is in hand
    assert _get(served["url"] + "/healthz")[0] == 200
    served["proc"].send_signal(signal.SIGTERM)
    output = served["proc"].communicate(timeout=60)[0]
    assert served["proc"].returncode == 0, output[-2000:]
    assert b"rejected a malformed request" in output  # the error was logged ...
    assert key.encode() not in output and key[3:20].encode() not in output  # ... redacted
    assert served["key"].encode() not in output

"""The engine server's keys: `/v1/*`, `/load` and `/stats` want the api key, `/admin/*` the admin
key (the api key when there is none), health, readiness and `/metrics` stay open; and `fairgate
engine` refuses a non-loopback address without an api key unless told it may serve it open."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from engine.async_engine import AsyncEngine
from engine.config import (
    ENGINE_ADMIN_KEY_ENV,
    ENGINE_KEY_ENV,
    EngineAccess,
    EngineConfig,
    is_loopback,
)
from engine.server import make_app
from fairgate.cli import main
from fairgate.config import FairgateConfig
from fairgate.engine_cli import build_access, register
from tests.support.engines import sim_config

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]

ROOT = Path(__file__).parents[2]
API_KEY = "engine-key-0123456789"
ADMIN_KEY = "engine-admin-0123456789"
COMPLETION = {"model": "random:tiny", "prompt": "hello", "max_tokens": 2}
RECONFIGURE = {"changes": {"max_num_seqs": 8}}
# (method, path, body): every keyed route
API_ROUTES = [("POST", "/v1/completions", COMPLETION),
              ("POST", "/v1/chat/completions",
               {"model": "random:tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}),
              ("GET", "/v1/models", None), ("GET", "/load", None), ("GET", "/stats", None)]
ADMIN_ROUTES = [("POST", "/admin/reconfigure", RECONFIGURE), ("GET", "/admin/config", None)]
OPEN_PATHS = ["/health", "/healthz", "/readyz", "/metrics"]


async def keyed(aiohttp_client: MakeClient, **keys: Any) -> Client:
    return await aiohttp_client(make_app(AsyncEngine(sim_config()), access=EngineAccess(**keys)))


def bearer(key: str | None) -> dict[str, str]:
    return {} if key is None else {"Authorization": f"Bearer {key}"}


async def call(client: Client, method: str, path: str, body: Any,
               key: str | None) -> tuple[int, Any]:
    resp = await client.request(method, path, json=body, headers=bearer(key))
    data = await resp.json() if resp.content_type == "application/json" else await resp.text()
    return resp.status, data


def rejected(status: int, body: Any, code: str) -> bool:
    """A 401 in OpenAI's error shape with `code`."""
    return status == 401 and set(body["error"]) == {"message", "type", "param", "code"} and (
        body["error"]["type"], body["error"]["code"]) == ("authentication_error", code)


@pytest.mark.parametrize(("method", "path", "body"), API_ROUTES + ADMIN_ROUTES)
async def test_every_keyed_route_refuses_a_request_without_its_key(
        aiohttp_client: MakeClient, method: str, path: str, body: Any) -> None:
    client = await keyed(aiohttp_client, api_key=API_KEY, admin_key=ADMIN_KEY)
    admin = path.startswith("/admin/")
    for key in (None, "not-the-key-0123456789"):
        status, answer = await call(client, method, path, body, key)
        code = ("invalid_admin_key" if admin else
                "missing_api_key" if key is None else "invalid_api_key")
        assert rejected(status, answer, code), (key, status, answer)


@pytest.mark.parametrize(("method", "path", "body"), API_ROUTES)
async def test_the_api_key_opens_the_api_and_not_the_admin_routes(
        aiohttp_client: MakeClient, method: str, path: str, body: Any) -> None:
    client = await keyed(aiohttp_client, api_key=API_KEY, admin_key=ADMIN_KEY)
    status, answer = await call(client, method, path, body, API_KEY)
    assert status == 200, answer
    status, answer = await call(client, "POST", "/admin/reconfigure", RECONFIGURE, API_KEY)
    assert rejected(status, answer, "invalid_admin_key")
    status, answer = await call(client, method, path, body, ADMIN_KEY)  # each key its routes
    assert rejected(status, answer, "invalid_api_key")


async def test_the_admin_key_reconfigures(aiohttp_client: MakeClient) -> None:
    client = await keyed(aiohttp_client, api_key=API_KEY, admin_key=ADMIN_KEY)
    status, answer = await call(client, "POST", "/admin/reconfigure", RECONFIGURE, ADMIN_KEY)
    assert status == 200 and answer["config"]["max_num_seqs"] == 8, answer
    status, answer = await call(client, "GET", "/admin/config", None, ADMIN_KEY)
    assert status == 200 and answer["config"]["max_num_seqs"] == 8
    # the keys are no knobs: never in the config the engine shows
    assert not {"api_key", "admin_key"} & set(answer["config"])
    assert API_KEY not in str(answer) and ADMIN_KEY not in str(answer)


async def test_without_an_admin_key_the_admin_routes_want_the_api_key(
        aiohttp_client: MakeClient) -> None:
    client = await keyed(aiohttp_client, api_key=API_KEY)
    status, answer = await call(client, "POST", "/admin/reconfigure", RECONFIGURE, None)
    assert rejected(status, answer, "invalid_admin_key")
    status, answer = await call(client, "POST", "/admin/reconfigure", RECONFIGURE, API_KEY)
    assert status == 200, answer


@pytest.mark.parametrize("path", OPEN_PATHS)
async def test_health_readiness_and_metrics_stay_open(aiohttp_client: MakeClient,
                                                      path: str) -> None:
    client = await keyed(aiohttp_client, api_key=API_KEY, admin_key=ADMIN_KEY)
    status, _ = await call(client, "GET", path, None, None)
    assert status == 200


async def test_an_engine_without_keys_is_open(aiohttp_client: MakeClient) -> None:
    client = await aiohttp_client(make_app(AsyncEngine(sim_config())))
    for method, path, body in API_ROUTES + ADMIN_ROUTES:
        status, answer = await call(client, method, path, body, None)
        assert status == 200, (path, answer)


# ---- the keys in the config, the environment and on the command line ----------------------------
def engine_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost",
                                  "::ffff:127.0.0.1"])
def test_loopback_addresses_need_no_key(host: str) -> None:
    assert is_loopback(host)
    assert build_access(engine_args("--host", host), {}) == EngineAccess()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.5", "192.168.1.2", "engine-0",
                                  "localhost.example.com"])
def test_other_addresses_are_refused_without_a_key(host: str) -> None:
    assert not is_loopback(host)
    with pytest.raises(ValueError, match="reachable from other machines and no api key"):
        build_access(engine_args("--host", host), {})


def test_a_key_or_allow_unauthenticated_lets_it_serve_any_address(tmp_path: Path) -> None:
    assert build_access(engine_args("--host", "0.0.0.0", "--api-key", API_KEY),
                        {}).api_key == API_KEY
    assert build_access(engine_args("--host", "0.0.0.0"),
                        {ENGINE_KEY_ENV: API_KEY}).api_key == API_KEY
    assert build_access(engine_args("--host", "0.0.0.0", "--allow-unauthenticated"),
                        {}).allow_unauthenticated
    config = tmp_path / "fairgate.yaml"
    config.write_text("engine:\n  executor: sim\n  allow_unauthenticated: true\n")
    assert build_access(engine_args("-c", str(config), "--host", "0.0.0.0"),
                        {}).api_key is None
    # an admin key alone leaves /v1 open: still refused
    with pytest.raises(ValueError, match="no api key"):
        build_access(engine_args("--host", "0.0.0.0"), {ENGINE_ADMIN_KEY_ENV: ADMIN_KEY})


def test_the_flag_wins_over_the_environment_which_wins_over_the_file(tmp_path: Path) -> None:
    config = tmp_path / "fairgate.yaml"
    config.write_text(f"engine:\n  api_key: file-key-0123456789\n  admin_key: {ADMIN_KEY}\n")
    env = {ENGINE_KEY_ENV: "env-key-0123456789"}
    assert build_access(engine_args("-c", str(config)), {}) == EngineAccess(
        "file-key-0123456789", ADMIN_KEY)
    assert build_access(engine_args("-c", str(config)), env).api_key == "env-key-0123456789"
    assert build_access(engine_args("-c", str(config), "--api-key", API_KEY),
                        env).api_key == API_KEY
    assert build_access(engine_args("-c", str(config)),
                        {ENGINE_ADMIN_KEY_ENV: "env-admin-0123456789"}).effective_admin_key == (
        "env-admin-0123456789")
    # the same file loads for `fairgate serve`, whose embedded engine has no port to guard
    assert FairgateConfig.load(config).engine == EngineConfig()


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--api-key", "short"], {}, "--api-key must be at least 16 characters"),
    (["--api-key", "has a space 0123456789"], {}, "--api-key must be visible ASCII"),
    ([], {ENGINE_KEY_ENV: "short"}, f"{ENGINE_KEY_ENV} must be at least 16"),
    (["--set", "allow_unauthenticated=maybe"], {}, "engine.allow_unauthenticated must be true"),
])
def test_a_malformed_key_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str], argv: list[str],
                                     env: dict[str, str], message: str) -> None:
    for name in (ENGINE_KEY_ENV, ENGINE_ADMIN_KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["engine", "--set", "executor=sim", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fairgate engine: error:") and message in err, err
    assert err.count("\n") == 1


def test_the_command_refuses_a_public_address_without_a_key_in_one_line() -> None:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}  # no FAIRGATE_ENGINE_KEY
    proc = subprocess.run([sys.executable, "-m", "fairgate", "engine", "--host", "0.0.0.0",
                           "--set", "executor=sim"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("fairgate engine: error: --host 0.0.0.0 is reachable")
    assert "--allow-unauthenticated" in proc.stderr and "serving" not in proc.stdout

"""docs/security.md against the code it describes, claim by claim, in-process:

- tenant keys: `fg-` + 43 URL-safe characters, shown once (`fairgate tenants create --key`,
  `fairgate keys create`, `POST /admin/tenants/{name}/keys`), stored as SHA-256, or HMAC-SHA256
  under FAIRGATE_KEY_SECRET (a gateway on another secret refuses them); a key revoked through
  the admin API is refused at once;
- the gateway's key check: 401 `missing_api_key` / `invalid_api_key` on every /v1 route before
  the body is read; a key of another shape never reaches the database; concurrent lookups of a
  key are one; an unknown key is remembered 5 s, by its hash; the per-address budget of failed
  lookups (429 `too_many_invalid_keys`, refilled, 0 = none, one address behind a proxy, spent by
  wrong admin keys too); a lookup not answered in 5 s is 503 `auth_unavailable`; last-used
  times written in the background, once a minute; the outage grace, and revocations heard
  during it;
- the admin key: 16 characters, FAIRGATE_ADMIN_KEY over the file, the startup line; each area
  the page names is /admin/* and wants it (without one: 404), the routes that need no key, the
  dashboard's cookie (its attributes; it reads, never writes);
- engine keys: which routes want which key and the codes, constant-time comparison, which key
  wins, the loopback rule, the gateway and `fairgate tune` sending them;
- metrics on a loopback listener and on the main port only to the token; the log filter;
  aiohttp's own refusals; the size and time limits; `log_requests`; the trace capture; the
  tests' own credential check; the NetworkPolicies; TLS in front of fairgate.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import re
import sqlite3
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from http.cookies import SimpleCookie
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from aiohttp import web

from control.app import make_app as make_gateway_app
from control.capture import TraceCapture
from control.jobs import EngineKeys
from control.state import JOBS
from engine.async_engine import AsyncEngine
from engine.config import ENGINE_ADMIN_KEY_ENV, ENGINE_KEY_ENV, EngineAccess, is_loopback
from engine.server import make_app as make_engine_app
from fairgate import engine_cli, serve_cli, tune_cli
from fairgate.cli import main
from fairgate.config import FairgateConfig
from gateway import auth as gateway_auth
from gateway.app import make_metrics_app, server_options
from gateway.auth import SESSION_TTL_S
from gateway.config import ADMIN_KEY_ENV, CaptureConfig, GatewayConfig
from gateway.state import AUTH, STORE
from protocol.openai import parse_request
from protocol.serving import DEFAULT_HEADER_TIMEOUT_S, REDACTED, RedactingFilter, Runner
from tenants import Principal, TenantStore
from tenants import store as tenant_store
from tenants.keys import KEY_BODY_LEN, KEY_PREFIX, generate_key, hash_key, looks_like_key
from tests.gateway.helpers import ControlledBackend, Harness, create_tenants, start_gateway
from tests.support.credentials import leaked_credentials
from tests.support.engines import sim_config
from tests.support.waiting import wait_for
from tests.test_docs import DOCS, ROOT, section

PAGE = DOCS / "security.md"
ADMIN_KEY = "admin-key-0123456789"  # start_gateway's
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
SECRET_ENV = "FAIRGATE_KEY_SECRET"
SECRET = "key-secret-0123456789"
TOKEN = "metrics-token-0123456789"
ENGINE_KEY = "engine-key-0123456789"
ENGINE_ADMIN = "engine-admin-0123456789"
KEY = re.compile(r"fg-[A-Za-z0-9_-]{43}")
PROMPT = "the secret recipe for plum jam"
COMPLETION = {"model": ControlledBackend.model_name, "prompt": PROMPT, "max_tokens": 3}
# the gateway's routes that want no key, as the page lists them
OPEN_ROUTES = {"/health", "/healthz", "/readyz", "/openapi.json", "/dashboard/login",
               "/dashboard/app.js", "/dashboard/logout"}
# what the page says the admin key guards -> the /admin/* routes that are it
ADMIN_AREAS = {"tenants and keys": ("/admin/tenants", "/admin/keys"),
               "usage": ("/admin/usage",), "queues": ("/admin/queues",),
               "shadow targets": ("/admin/shadow",), "the capture": ("/admin/capture",),
               "tune jobs": ("/admin/tune-jobs",), "sim profiles": ("/admin/sim-profiles",),
               "the dashboard's data": ("/admin/slo/", "/admin/engines")}
ENGINE_API = ("/v1/", "/load", "/stats")
ENGINE_OPEN = {"/health", "/healthz", "/readyz", "/metrics"}
ENGINE_BODIES = {"/v1/completions": {"model": "random:tiny", "prompt": "hi", "max_tokens": 2},
                 "/v1/chat/completions": {"model": "random:tiny", "max_tokens": 2,
                                          "messages": [{"role": "user", "content": "hi"}]},
                 "/admin/reconfigure": {"changes": {"max_num_seqs": 8}}}


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"


@pytest.fixture
def logged(caplog: pytest.LogCaptureFixture,
           monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """caplog without the redacting filter an earlier test's `setup_logging` may have left on
    its handler: the records as the code logs them."""
    monkeypatch.setattr(caplog.handler, "filters", [
        f for f in caplog.handler.filters if not isinstance(f, RedactingFilter)])
    return caplog


def page() -> str:
    return " ".join(PAGE.read_text().split())


def fill(path: str) -> str:
    """A route's path with a value for each of its parameters."""
    return path.replace("{name}", "acme").replace("{id}", "key_0123456789abcdef")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def gateway(aiohttp_client: Any, db_url: str, tenants: dict[str, Any] | None = None,
                  **settings: Any) -> Harness:
    backend = ControlledBackend(capacity_=4)
    backend.release()  # every request is answered at once
    return await start_gateway(aiohttp_client, db_url, backends=[backend], gateway=settings,
                               tenants={"acme": {}} if tenants is None else tenants)


async def refusal(resp: Any) -> tuple[int, str]:
    """(status, code) of an answer in OpenAI's error shape."""
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return resp.status, error["code"]


def lookups(store: TenantStore, monkeypatch: pytest.MonkeyPatch,
            lookup: Callable[[str], Awaitable[Principal | None]] | None = None) -> list[str]:
    """The keys the store is asked about from now on (answered by `lookup` when given)."""
    asked: list[str] = []
    real = lookup or store.authenticate_key

    async def counting(plaintext: str) -> Principal | None:
        asked.append(plaintext)
        return await real(plaintext)

    monkeypatch.setattr(store, "authenticate_key", counting)
    return asked


class Clock:
    """A module's `time`: stopped where it was made (unless `running`), `ahead` seconds on."""

    def __init__(self, running: bool) -> None:
        self.ahead = 0.0
        self.running = running
        self.made = (time.monotonic(), time.time())

    def monotonic(self) -> float:
        return (time.monotonic() if self.running else self.made[0]) + self.ahead

    def time(self) -> float:
        return (time.time() if self.running else self.made[1]) + self.ahead


@contextlib.contextmanager
def root_handler() -> Iterator[logging.Handler]:
    """A new handler on the root logger, for the block (what a command's lines go through)."""
    handler = logging.NullHandler()
    logging.getLogger().addHandler(handler)
    try:
        yield handler
    finally:
        logging.getLogger().removeHandler(handler)


def redacts(handler: logging.Handler) -> bool:
    return any(isinstance(f, RedactingFilter) for f in handler.filters)


def clock(monkeypatch: pytest.MonkeyPatch, module: ModuleType, running: bool = False) -> Clock:
    moved = Clock(running)
    monkeypatch.setattr(module, "time", moved)
    return moved


def test_the_numbers_the_page_states_are_the_codes() -> None:
    config, text = GatewayConfig(), page()
    stated = [f"(`{KEY_PREFIX}` + {KEY_BODY_LEN} URL-safe characters)",
              f"({config.auth_failures_per_s:g} and {config.auth_failure_burst};",
              f"within {gateway_auth.LOOKUP_TIMEOUT_S:g} s is 503 `auth_unavailable`",
              f"`auth_outage_grace_s` ({config.auth_outage_grace_s:g} s)",
              f"(`{config.metrics_host}:{config.metrics_port}` by default)",
              f"{SESSION_TTL_S / 3600:g} hours",
              f"`gateway.max_body_bytes` ({config.max_body_bytes >> 20} MiB)",
              f"`client_timeout_s` ({config.client_timeout_s:g} s)",
              f"`header_timeout_s` ({config.header_timeout_s:g} s)"]
    assert [phrase for phrase in stated if phrase not in text] == []


# ---- tenant keys ----------------------------------------------------------------------------
def test_a_key_is_shown_once_and_only_its_hash_is_stored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'keys.db'}"

    def run(*argv: str) -> str:
        assert main([*argv, "--database", url]) == 0
        return capsys.readouterr().out

    first = KEY.findall(run("tenants", "create", "acme", "--key"))
    second = run("keys", "create", "acme").strip()
    monkeypatch.setenv(SECRET_ENV, SECRET)
    third = run("keys", "create", "acme").strip()
    listing = run("keys", "list")
    with sqlite3.connect(tmp_path / "keys.db") as db:
        stored = {row[0] for row in db.execute("SELECT key_hash FROM fg_api_keys")}
    assert len(first) == 1
    assert stored == {hash_key(first[0]), hash_key(second), hash_key(third, SECRET)}
    assert hash_key(second).startswith("sha256:")
    assert hash_key(third, SECRET).startswith("hmac-sha256:")
    files = b"".join(p.read_bytes() for p in tmp_path.glob("keys.db*"))
    for key in (first[0], second, third):
        assert looks_like_key(key) and KEY.fullmatch(key)
        assert key.encode() not in files and key not in listing and key[:10] in listing


async def test_serve_and_the_tenants_command_must_share_the_key_secret(
        aiohttp_client: Any, db_url: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET)
    argv = ["tenants", "create", "acme", "--key", "--database", db_url]
    assert await asyncio.to_thread(main, argv) == 0
    key = KEY.findall(capsys.readouterr().out)[0]
    same = await gateway(aiohttp_client, db_url, tenants={})
    assert (await same.client.get("/v1/models", headers=bearer(key))).status == 200
    monkeypatch.delenv(SECRET_ENV)
    other = await gateway(aiohttp_client, db_url, tenants={})
    resp = await other.client.get("/v1/models", headers=bearer(key))
    assert await refusal(resp) == (401, "invalid_api_key")


async def test_the_admin_api_shows_a_key_once_and_revoking_it_refuses_it_at_once(
        aiohttp_client: Any, db_url: str) -> None:
    h = await gateway(aiohttp_client, db_url)
    resp = await h.client.post("/admin/tenants/acme/keys", headers=ADMIN)
    created = await resp.json()
    assert resp.status == 201 and KEY.fullmatch(created["key"])
    assert (await h.client.get("/v1/models", headers=bearer(created["key"]))).status == 200
    assert created["key"] not in await (await h.client.get("/admin/tenants", headers=ADMIN)).text()
    resp = await h.client.delete(f"/admin/keys/{created['id']}", headers=ADMIN)
    assert resp.status == 200 and created["key"] not in await resp.text()
    resp = await h.client.get("/v1/models", headers=bearer(created["key"]))
    assert await refusal(resp) == (401, "invalid_api_key")


# ---- tenant keys at the gateway -------------------------------------------------------------
@pytest.mark.parametrize(("authorization", "code"), [
    (None, "missing_api_key"), ("Basic YWNtZTprZXk=", "missing_api_key"),
    ("Bearer ", "missing_api_key"), ("Bearer fg-short", "invalid_api_key"),
    ("Bearer " + "x" * 4000, "invalid_api_key"), ("bearer UNKNOWN", "invalid_api_key")])
async def test_no_key_or_a_wrong_key_is_a_401_before_the_body_is_read(
        aiohttp_client: Any, db_url: str, authorization: str | None, code: str) -> None:
    h = await gateway(aiohttp_client, db_url)
    value = (authorization or "").replace("UNKNOWN", generate_key())
    headers = {"Authorization": value} if authorization else {}
    for method, path in [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                         ("GET", "/v1/models"), ("GET", "/v1/usage")]:
        resp = await h.client.request(method, path, headers=headers, data=b"{not json")
        assert await refusal(resp) == (401, code), path
        assert (await resp.json())["error"]["type"] == "authentication_error"


async def test_a_key_not_of_fairgates_shape_never_reaches_the_database(
        aiohttp_client: Any, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    h = await gateway(aiohttp_client, db_url)
    asked = lookups(h.app[STORE], monkeypatch)
    body = generate_key()[3:]
    for key in ("fg-short", "sk-" + body, "fg-" + body + "a", "fg-" + body[:-1] + "=",
                "fg-" + body[:-1] + "é", "FG-" + body):
        resp = await h.client.post("/v1/completions", json=COMPLETION, headers=bearer(key))
        assert await refusal(resp) == (401, "invalid_api_key"), key
    assert asked == []


async def test_concurrent_lookups_of_one_key_are_shared(
        aiohttp_client: Any, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    h = await gateway(aiohttp_client, db_url)
    store, auth, gate = h.app[STORE], h.app[AUTH], asyncio.Event()
    real = store.authenticate_key

    async def held(plaintext: str) -> Principal | None:
        await gate.wait()
        return await real(plaintext)

    asked = lookups(store, monkeypatch, held)
    arrived = 0
    check = auth.tenant

    def counted(request: web.Request) -> Awaitable[Principal]:
        nonlocal arrived
        arrived += 1  # and the check runs up to its lookup before anything else does
        return check(request)

    monkeypatch.setattr(auth, "tenant", counted)
    requests = [asyncio.create_task(h.client.get("/v1/models", headers=h.auth("acme")))
                for _ in range(6)]
    await wait_for(lambda: arrived == 6)
    gate.set()
    assert [r.status for r in await asyncio.gather(*requests)] == [200] * 6
    assert asked == [h.keys["acme"]]


async def test_an_unknown_key_is_remembered_five_seconds_by_its_hash(
        aiohttp_client: Any, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    h = await gateway(aiohttp_client, db_url)
    asked, moved, unknown = lookups(h.app[STORE], monkeypatch), clock(monkeypatch,
                                                                     gateway_auth), generate_key()
    for ahead, looked_up in ((0.0, 1), (0.0, 1), (4.9, 1), (5.1, 2)):
        moved.ahead = ahead
        resp = await h.client.get("/v1/models", headers=bearer(unknown))
        assert await refusal(resp) == (401, "invalid_api_key")
        assert len(asked) == looked_up, ahead
    assert unknown not in repr(vars(h.app[AUTH]))  # what it remembers is the hash


async def test_failed_lookups_per_address_have_a_budget(
        aiohttp_client: Any, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (GatewayConfig().auth_failures_per_s, GatewayConfig().auth_failure_burst) == (10, 20)
    h = await gateway(aiohttp_client, db_url, auth_failures_per_s=0.5, auth_failure_burst=3)
    h.app[STORE].cache_ttl = 0.0  # acme's key is looked up each time: a key seen valid
    moved = clock(monkeypatch, gateway_auth, running=True)
    assert (await h.client.get("/v1/models", headers=h.auth("acme"))).status == 200
    for _ in range(3):
        resp = await h.client.get("/v1/models", headers=bearer(generate_key()))
        assert await refusal(resp) == (401, "invalid_api_key")
    for forwarded in ("10.0.0.1", "10.0.0.2"):  # behind a proxy: one address for all
        resp = await h.client.get("/v1/models", headers={
            **bearer(generate_key()), "X-Forwarded-For": forwarded})
        assert await refusal(resp) == (429, "too_many_invalid_keys")
        assert int(resp.headers["Retry-After"]) >= 1
    assert (await h.client.get("/v1/models", headers=h.auth("acme"))).status == 200
    moved.ahead = 2.0  # one failed lookup's worth refilled
    resp = await h.client.get("/v1/models", headers=bearer(generate_key()))
    assert await refusal(resp) == (401, "invalid_api_key")


async def test_no_budget_when_auth_failures_per_s_is_0(aiohttp_client: Any, db_url: str) -> None:
    h = await gateway(aiohttp_client, db_url, auth_failures_per_s=0, auth_failure_burst=1)
    for _ in range(25):
        resp = await h.client.get("/v1/models", headers=bearer(generate_key()))
        assert await refusal(resp) == (401, "invalid_api_key")


async def test_wrong_admin_keys_spend_the_same_budget(aiohttp_client: Any, db_url: str) -> None:
    h = await gateway(aiohttp_client, db_url, auth_failures_per_s=0.01, auth_failure_burst=3)
    for _ in range(2):
        resp = await h.client.get("/admin/tenants", headers=bearer("wrong-admin-key-0123456"))
        assert await refusal(resp) == (401, "invalid_admin_key")
    resp = await h.client.post("/dashboard/login", data={"key": "wrong-admin-key-0123456"},
                               allow_redirects=False)
    assert resp.status == 303 and resp.headers["Location"].endswith("failed=1")
    resp = await h.client.get("/v1/models", headers=bearer(generate_key()))
    assert await refusal(resp) == (429, "too_many_invalid_keys")
    assert await refusal(await h.client.get("/admin/tenants", headers=ADMIN)) == (
        429, "too_many_invalid_keys")


async def test_a_lookup_the_database_does_not_answer_in_5_s_is_a_503(
        aiohttp_client: Any, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert gateway_auth.LOOKUP_TIMEOUT_S == 5.0
    monkeypatch.setattr(gateway_auth, "LOOKUP_TIMEOUT_S", 0.05)
    h = await gateway(aiohttp_client, db_url)
    answer = asyncio.Event()

    async def unanswered(plaintext: str) -> Principal | None:
        await answer.wait()
        return None

    lookups(h.app[STORE], monkeypatch, unanswered)
    resp = await h.client.get("/v1/models", headers=h.auth("acme"))
    assert await refusal(resp) == (503, "auth_unavailable") and resp.headers["Retry-After"]
    answer.set()


async def test_a_lookup_only_reads_last_used_is_written_in_the_background_once_a_minute(
        aiohttp_client: Any, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    h = await gateway(aiohttp_client, db_url)
    store, writes = h.app[STORE], asyncio.Event()
    run = store.db.run

    async def held_writes(fn: Any, *, write: bool = True) -> Any:
        if write:  # the database's write lock, held by someone else
            await writes.wait()
        return await run(fn, write=write)

    monkeypatch.setattr(store.db, "run", held_writes)
    async with asyncio.timeout(10):  # answered while its last-used write waits
        assert (await h.client.get("/v1/models", headers=h.auth("acme"))).status == 200
    writes.set()
    moved = clock(monkeypatch, tenant_store)

    async def last_used(ahead: float) -> float | None:
        moved.ahead = ahead
        store.forget_all()  # the next request looks the key up
        assert (await h.client.get("/v1/models", headers=h.auth("acme"))).status == 200
        [key] = await store.list_keys("acme")  # what `fairgate keys list` shows
        return key.last_used_at

    first = await last_used(0.0)
    assert first is not None
    assert await last_used(58.0) == first
    assert (await last_used(62.0) or 0.0) > first + 60


async def test_keys_seen_lately_keep_working_while_the_database_is_away(
        aiohttp_client: Any, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    assert GatewayConfig().auth_outage_grace_s == 600
    monkeypatch.setattr(gateway_auth, "LOOKUP_TIMEOUT_S", 0.05)
    h = await gateway(aiohttp_client, db_url, tenants={"acme": {}, "beta": {}})
    for tenant in ("acme", "beta"):
        assert (await h.client.get("/v1/models", headers=h.auth(tenant))).status == 200
    back = asyncio.Event()

    async def away(plaintext: str) -> Principal | None:
        await back.wait()
        raise OSError("the database is away")

    asked = lookups(h.app[STORE], monkeypatch, away)
    clock(monkeypatch, gateway_auth).ahead = 6.0  # past the 5 s cache: each key is asked again
    for tenant in ("acme", "beta", "acme"):
        assert (await h.client.get("/v1/models", headers=h.auth(tenant))).status == 200
    resp = await h.client.get("/v1/models", headers=bearer(generate_key()))
    assert await refusal(resp) == (503, "auth_unavailable")
    assert len(asked) == 1  # one lookup at a time asks the database again
    clock(monkeypatch, tenant_store).ahead = 601.0  # seen longer ago than the grace
    resp = await h.client.get("/v1/models", headers=h.auth("beta"))
    assert await refusal(resp) == (503, "auth_unavailable")
    back.set()


async def test_a_revocation_is_refused_during_an_outage_only_once_it_is_heard(
        aiohttp_client: Any, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_auth, "LOOKUP_TIMEOUT_S", 0.05)
    h = await gateway(aiohttp_client, db_url)
    assert (await h.client.get("/v1/models", headers=h.auth("acme"))).status == 200
    replica = TenantStore(db_url)  # another replica revokes it
    [key] = await replica.list_keys("acme")
    await replica.revoke_key(key.id)
    await replica.close()
    back = asyncio.Event()

    async def away(plaintext: str) -> Principal | None:
        await back.wait()
        raise OSError("the database is away")

    lookups(h.app[STORE], monkeypatch, away)
    clock(monkeypatch, gateway_auth).ahead = 6.0
    assert (await h.client.get("/v1/models", headers=h.auth("acme"))).status == 200
    h.app[STORE].forget_key(key.id)  # what a revocation heard through Redis does
    resp = await h.client.get("/v1/models", headers=h.auth("acme"))
    assert await refusal(resp) == (503, "auth_unavailable")
    back.set()


# ---- the admin key --------------------------------------------------------------------------
def test_the_admin_key_is_16_characters_and_the_environments_wins() -> None:
    with pytest.raises(ValueError, match="gateway.admin_key must be a string of at least 16"):
        GatewayConfig.from_dict({"admin_key": "fifteen-chars-x"})
    config = GatewayConfig.from_dict({"admin_key": ADMIN_KEY})
    assert config.with_environment({ADMIN_KEY_ENV: "env-admin-0123456789"}).admin_key == (
        "env-admin-0123456789")
    with pytest.raises(ValueError, match=f"{ADMIN_KEY_ENV} must be a string of at least 16"):
        config.with_environment({ADMIN_KEY_ENV: "short"})


@pytest.mark.parametrize(("environ", "file_key", "says"), [
    ({ADMIN_KEY_ENV: "env-admin-0123456789"}, True, f"admin key: ${ADMIN_KEY_ENV}"),
    ({}, True, "admin key: gateway.admin_key"), ({}, False, "admin key: off")])
def test_the_startup_line_says_which_admin_key_is_used(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        environ: dict[str, str], file_key: bool, says: str) -> None:
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    settings = {"demo_tenant": False, "backends": [{"url": "http://127.0.0.1:9"}],
                **({"admin_key": ADMIN_KEY} if file_key else {})}
    config = tmp_path / "fairgate.yaml"
    config.write_text(json.dumps({"database": f"sqlite+aiosqlite:///{tmp_path / 'fg.db'}",
                                  "gateway": settings}))
    served: dict[str, Any] = {}

    def serve(app: web.Application, host: str, port: int, *, extra: Any,
              on_listening: Callable[[list[tuple[str, int]]], None], **options: Any) -> None:
        served.update(extra=extra, options=options)
        on_listening([(host, port), *((h, p) for _, h, p in extra)])

    monkeypatch.setattr(serve_cli, "serve", serve)
    monkeypatch.setattr(serve_cli, "install_fast_event_loop", lambda: None)
    parser = argparse.ArgumentParser()
    serve_cli.register(parser)
    with root_handler() as handler:
        assert serve_cli.run(parser.parse_args(["-c", str(config)])) == 0
    out = capsys.readouterr().out
    assert says in out and "metrics on http://127.0.0.1:9464/metrics" in out
    assert redacts(handler)  # every line it logs passes the filter
    [(_, metrics_host, metrics_port)] = served["extra"]
    assert (metrics_host, metrics_port) == ("127.0.0.1", 9464)
    assert served["options"]["header_timeout"] == DEFAULT_HEADER_TIMEOUT_S == 20


def test_the_page_names_every_admin_area() -> None:
    text = section(PAGE.read_text(), "The admin key")
    assert [area for area in ADMIN_AREAS if area not in " ".join(text.split())] == []


async def test_every_admin_route_wants_the_admin_key(aiohttp_client: Any, db_url: str) -> None:
    h = await gateway(aiohttp_client, db_url, auth_failures_per_s=0)  # no budget: many tries
    routes = [(r.method, fill(r.resource.canonical)) for r in h.app.router.routes()
              if r.resource is not None and r.method != "HEAD"
              and r.resource.canonical.startswith("/admin/")]
    areas = [prefix for prefixes in ADMIN_AREAS.values() for prefix in prefixes]
    assert [path for _, path in routes if not path.startswith(tuple(areas))] == []
    assert {prefix for prefix in areas if not any(p.startswith(prefix) for _, p in routes)} == set()
    for method, path in routes:
        for headers in ({}, h.auth("acme"), bearer("wrong-admin-key-0123456")):
            resp = await h.client.request(method, path, headers=headers, json={})
            assert await refusal(resp) == (401, "invalid_admin_key"), (method, path, headers)
        resp = await h.client.request(method, path, headers=ADMIN, json={})
        assert resp.status not in (401, 403) and resp.status < 500, (method, path)
    off = await gateway(aiohttp_client, db_url.replace("gateway.db", "off.db"), admin_key=None)
    for method, path in routes:
        resp = await off.client.request(method, path, headers=ADMIN, json={})
        assert await refusal(resp) == (404, "admin_disabled"), (method, path)
    assert await refusal(await off.client.get("/dashboard")) == (404, "admin_disabled")


async def test_the_routes_that_need_no_key_and_those_that_want_one(
        aiohttp_client: Any, db_url: str) -> None:
    h = await gateway(aiohttp_client, db_url)
    for route in h.app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        if route.method == "HEAD":
            continue
        resp = await h.client.request(route.method, fill(path), allow_redirects=False)
        if path in OPEN_ROUTES:
            assert resp.status < 400, (route.method, path)
        elif path.startswith("/v1/"):
            assert await refusal(resp) == (401, "missing_api_key"), path
        elif path.startswith("/admin/"):
            assert await refusal(resp) == (401, "invalid_admin_key"), path
        elif path == "/dashboard":
            assert resp.status == 303 and resp.headers["Location"] == "/dashboard/login"
        else:
            assert path == "/metrics", f"{route.method} {path}: not on the page"
            assert await refusal(resp) == (404, "not_found")


async def test_the_dashboards_cookie_only_ever_authorises_reading(
        aiohttp_client: Any, db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    h = await gateway(aiohttp_client, db_url)
    resp = await h.client.post("/dashboard/login", data={"key": ADMIN_KEY}, allow_redirects=False)
    assert resp.status == 303 and resp.headers["Location"] == "/dashboard"
    cookie = SimpleCookie(resp.headers["Set-Cookie"])["fairgate_session"]
    assert (cookie["httponly"], cookie["secure"], cookie["samesite"], cookie["path"],
            cookie["max-age"]) == (True, True, "Strict", "/", f"{SESSION_TTL_S:.0f}")
    h.client.session.cookie_jar.clear()
    session = {"Cookie": f"fairgate_session={cookie.value}"}
    assert (await h.client.get("/admin/tenants", headers=session)).status == 200
    assert (await h.client.get("/dashboard", headers=session)).status == 200
    for method, path in [("POST", "/admin/tenants"), ("POST", "/admin/tenants/acme/keys"),
                         ("DELETE", "/admin/keys/key_0123456789abcdef")]:
        resp = await h.client.request(method, path, headers=session, json={"name": "evil"})
        assert await refusal(resp) == (401, "invalid_admin_key"), path

    async def login_cookie(headers: dict[str, str]) -> Any:
        resp = await h.client.post("/dashboard/login", data={"key": ADMIN_KEY},
                                   headers=headers, allow_redirects=False)
        return SimpleCookie(resp.headers["Set-Cookie"])["fairgate_session"]

    behind_tls = await login_cookie({"Host": "fairgate.example", "X-Forwarded-Proto": "https"})
    assert behind_tls["secure"] is True
    assert not [r for r in caplog.records if "plain HTTP" in r.getMessage()]
    plain = await login_cookie({"Host": "fairgate.example"})
    assert not plain["secure"] and plain["httponly"] is True
    assert [r.levelname for r in caplog.records if "plain HTTP" in r.getMessage()] == ["WARNING"]


# ---- engine keys ----------------------------------------------------------------------------
async def engine(aiohttp_client: Any, **keys: Any) -> Any:
    return await aiohttp_client(make_engine_app(AsyncEngine(sim_config()),
                                                access=EngineAccess(**keys)))


async def test_engine_routes_want_the_keys_the_page_says(aiohttp_client: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    compared: list[bytes] = []
    real = hmac.compare_digest

    def constant_time(a: Any, b: Any) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", constant_time)
    client = await engine(aiohttp_client, api_key=ENGINE_KEY, admin_key=ENGINE_ADMIN)

    async def call(method: str, path: str, key: str | None) -> Any:
        return await client.request(method, path, headers=bearer(key) if key else {},
                                    json=ENGINE_BODIES.get(path))

    for route in client.app.router.routes():
        method, path = route.method, route.resource.canonical
        if method == "HEAD":
            continue
        if path in ENGINE_OPEN:
            assert (await call(method, path, None)).status == 200, path
            continue
        admin = path.startswith("/admin/")
        assert admin or path.startswith(ENGINE_API), path
        right, wrong = (ENGINE_ADMIN, ENGINE_KEY) if admin else (ENGINE_KEY, ENGINE_ADMIN)
        assert await refusal(await call(method, path, None)) == (
            401, "invalid_admin_key" if admin else "missing_api_key"), path
        assert await refusal(await call(method, path, wrong)) == (  # each key its own routes
            401, "invalid_admin_key" if admin else "invalid_api_key"), path
        compared.clear()
        assert (await call(method, path, right)).status == 200, path
        assert right.encode() in compared  # compared in constant time


def engine_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    engine_cli.register(parser)
    return parser.parse_args(list(argv))


def test_which_engine_key_wins(tmp_path: Path) -> None:
    config = tmp_path / "fairgate.yaml"
    config.write_text("engine:\n  api_key: file-key-0123456789\n"
                      "  admin_key: file-admin-0123456789\n")
    file_only = engine_cli.build_access(engine_args("-c", str(config)), {})
    assert (file_only.api_key, file_only.effective_admin_key) == (
        "file-key-0123456789", "file-admin-0123456789")
    env = {ENGINE_KEY_ENV: "env-key-0123456789", ENGINE_ADMIN_KEY_ENV: "env-admin-0123456789"}
    environment = engine_cli.build_access(engine_args("-c", str(config)), env)
    assert (environment.api_key, environment.effective_admin_key) == (
        "env-key-0123456789", "env-admin-0123456789")
    flag = engine_cli.build_access(engine_args("-c", str(config), "--api-key", ENGINE_KEY), env)
    assert flag.api_key == ENGINE_KEY
    api_only = engine_cli.build_access(engine_args("--api-key", ENGINE_KEY), {})
    assert api_only.effective_admin_key == ENGINE_KEY  # else the api key
    # `fairgate serve`'s embedded engine has no port: the keys are no engine knob
    assert "api_key" not in FairgateConfig.load(config).engine.to_dict()


def test_a_public_engine_without_an_api_key_refuses_to_start_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    for name in (ENGINE_KEY_ENV, ENGINE_ADMIN_KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    for host in ("127.0.0.1", "127.8.9.10", "::1", "localhost"):
        assert is_loopback(host)
        assert engine_cli.build_access(engine_args("--host", host), {}) == EngineAccess()
    with root_handler() as handler:
        assert main(["engine", "--host", "0.0.0.0", "--set", "executor=sim"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--allow-unauthenticated" in err, err
    assert redacts(handler)  # every line it logs passes the filter
    assert engine_cli.build_access(engine_args("--host", "0.0.0.0", "--allow-unauthenticated"),
                                   {}).allow_unauthenticated
    config = tmp_path / "fairgate.yaml"
    config.write_text("engine:\n  allow_unauthenticated: true\n")
    assert engine_cli.build_access(engine_args("-c", str(config), "--host", "10.1.2.3"),
                                   {}).api_key is None


async def test_the_gateway_and_tune_send_the_engines_keys(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    server = await aiohttp_server(make_engine_app(AsyncEngine(sim_config()), access=EngineAccess(
        ENGINE_KEY, ENGINE_ADMIN)))
    url = str(server.make_url("")).rstrip("/")
    h = await start_gateway(aiohttp_client, db_url, gateway={"backends": [
        {"url": url, "api_key": ENGINE_KEY, "admin_key": ENGINE_ADMIN}]})
    resp = await h.post("acme", {"model": "random:tiny", "prompt": "hi", "max_tokens": 2})
    assert resp.status == 200, await resp.text()
    assert h.app[JOBS].engine_keys(url) == EngineKeys(ENGINE_KEY, ENGINE_ADMIN)
    parser = argparse.ArgumentParser()
    tune_cli.register(parser)
    args = parser.parse_args(["--api-key", ENGINE_KEY, "--engine-admin-key", ENGINE_ADMIN])
    assert (args.api_key, args.engine_admin_key) == (ENGINE_KEY, ENGINE_ADMIN)


# ---- metrics, logs and traces ---------------------------------------------------------------
async def test_metrics_are_on_a_loopback_listener_and_on_the_main_port_only_to_the_token(
        aiohttp_client: Any, db_url: str) -> None:
    assert (GatewayConfig().metrics_host, GatewayConfig().metrics_port) == ("127.0.0.1", 9464)
    closed = await gateway(aiohttp_client, db_url)
    resp = await closed.client.get("/metrics", headers=closed.auth("acme"))
    assert await refusal(resp) == (404, "not_found")
    h = await gateway(aiohttp_client, db_url.replace("gateway.db", "token.db"),
                      metrics_token=TOKEN)
    assert (await h.post("acme", COMPLETION)).status == 200
    for headers in ({}, h.auth("acme"), ADMIN):
        resp = await h.client.get("/metrics", headers=headers)
        assert await refusal(resp) == (401, "invalid_metrics_token")
    resp = await h.client.get("/metrics", headers=bearer(TOKEN))
    text = await resp.text()
    assert resp.status == 200 and 'tenant="acme"' in text
    assert PROMPT not in text and not KEY.search(text) and ADMIN_KEY not in text
    listener = await aiohttp_client(make_metrics_app(h.app))
    assert (await listener.get("/metrics")).status == 401  # the listener checks it too
    assert (await listener.get("/metrics", headers=bearer(TOKEN))).status == 200
    assert (await listener.get("/v1/models", headers=h.auth("acme"))).status == 404


def test_the_log_filter_redacts_credentials_in_messages_and_tracebacks(
        logged: pytest.LogCaptureFixture) -> None:
    key, log = generate_key(), logging.getLogger("fairgate.test")
    logged.handler.addFilter(RedactingFilter())  # as setup_logging does (gone after the test)
    log.info("headers %s", {"Authorization": "Bearer engine-key-0123456789"})
    log.warning("a client sent %s in its URL", f"/v1/models?key={key}")
    log.info("Authorization: Basic YWNtZTpzZWNyZXQ=")
    try:
        raise RuntimeError(f"upstream refused Bearer {ENGINE_ADMIN} and {key}")
    except RuntimeError:
        log.exception("the upstream failed")
    lines = [record.getMessage() + (record.exc_text or "") for record in logged.records]
    assert len(lines) == 4 and all(REDACTED in line for line in lines), lines
    for secret in (key, key[3:20], "engine-key-0123456789", ENGINE_ADMIN, "YWNtZTpzZWNyZXQ="):
        assert secret not in logged.text, secret
    assert "RuntimeError" in lines[3]  # the traceback is kept, redacted


async def served(app: web.Application, **options: Any) -> tuple[Runner, int]:
    """`app` served as `fairgate serve` serves it (protocol.serving.Runner), on a free port."""
    runner = Runner(app, **options)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]


async def exchange(port: int, request: bytes) -> bytes:
    """The server's answer to `request`; b"" when it closes the connection without one (a
    guard of 30 s)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    try:
        async with asyncio.timeout(30):
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
            assert length is not None, head
            return head + await reader.readexactly(int(length.group(1)))
    except asyncio.IncompleteReadError as closed:
        return closed.partial
    finally:
        writer.close()


def answer(raw: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def refused_lines(logged: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in logged.records if "rejected a malformed request" in r.getMessage()]


@pytest.fixture
async def raw_gateway(db_url: str) -> AsyncIterator[tuple[int, str]]:
    """The gateway as `fairgate serve` serves it, with short time limits and a 4 KiB body
    limit: its port and a tenant's key."""
    keys = await create_tenants(db_url, {"acme": {}})
    config = GatewayConfig(demo_tenant=False, header_timeout_s=0.2, client_timeout_s=0.2,
                           max_body_bytes=4096)
    backend: Any = ControlledBackend()  # a Backend by its methods
    backend.release()
    runner, port = await served(make_gateway_app(config, database=db_url, backends=[backend]),
                                **server_options(config))
    yield port, keys["acme"]
    await runner.cleanup()


async def test_requests_aiohttp_refuses_are_an_openai_400_without_the_key(
        raw_gateway: tuple[int, str], logged: pytest.LogCaptureFixture) -> None:
    port, key = raw_gateway
    head = "GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\r\n"
    fits = await exchange(port, head.format(generate_key() + "x" * 7900).encode())
    assert answer(fits)[0] == 401  # a header under 8 KiB reaches the gateway
    raw = await exchange(port, head.format(key + "x" * 8300).encode())
    status, error = answer(raw)
    assert (status, error["code"], error["type"]) == (400, "bad_request", "invalid_request_error")
    assert key.encode() not in raw and "too long" in error["message"]
    assert answer(await exchange(port, b"GARBAGE\r\n\r\n"))[0] == 400
    records = refused_lines(logged)
    assert [r.levelname for r in records] == ["INFO", "INFO"]
    assert not any(key[3:20] in r.getMessage() for r in records)


async def test_a_refused_request_is_one_log_line(
        raw_gateway: tuple[int, str], logged: pytest.LogCaptureFixture) -> None:
    port, key = raw_gateway
    await exchange(port, f"GET / HTTP/1.1\r\nAuthorization: Bearer {key}{'x' * 8300}\r\n\r\n"
                   .encode())
    await exchange(port, b"GARBAGE\r\n\r\n")
    assert [r.getMessage().count("\n") for r in refused_lines(logged)] == [0, 0]


async def test_bodies_and_headers_are_bounded_in_size_and_time(
        raw_gateway: tuple[int, str]) -> None:
    assert GatewayConfig().header_timeout_s == 20 and GatewayConfig().max_body_bytes == 1 << 20
    assert GatewayConfig().client_timeout_s == 30
    port, key = raw_gateway
    assert await exchange(port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n") == b""  # closed
    post = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
            "Content-Length: {}\r\n\r\n")
    big = json.dumps({**COMPLETION, "prompt": "x" * 5000}).encode()
    status, error = answer(await exchange(port, post.format(len(big)).encode() + big))
    assert (status, error["code"]) == (413, "request_too_large")
    status, error = answer(await exchange(port, post.format(100).encode() + b'{"model"'))
    assert (status, error["code"]) == (408, "client_timeout")


async def test_log_requests_logs_tenant_status_and_timings_never_keys_or_bodies(
        aiohttp_client: Any, db_url: str, logged: pytest.LogCaptureFixture) -> None:
    quiet = await gateway(aiohttp_client, db_url)
    assert (await quiet.post("acme", COMPLETION)).status == 200
    assert not [r for r in logged.records if "tenant=acme" in r.getMessage()]
    h = await gateway(aiohttp_client, db_url.replace("gateway.db", "logged.db"),
                      log_requests=True)
    assert (await h.post("acme", COMPLETION)).status == 200
    [line] = [r.getMessage() for r in logged.records if "tenant=acme" in r.getMessage()]
    assert "status=200" in line and re.search(r"e2e=[0-9.]+s", line)
    assert PROMPT not in logged.text and h.keys["acme"] not in logged.text


async def test_the_capture_writes_no_prompt_text_keyed_hashes_and_mode_0600(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    path = tmp_path / "capture" / "trace.jsonl"
    h = await gateway(aiohttp_client, db_url, capture={"path": str(path)})
    assert (await h.post("acme", COMPLETION)).status == 200
    await h.capture.flush()
    text = path.read_text()
    assert '"tenant":"acme"' in text and PROMPT not in text and h.keys["acme"] not in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    request = parse_request(COMPLETION, "completions")
    config = CaptureConfig(path=str(tmp_path / "other.jsonl"))
    one, other = (TraceCapture(CaptureConfig(path=config.path, secret=secret))
                  for secret in ("capture-secret-one", "capture-secret-two"))
    assert one.prefix_hashes(request, "acme") != other.prefix_hashes(request, "acme")
    line = {"tenant": "acme"}
    assert PROMPT not in one.encode(request, line)
    with_text = TraceCapture(CaptureConfig(path=config.path, prompt_text=True))
    assert PROMPT in with_text.encode(request, line)


def test_every_test_fails_if_a_credential_reaches_its_log(request: pytest.FixtureRequest) -> None:
    assert "no_credential_in_logs" in request.fixturenames

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("fairgate", logging.INFO, __file__, 1, message, None, None)

    assert leaked_credentials([record(f"key {generate_key()}")])
    assert leaked_credentials([record(f"admin {ADMIN_KEY}")])
    assert not leaked_credentials([record(f"key fg-{REDACTED}")])


# ---- the network ----------------------------------------------------------------------------
def policies() -> dict[str, dict[str, Any]]:
    text = (ROOT / "deploy" / "k8s" / "base" / "networkpolicy.yaml").read_text()
    return {doc["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]: doc["spec"]
            for doc in yaml.safe_load_all(text)}


def sources(rule: dict[str, Any]) -> set[str]:
    """Who a rule lets in: pod names ("prometheus" only from the monitoring namespace), or
    "anyone" for a rule without `from`."""
    if "from" not in rule:
        return {"anyone"}
    names = set()
    for peer in rule["from"]:
        name = peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
        namespace = peer.get("namespaceSelector", {}).get("matchLabels", {})
        assert name != "prometheus" or namespace == {"kubernetes.io/metadata.name": "monitoring"}
        names.add(name)
    return names


def test_the_network_policies_let_in_only_whom_the_page_says() -> None:
    spec = policies()
    assert set(spec) == {"fairgate-engine", "fairgate-gateway", "fairgate-postgres",
                         "fairgate-redis"}
    assert all(s["policyTypes"] == ["Ingress"] for s in spec.values())
    for rule in spec["fairgate-engine"]["ingress"]:
        assert sources(rule) <= {"fairgate-gateway", "prometheus"}
    for rule in spec["fairgate-gateway"]["ingress"]:
        ports = {port["port"] for port in rule["ports"]}
        if "metrics" in ports:
            assert sources(rule) <= {"fairgate-gateway", "prometheus"}
    for name in ("fairgate-postgres", "fairgate-redis"):
        assert [sources(rule) for rule in spec[name]["ingress"]] == [{"fairgate-gateway"}]


def test_fairgate_serves_plain_http_and_tls_goes_in_front(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as refused:
        main(["engine", "--ssl-keyfile", "key.pem"])
    assert refused.value.code == 2
    assert "--ssl-keyfile is a vLLM flag fairgate does not have" in capsys.readouterr().err
    assert main(["serve", "--ssl-certfile", "cert.pem"]) == 2
    with pytest.raises(ValueError, match="ssl_certfile"):
        GatewayConfig.from_dict({"ssl_certfile": "cert.pem"})

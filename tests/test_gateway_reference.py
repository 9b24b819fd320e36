"""docs/gateway.md against the gateway it documents, as an operator and a client meet it.

- `fairgate serve`: its options, the address it listens on, the startup line's admin-key
  source, the environment keys, the demo tenant made at first start (its key printed once,
  hashed with HMAC under FAIRGATE_KEY_SECRET).
- The routes the page names are served; /readyz's answers (unready, degraded, database away);
  the admin API's errors; GET /v1/usage counts every request before it, rejections included.
- Admission: the cost estimate (16 on completions, the p90 output length on chat, seeded from
  the ledger within 1 s), the 60 s rate windows and their Retry-After, the queues' bounds and
  their Retry-After, the queue timeout, a client that leaves while queued or streaming.
- Dispatch: the policies the page names are the ones the config takes; interactive before
  batch; weighted VTC with the lift; max_concurrent; dispatch_headroom; what the engine is
  sent (tenant, weight, priority; cache_salt to `openai` backends); the token estimate.
- Routing: model_not_found, model_unavailable, failover once within the retry budget and the
  status of a failure not retried, a mid-stream failure, outlier ejection's rules and where it
  shows, prefix affinity and its bound, least-loaded, DNS discovery and draining.
- Every number the page states about these is the code's (NUMBERS).

Behaviour the page promises that the code does not keep is a strict xfail naming the defect.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from control import canary, shadow
from engine.config import EngineConfig
from engine.request import SamplingParams
from engine.tokenizer import ByteTokenizer
from fairgate import cli, serve_cli
from fairgate.config import FairgateConfig
from gateway import admin, auth, service
from gateway.admission import PERIOD_S, OutputEstimator, RateLimited, RateLimiter
from gateway.app import make_app as make_serving_app
from gateway.backends import (
    HOMES_PER_PREFIX,
    PREFIX_HOMES,
    PREFIX_LOAD_SLACK,
    BackendErrored,
    BackendFailed,
    BackendPool,
    DnsGroup,
    Job,
    Outcome,
    RemoteBackend,
    engine_body,
)
from gateway.config import (
    BACKEND_KINDS,
    ROUTING_POLICIES,
    BackendConfig,
    GatewayConfig,
    OutlierDetectionConfig,
    RetryBudgetConfig,
)
from gateway.dispatch import HOLD_S, REFUSED_REASONS, RetryBudget
from gateway.fairqueue import (
    DISPATCH_POLICIES,
    FairQueue,
    QueueBounds,
    QueuedRequest,
    QueueFull,
    RemoteTenant,
)
from gateway.outlier import OutlierDetector, Verdict
from gateway.replicas.redis_fair_share import MIN_GAP_S, REPLICA_TTL_S, SYNC_INTERVAL_S
from gateway.replicas.redis_limits import PROBE_INTERVAL_S, REDIS_TIMEOUT_S
from gateway.state import METRICS, SETTINGS, STORE
from gateway.upstream import UpstreamPool
from protocol.errors import retry_after_header
from protocol.fairness import VTC_COST
from protocol.openai import parse_request, prompt_token_ids
from tenants import TenantLimits, TenantStore
from tenants.keys import hash_key
from tenants.ledger import UsageLedger, block_sizes
from tests.gateway.helpers import ControlledBackend, Harness, collect, completion, start_gateway
from tests.support.waiting import wait_for
from tests.test_docs import DOCS, ROOT
from tuner.fake_server import SCRIPT, make_fake_app

PAGE = DOCS / "gateway.md"
ADMIN = {"Authorization": "Bearer admin-key-0123456789"}  # tests.gateway.helpers' admin key
MODEL = ControlledBackend.model_name
WORDS = {"half": 50, "four": 4}  # "never more than half", "four replicas each"


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"


def page() -> str:
    """The page as one line: a phrase the tests look for may be wrapped anywhere."""
    return " ".join(PAGE.read_text().split())


def stated(pattern: str) -> tuple[float, ...]:
    """The numbers `pattern`'s groups find on the page ('65,536', 'four' read as numbers)."""
    found = re.search(pattern, page())
    assert found, f"docs/gateway.md no longer says /{pattern}/"
    return tuple(float(WORDS.get(g, g.replace(",", ""))) for g in found.groups())


def body(**extra: Any) -> dict[str, Any]:
    return completion(model=MODEL, **extra)


async def error_of(resp: Any, status: int, code: str | None) -> dict[str, Any]:
    """OpenAI's error of `resp`, whose status and code (None: any) are these."""
    assert resp.status == status, await resp.text()
    err: dict[str, Any] = (await resp.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert code is None or err["code"] == code, err
    return err


async def gateway(aiohttp_client: Any, db_url: str, backends: list[Any] | None = None,
                  tenants: dict[str, dict[str, Any]] | None = None, **settings: Any) -> Harness:
    return await start_gateway(aiohttp_client, db_url, backends=backends or [ControlledBackend()],
                               tenants=tenants or {"acme": {}, "other": {}}, gateway=settings)


@dataclass
class Recording(ControlledBackend):
    """A controlled backend that keeps the jobs it was handed."""

    jobs: list[Job] = field(default_factory=list)

    async def stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]:
        self.jobs.append(job)
        async for chunk in super().stream(job, outcome):
            yield chunk


@dataclass
class Failing(ControlledBackend):
    """A backend that fails every request with `error`, after `chunks` tokens of its stream."""

    error: type[BackendFailed] = BackendFailed
    chunks: int = 0

    async def stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]:
        self.started.append(job.tenant)
        for _ in range(self.chunks):
            outcome.completion_tokens += 1
            outcome.chunk_times.append(time.perf_counter())
            yield job.writer().chunk("x", None)
        raise self.error(f"engine backend error (HTTP 500): {self.name} broke", 5.0)

    async def complete(self, job: Job, outcome: Outcome) -> bytes:
        return b"".join([chunk async for chunk in self.stream(job, outcome)])


@dataclass
class Loaded(ControlledBackend):
    work: int = 0  # outstanding tokens
    sent: int = 0  # the Backend protocol's; ControlledBackend keeps none

    def outstanding_tokens(self) -> int:
        return self.work


def doubles(*backends: ControlledBackend) -> list[Any]:
    """The backends of a gateway or pool: these, else one ControlledBackend (a test double,
    not a `Backend` to mypy: it keeps no `sent` count)."""
    return list(backends) or [ControlledBackend()]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- the numbers the page states ------------------------------------------------------------
NUMBERS: list[tuple[str, Callable[[], tuple[float, ...]]]] = [
    (r"Listens on 127\.0\.0\.1:(\d+)", lambda: (GatewayConfig().port,)),
    (r"VTC costs \((\d+) per prompt token, (\d+) per output token\)",
     lambda: (VTC_COST.input_weight, VTC_COST.output_weight)),
    (r"does not answer within ([\d.]+) s, each replica", lambda: (REDIS_TIMEOUT_S,)),
    (r"asks Redis again every ([\d.]+) s", lambda: (PROBE_INTERVAL_S,)),
    (r"one Lua script a few milliseconds after .*?\(every (\d+) ms anyway\)",
     lambda: (SYNC_INTERVAL_S * 1000,)),
    (r"A replica not heard from for (\d+) s is dropped", lambda: (REPLICA_TTL_S,)),
    (r"the room stays free for it for at most (\d+) ms", lambda: (HOLD_S * 1000,)),
    (r"p(\d+) of the tenant's last ([\d,]+) output lengths",
     lambda: (OutputEstimator().percentile, OutputEstimator().samples)),
    (r"a database slower than (\d+) s there", lambda: (service.SEED_TIMEOUT_S,)),
    (r"sliding (\d+) s\)", lambda: (PERIOD_S,)),
    (r"multi-row INSERTs of up to (\d+) rows", lambda: (max(block_sizes(100_000)),)),
    (r"A connection idle over (\d+) s is not reused",
     lambda: (UpstreamPool("http://127.0.0.1:9").idle_timeout,)),
    (r"Envoy's: (\d+)% of the requests in flight and queued, at least (\d+)",
     lambda: (RetryBudgetConfig().budget_percent, RetryBudgetConfig().min_retry_concurrency)),
    (r"after (\d+) failures in a row, or half of at least (\d+) requests over (\d+) s",
     lambda: (OutlierDetectionConfig().consecutive_5xx,
              OutlierDetectionConfig().failure_percentage_request_volume,
              OutlierDetectionConfig().interval_s)),
    (r"for (\d+) s times the number of times it has been ejected \(at most (\d+) s\)",
     lambda: (OutlierDetectionConfig().base_ejection_time_s,
              OutlierDetectionConfig().max_ejection_time_s)),
    (r"Never more than (half) of a model's replicas",
     lambda: (OutlierDetectionConfig().max_ejection_percent,)),
    (r"its first (\d+) characters, (\d+), \.\.\. up to `prefix_chars` \((\d+)\)",
     lambda: (service.PREFIX_CHUNK_CHARS, 2 * service.PREFIX_CHUNK_CHARS,
              GatewayConfig().prefix_chars)),
    (r"\(([\d,]+) keys, (\w+) replicas each", lambda: (PREFIX_HOMES, HOMES_PER_PREFIX)),
    (r"`prefix_load_factor` \(([\d.]+)\) times the average, plus (\d+)",
     lambda: (GatewayConfig().prefix_load_factor, PREFIX_LOAD_SLACK)),
    (r"discover_interval_s: (\d+)", lambda: (BackendConfig("http://e:1").discover_interval_s,)),
    (r"\(`control/canary.py`\) \| the last ([\d,]+)", lambda: (canary.MAX_SERVED,)),
    (r"\(`control/shadow.py`\) \| the last ([\d,]+)", lambda: (shadow.MAX_PAIRS,)),
    (r"does not answer within (\d+) s 503 `database_unavailable`",
     lambda: (admin.DATABASE_TIMEOUT_S,)),
    (r"within their (\d+) s key cache", lambda: (TenantStore("sqlite:///:memory:").cache_ttl,)),
    (r"It answers within about (\d+) s whatever the database does", lambda: (auth.PING_TIMEOUT_S,)),
]


@pytest.mark.parametrize(("pattern", "code"), NUMBERS, ids=[p for p, _ in NUMBERS])
def test_each_number_the_page_states_is_the_codes(
        pattern: str, code: Callable[[], tuple[float, ...]]) -> None:
    assert stated(pattern) == tuple(float(v) for v in code())


def test_the_words_that_stand_for_numbers_are_the_codes() -> None:
    text = page()
    assert "a few milliseconds after" in text and MIN_GAP_S <= 0.01
    assert "each tenant's charges (`gateway/admission.py`) | the last minute" in text
    assert PERIOD_S == 60
    assert "writes its rows once a second" in text
    assert UsageLedger(TenantStore("sqlite:///:memory:")).flush_interval == 1.0


# ---- fairgate serve ---------------------------------------------------------------------------
def run_serve(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gateway_section: dict[str, Any],
              argv: list[str], environ: dict[str, str]) -> dict[str, Any]:
    """`fairgate serve -c fairgate.yaml ARGV` up to the point it would serve: what it would
    serve (app, host, port)."""
    served: dict[str, Any] = {}

    def serve(app: Any, host: str, port: int, *, extra: Any = (),
              on_listening: Callable[[list[tuple[str, int]]], None] | None = None,
              **options: Any) -> None:
        served.update(app=app, host=host, port=port)
        assert on_listening is not None
        on_listening([(host, port), *((h, p) for _, h, p in extra)])

    monkeypatch.setattr(serve_cli, "serve", serve)
    monkeypatch.setattr(serve_cli, "setup_logging", lambda level: None)
    monkeypatch.setattr(serve_cli, "install_fast_event_loop", lambda: None)
    for name in ("FAIRGATE_ADMIN_KEY", "FAIRGATE_ENGINE_KEY", "FAIRGATE_ENGINE_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    config = tmp_path / "fairgate.yaml"
    config.write_text(json.dumps({
        "database": f"sqlite+aiosqlite:///{tmp_path / 'fg.db'}",
        "gateway": {"metrics_port": None, "backends": [{"url": "http://127.0.0.1:9"}],
                    **gateway_section}}))
    assert cli.main(["serve", "-c", str(config), *argv]) == 0
    return served


def test_serve_takes_the_options_the_page_shows() -> None:
    usage = re.search(r"fairgate serve ((?:\[[^\]]+\] ?)+)", page())
    assert usage
    options = set(re.findall(r"\[(-[-\w]+)", usage.group(1)))
    assert options == {"-c", "--host", "--port"}, options
    args = cli.build_parser(["serve"]).parse_args(
        ["serve", "-c", "f.yaml", "--host", "0.0.0.0", "--port", "9000"])
    assert (args.config, args.host, args.port) == ("f.yaml", "0.0.0.0", 9000)


def test_serve_listens_where_the_page_says_and_names_the_admin_key_it_uses(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    served = run_serve(monkeypatch, tmp_path, {}, [], {})
    assert (served["host"], served["port"]) == ("127.0.0.1", 8080)
    assert "on http://127.0.0.1:8080 -> " in capsys.readouterr().out
    served = run_serve(monkeypatch, tmp_path, {"host": "0.0.0.0", "port": 8000},
                       ["--host", "127.0.0.2", "--port", "8001"], {})
    assert (served["host"], served["port"]) == ("127.0.0.2", 8001)

    file_key, env_key = "f" * 20, "e" * 20
    assert "admin key: off" in capsys.readouterr().out
    served = run_serve(monkeypatch, tmp_path, {"admin_key": file_key}, [], {})
    assert "admin key: gateway.admin_key" in capsys.readouterr().out
    served = run_serve(monkeypatch, tmp_path, {"admin_key": file_key}, [],
                       {"FAIRGATE_ADMIN_KEY": env_key})
    assert "admin key: $FAIRGATE_ADMIN_KEY" in capsys.readouterr().out
    assert served["app"][SETTINGS].admin_key == env_key  # over gateway.admin_key
    served = run_serve(monkeypatch, tmp_path, {"admin_key": file_key}, [],
                       {"FAIRGATE_ADMIN_KEY": ""})  # set but empty: the file's
    assert served["app"][SETTINGS].admin_key == file_key
    assert serve_cli.freeze_startup_heap in served["app"].on_startup  # gc.freeze()


def test_engine_keys_from_the_environment_go_to_fairgate_backends_without_their_own(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key, admin_key, own = "k" * 32, "a" * 32, "o" * 32
    served = run_serve(monkeypatch, tmp_path, {
        "backends": [{"url": "http://127.0.0.1:9"},
                     {"url": "http://127.0.0.1:10", "kind": "openai"},
                     {"url": "http://127.0.0.1:11", "api_key": own}],
        "shadow": [{"name": "s", "url": "http://127.0.0.1:12"}]}, [],
        {"FAIRGATE_ENGINE_KEY": key, "FAIRGATE_ENGINE_ADMIN_KEY": admin_key})
    settings = served["app"][SETTINGS]
    assert [(b.api_key, b.admin_key) for b in settings.backends] == [
        (key, admin_key), (None, None), (own, None)]
    assert (settings.shadow[0].api_key, settings.shadow[0].admin_key) == (key, admin_key)


def test_the_embedded_engine_and_database_defaults() -> None:
    found = re.search(r"the `engine` section \(default `([^`]+)`", page())
    assert found
    config = FairgateConfig.from_dict({})
    assert config.gateway.backends == () and config.engine.model == found.group(1)
    assert "`engine.device: auto`" in page() and config.engine.device == "auto"
    runner = (ROOT / "engine" / "runner.py").read_text()  # read, not imported: torch is slow
    assert re.search(r'"auto":\s+return torch\.device\("cuda" if torch\.cuda\.is_available\(\) '
                     r'else "cpu"\)', runner)
    assert config.database.startswith("sqlite") and config.database.endswith("/fairgate.db")


async def test_first_start_creates_demo_and_prints_its_key_once_stored_as_an_hmac(
        aiohttp_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    secret = "s" * 32
    monkeypatch.setenv("FAIRGATE_KEY_SECRET", secret)
    database = f"sqlite+aiosqlite:///{tmp_path / 'first.db'}"

    async def start() -> Any:
        app = make_serving_app(GatewayConfig(), database=database, backends=doubles(),
                               on_demo_key=serve_cli.print_demo_key)
        return await aiohttp_client(app)

    client = await start()
    printed = capsys.readouterr().out
    assert "created tenant 'demo'" in printed
    key = printed.strip().splitlines()[-1].strip()
    resp = await client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert resp.status == 200
    stored = b"".join(p.read_bytes() for p in tmp_path.glob("first.db*"))
    assert key.encode() not in stored and hash_key(key, secret).encode() in stored
    await start()  # a tenant exists: no new one, nothing printed
    assert capsys.readouterr().out == ""


# ---- endpoints ------------------------------------------------------------------------------
ROUTE = re.compile(r"`((?:GET|POST|DELETE|PATCH|PUT)(?:\|(?:GET|POST|DELETE|PATCH|PUT))*) "
                   r"(/[^`\s\[]*)")


async def test_every_route_the_page_names_is_served(aiohttp_client: Any, db_url: str) -> None:
    named = {(method, path) for methods, path in ROUTE.findall(page())
             for method in methods.split("|")}
    assert len(named) >= 15, named
    h = await gateway(aiohttp_client, db_url)
    served = {(r.method, r.resource.canonical) for r in h.app.router.routes()
              if r.resource is not None}
    assert ("GET", "/metrics") in named
    missing = sorted(named - served)
    assert not missing, f"docs/gateway.md names routes the gateway does not serve: {missing}"
    await error_of(await h.client.get("/metrics"), 404, "not_found")  # not on this port
    for path in ("/health", "/healthz", "/openapi.json"):  # no key
        assert (await h.client.get(path)).status == 200, path


async def test_readyz_unready_without_a_backend_and_degraded_with_an_ejected_replica(
        aiohttp_client: Any, db_url: str) -> None:
    a, b = ControlledBackend(name="a"), ControlledBackend(name="b")
    h = await gateway(aiohttp_client, db_url, [a, b])
    for backend in (a, b):
        backend.healthy = False
    resp = await h.client.get("/readyz")
    answer = await resp.json()
    assert resp.status == 503 and answer["ready"] is False
    assert answer["checks"]["backends"]["ok"] is False and answer["checks"]["backends"]["detail"]
    a.healthy = b.healthy = True
    for _ in range(OutlierDetectionConfig().consecutive_5xx):
        h.gateway.pool.record(a, Verdict.FAILED)
    resp = await h.client.get("/readyz")
    answer = await resp.json()
    assert resp.status == 200 and answer["ready"] is True
    detail = re.search(r'"detail": "(degraded: model m: [^"]+)"', page())
    assert detail
    assert answer["checks"]["backends"]["detail"] == detail.group(1).replace(" m:", f" {MODEL}:")
    assert answer["checks"]["backends"]["models"][MODEL] == {
        "replicas": 2, "available": 1, "ejected": 1}


async def test_readyz_with_the_database_away_is_ready_degraded_within_the_ping_timeout(
        aiohttp_client: Any, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    h = await gateway(aiohttp_client, db_url)
    answered = asyncio.Event()

    async def silent() -> None:
        await answered.wait()

    monkeypatch.setattr(h.app[STORE], "ping", silent)
    monkeypatch.setattr(auth, "PING_TIMEOUT_S", 0.1)  # the 1 s is NUMBERS'
    start = time.monotonic()
    resp = await h.client.get("/readyz")
    elapsed = time.monotonic() - start
    answered.set()
    database = (await resp.json())["checks"]["database"]
    assert resp.status == 200 and database["ok"] is False
    assert database["detail"].startswith("degraded: database: ")
    assert 0.1 <= elapsed < 1.0  # it waited for the ping's timeout, not for the database


async def test_admin_errors_are_the_pages(aiohttp_client: Any, db_url: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    h = await gateway(aiohttp_client, db_url)
    resp = await h.client.post("/admin/tenants", headers=ADMIN,
                               json={"name": "newco", "limits": {"max_tokens": -1}})
    assert (await error_of(resp, 400, None))["param"] == "limits.max_tokens"
    resp = await h.client.post("/admin/tenants", headers=ADMIN, json={"name": "acme"})
    await error_of(resp, 409, None)

    async def down() -> None:
        raise ConnectionRefusedError("database down")

    monkeypatch.setattr(h.app[STORE], "list_tenants", down)
    resp = await h.client.get("/admin/tenants", headers=ADMIN)
    await error_of(resp, 503, "database_unavailable")
    assert "Retry-After" in resp.headers


async def test_a_revoked_key_is_refused_at_once_on_this_replica(aiohttp_client: Any,
                                                                 db_url: str) -> None:
    backend = ControlledBackend()
    backend.release()
    h = await gateway(aiohttp_client, db_url, [backend])
    made = await (await h.client.post("/admin/tenants/acme/keys", headers=ADMIN)).json()
    bearer = {"Authorization": f"Bearer {made['key']}"}
    assert (await h.client.post("/v1/completions", json=body(), headers=bearer)).status == 200
    assert (await h.client.delete(f"/admin/keys/{made['id']}", headers=ADMIN)).status == 200
    resp = await h.client.post("/v1/completions", json=body(), headers=bearer)
    await error_of(resp, 401, None)


async def test_usage_counts_every_request_made_before_it_rejections_included(
        aiohttp_client: Any, db_url: str) -> None:
    backend = ControlledBackend()
    backend.release()
    h = await gateway(aiohttp_client, db_url, [backend])
    assert (await h.post("acme", body())).status == 200
    assert (await h.post("acme", completion(model="no-such-model"))).status == 404
    usage = await (await h.client.get("/v1/usage", headers=h.auth("acme"))).json()
    assert usage["requests"] == 2 and usage["by_status"] == {"200": 1, "404": 1}


# ---- the cost estimate ----------------------------------------------------------------------
async def charged(h: Harness, backend: ControlledBackend, request: dict[str, Any],
                  path: str = "/v1/completions") -> int:
    """The tokens `request` is charged at admission (its estimate); it then runs to its end."""
    backend.gate.clear()
    before = h.gateway.limiter.usage("acme")[1]
    task = asyncio.create_task(h.post("acme", request, path))
    await wait_for(lambda: h.gateway.limiter.usage("acme")[1] != before or task.done())
    estimate = h.gateway.limiter.usage("acme")[1] - before
    backend.release()
    assert (await task).status == 200
    return estimate


def prompt_tokens(backend: ControlledBackend, request: dict[str, Any], endpoint: str) -> int:
    return backend.count_prompt(parse_request(request, endpoint))


async def test_a_completion_without_max_tokens_is_estimated_at_16(
        aiohttp_client: Any, db_url: str) -> None:
    (default,) = stated(r"`max_tokens` \((\d+) when a completion omits it\)")
    backend = Recording()
    h = await gateway(aiohttp_client, db_url, [backend])
    request = body(prompt="hello there")
    del request["max_tokens"]
    assert await charged(h, backend, request) == prompt_tokens(
        backend, request, "completions") + default
    assert backend.jobs[-1].max_tokens == default
    resp = await h.post("acme", body(prompt="x" * 500, max_tokens=20))  # 501 + 20 > 512
    await error_of(resp, 400, "context_length_exceeded")


async def test_a_chat_without_max_tokens_is_estimated_at_the_p90_of_recent_outputs(
        aiohttp_client: Any, db_url: str) -> None:
    backend = Recording()
    h = await gateway(aiohttp_client, db_url, [backend],
                      tenants={"acme": {"limits": {"max_tokens": 300}}})
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    prompt = prompt_tokens(backend, chat, "chat")
    # no history (the ledger has none): default_output_tokens; it may run to the tenant's limit
    assert await charged(h, backend, chat, "/v1/chat/completions") == (
        prompt + GatewayConfig().default_output_tokens)
    assert backend.jobs[-1].max_tokens == 300
    # exact after every answer: each answered 3 tokens
    assert await charged(h, backend, chat, "/v1/chat/completions") == prompt + 3
    estimator = OutputEstimator()
    for length in range(1, 1001):
        estimator.observe("t", length)
    assert estimator.estimate("t") == 900
    estimator.observe("t", 5000)  # the oldest (1) leaves: the last 1,000 only
    assert estimator.estimate("t") == 901


async def test_the_estimate_is_seeded_from_the_ledger_over_its_window_or_left_at_the_default(
        aiohttp_client: Any, db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = ControlledBackend()
    h = await gateway(aiohttp_client, db_url, [backend], output_estimate_window_s=1234,
                      default_output_tokens=77)
    asked: list[tuple[Any, ...]] = []
    answered = asyncio.Event()

    async def history(*args: Any) -> float:
        asked.append(args)
        if args[0] == "other":
            await answered.wait()  # slower than the seed's timeout
        return 42.0

    assert h.gateway.ledger is not None
    monkeypatch.setattr(h.gateway.ledger, "output_tokens_percentile", history)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    prompt = prompt_tokens(backend, chat, "chat")
    assert await charged(h, backend, chat, "/v1/chat/completions") == prompt + 42
    assert asked == [("acme", 1234, 90)]
    monkeypatch.setattr(service, "SEED_TIMEOUT_S", 0.05)  # the 1 s is NUMBERS'
    backend.gate.clear()
    task = asyncio.create_task(h.post("other", chat, "/v1/chat/completions"))
    await wait_for(lambda: backend.inflight == 1)
    assert h.gateway.limiter.usage("other")[1] == prompt + 77
    backend.release()
    answered.set()
    assert (await task).status == 200


# ---- rate limits ------------------------------------------------------------------------------
def test_retry_after_is_when_enough_old_charges_leave_the_window() -> None:
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    rpm = TenantLimits(requests_per_min=2)
    for at in (0.0, 20.0):
        clock.now = 1000.0 + at
        limiter.admit("t", rpm, 1)
    clock.now = 1030.0
    with pytest.raises(RateLimited) as refused:
        limiter.admit("t", rpm, 1)
    assert refused.value.reason == "requests_per_min" and refused.value.retry_after == 30.0
    tpm = TenantLimits(tokens_per_min=100)
    for at, tokens in ((0.0, 60), (10.0, 30)):
        clock.now = 2000.0 + at
        limiter.admit("u", tpm, tokens)
    clock.now = 2020.0
    with pytest.raises(RateLimited) as refused:
        limiter.admit("u", tpm, 50)  # 40 over: the first charge must leave, at 2060
    assert refused.value.retry_after == 40.0


async def test_rate_limits_charge_the_estimate_settle_to_actuals_and_answer_429(
        aiohttp_client: Any, db_url: str) -> None:
    backend = ControlledBackend()
    backend.release()
    h = await gateway(aiohttp_client, db_url, [backend],
                      tenants={"acme": {"limits": {"requests_per_min": 1}}, "other": {}})
    assert (await h.post("acme", body(prompt="x" * 9, max_tokens=40))).status == 200
    assert h.gateway.limiter.usage("acme") == (1, 10 + 3)  # settled: 10 in, 3 out
    resp = await h.post("acme", body())
    await error_of(resp, 429, "requests_per_min")
    assert PERIOD_S - 5 <= int(resp.headers["Retry-After"]) <= PERIOD_S


# ---- queues -----------------------------------------------------------------------------------
def test_a_full_queues_retry_after_is_when_a_slot_frees() -> None:
    clock = Clock()
    queue = FairQueue(clock=clock)
    bounds = QueueBounds(max_requests=1, max_concurrent=1)

    def submit() -> QueuedRequest:
        item = QueuedRequest("t", 10, 9)
        queue.push(item, bounds)
        return item

    first = submit()
    assert queue.pop() is first
    clock.now += 10
    queue.finish(first, 10, 9)  # 10 s for 9 + 1 tokens: 1 s a token
    running = submit()
    assert queue.pop() is running
    submit()  # queued behind it
    clock.now += 2
    with pytest.raises(QueueFull) as full:
        submit()
    assert full.value.reason == "queue_requests"
    # the running one ends 8 s from now and the queued one takes its seat
    assert 8 <= full.value.retry_after <= 8.1
    clock.now += 8
    queue.finish(running, 10, 9)
    assert queue.pop() is not None
    clock.now += retry_after_header(full.value.retry_after) - 8
    submit()  # a client that waited exactly Retry-After gets in at its first retry


def test_before_any_request_finished_the_drain_rate_stands_in() -> None:
    clock = Clock()
    queue = FairQueue(clock=clock)
    bounds = QueueBounds(max_requests=1, max_concurrent=2)
    for _ in range(2):
        queue.push(QueuedRequest("t", 10, 9), bounds)
        assert queue.pop() is not None
        clock.now += 1
    queue.push(QueuedRequest("t", 10, 9), bounds)
    with pytest.raises(QueueFull) as full:
        queue.push(QueuedRequest("t", 10, 9), bounds)
    assert full.value.retry_after == 1.0  # 2 dispatched over 2 s: one a second


def test_queue_bounds_count_the_tenants_queue_on_every_replica() -> None:
    queue = FairQueue()
    queue.remote = {"t": RemoteTenant(queued_requests=2)}
    with pytest.raises(QueueFull):
        queue.push(QueuedRequest("t", 1, 1), QueueBounds(max_requests=2))
    queue.push(QueuedRequest("u", 1, 1), QueueBounds(max_requests=2))


async def test_full_queues_answer_429_with_retry_after_and_the_timeout_503(
        aiohttp_client: Any, db_url: str) -> None:
    backend = ControlledBackend()
    h = await gateway(aiohttp_client, db_url, [backend], tenants={
        "acme": {"limits": {"max_queued_requests": 2, "max_queued_tokens": 100}},
        "other": {"limits": {"queue_timeout_s": 0.1}}})
    tasks = [asyncio.create_task(h.post("acme", body()))]
    await wait_for(lambda: backend.inflight == 1)
    tasks.append(asyncio.create_task(h.post("acme", body())))  # 6 + 4 tokens queued
    await queued(h, 1)
    resp = await h.post("acme", body(prompt="x" * 90, max_tokens=4))  # 10 + 91 + 4 > 100
    await error_of(resp, 429, "queue_tokens")
    assert int(resp.headers["Retry-After"]) >= 1
    tasks.append(asyncio.create_task(h.post("acme", body())))
    await queued(h, 2)
    resp = await h.post("acme", body())
    await error_of(resp, 429, "queue_requests")
    assert int(resp.headers["Retry-After"]) >= 1
    timed_out = await h.post("other", body())  # waits past its queue_timeout_s
    await error_of(timed_out, 503, "queue_timeout")
    assert "Retry-After" in timed_out.headers
    backend.release()
    assert [r.status for r in await asyncio.gather(*tasks)] == [200] * 3


async def test_a_request_that_can_never_be_queued_gets_no_retry_after(
        aiohttp_client: Any, db_url: str) -> None:
    h = await gateway(aiohttp_client, db_url,
                      tenants={"acme": {"limits": {"max_queued_tokens": 50}}})
    resp = await h.post("acme", body(prompt="x" * 60, max_tokens=4))
    assert resp.status == 429, await resp.text()
    assert "Retry-After" not in resp.headers
    error = (await resp.json())["error"]
    assert error["code"] == "request_too_large" and "max_queued_tokens (50)" in error["message"]


async def test_a_client_that_leaves_is_removed_uncharged_or_its_stream_aborted(
        aiohttp_client: Any, db_url: str) -> None:
    backend = ControlledBackend()
    h = await gateway(aiohttp_client, db_url, [backend])
    blocker = asyncio.create_task(h.post("acme", body()))
    await wait_for(lambda: backend.inflight == 1)
    charged_before = h.gateway.limiter.usage("acme")
    waiting = asyncio.create_task(h.post("acme", body(max_tokens=100)))
    await wait_for(lambda: h.gateway.queue.depth("acme")[0] == 1)
    assert h.gateway.limiter.usage("acme") != charged_before  # charged while it waits
    waiting.cancel()
    await wait_for(lambda: h.gateway.queue.depth("acme")[0] == 0)
    assert h.gateway.limiter.usage("acme") == charged_before
    backend.release()
    assert (await blocker).status == 200
    backend.tokens_per_request = 10_000
    resp = await h.post("acme", body(stream=True))
    await resp.content.readline()
    resp.close()
    await wait_for(lambda: backend.closed == ["acme", "acme"] and backend.inflight == 0)
    assert backend.started == ["acme", "acme"]  # the one that left the queue never ran


# ---- dispatch ---------------------------------------------------------------------------------
def test_the_dispatch_and_routing_policies_are_the_ones_the_config_takes() -> None:
    text = page()
    dispatch = re.findall(r"`gateway\.dispatch: (\w+)`", text)
    routing = re.findall(r"`gateway\.routing: (\w+)`", text)
    default_dispatch = re.search(r"`gateway\.dispatch: (\w+)`, the default", text)
    assert set(dispatch) == set(DISPATCH_POLICIES)
    assert default_dispatch and default_dispatch.group(1) == GatewayConfig().dispatch
    default_routing = re.search(r"The default, `(\w+)`", text)
    assert default_routing and default_routing.group(1) == GatewayConfig().routing
    assert set(routing) | {default_routing.group(1)} == set(ROUTING_POLICIES)
    for key, names in (("dispatch", DISPATCH_POLICIES), ("routing", ROUTING_POLICIES)):
        for name in names:
            GatewayConfig.from_dict({key: name})
        with pytest.raises(ValueError, match=f"gateway.{key}"):
            GatewayConfig.from_dict({key: "round_robin"})


def test_the_backend_kinds_are_the_ones_the_config_takes() -> None:
    kinds = set(re.findall(r"`kind: (\w+)`", page()))
    assert kinds == set(BACKEND_KINDS)
    with pytest.raises(ValueError, match=r"gateway.backends\[\].kind"):
        BackendConfig("http://e:1", kind="vllm")


async def queued(h: Harness, size: int) -> None:
    await wait_for(lambda: h.gateway.queue.size == size)


# other's batch requests would go first by their counters (other's blocker settled below its
# estimate, acme was lifted to other's estimate): only the class puts acme's first under fair
@pytest.mark.parametrize(("policy", "order"), [
    ("fair", ["other", "acme", "other", "other"]),
    ("fcfs", ["other", "other", "other", "acme"])])  # arrival order
async def test_interactive_goes_before_batch_under_fair_arrival_order_under_fcfs(
        aiohttp_client: Any, db_url: str, policy: str, order: list[str]) -> None:
    backend = ControlledBackend()
    h = await gateway(aiohttp_client, db_url, [backend], dispatch=policy)
    tasks = [asyncio.create_task(h.post("other", body()))]
    await wait_for(lambda: backend.inflight == 1)
    for size, (tenant, priority) in enumerate(
            (("other", "batch"), ("other", "batch"), ("acme", "interactive")), start=1):
        tasks.append(asyncio.create_task(h.post(tenant, body(priority=priority))))
        await queued(h, size)
    backend.release()
    assert [r.status for r in await asyncio.gather(*tasks)] == [200] * 4
    assert backend.started == order


def test_fair_shares_go_by_weight_and_a_tenant_that_becomes_active_starts_at_the_minimum() -> None:
    queue = FairQueue()
    for _ in range(30):
        queue.push(QueuedRequest("light", 10, 5, weight=1.0))
        queue.push(QueuedRequest("heavy", 10, 5, weight=2.0))
    served = [item.tenant for item in (queue.pop() for _ in range(30)) if item is not None]
    assert abs(served.count("heavy") - 2 * served.count("light")) <= 2
    light = queue.tenants["light"]
    assert light.counter == served.count("light") * VTC_COST.cost(10, 5)  # / weight 1
    queue.push(QueuedRequest("late", 10, 5))
    assert queue.tenants["late"].counter == min(t.counter for n, t in queue.tenants.items()
                                                if n != "late")
    item = queue.pop()
    assert item is not None
    tq = queue.tenants[item.tenant]
    before = tq.counter
    queue.finish(item, 10, 1)  # settled to the actual tokens: 4 output tokens fewer
    assert tq.counter == before - 4 * VTC_COST.output_weight / tq.weight
    before = light.counter
    queue.add_remote_service({"light": 7.0})  # service elsewhere advances it here too
    assert light.counter == before + 7.0


async def test_max_concurrent_caps_a_tenants_requests_in_flight(
        aiohttp_client: Any, db_url: str) -> None:
    backend = ControlledBackend(capacity_=4)
    h = await gateway(aiohttp_client, db_url, [backend],
                      tenants={"acme": {"limits": {"max_concurrent": 1}}})
    tasks = [asyncio.create_task(h.post("acme", body())) for _ in range(2)]
    await wait_for(lambda: h.gateway.queue.depth("acme")[0] == 1)
    assert backend.inflight == 1
    backend.release()
    assert [r.status for r in await asyncio.gather(*tasks)] == [200, 200]


async def test_headroom_seats_go_to_a_tenant_under_its_share_a_lone_tenant_takes_them_all(
        aiohttp_client: Any, db_url: str) -> None:
    backend = ControlledBackend(capacity_=8)
    h = await gateway(aiohttp_client, db_url, [backend])
    assert GatewayConfig().dispatch_headroom * 8 == 1  # one seat of 8 kept
    lone = [asyncio.create_task(h.post("acme", body())) for _ in range(9)]
    await wait_for(lambda: h.gateway.queue.depth("acme")[0] == 1)
    assert backend.inflight == 8  # alone, it uses every seat
    backend.release()
    await asyncio.gather(*lone)
    backend.gate.clear()
    tasks = [asyncio.create_task(h.post("other", body()))]
    await wait_for(lambda: backend.inflight == 1)
    tasks += [asyncio.create_task(h.post("acme", body())) for _ in range(9)]
    await wait_for(lambda: h.gateway.queue.depth("acme")[0] == 3)
    assert backend.inflight == 7  # the last seat is kept from acme, over its share
    tasks.append(asyncio.create_task(h.post("other", body())))
    await wait_for(lambda: backend.inflight == 8)  # other, under its share: at once
    assert backend.started[-1] == "other" and h.gateway.queue.depth("acme")[0] == 3
    backend.release()
    assert {r.status for r in await asyncio.gather(*tasks)} == {200}


async def test_tenant_weight_and_priority_go_to_fairgate_engines_cache_salt_to_openai_ones(
        aiohttp_server: Any, aiohttp_client: Any, db_url: str) -> None:
    job = Job("r", parse_request({"prompt": "hi"}, "completions"), "acme", "batch", 1,
              SamplingParams(max_tokens=4), tenant_weight=2.5)
    sent = engine_body(job, "m", stream=False, fairgate=True)
    assert "`policy: fair`" in page() and EngineConfig(policy="fair").policy == "fair"
    assert (sent["tenant"], sent["tenant_weight"], sent["priority"]) == ("acme", 2.5, "batch")
    assert "cache_salt" not in sent
    engine = await aiohttp_server(make_fake_app(output_tokens=2))
    h = await start_gateway(aiohttp_client, db_url, gateway={"backends": [
        {"url": str(engine.make_url("/")), "kind": "openai", "model": "fake-model"}]})
    await wait_for(lambda: h.gateway.pool.backends[0].healthy)
    resp = await h.post("acme", completion(model="fake-model", stream=True))
    [_ async for _ in collect(resp)]
    assert resp.status == 200
    [received] = engine.app[SCRIPT].received
    assert received["cache_salt"] == "acme"
    assert not {"tenant", "tenant_weight", "priority"} & set(received)


# ---- token counting ---------------------------------------------------------------------------
def remote(**config: Any) -> RemoteBackend:
    return RemoteBackend(BackendConfig("http://127.0.0.1:9", **config), default_max_model_len=2048)


def test_without_a_tokenizer_a_remote_prompt_is_estimated_at_4_bytes_a_token() -> None:
    (per,) = stated(r"an estimate of one token per (\d+) bytes")
    req = parse_request({"prompt": "é" * 2000}, "completions")  # 4,000 bytes
    assert remote(model="m", kind="openai").count_prompt(req) == pytest.approx(4000 / per, abs=1)


async def test_a_fairgate_engine_serving_random_models_is_counted_with_the_byte_tokenizer(
        aiohttp_server: Any) -> None:
    engine = await aiohttp_server(make_fake_app(model="random:tiny"))
    backend = RemoteBackend(BackendConfig(str(engine.make_url("/"))), default_max_model_len=2048)
    await backend.refresh()  # reads /v1/models (then finds no /load)
    req = parse_request({"prompt": "é" * 2000}, "completions")
    assert backend.count_prompt(req) == len(prompt_token_ids(req, ByteTokenizer()))
    await backend.close()


def test_a_fairgate_backend_configured_with_a_random_model_uses_the_byte_tokenizer() -> None:
    req = parse_request({"prompt": "é" * 2000}, "completions")
    count = remote(model="random:tiny").count_prompt(req)
    assert count == len(prompt_token_ids(req, ByteTokenizer()))


# ---- routing --------------------------------------------------------------------------------
async def test_unknown_and_unavailable_models(aiohttp_client: Any, db_url: str) -> None:
    a = ControlledBackend(name="a", model_name="ma")
    b = ControlledBackend(name="b-replica", model_name="mb", healthy=False)
    h = await gateway(aiohttp_client, db_url, [a, b],
                      outlier_detection={"max_ejection_percent": 100})  # a lone one may go
    err = await error_of(await h.post("acme", completion(model="mc")), 404, "model_not_found")
    assert err["param"] == "model"
    for state in ("down", "ejected"):
        if state == "ejected":
            b.healthy = True
            for _ in range(OutlierDetectionConfig().consecutive_5xx):
                h.gateway.pool.record(b, Verdict.FAILED)
        resp = await h.post("acme", completion(model="mb"))
        err = await error_of(resp, 503, "model_unavailable")
        assert "Retry-After" in resp.headers and "b-replica" in err["message"]
    models = await (await h.client.get("/v1/models", headers=h.auth("acme"))).json()
    assert [m["id"] for m in models["data"]] == ["ma", "mb"]  # the union
    a.healthy = b.healthy = False
    resp = await h.post("acme", completion(model="ma"))
    await error_of(resp, 503, "backend_unavailable")  # none reachable at all
    assert "Retry-After" in resp.headers


@pytest.mark.parametrize("tenant", ["other", "acme"])  # another tenant's, and its own
async def test_a_request_for_a_full_model_waits_while_other_models_requests_go(
        aiohttp_client: Any, db_url: str, tenant: str) -> None:
    a = ControlledBackend(name="a", model_name="ma")
    b = ControlledBackend(name="b", model_name="mb")
    h = await gateway(aiohttp_client, db_url, [a, b])
    tasks = [asyncio.create_task(h.post("acme", completion(model="ma")))]
    await wait_for(lambda: a.inflight == 1)
    tasks.append(asyncio.create_task(h.post("acme", completion(model="ma"))))
    await wait_for(lambda: h.gateway.queue.size == 1)
    tasks.append(asyncio.create_task(h.post(tenant, completion(model="mb"))))
    try:
        await wait_for(lambda: h.gateway.queue.size == 2 or b.inflight == 1)
        assert b.inflight == 1 and h.gateway.queue.size == 1
    finally:
        a.release()
        b.release()
    assert [r.status for r in await asyncio.gather(*tasks)] == [200] * 3


async def test_a_request_is_held_to_its_own_models_context_length(
        aiohttp_client: Any, db_url: str) -> None:
    long = ControlledBackend(name="a", model_name="long", max_model_len=4096)
    short = ControlledBackend(name="b", model_name="short", max_model_len=128)
    long.release()
    h = await gateway(aiohttp_client, db_url, [long, short])
    resp = await h.post("acme", completion(model="long", prompt="x" * 600, max_tokens=4))
    assert resp.status == 200, await resp.text()
    resp = await h.post("acme", completion(model="short", prompt="x" * 600, max_tokens=4))
    await error_of(resp, 400, "context_length_exceeded")


async def test_a_failure_before_the_first_byte_is_retried_once_on_another_replica(
        aiohttp_client: Any, db_url: str) -> None:
    bad, good = Failing(name="bad", error=BackendErrored), ControlledBackend(name="good")
    good.release()
    h = await gateway(aiohttp_client, db_url, [bad, good])
    for stream in (False, True):
        resp = await h.post("acme", body(stream=stream))
        [_ async for _ in collect(resp)]
        assert resp.status == 200
    assert bad.started == ["acme", "acme"] and good.started == ["acme", "acme"]
    metrics = h.metrics()
    assert 'fairgate_gateway_failovers_total{backend="bad"} 2.0' in metrics
    assert 'fairgate_gateway_retries_total{reason="5xx"} 2.0' in metrics


async def test_a_request_is_retried_once_only(aiohttp_client: Any, db_url: str) -> None:
    first, second = Failing(name="first", error=BackendErrored), Failing(name="second")
    good = ControlledBackend(name="good")
    good.release()
    h = await gateway(aiohttp_client, db_url, [first, second, good])
    await error_of(await h.post("acme", body()), 503, "backend_unavailable")  # second's failure
    assert first.started == second.started == ["acme"] and good.started == []


@pytest.mark.parametrize(("error", "status", "code"), [
    (BackendErrored, 502, "bad_gateway"), (BackendFailed, 503, "backend_unavailable")])
async def test_a_failure_not_retried_is_502_for_a_5xx_503_for_a_broken_connection(
        aiohttp_client: Any, db_url: str, error: type[BackendFailed], status: int,
        code: str) -> None:
    h = await gateway(aiohttp_client, db_url, [Failing(error=error)])
    resp = await h.post("acme", body())
    await error_of(resp, status, code)
    assert 'retries_refused_total{reason="no_replica"} 1.0' in h.metrics()


async def test_a_failure_mid_stream_ends_it_with_an_error_event_never_retried(
        aiohttp_client: Any, db_url: str) -> None:
    broken, other = Failing(name="broken", chunks=1), ControlledBackend(name="other")
    other.release()
    h = await gateway(aiohttp_client, db_url, [broken, other])
    resp = await h.post("acme", body(stream=True))
    events = [event async for event in collect(resp)]
    assert resp.status == 200 and "error" in events[-1] and other.started == []


def test_retries_under_way_stay_within_the_budget() -> None:
    percent, least = stated(r"Envoy's: (\d+)% of the requests in flight and queued, at least (\d+)")
    budget = RetryBudget(RetryBudgetConfig())
    for active in (1, 10, 50, 100):
        allowed = max(int(least), math.floor(active * percent / 100))
        budget.under_way = set(range(allowed - 1))
        assert budget.allows(active)
        budget.under_way = set(range(allowed))
        assert not budget.allows(active)
    refused = re.search(r'retries_refused_total\{reason="(\w+)"\|"(\w+)"\}', page())
    assert refused and set(refused.groups()) == set(REFUSED_REASONS)


def test_a_failed_request_goes_to_a_replica_with_room_else_the_least_loaded() -> None:
    failed, idle = Loaded(name="failed"), Loaded(name="idle")
    busy, busier = Loaded(name="busy", work=10), Loaded(name="busier", work=90)
    pool = BackendPool(doubles(failed, busier, busy, idle))
    busy.inflight = busier.inflight = 1  # full: capacity 1
    assert pool.fallback(failed, MODEL) is idle
    idle.inflight, idle.work = 1, 50  # now every other one is full
    assert pool.fallback(failed, MODEL) is busy  # over its seats: its engine queues it


def test_outlier_ejection_follows_the_pages_rules() -> None:
    in_a_row, volume, interval = stated(
        r"after (\d+) failures in a row, or half of at least (\d+) requests over (\d+) s")
    base, longest = stated(
        r"for (\d+) s times the number of times it has been ejected \(at most (\d+) s\)")
    (decay,) = stated(r"each (\d+) s it serves without an ejection takes one off")
    assert decay == base
    clock = Clock()
    detector = OutlierDetector(OutlierDetectionConfig(), clock)
    pair = ("a", "b")

    def fail(name: str, times: int, replicas: tuple[str, ...] = pair) -> bool:
        return [detector.record(name, Verdict.FAILED, replicas) for _ in range(times)][-1]

    assert not fail("a", int(in_a_row) - 1) and fail("a", 1)
    lengths = []
    while True:
        start = clock.now
        while detector.ejected("a"):
            clock.now += 1
        lengths.append(clock.now - start)
        if lengths[-1] >= longest:
            break
        fail("a", int(in_a_row))
    assert lengths == [min(base * n, longest) for n in range(1, len(lengths) + 1)]
    ejections = detector.state("a")["ejections"]
    clock.now += decay
    detector.record("a", Verdict.OK, pair)  # served a while without an ejection
    assert detector.state("a")["ejections"] == ejections - 1
    for i in range(int(volume)):  # never two failures in a row, half of them failed
        detector.record("c", Verdict.FAILED if i % 2 else Verdict.OK, ("c", "d"))
        clock.now += interval / volume / 2
    assert detector.ejected("c")
    assert not fail("e", 20, ("e",))  # a lone replica never
    assert fail("f", int(in_a_row), ("f", "g")) and not fail("g", 20, ("f", "g"))  # one of two


async def test_a_replica_answering_5xx_is_ejected_and_shows_where_the_page_says(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    good = await aiohttp_server(make_fake_app(output_tokens=2))
    bad = await aiohttp_server(make_fake_app(statuses=(500,)))
    h = await start_gateway(aiohttp_client, db_url, gateway={"backends": [
        {"url": str(s.make_url("/")), "kind": "openai", "model": "fake-model"}
        for s in (bad, good)]})
    pool = h.gateway.pool
    await wait_for(lambda: all(b.healthy for b in pool.backends))
    bad_name = pool.backends[0].name
    for _ in range(60):
        if pool.outliers.ejected(bad_name):
            break
        resp = await h.post("acme", completion(model="fake-model", stream=True))
        [_ async for _ in collect(resp)]
        assert resp.status == 200  # failed over to the good one
    assert len(bad.app[SCRIPT].received) == OutlierDetectionConfig().consecutive_5xx
    engines = await (await h.client.get("/admin/engines", headers=ADMIN)).json()
    outlier = next(e["outlier"] for e in engines["engines"] if e["name"] == bad_name)
    shows = re.search(r"shows each backend's `outlier` state \(([^)]*)\)", page())
    assert shows
    fields = set(re.findall(r"`(\w+)`", shows.group(1)))
    assert len(fields) >= 5 and fields <= set(outlier), (fields, outlier)
    assert outlier["ejected"] is True and outlier["ejections"] == 1
    text = h.metrics()
    for name in ("fairgate_gateway_backend_ejected", "fairgate_gateway_backend_ejections_total"):
        assert f"`{name}{{backend}}`" in page()
        assert f'{name}{{backend="{bad_name}"}} 1.0' in text


def test_every_metric_the_page_names_is_exported() -> None:
    named = set(re.findall(r"`(fairgate_gateway_\w+)", page()))
    assert len(named) >= 8, named
    app = make_serving_app(GatewayConfig(redis="redis://127.0.0.1:9/0"),
                           backends=doubles())
    exported = set(re.findall(r"^# TYPE (\w+) (\w+)", generate_latest(
        app[METRICS].registry).decode(), re.M))
    names = {n for n, _ in exported} | {f"{n}_total" for n, kind in exported if kind == "counter"}
    assert sorted(named - names) == []


# ---- prefix affinity and least-loaded -------------------------------------------------------
async def test_prefix_routing_keeps_a_prefix_on_its_replica(aiohttp_client: Any,
                                                            db_url: str) -> None:
    backends = [ControlledBackend(capacity_=8, name=n, max_model_len=4096) for n in "abc"]
    for b in backends:
        b.release()
    h = await gateway(aiohttp_client, db_url, backends, routing="prefix")
    system = "You are a helpful assistant. " * 30  # over 256 characters

    async def send(prompt: str) -> None:
        assert (await h.post("acme", body(prompt=prompt))).status == 200

    await send(system[:600])
    assert len(h.gateway.pool.homes) == 3  # keys at 256, 512 and 600 characters
    for tail in ("first question", "second question", "third"):
        await send(system[:256] + tail)  # shares the first 256 characters only
    assert sorted(len(b.started) for b in backends) == [0, 0, 4]
    homes = len(h.gateway.pool.homes)
    await send("y" * 3000)
    assert len(h.gateway.pool.homes) == homes + 2048 // 256  # keyed up to prefix_chars


def test_a_home_takes_a_prefix_within_the_load_bound_then_it_spills() -> None:
    factor, slack = stated(r"`prefix_load_factor` \(([\d.]+)\) times the average, plus (\d+)")
    backends = [ControlledBackend(capacity_=64, name=n) for n in "abc"]
    pool = BackendPool(doubles(*backends))
    keys = (11, 12)
    for inflight in range(12):
        pool.homes.record(keys, "a")
        backends[0].inflight = inflight
        average = (inflight + 1) / 3  # this request included
        home = inflight + 1 <= math.ceil(factor * average) + slack
        picked = pool.pick_affine(keys, None, factor)
        assert picked is not None and (picked.name == "a") == home, inflight


def test_least_loaded_picks_the_fewest_outstanding_tokens_per_seat_and_skips_draining() -> None:
    busy = Loaded(capacity_=4, name="busy", work=60)  # 15 a seat
    roomy = Loaded(capacity_=8, name="roomy", work=100)  # 12.5 a seat
    pool = BackendPool(doubles(busy, roomy))
    assert pool.pick() is roomy
    pool.draining.add("roomy")
    assert pool.pick() is busy


async def test_dns_discovery_adds_drains_then_closes_and_keeps_what_is_there_on_failure() -> None:
    answers: list[list[str] | OSError] = [["10.0.0.1", "10.0.0.2"], ["10.0.0.1"],
                                          OSError("no answer"), ["10.0.0.1"]]
    closed: list[str] = []

    @dataclass
    class Replica(ControlledBackend):
        async def close(self) -> None:
            closed.append(self.name)

    async def resolver(host: str, port: int) -> list[str]:
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    config = BackendConfig("http://engines:8100", discover="dns")
    def make(replica: BackendConfig) -> Any:
        return Replica(name=replica.url)

    group = DnsGroup(config, make, resolver=resolver)
    pool = BackendPool([], groups=[group])
    group.pool = pool
    await group.refresh()
    assert [b.name for b in pool.backends] == ["http://10.0.0.1:8100", "http://10.0.0.2:8100"]
    leaving = pool.backends[1]
    leaving.inflight = 1  # a stream still running on it
    await group.refresh()
    assert leaving in pool.backends and leaving.name in pool.draining
    assert pool.pick() is pool.backends[0]
    await group.refresh()  # a failed lookup
    assert len(pool.backends) == 2
    leaving.inflight = 0
    await group.refresh()
    assert [b.name for b in pool.backends] == ["http://10.0.0.1:8100"]
    assert closed == ["http://10.0.0.2:8100"]


# ---- streams ----------------------------------------------------------------------------------
@dataclass
class Chatty(ControlledBackend):
    """Sends more after [DONE]."""

    async def stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]:
        outcome.completion_tokens = 1
        outcome.chunk_times.append(time.perf_counter())
        yield job.writer().chunk("x", "length") + b"data: [DONE]\n\n"
        yield b'data: {"late": true}\n\n'


async def test_what_a_backend_sends_after_done_is_not_passed_on(aiohttp_client: Any,
                                                                db_url: str) -> None:
    h = await gateway(aiohttp_client, db_url, [Chatty()])
    resp = await h.post("acme", body(stream=True))
    raw = await resp.read()
    assert resp.status == 200 and raw.endswith(b"data: [DONE]\n\n") and b"late" not in raw

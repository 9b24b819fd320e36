"""Gateway test helpers: a tenant database, gateways with a real (simulated) engine or a
hand-controlled backend, and a gateway served from a thread for synchronous clients."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from prometheus_client import generate_latest

from control.app import make_app
from control.state import CAPTURE, SHADOWS
from engine import EngineConfig
from gateway.backends import Job, Outcome
from gateway.config import GatewayConfig
from gateway.state import GATEWAY, METRICS
from protocol.openai import OpenAIRequest, prompt_text
from tenants import TenantLimits, TenantStore
from tests.support.processes import free_port

SIM_ENGINE = EngineConfig(executor="sim", max_model_len=512, max_num_seqs=8,
                          max_num_batched_tokens=512)


async def create_tenants(db_url: str, tenants: dict[str, dict[str, Any]]) -> dict[str, str]:
    """{name: spec} -> {name: plaintext key}; spec: weight, limits (dict), other fields."""
    store = TenantStore(db_url)
    await store.init()
    keys = {}
    try:
        for name, spec in tenants.items():
            spec = dict(spec)
            limits = TenantLimits(**spec.pop("limits", {}))
            await store.create_tenant(name, limits=limits, **spec)
            _, keys[name] = await store.create_key(name)
    finally:
        await store.close()
    return keys


@dataclass
class ControlledBackend:
    """A backend whose requests stream one token each time the test calls `release()`."""

    capacity_: int = 1
    name: str = "controlled"
    model_name: str = "test-model"
    max_model_len: int = 512
    inflight: int = 0
    healthy: bool = True
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    started: list[str] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    tokens_per_request: int = 3

    def capacity(self) -> int:
        return self.capacity_

    def seats(self) -> int:
        return self.capacity_

    def has_room(self) -> bool:
        return self.inflight < self.capacity_

    def outstanding_tokens(self) -> int:
        return 0  # by requests in flight alone

    def dispatched(self, tokens: int) -> None:
        pass

    def count_prompt(self, req: OpenAIRequest) -> int:
        return len(prompt_text(req)) + 1

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def release(self) -> None:
        self.gate.set()

    async def stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]:
        writer = job.writer()
        self.started.append(job.tenant)
        try:
            await self.gate.wait()
            for i in range(self.tokens_per_request):
                outcome.completion_tokens += 1
                last = i == self.tokens_per_request - 1
                outcome.finish_reason = "length" if last else None
                outcome.chunk_times.append(asyncio.get_running_loop().time())
                yield writer.chunk("x", outcome.finish_reason)
                await asyncio.sleep(0)
            yield b"data: [DONE]\n\n"
        finally:
            self.closed.append(job.tenant)

    async def complete(self, job: Job, outcome: Outcome) -> bytes:
        chunks = [c async for c in self.stream(job, outcome)]
        body = job.writer().whole(
            "x" * (len(chunks) - 1), outcome.finish_reason, outcome.prompt_tokens,
            outcome.completion_tokens)
        return json.dumps(body).encode()


@dataclass
class Harness:
    client: Any
    app: web.Application
    keys: dict[str, str]

    @property
    def gateway(self) -> Any:
        return self.app[GATEWAY]

    @property
    def shadows(self) -> Any:  # the control plane's (control/app.py)
        return self.app[SHADOWS]

    @property
    def capture(self) -> Any:
        return self.app[CAPTURE]

    def auth(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    def metrics(self) -> str:
        """What the metrics listener serves (tenants cannot reach it: see test_privacy)."""
        return generate_latest(self.app[METRICS].registry).decode()

    async def post(self, tenant: str | None, body: Any, path: str = "/v1/completions") -> Any:
        headers = self.auth(tenant) if tenant else {}
        data = body if isinstance(body, bytes | str) else json.dumps(body)
        return await self.client.post(path, data=data, headers=headers)


async def start_gateway(aiohttp_client: Any, db_url: str, *,
                        tenants: dict[str, dict[str, Any]] | None = None,
                        gateway: dict[str, Any] | None = None,
                        engine: EngineConfig = SIM_ENGINE, backends: list[Any] | None = None,
                        **make_kwargs: Any) -> Harness:
    keys = await create_tenants(db_url, tenants if tenants is not None else {"acme": {}})
    settings = {"demo_tenant": False, "admin_key": "admin-key-0123456789",
                "backend_poll_interval_s": 0.02, **(gateway or {})}
    app = make_app(GatewayConfig.from_dict(settings), engine=engine, database=db_url,
                   backends=backends, **make_kwargs)
    client = await aiohttp_client(app)
    return Harness(client, app, keys)


def completion(prompt: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "random:tiny", "prompt": prompt, "max_tokens": 4, **extra}


class ServerThread:
    """An aiohttp app on a real port in its own thread and event loop (for sync clients)."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(self.app, handler_cancellation=True)
        self.loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", self.port)
        self.loop.run_until_complete(site.start())
        self.runner = runner
        self._ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._ready.wait(30), "server thread did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)


async def post_raw(port: int, path: str, key: str, body: dict[str, Any]) -> tuple[
        asyncio.StreamReader, asyncio.StreamWriter]:
    """`body` POSTed to `path` on a raw socket (no client library between the test and the
    bytes): the connection, for the test to read the answer as it likes and close."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST {path} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {key}\r\n"
                 f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                 .encode() + data)
    return reader, writer


def sse_events(raw: bytes) -> list[dict[str, Any]]:
    """The JSON events of a whole streamed answer ([DONE] and comments left out)."""
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]


async def collect(resp: Any) -> AsyncIterator[dict[str, Any]]:
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])


async def leave_an_apply_mid_canary(db_url: str, folder: str, url: str) -> None:
    """The job row a gateway killed during a canary window leaves behind: job-cut's apply of
    max_num_seqs 32 onto `url` (before: 4), switched, in state canary."""
    from tenants.jobs import JobStore

    store = TenantStore(db_url)
    await store.init()
    try:
        jobs = JobStore(store.db)
        await jobs.create("job-cut", {"mode": "sim"}, None, "cut", folder, 1)
        await jobs.transition("job-cut", ["queued"], "succeeded")
        await jobs.update("job-cut", apply={
            "state": "canary", "backend": url, "config": {"max_num_seqs": 32},
            "previous": {url: {"max_num_seqs": 4}}, "switched": [url], "steps": []})
    finally:
        await store.close()


@contextlib.asynccontextmanager
async def streamed_traffic(h: Harness, streams: int,
                           tenant: str = "acme") -> AsyncIterator[list[int]]:
    """`streams` clients of `tenant` sending streamed requests back to back until the block
    ends; yields the statuses they got, as they get them."""
    statuses: list[int] = []
    stop = asyncio.Event()

    async def client(i: int) -> None:
        while not stop.is_set():
            resp = await h.post(tenant, completion(f"client {i}", max_tokens=8, stream=True))
            [_ async for _ in collect(resp)]
            statuses.append(resp.status)

    tasks = [asyncio.create_task(client(i)) for i in range(streams)]
    try:
        yield statuses
    finally:
        stop.set()
        await asyncio.gather(*tasks)

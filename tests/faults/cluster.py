"""A real deployment for one test: `fairgate engine` processes (simulated executor, real time),
one `fairgate serve` in front of them with its database behind the test's proxy, tenants made
with `fairgate tenants import` (more keys through the admin API).

Every key (printed by the tenants command or answered by the admin API) and the admin key go
into `Fleet.secrets` as soon as they exist, so the key-leak check knows what to look for in
every process's output.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.faults.services import Service
from tests.support.processes import ROOT, free_port
from tests.support.waiting import wait_for

# A decode step of the simulated llama-3-8b on an H100 takes ~8 ms in real time: a stream of
# STREAM_TOKENS lasts about 0.6 s, long enough to break mid-way, short enough for CI.
ENGINE_KNOBS: dict[str, Any] = {
    "executor": "sim", "sim_model": "llama-3-8b", "sim_clock": "realtime",
    "max_model_len": 1024, "num_kv_blocks": 1024, "policy": "fair"}
STREAM_TOKENS = 80
# The per-backend timeouts (gateway.backends[] keys), short: a silent engine is noticed fast.
BACKEND_TIMEOUTS = {"first_byte_timeout_s": 2.0, "stall_timeout_s": 1.0}
# Two gateways on one machine must not share the metrics listener's fixed default port.
_OWN_SETTINGS = {"metrics_port": None}
_KEY_LINE = re.compile(r"for (?P<tenant>\S+) .*?(?P<key>fg-[A-Za-z0-9_-]{20,})")


def accepts(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Fleet:
    """Every process a test started, and every secret they were given (the leak check)."""

    services: list[Service] = field(default_factory=list)
    secrets: list[str] = field(default_factory=list)


@dataclass
class Cluster:
    fleet: Fleet
    gateway: Service
    engines: list[Service]
    engine_urls: list[str]
    url: str
    admin_key: str
    tenants: dict[str, str]  # short name -> the tenant's name (unique to the test)
    keys: dict[str, str]  # short name -> the tenant's first key

    def auth(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_key}"}

    async def new_key(self, session: aiohttp.ClientSession, tenant: str) -> str:
        """Another key for `tenant` (short name), through the admin API."""
        async with session.post(f"{self.url}/admin/tenants/{self.tenants[tenant]}/keys",
                                headers=self.admin) as resp:
            assert resp.status == 201, await resp.text()
            key = str((await resp.json())["key"])
        self.fleet.secrets.append(key)
        return key

    async def backends(self, session: aiohttp.ClientSession) -> dict[str, bool]:
        """{engine url: healthy} as the gateway sees it (GET /admin/queues)."""
        async with session.get(f"{self.url}/admin/queues", headers=self.admin) as resp:
            assert resp.status == 200, await resp.text()
            return {b["name"]: b["healthy"] for b in (await resp.json())["backends"]}


StartCluster = Callable[..., Awaitable[Cluster]]  # the `cluster` fixture


def start_engine(name: str, cwd: Path) -> tuple[Service, str]:
    port = free_port()
    knobs = [a for k, v in ENGINE_KNOBS.items() for a in ("--set", f"{k}={v}")]
    engine = Service(name, ["engine", "--port", str(port), *knobs], cwd)
    return engine, f"http://127.0.0.1:{port}"


async def import_tenants(database_url: str, tenants: list[str], cwd: Path) -> dict[str, str]:
    """`fairgate tenants import -`, one generated key each (one process for all of them);
    {tenant: key}, read from what the command printed."""
    spec = yaml.safe_dump({"tenants": [{"name": t, "keys": [{"create": True}]}
                                       for t in tenants]})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "fairgate", "tenants", "import", "-", "--database", database_url,
        cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out = (await asyncio.wait_for(proc.communicate(spec.encode()), 60))[0].decode()
    assert proc.returncode == 0, out
    keys = {m["tenant"]: m["key"] for m in _KEY_LINE.finditer(out)}
    assert sorted(keys) == sorted(tenants), out
    return keys


def gateway_config(database_url: str, engine_urls: list[str], port: int, admin_key: str,
                   settings: dict[str, Any], backend: dict[str, Any]) -> dict[str, Any]:
    timeouts = BACKEND_TIMEOUTS
    return {"database": database_url, "gateway": {
        "port": port, "admin_key": admin_key, "demo_tenant": False, "log_requests": True,
        "backend_poll_interval_s": 0.05, "request_timeout_s": 30, **_OWN_SETTINGS,
        "backends": [{"url": u, **timeouts, **backend} for u in engine_urls], **settings}}


async def start_cluster(fleet: Fleet, tmp: Path, *, gateway_database: str,
                        admin_database: str, tenants: dict[str, str], engines: int = 1,
                        settings: dict[str, Any] | None = None,
                        backend: dict[str, Any] | None = None) -> Cluster:
    """Engines and tenants (`tenants`: short name -> name) at once, then the gateway. Every
    process joins `fleet` as soon as it exists, every key as soon as it is made."""
    pairs = [start_engine(f"engine-{i}", tmp) for i in range(engines)]
    fleet.services.extend(e for e, _ in pairs)
    made = await import_tenants(admin_database, list(tenants.values()), tmp)
    fleet.secrets.extend(made.values())
    admin_key = "admin-" + secrets.token_urlsafe(24)
    fleet.secrets.append(admin_key)
    for engine, _ in pairs:
        await engine.wait_line("serving ")  # logged once its port is open
    port = free_port()
    urls = [u for _, u in pairs]
    path = tmp / "fairgate.yaml"
    path.write_text(yaml.safe_dump(gateway_config(gateway_database, urls, port, admin_key,
                                                  settings or {}, backend or {})))
    gateway = Service("gateway", ["serve", "-c", str(path)], tmp)
    fleet.services.append(gateway)
    await gateway.wait_line("fairgate gateway on")
    # It prints that line once it listens: this returns at once, unless it exited since.
    await wait_for(lambda: gateway.proc.poll() is not None or accepts(port), timeout=30)
    assert gateway.proc.poll() is None, gateway.tail()
    return Cluster(fleet, gateway, [e for e, _ in pairs], urls, f"http://127.0.0.1:{port}",
                   admin_key, dict(tenants), {t: made[name] for t, name in tenants.items()})


def stop_all(services: list[Service]) -> None:
    """Gateways first (SIGTERM: a graceful stop that flushes usage), then engines; each
    resumed first in case a test stopped it."""
    for service in services:
        service.send(signal.SIGCONT)
    for service in sorted(services, key=lambda s: s.name != "gateway"):
        service.stop(signal.SIGTERM, timeout=20)


def leaked(services: list[Service], keys: list[str]) -> list[str]:
    """Lines of any service's output holding one of `keys`, or the secret part of one (all
    after the 10-character display prefix), the key itself shown as <KEY>."""
    found = []
    for service in services:
        for line in service.output.splitlines():
            hits = [k for k in keys if k[10:] in line]
            for k in hits:
                line = line.replace(k, "<KEY>").replace(k[10:], "<KEY-TAIL>")
            if hits:
                found.append(f"{service.name}: {line[:300]}")
    return found

"""Discovery: the replicas behind one DNS name, a backend per address, kept up to date."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from gateway.backends.base import Backend
from gateway.config import BackendConfig

if TYPE_CHECKING:
    from gateway.backends.pool import BackendPool

log = logging.getLogger("fairgate.gateway")


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to now (every A and AAAA record), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class DnsGroup:
    """The replicas behind one host name (`discover: dns`, a Kubernetes headless Service): a
    backend per address it resolves to, added as addresses appear; one whose address is gone
    is drained (no new requests, its streams finish) and then closed. A failed lookup keeps
    what is there."""

    def __init__(self, config: BackendConfig, make: Callable[[BackendConfig], Backend],
                 pool: BackendPool | None = None, resolver: Resolver | None = None) -> None:
        parts = urlsplit(config.url)
        self.config, self.make, self.resolver = config, make, resolver
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.pool = pool
        self.members: dict[str, Backend] = {}  # address -> backend
        self.leaving: dict[str, Backend] = {}
        self.task: asyncio.Task[None] | None = None

    def url_for(self, address: str) -> str:
        parts = urlsplit(self.config.url)
        host = f"[{address}]" if ":" in address else address
        return parts._replace(netloc=f"{host}:{self.port}").geturl()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.discover_interval_s)
            await self.refresh()

    async def refresh(self) -> None:
        assert self.pool is not None
        try:
            found = set(await (self.resolver or resolve)(self.host, self.port))
        except OSError as exc:
            log.warning("discovering %s: %s; keeping its %d backends", self.host, exc,
                        len(self.members))
            found = set(self.members)
        for address in sorted(found - set(self.members)):
            backend = self.leaving.pop(address, None)
            if backend is None:
                backend = self.make(dataclasses.replace(self.config, url=self.url_for(address),
                                                        discover=None))
                await backend.start()
                self.pool.add(backend)
                log.info("discovered %s behind %s", backend.name, self.host)
            self.pool.draining.discard(backend.name)
            self.members[address] = backend
        for address in sorted(set(self.members) - found):
            backend = self.members.pop(address)
            self.pool.draining.add(backend.name)  # no new requests; its streams finish
            self.leaving[address] = backend
            log.info("%s left %s: draining it", backend.name, self.host)
        for address, backend in list(self.leaving.items()):
            if backend.inflight == 0:
                del self.leaving[address]
                self.pool.remove(backend)
                self.pool.draining.discard(backend.name)
                await backend.close()

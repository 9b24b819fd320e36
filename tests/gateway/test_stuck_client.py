"""A client that opens a stream and stops reading cannot hold its seat past request_timeout_s
(issue 13 review): the deadline covers every write, the error event gets a few seconds, then
the gateway hangs up and settles the request."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from gateway.backends import Job, Outcome
from tests.gateway.helpers import ControlledBackend, start_gateway
from tests.support.waiting import wait_for


@dataclass
class Firehose(ControlledBackend):
    """Streams 64 KiB events for as long as anyone writes them."""

    async def stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]:
        writer = job.writer()
        while True:
            outcome.completion_tokens += 1
            yield writer.chunk("x" * 65536, None)
            await asyncio.sleep(0)


async def test_a_client_that_stops_reading_is_settled_after_the_deadline(
        aiohttp_client: Any, db_url: str) -> None:
    backend = Firehose(capacity_=4)
    h = await start_gateway(aiohttp_client, db_url, backends=[backend],
                            gateway={"request_timeout_s": 0.5})
    body = json.dumps({"model": "test-model", "prompt": "hi", "stream": True}).encode()
    sock = socket.create_connection((h.client.host, h.client.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nAuthorization: Bearer " + h.keys["acme"].encode()
                     + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        queue = h.gateway.queue
        await wait_for(lambda: "acme" in queue.tenants and queue.tenants["acme"].running == 1)
        # never read: after the deadline (0.5 s) and the error event's grace (5 s) it is over
        await wait_for(lambda: queue.tenants["acme"].running == 0, timeout=15)
        assert backend.inflight == 0
    finally:
        sock.close()
    await h.gateway.ledger.flush()
    assert (await h.gateway.ledger.totals("acme"))["by_status"] == {504: 1}

"""The floor for an aiohttp gateway: a reverse proxy that only forwards bytes.

    python bench/bare_proxy.py UPSTREAM_URL PORT

No auth, no parsing, no admission, no queue, no accounting: one POST forwarded with one
pooled client session and the response streamed back chunk by chunk. `bench/gateway_overhead.py`
runs it beside the gateway so the gateway's own cost can be told apart from what any Python
proxy on this machine adds.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from engine.server import install_fast_event_loop

UPSTREAM = web.AppKey("upstream", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    url = request.app[UPSTREAM] + request.path
    async with request.app[SESSION].request(request.method, url, data=body, headers={
            "Content-Type": "application/json"}) as upstream:
        resp = web.StreamResponse(status=upstream.status, headers={
            "Content-Type": upstream.headers.get("Content-Type", "application/json")})
        await resp.prepare(request)
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


async def session_ctx(app: web.Application) -> AsyncIterator[None]:
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    yield
    await app[SESSION].close()


def main() -> None:
    upstream, port = sys.argv[1], int(sys.argv[2])
    app = web.Application()
    app[UPSTREAM] = upstream.rstrip("/")
    app.cleanup_ctx.append(session_ctx)
    app.router.add_route("*", "/{tail:.*}", forward)
    install_fast_event_loop()
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


if __name__ == "__main__":
    main()

"""The floor for an aiohttp gateway: a reverse proxy that only forwards bytes.

    python bench/bare_proxy.py UPSTREAM_URL PORT [--client aiohttp|lean]

No auth, no parsing, no admission, no queue, no accounting: one request forwarded and the
response passed back chunk by chunk. The upstream client is aiohttp's pooled `ClientSession`
(the default: what a plain aiohttp proxy is), or `lean`: the gateway's own `UpstreamPool`, so
what is left between this proxy and the gateway is the gateway's work alone. The lean one also
sends as few times as the gateway does: the response's headers with its first bytes, and the
last bytes (those read once the backend's answer had all arrived) with the body's end.
`bench/gateway_overhead.py` runs it beside the gateway so the gateway's own cost can be told apart
from what any Python proxy on this machine adds; `bench/gateway_cpu.py` runs the lean one as the
floor of the gateway's CPU per request.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from engine.server import install_fast_event_loop  # noqa: E402
from gateway.upstream import UpstreamPool  # noqa: E402

UPSTREAM = web.AppKey("upstream", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)
POOL = web.AppKey("pool", UpstreamPool)


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    url = request.app[UPSTREAM] + request.path
    async with request.app[SESSION].request(request.method, url, data=body, headers={
            "Content-Type": "application/json"}) as upstream:
        return await relay(request, upstream.status,
                           upstream.headers.get("Content-Type", "application/json"),
                           upstream.content.iter_any())


class LeanResponse(web.StreamResponse):
    _send_headers_immediately = False  # as protocol.http.SSEResponse: with the first bytes


async def forward_lean(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    upstream = await request.app[POOL].request(request.method, request.path, body, timeout=60)
    try:
        resp = LeanResponse(status=upstream.status, headers={
            "Content-Type": upstream.headers.get("content-type", "application/json")})
        await resp.prepare(request)
        while chunk := await upstream.next_chunk():
            if upstream.ended:  # all of the answer is here: this is its last
                await resp.write_eof(chunk)
            else:
                await resp.write(chunk)
        await resp.write_eof()
        return resp
    finally:
        upstream.close()


async def relay(request: web.Request, status: int, content_type: str,
                body: AsyncIterator[bytes]) -> web.StreamResponse:
    """The backend's answer back to the client, chunk by chunk as it came."""
    resp = web.StreamResponse(status=status, headers={"Content-Type": content_type})
    await resp.prepare(request)
    async for chunk in body:
        await resp.write(chunk)
    await resp.write_eof()
    return resp


async def session_ctx(app: web.Application) -> AsyncIterator[None]:
    app[SESSION] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    yield
    await app[SESSION].close()


async def pool_ctx(app: web.Application) -> AsyncIterator[None]:
    app[POOL] = UpstreamPool(app[UPSTREAM])
    yield
    app[POOL].close()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("upstream", help="the backend's base URL")
    parser.add_argument("port", type=int)
    parser.add_argument("--client", choices=("aiohttp", "lean"), default="aiohttp",
                        help="aiohttp's ClientSession, or the gateway's UpstreamPool")
    args = parser.parse_args()
    app = web.Application()
    app[UPSTREAM] = args.upstream.rstrip("/")
    lean = args.client == "lean"
    app.cleanup_ctx.append(pool_ctx if lean else session_ctx)
    app.router.add_route("*", "/{tail:.*}", forward_lean if lean else forward)
    install_fast_event_loop()
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()

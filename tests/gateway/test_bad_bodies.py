"""Whatever body arrives, on whatever route, with whatever Content-Type and Content-Encoding,
the answer is a 4xx in OpenAI's error shape when it cannot be read, never a 500: a multipart
form without its boundary, a charset nobody knows, bytes that are not in the charset, a body
that is not in its Content-Encoding, a malformed chunked body."""

from __future__ import annotations

import asyncio
import gzip
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import make_app, server_options
from gateway.config import GatewayConfig
from protocol.serving import Runner
from tests.gateway.helpers import SIM_ENGINE, create_tenants, start_gateway

ADMIN_KEY = "admin-key-0123456789"
FORM = "application/x-www-form-urlencoded"


def _part(headers: str, value: bytes = b"abc") -> bytes:
    return (b"--xyz\r\n" + headers.encode() + b'Content-Disposition: form-data; name="key"'
            b"\r\n\r\n" + value + b"\r\n--xyz--\r\n")


# (Content-Type, extra headers, body): none of them can be read as a form
UNREADABLE_FORMS = [
    ("multipart/form-data", {}, b""),  # no boundary, no body
    ("multipart/form-data", {}, b"key=abc"),  # no boundary
    ("multipart/form-data; boundary=xyz", {}, b"garbage"),
    ("multipart/form-data; boundary=xyz", {}, b"--xyz\r\nContent-Disposition: nonsense\r\n\r\n"
                                              b"abc\r\n--xyz--\r\n"),
    ("multipart/form-data; boundary=xyz", {}, _part("Content-Type: text/plain; charset=nope\r\n")),
    ("multipart/form-data; boundary=xyz", {}, _part("Content-Transfer-Encoding: nope\r\n")),
    (f"{FORM}; charset=nope", {}, b"key=abc"),  # a charset Python does not know
    (f"{FORM}; charset=utf-16", {}, b"key=abc"),  # odd bytes: truncated UTF-16
    (FORM, {}, b"key=\xe2\x82"),  # a UTF-8 character cut off
    (FORM, {"Content-Encoding": "gzip"}, b"key=abc"),  # not gzip
    (FORM, {"Content-Encoding": "deflate"}, gzip.compress(b"key=abc", mtime=0)[:-4]),
]
# (Content-Type, extra headers, body) a JSON route cannot read
UNREADABLE_JSON = [
    ("multipart/form-data", {}, b""),
    ("application/json", {"Content-Encoding": "gzip"}, b'{"prompt": "hi"}'),
    ("application/json", {"Content-Encoding": "gzip"},
     gzip.compress(b'{"prompt": "hi", "max_tokens": 2}', mtime=0)[:20]),  # cut off
    ("application/json; charset=utf-16", {}, '{"prompt": "hi"}'.encode("utf-16")),
]


def _assert_error(status: int, body: bytes, expected: int = 400) -> dict[str, Any]:
    assert status == expected, body[:300]
    error = json.loads(body)["error"]
    assert isinstance(error["message"], str) and error["type"] == "invalid_request_error"
    return dict(error)


@pytest.mark.parametrize(("content_type", "headers", "body"), UNREADABLE_FORMS)
async def test_an_unreadable_login_form_is_a_400(aiohttp_client: Any, db_url: str,
                                                 content_type: str, headers: dict[str, str],
                                                 body: bytes) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    # Connection: close, as aiohttp closes a connection whose body it could not decode
    resp = await h.client.post("/dashboard/login", data=body, allow_redirects=False,
                               headers={"Content-Type": content_type, "Connection": "close",
                                        **headers})
    error = _assert_error(resp.status, await resp.read())
    assert error["code"] in ("invalid_form", "invalid_body")
    # and a readable one still logs in
    resp = await h.client.post("/dashboard/login", data={"key": ADMIN_KEY},
                               allow_redirects=False)
    assert resp.status == 303 and resp.headers["Location"] == "/dashboard"


@pytest.mark.parametrize(("content_type", "headers", "body"), UNREADABLE_JSON)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/admin/tenants"])
async def test_an_unreadable_json_body_is_a_400(aiohttp_client: Any, db_url: str, route: str,
                                                content_type: str, headers: dict[str, str],
                                                body: bytes) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    key = ADMIN_KEY if route.startswith("/admin") else h.keys["acme"]
    resp = await h.client.post(route, data=body, headers={
        "Content-Type": content_type, "Authorization": f"Bearer {key}", **headers})
    _assert_error(resp.status, await resp.read())


async def _raw(port: int, request: bytes) -> tuple[int, bytes]:
    """One request as bytes on a socket; the answer's status and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        async with asyncio.timeout(30):
            status_line = await reader.readline()
            headers = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
            length = int(headers.split("content-length:")[1].split("\r\n")[0])
            return int(status_line.split()[1]), await reader.readexactly(length)
    finally:
        writer.close()


@pytest.mark.parametrize(("route", "content_type"), [
    ("/dashboard/login", FORM), ("/v1/completions", "application/json")])
async def test_a_malformed_chunked_body_is_a_400(db_url: str, route: str,
                                                 content_type: str) -> None:
    """aiohttp's parser meets the bad chunk (headers and body in one read) and answers before
    any handler: served as `fairgate serve` serves it, that answer is OpenAI's shape too."""
    keys = await create_tenants(db_url, {"acme": {}})
    config = GatewayConfig(demo_tenant=False, admin_key=ADMIN_KEY)
    runner = Runner(make_app(config, engine=SIM_ENGINE, database=db_url),
                    **server_options(config))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        head = (f"POST {route} HTTP/1.1\r\nHost: gateway\r\nContent-Type: {content_type}\r\n"
                f"Authorization: Bearer {keys['acme']}\r\nTransfer-Encoding: chunked\r\n\r\n")
        # a chunk size that is not hexadecimal, after a good first chunk
        status, body = await _raw(runner.addresses[0][1],
                                  head.encode() + b"3\r\nkey\r\nzz\r\n=abc\r\n0\r\n\r\n")
        _assert_error(status, body)
    finally:
        await runner.cleanup()


# ---- anything at all ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory: Any) -> Iterator[tuple[int, dict[str, str]]]:
    """The gateway on a real port, served as `fairgate serve` serves it, from a thread (for a
    blocking client); its port and the key each route is sent with."""
    db_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('bodies') / 'g.db'}"
    keys = asyncio.run(create_tenants(db_url, {"acme": {}}))
    # a body that ends inside a deflate stream, read by the handler, waits for the rest until
    # client_timeout_s (aiohttp never fails the read): a 408, here soon
    config = GatewayConfig(demo_tenant=False, admin_key=ADMIN_KEY, max_body_bytes=4096,
                           client_timeout_s=2.0)
    loop = asyncio.new_event_loop()
    runner = Runner(make_app(config, engine=SIM_ENGINE, database=db_url),
                    **server_options(config))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield runner.addresses[0][1], {"tenant": keys["acme"], "admin": ADMIN_KEY}
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.run_until_complete(runner.cleanup())
        loop.close()


ROUTES = [("/dashboard/login", None), ("/dashboard/logout", None),
          ("/v1/completions", "tenant"), ("/v1/chat/completions", "tenant"),
          ("/admin/tenants", "admin"), ("/admin/shadow", "admin"),
          ("/admin/tune-jobs", "admin")]
MEDIA_TYPES = ["application/json", FORM, "multipart/form-data", "multipart/mixed",
               "text/plain", "application/octet-stream", "", "*/*", "application/x-ndjson"]
HEADER_TEXT = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7e), max_size=30)
content_types = st.sampled_from(MEDIA_TYPES) | st.builds(
    lambda media, params: f"{media}; {params}", st.sampled_from(MEDIA_TYPES),
    st.sampled_from(["charset=", "boundary=", "charset=utf-16; boundary="]).flatmap(
        lambda name: HEADER_TEXT.map(lambda value: name + value)) | HEADER_TEXT)
encodings = st.sampled_from([None, "gzip", "deflate", "br", "identity", "nope"])
bodies = st.binary(max_size=300) | st.sampled_from([
    b"key=abc", b"--xyz\r\n\r\n", b'{"prompt": "hi", "max_tokens": 2}', b"\xff\xfe{}",
    gzip.compress(b"key=abc", mtime=0), b""]) | st.builds(
    lambda body, cut: body[:cut], st.sampled_from([gzip.compress(b'{"prompt": "hello"}', mtime=0),
                                                   _part("")]), st.integers(0, 40))


def _send(port: int, route: str, key: str | None, content_type: str,
          encoding: str | None, body: bytes) -> tuple[int, bytes]:
    """The request in one write (http.client writes the body apart, so whether aiohttp's
    parser or the handler meets a bad body would be the scheduler's choice); the answer."""
    head = [f"POST {route} HTTP/1.1", "Host: gateway", f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}", "Connection: close"]
    if key is not None:
        head.append(f"Authorization: Bearer {key}")
    if encoding is not None:
        head.append(f"Content-Encoding: {encoding}")
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall("\r\n".join(head).encode() + b"\r\n\r\n" + body)
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, resp.read()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(ROUTES), content_type=content_types, encoding=encodings,
       body=bodies)
def test_no_body_is_ever_a_5xx(served: tuple[int, dict[str, str]],
                               route: tuple[str, str | None], content_type: str,
                               encoding: str | None, body: bytes) -> None:
    port, keys = served
    path, key = route
    status, answer = _send(port, path, None if key is None else keys[key], content_type,
                           encoding, body)
    assert status < 500, (path, content_type, encoding, body, answer[:300])
    if status >= 400:
        error = json.loads(answer)["error"]
        assert isinstance(error["message"], str) and error["type"]

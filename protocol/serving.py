"""Running an aiohttp server the way both fairgate servers need it: credentials redacted from
every log line, even the errors aiohttp answers before any handler runs (a header line over
its limit, a malformed request line) in OpenAI's error shape, and a connection closed whose
request headers do not arrive within `header_timeout` seconds (aiohttp has no such bound: a
client sending a header line every few seconds held its connection for the hour of aiohttp's
keep-alive timeout).

    setup_logging("INFO")                 # every handler of the root logger redacts
    serve(app, host, port, extra=[(metrics_app, "127.0.0.1", 9464)])

`serve` is `web.run_app` with a request handler whose `handle_error` answers JSON: SIGINT and
SIGTERM stop accepting, wait for requests in flight (up to `shutdown_timeout`), then run the
applications' cleanups, as `run_app` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import sys
import traceback
from collections.abc import Callable, Sequence
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from aiohttp.web_server import Server

from protocol.errors import ApiError

log = logging.getLogger("fairgate.http")
DEFAULT_HEADER_TIMEOUT_S = 20.0

# A credential is whatever follows `Bearer` (or `Basic`), and anything shaped like a fairgate
# key wherever it appears (a header echoed in an exception, a URL, a repr of bytes).
_CREDENTIAL = re.compile(r"(?i)\b(bearer|basic)(\s+|%20|\\x20)[^\s'\",;\\]+")
_KEY = re.compile(r"fg-[A-Za-z0-9_-]{8,}")
REDACTED = "[redacted]"
_MAX_LOGGED_LINE = 2000  # a client-controlled line never floods the log


def redact(text: str) -> str:
    """`text` with every credential replaced by [redacted]."""
    if "fg-" in text:
        text = _KEY.sub("fg-" + REDACTED, text)
    return _CREDENTIAL.sub(lambda m: f"{m.group(1)} {REDACTED}", text)


class RedactingFilter(logging.Filter):
    """Redacts the formatted message and the traceback of every record it sees (install it on
    handlers: a handler's filters see the records of every logger that reach it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info:
            record.exc_text = redact("".join(traceback.format_exception(*record.exc_info)))
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        record.msg, record.args = redact(message), None
        return True


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_redaction()


def install_redaction(logger: logging.Logger | None = None) -> None:
    """Put a RedactingFilter on every handler of `logger` (default: the root logger)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


class _Handler(RequestHandler):
    """aiohttp's protocol handler, answering its own errors in OpenAI's shape, and closing a
    connection whose request headers take longer than `header_timeout` s: the first
    request's from the connection's start, a later one's from its first byte (an idle
    kept-alive connection is aiohttp's `keepalive_timeout`'s to close)."""

    def __init__(self, manager: Server, *, header_timeout: float | None = None,
                 **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.header_timeout = header_timeout
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        # idle: waiting for the next request, so these bytes begin its headers
        idle = self._waiter is not None and not self._waiter.done()
        requests = self._request_count
        super().data_received(data)
        if self._request_count > requests:  # a request's headers are complete
            self._stop_header_timer()
        elif idle and data:
            self._start_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _start_header_timer(self) -> None:
        if self.header_timeout is not None and self._header_timer is None:
            self._header_timer = self._loop.call_later(self.header_timeout,
                                                       self._header_timed_out)

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timed_out(self) -> None:
        self._header_timer = None
        peer = self.transport.get_extra_info("peername") if self.transport else None
        self.logger.info("closed a connection from %s: its request headers did not arrive "
                         "within %g s", peer, self.header_timeout)
        self.force_close()

    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # a response is under way: nothing can be sent
            return super().handle_error(request, status, exc, message)
        if status >= 500:
            self.logger.error("error handling a request from %s: %s", request.remote,
                              _loggable(exc))
            error = ApiError(status, "internal server error", code="internal_error")
        else:
            # The client's fault: one line at INFO, the offending input never echoed back.
            self.logger.info("rejected a malformed request from %s: %s", request.remote,
                             _loggable(exc))
            error = ApiError(status, _client_message(status, exc), code=_client_code(status))
        response = web.json_response(error.body(), status=status)
        response.force_close()
        return response


def _describe(exc: BaseException | None) -> str:
    return "unknown error" if exc is None else f"{type(exc).__name__}: {exc}"


def _loggable(exc: BaseException | None) -> str:
    """`exc` as one log line: redacted, its line breaks (aiohttp's parser errors quote the
    offending bytes over several lines) made spaces, cut to _MAX_LOGGED_LINE."""
    return " ".join(redact(_describe(exc)).split())[:_MAX_LOGGED_LINE]


def _client_message(status: int, exc: BaseException | None) -> str:
    name = type(exc).__name__ if exc is not None else ""
    if name == "LineTooLong" or status == HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE:
        return "a request line or header is too long (an API key is about 50 characters)"
    if status == HTTPStatus.REQUEST_ENTITY_TOO_LARGE:
        return "the request is too large"
    return "the request is not valid HTTP"


def _client_code(status: int) -> str:
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_")
    except ValueError:
        return "bad_request"


class _Server(Server):
    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """aiohttp's AppRunner whose connections are `_Handler`s: aiohttp's own errors in OpenAI's
    shape, and `header_timeout` (seconds; None: no bound) on request headers."""

    def __init__(self, app: web.Application, *,
                 header_timeout: float | None = DEFAULT_HEADER_TIMEOUT_S, **kwargs: Any) -> None:
        super().__init__(app, header_timeout=header_timeout, **kwargs)

    async def _make_server(self) -> Server:
        server = await super()._make_server()
        server.__class__ = _Server  # the same server, building the handler above
        return server


Site = tuple[web.Application, str, int]


def serve(app: web.Application, host: str, port: int, *, extra: Sequence[Site] = (),
          shutdown_timeout: float = 60.0,
          on_listening: Callable[[list[tuple[str, int]]], None] | None = None,
          **runner_kwargs: Any) -> None:
    """Serve `app` (and the `extra` applications on their own addresses) until SIGINT or
    SIGTERM; returns after a graceful shutdown. `on_listening` gets each site's bound (host,
    port) once all listen (a port 0 is bound to a free one). OSError when an address is taken."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    main = loop.create_task(_serve([(app, host, port), *extra], shutdown_timeout,
                                   on_listening, runner_kwargs))
    try:
        loop.run_until_complete(main)
    except (web.GracefulExit, KeyboardInterrupt):
        pass
    finally:
        main.cancel()
        with contextlib.suppress(asyncio.CancelledError, web.GracefulExit):
            loop.run_until_complete(main)
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def _bind(host: str, port: int) -> list[socket.socket]:
    """A listening socket on every address `host` names (as aiohttp's TCPSite listens: a
    "localhost" that is ::1 and 127.0.0.1 answers on both); one port for all of them."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        for family, _, _, _, address in dict.fromkeys(infos):
            bound_port = sockets[0].getsockname()[1] if sockets else port  # port 0: the first's
            sock = socket.create_server((address[0], bound_port), family=family, backlog=128,
                                        dualstack_ipv6=False)
            sock.setblocking(False)
            sockets.append(sock)
    except OSError as exc:  # one line for the CLI: which address, and why
        for sock in sockets:
            sock.close()
        raise OSError(f"cannot listen on {host}:{port}: "
                      f"{(exc.strerror or str(exc)).lower()}") from None
    return sockets


async def _serve(sites: list[Site], shutdown_timeout: float,
                 on_listening: Callable[[list[tuple[str, int]]], None] | None,
                 runner_kwargs: dict[str, Any]) -> None:
    # Every address is bound before any application starts, so a port in use fails at once,
    # before a start-up that has effects (a database created, a demo key printed).
    sockets = [_bind(host, port) for _, host, port in sites]
    runners: list[web.AppRunner] = []
    try:
        for i, ((app, _, _), site_sockets) in enumerate(zip(sites, sockets, strict=True)):
            # Only the main application's runner handles signals; the others stop with it.
            runner = Runner(app, handle_signals=i == 0, shutdown_timeout=shutdown_timeout,
                            **runner_kwargs)
            runners.append(runner)
            await runner.setup()
            for sock in site_sockets:
                await web.SockSite(runner, sock).start()
        if on_listening is not None:
            on_listening([(host, int(site_sockets[0].getsockname()[1]))
                          for (_, host, _), site_sockets in zip(sites, sockets, strict=True)])
        await asyncio.Event().wait()  # until a signal raises GracefulExit
    finally:
        for started in reversed(runners):
            await started.cleanup()
        for site_sockets in sockets:
            for sock in site_sockets:
                sock.close()


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait for `event` at most `timeout` seconds; whether it is set. Unlike a loop around
    `asyncio.wait_for` (Python 3.11), a cancellation that comes as the event is set is never
    swallowed, so a background loop built on this always stops when cancelled."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True

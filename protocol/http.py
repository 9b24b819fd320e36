"""The aiohttp side of the protocol, shared by the engine server and the gateway: the error
middleware (every error in OpenAI's shape, never an HTML page or a traceback), reading a form
body, a bearer token and a number in the query string, and the headers of an SSE response.

Whatever a client sends as a body is its own mistake when it cannot be read: a body that is
not in its Content-Encoding or whose chunks are malformed (aiohttp raises these while it is
read, wherever that is) and a form that does not parse (`read_form`) are 400s, never 500s.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware
from multidict import MultiDictProxy

from protocol.errors import ApiError, bad_request

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


class SSEResponse(web.StreamResponse):
    """A response for a stream of events, its headers (SSE_HEADERS) sent with its first write.

    aiohttp's StreamResponse sends its headers alone as soon as it is prepared: a send of its
    own, on the event loop's time, in every stream. Both of fairgate's servers prepare a stream
    only once its first event is ready, so the headers would leave with it anyway; buffered as
    aiohttp's `Response` buffers them, they go in the same send (and an end written with
    `write_eof(data)` goes in the last one)."""

    _send_headers_immediately = False  # aiohttp's switch (3.11+); `Response` has it off too

    def __init__(self) -> None:
        super().__init__(headers=SSE_HEADERS)


_KEPT_HEADERS = ("Allow", "Retry-After")


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status, headers=error.headers())


def error_middleware(logger: logging.Logger) -> Middleware:
    """A middleware answering ApiError, aiohttp's HTTP errors and anything unexpected (logged
    without the request body, answered 500) in OpenAI's error shape."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            return error_response(exc)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            error = ApiError(exc.status, _message(exc), code=_code(exc))
            response = error_response(error)
            response.headers.update({k: v for k, v in exc.headers.items() if k in _KEPT_HEADERS})
            return response
        except (web.RequestPayloadError, HttpProcessingError):
            return error_response(UNREADABLE_BODY)
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            logger.exception("unexpected error in %s %s", request.method, request.path)
            return error_response(ApiError(500, "internal server error", code="internal_error"))

    return middleware


UNREADABLE_BODY = bad_request("the request body cannot be read: it is not in its "
                              "Content-Encoding, or its chunked encoding is malformed",
                              code="invalid_body")
FormValue = str | bytes | bytearray | web.FileField  # what aiohttp's form readers give
_FORM_REASON_CHARS = 200  # of the form reader's own words, in the 400


def client_timeout(timeout_s: float) -> ApiError:
    """The 408 of a body that did not arrive within the server's body timeout."""
    return ApiError(408, f"the request body did not arrive within {timeout_s:g} s",
                    code="client_timeout")


async def read_form(request: web.Request, timeout_s: float) -> MultiDictProxy[FormValue]:
    """The request's form (urlencoded or multipart), sent within `timeout_s` (else 408); 400
    for a form that does not parse (a multipart body without its boundary or with garbage, a
    charset Python does not know, bytes that are not in the charset)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await request.post()
    except TimeoutError:
        raise client_timeout(timeout_s) from None
    except (ValueError, LookupError, RuntimeError, AssertionError) as exc:
        # what aiohttp's form readers raise on a body they cannot parse: ValueError (no
        # boundary, a missing name, undecodable bytes), LookupError (an unknown charset),
        # RuntimeError (an unknown Content-Transfer-Encoding), AssertionError (a part
        # header it does not expect)
        reason = str(exc)[:_FORM_REASON_CHARS] or type(exc).__name__
        raise bad_request(f"the form body cannot be read: {reason}",
                          code="invalid_form") from None


def _message(exc: web.HTTPException) -> str:
    if exc.status == 413:
        return "the request body is too large"
    return exc.reason


def _code(exc: web.HTTPException) -> str:
    if exc.status == 413:
        return "request_too_large"
    return exc.reason.lower().replace(" ", "_")


def bearer(request: web.Request) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (the scheme in any case); None
    without one."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def query_float(request: web.Request, name: str, default: float | None, not_number: str,
                within: Callable[[float], bool] = lambda _: True,
                outside: str = "") -> float | None:
    """The query parameter `name` as a number (`default` when absent); a 400 naming it with
    `not_number` when it is not one, with `outside` when `within(value)` fails."""
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise bad_request(not_number, name) from None
    if not within(value):
        raise bad_request(outside, name)
    return value

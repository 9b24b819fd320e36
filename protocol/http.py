"""The aiohttp side of the protocol, shared by the engine server and the gateway: the error
middleware (every error in OpenAI's shape, never an HTML page or a traceback) and the
headers of an SSE response."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from protocol.errors import ApiError

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
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
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception:
            logger.exception("unexpected error in %s %s", request.method, request.path)
            return error_response(ApiError(500, "internal server error", code="internal_error"))

    return middleware


def _message(exc: web.HTTPException) -> str:
    if exc.status == 413:
        return "the request body is too large"
    return exc.reason


def _code(exc: web.HTTPException) -> str:
    if exc.status == 413:
        return "request_too_large"
    return exc.reason.lower().replace(" ", "_")

"""The OpenAI endpoints: read and validate, admit, wait for dispatch, run, stream back.

Failure paths never become a bare 500: every exception is mapped to an OpenAI error (before the
stream starts) or an error event (after). A client that goes away is noticed by aiohttp
cancelling the handler (handler_cancellation) or by a failed write; either way the backend
iterator is closed, which aborts the engine request, and a request still queued is removed and
charged nothing.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web

from gateway.backends import Backend, BackendFailed, BackendUnavailable, Outcome
from gateway.service import Admission
from gateway.state import AUTH, GATEWAY, SETTINGS
from protocol.errors import ApiError
from protocol.http import SSEResponse, client_timeout
from protocol.openai import OpenAIRequest, error_event, parse_json_body, parse_request
from protocol.sse import DONE

log = logging.getLogger("fairgate.gateway")
CLIENT_GONE = 499  # nginx's code for "client closed request", recorded in usage
_ERROR_WRITE_S = 5.0  # the error event at the end of a broken stream, to a client that reads


async def read_json(request: web.Request) -> dict[str, Any]:
    settings = request.app[SETTINGS]
    length = request.content_length
    if length is not None and length > settings.max_body_bytes:
        raise _too_large(settings.max_body_bytes)
    try:
        if request.content.is_eof():  # the whole body came with the head: no wait to bound
            raw = await request.read()
        else:
            async with asyncio.timeout(settings.client_timeout_s):
                raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise _too_large(settings.max_body_bytes) from None
    except TimeoutError:
        raise client_timeout(settings.client_timeout_s) from None
    return parse_json_body(raw)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"the request body is larger than {limit} bytes",
                    code="request_too_large")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "completions")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, "chat")


async def _handle(request: web.Request, endpoint: str) -> web.StreamResponse:
    principal = await request.app[AUTH].tenant(request)
    gw = request.app[GATEWAY]
    req: OpenAIRequest | None = None
    try:
        req = parse_request(await read_json(request), endpoint)
        req.token_ids = None  # a client's prompt_token_ids: the engine extension is ours to send
        adm, future = await gw.admit(principal, req)
    except ApiError as exc:
        gw.record_rejection(principal, req, exc.status)
        raise
    try:
        backend = await adm.wait(future, gw.queue_timeout(principal.tenant))
        # The request timeout is a deadline the stream itself checks: one that passes after the
        # first byte must end the stream with an error event, not just stop writing.
        deadline = asyncio.get_running_loop().time() + gw.config.request_timeout_s
        for retried in (False, True):
            try:
                if req.stream:
                    return await _stream(request, adm, backend, deadline)
                async with asyncio.timeout_at(deadline):
                    return await _whole(adm, backend)
            except BackendFailed as exc:
                # it broke before any byte reached the client: another replica takes it, once
                other = None if retried else gw.dispatcher.failover(adm.item, backend,
                                                                    req.model, exc.reason)
                if other is None:
                    raise
                log.warning("failover: %s failed before answering (%s); %s takes the request",
                            backend.name, exc, other.name)
                backend = adm.backend = other
                adm.outcome = Outcome(prompt_tokens=adm.cost.prompt_tokens)
        raise AssertionError("unreachable")  # the loop returns or raises
    except ApiError as exc:
        adm.settle(exc.status)
        raise
    except BackendUnavailable as exc:
        adm.settle(503)
        raise ApiError(503, str(exc), code="backend_unavailable",
                       retry_after=exc.retry_after) from None
    except TimeoutError:
        adm.settle(504)
        raise _request_timeout(gw.config.request_timeout_s) from None
    except (asyncio.CancelledError, ConnectionError):
        adm.settle(CLIENT_GONE)
        raise
    finally:
        adm.settle(500)  # only reached unsettled by an unexpected error


def _request_timeout(seconds: float) -> ApiError:
    return ApiError(504, f"the request did not finish within {seconds:g} s", code="timeout")


async def _whole(adm: Admission, backend: Backend) -> web.Response:
    body = await backend.complete(adm.job, adm.outcome)
    adm.settle(200)
    return web.Response(body=body, content_type="application/json")


async def _stream(request: web.Request, adm: Admission, backend: Backend,
                  deadline: float) -> web.StreamResponse:
    """The stream, under one deadline from the first event to the last write: a client that
    stops reading cannot hold its seat past it. Headers wait for the first event: an error
    that comes before any token (bad params, overload, the deadline) still gets a proper
    status code. After the first byte an error travels as an SSE error event (`_broken`).
    Once `[DONE]` is written the request is settled as served (200): a client that hangs up
    as soon as it reads it (many do) was answered, whatever the end of the stream then meets
    (a closing transport, a cancelled handler, the backend's own end)."""
    events = backend.stream(adm.job, adm.outcome)
    resp: web.StreamResponse | None = None  # once its headers went out
    try:
        try:
            async with asyncio.timeout_at(deadline):
                first = await anext(events, b"")
                started = SSEResponse()
                await started.prepare(request)  # the headers go with the first write
                resp = started
                await _write(resp, first, adm)
                async for chunk in events:
                    if not adm.settled:  # nothing goes after [DONE]; the rest is read all the same
                        await _write(resp, chunk, adm)
                await resp.write_eof()  # a stream that ended without [DONE]
            status = 200
        except (ConnectionError, ApiError, BackendUnavailable, TimeoutError) as exc:
            if resp is None or (isinstance(exc, ConnectionError) and not adm.settled):
                raise  # nothing sent yet (the status code says it), or the client is gone
            status = await _broken(request, resp, adm, events, exc)
        adm.settle(status)
        return resp
    finally:
        await events.aclose()


async def _broken(request: web.Request, resp: web.StreamResponse, adm: Admission,
                  events: Any, exc: Exception) -> int:
    """A stream that failed after its first byte (a backend's error, the deadline; a client
    gone after [DONE]): an error event to the client unless it was answered already. The
    status the request settles with."""
    if adm.settled:  # after [DONE]: nothing more is the client's; no event after the end
        log.debug("after [DONE]: %s", exc)
        return 200
    if isinstance(exc, ApiError):
        err = exc
    elif isinstance(exc, TimeoutError):
        err = _request_timeout(adm.gateway.config.request_timeout_s)
    else:
        err = ApiError(503, str(exc), code="backend_error")
    await events.aclose()  # the engine's seat is free before the client hears why
    try:
        async with asyncio.timeout(_ERROR_WRITE_S):
            await resp.write(error_event(err) + DONE)
            await resp.write_eof()
    except (TimeoutError, ConnectionError, asyncio.CancelledError):
        # It will not read even this: hang up. (A write cut off by the deadline leaves
        # aiohttp's drain waiter cancelled, so the next write raises CancelledError at once;
        # a cancellation of this task itself still propagates.)
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
        if request.transport is not None:
            request.transport.abort()
    return err.status


async def _write(resp: web.StreamResponse, chunk: bytes, adm: Admission) -> None:
    if chunk.endswith(DONE):  # a backend's stream ends with it (after any usage chunk)
        await resp.write_eof(chunk)  # its last events and the body's end in one send
        adm.streamed()
        adm.settle(200)
        return
    await resp.write(chunk)
    adm.streamed()  # the first token's event, once it is written

"""The engine's HTTP server: OpenAI API, load and stats for gateways and the tuner, live
reconfiguration, Prometheus metrics.

Errors always use OpenAI's shape; unexpected ones are logged and answered 500 in that shape.
With keys (EngineAccess), `/v1/*`, `/load` and `/stats` want `Authorization: Bearer <api_key>`
and `/admin/*` the admin key; health, readiness and `/metrics` stay open, as vLLM's do.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import hmac
import logging
import math
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.async_engine import AsyncEngine, EngineOverloaded, EngineStopped, RequestOutput
from engine.config import EngineAccess
from engine.metrics import EngineMetrics, register_process_metrics
from engine.openai_api import generation_request
from protocol.errors import ApiError, bad_request
from protocol.http import SSEResponse, bearer, error_middleware, query_float
from protocol.openai import (
    ResponseWriter,
    error_event,
    invalid_value,
    parse_json_body,
    parse_request,
)
from protocol.sse import DONE

logger = logging.getLogger("fairgate.engine.server")

DEFAULT_CLIENT_MAX_SIZE = 4 * 1024 * 1024
ENGINE_KEY = web.AppKey("engine", AsyncEngine)
METRICS_KEY = web.AppKey("metrics", EngineMetrics)


async def freeze_startup_heap(app: web.Application) -> None:
    """Move everything allocated at startup (the model, imports, pools) out of the garbage
    collector's reach. A full collection walks every object: with SQLAlchemy or torch loaded that
    is a 50-100 ms pause of the event loop, which lands in the p99 of whatever request is in
    flight. Long-running servers only: call it once, after startup.

    Unfrozen at exit: the interpreter's last collections skip frozen objects, so triton's
    nanobind objects would outlive their module and print "nanobind: leaked ..." lines."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however many apps froze
    atexit.register(gc.unfreeze)


def install_fast_event_loop() -> None:
    """Use uvloop when it is installed: it roughly halves the event loop's cost per request,
    which is most of a proxy's work."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def make_app(engine: AsyncEngine, *, client_max_size: int = DEFAULT_CLIENT_MAX_SIZE,
             access: EngineAccess | None = None) -> web.Application:
    """An app serving `engine`; its startup starts the engine and its cleanup shuts it down.
    `access`: the keys its routes want (None: every route open)."""
    app = web.Application(middlewares=[error_middleware(logger),
                                       key_middleware(access or EngineAccess())],
                          client_max_size=client_max_size)
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = EngineMetrics(engine)  # vLLM's names too: engine.config.metrics_compat
    register_process_metrics(app[METRICS_KEY].registry)
    app.cleanup_ctx.append(_engine_context)
    # Abort open streams before aiohttp waits for their handlers to end.
    app.on_shutdown.append(_shutdown_engine)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", healthz)  # the path vLLM and SGLang serve
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/load", load)
    app.router.add_get("/stats", stats)
    app.router.add_post("/admin/reconfigure", reconfigure)
    app.router.add_get("/admin/config", current_config)
    app.router.add_get("/metrics", metrics)
    return app


# ---- keys -------------------------------------------------------------------------------------
API_KEY_PATHS = ("/v1/", "/load", "/stats")  # what a gateway and a load generator call
ADMIN_PATHS = ("/admin/",)


def key_middleware(access: EngineAccess) -> Middleware:
    """401 for a request to a keyed route without its key, in the gateway's words (OpenAI's
    shape and codes); the key is compared in constant time."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path.startswith(ADMIN_PATHS):
            if access.effective_admin_key is not None and not _matches(
                    request, access.effective_admin_key):
                raise ApiError(401, "an admin key is required for /admin/*",
                               code="invalid_admin_key")
        elif path.startswith(API_KEY_PATHS) and access.api_key is not None:
            if bearer(request) is None:
                raise ApiError(401, "You didn't provide an API key. You need to provide your "
                               "API key in an Authorization header using Bearer auth (i.e. "
                               "Authorization: Bearer YOUR_KEY).", code="missing_api_key")
            if not _matches(request, access.api_key):
                raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return await handler(request)

    return middleware


def _matches(request: web.Request, key: str) -> bool:
    return hmac.compare_digest((bearer(request) or "").encode(), key.encode())


async def _engine_context(app: web.Application) -> AsyncIterator[None]:
    engine, observer = app[ENGINE_KEY], app[METRICS_KEY]
    engine.add_observer(observer)
    await engine.start()
    yield
    engine.remove_observer(observer)
    await engine.shutdown()


async def _shutdown_engine(app: web.Application) -> None:
    await app[ENGINE_KEY].shutdown()


async def _read_json(request: web.Request) -> dict[str, Any]:
    return parse_json_body(await request.read())  # over client_max_size: aiohttp's 413


# ---- OpenAI API ------------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    req = parse_request(await _read_json(request), "chat" if chat else "completions")
    gen = generation_request(req, engine.tokenizer, engine.config.resolved_max_model_len,
                             engine.config.accepted_model_names)
    request_id = uuid.uuid4().hex
    writer = ResponseWriter(request_id, chat, engine.model_name, req.include_usage)
    outputs = engine.generate(request_id, gen.prompt_token_ids, gen.params, tenant=req.tenant,
                              priority=req.priority or "interactive",
                              tenant_weight=req.tenant_weight)
    # aclosing: a client that leaves (write error, cancelled handler) aborts its request
    async with contextlib.aclosing(outputs):
        first = await _first_output(outputs)
        if req.stream:
            return await _stream(request, writer, first, outputs)
        return await _whole(writer, first, outputs)


async def _first_output(outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    """The first output, or the request's rejection as an API error (nothing sent yet)."""
    try:
        return await anext(outputs)
    except ValueError as exc:
        raise invalid_value(exc) from None
    except EngineOverloaded as exc:
        raise ApiError(503, str(exc), code="engine_overloaded",
                       retry_after=exc.retry_after) from None
    except EngineStopped as exc:
        raise ApiError(503, str(exc), code="engine_stopped") from None


async def _whole(writer: ResponseWriter, first: RequestOutput,
                 outputs: AsyncGenerator[RequestOutput, None]) -> web.Response:
    last, parts = first, [first.text]
    while not last.finished:
        last = await anext(outputs)
        parts.append(last.text)
    _raise_for_failure(last)
    return web.json_response(writer.whole("".join(parts), last.finish_reason,
                                          last.num_prompt_tokens, last.num_output_tokens))


def _raise_for_failure(output: RequestOutput) -> None:
    failure = _failure(output)
    if failure is not None:
        raise failure


def _failure(output: RequestOutput) -> ApiError | None:
    if output.finish_reason == "error":
        return ApiError(500, "the engine failed while generating this request",
                        code="engine_error")
    if output.finish_reason == "abort":
        return ApiError(503, "the request was aborted (engine shutting down or reconfiguring)",
                        code="request_aborted")
    return None


async def _stream(request: web.Request, writer: ResponseWriter, first: RequestOutput,
                  outputs: AsyncGenerator[RequestOutput, None]) -> web.StreamResponse:
    """The events as they come, in as few sends as they allow: the headers and the role chunk
    with the first token, the last token with the end (its error, the usage, [DONE])."""
    response = SSEResponse()
    await response.prepare(request)  # the headers go with the first write
    try:
        opening = writer.role_chunk()  # b"" for completions
        if not (first.text or first.finished):  # no event of its own yet: the role goes now
            await response.write(opening)
            opening = b""
        last, end = await _stream_outputs(response, writer, first, outputs, opening)
        if last.finish_reason == "error":
            failure = _failure(last)
            assert failure is not None
            end += error_event(failure)
        if writer.include_usage:
            end += writer.usage_chunk(last.num_prompt_tokens, last.num_output_tokens)
        await response.write_eof(end + DONE)
    except ConnectionResetError:
        logger.debug("client left during %s", writer.id)
    return response


async def _stream_outputs(response: web.StreamResponse, writer: ResponseWriter,
                          output: RequestOutput, outputs: AsyncGenerator[RequestOutput, None],
                          opening: bytes) -> tuple[RequestOutput, bytes]:
    """Each unfinished output's event as it comes, `opening` (the role chunk) in the first
    send; the last output and its event, not sent: the stream's end goes with it."""
    while not output.finished:
        if output.text:
            await response.write(opening + writer.chunk(output.text, output.finish_reason))
            opening = b""
        output = await anext(outputs)
    return output, opening + writer.chunk(output.text, output.finish_reason)


async def models(request: web.Request) -> web.Response:
    """A card per served name, the id first, as vLLM's: `root` is the model itself, which a
    request may name too (an alias, not listed)."""
    config = request.app[ENGINE_KEY].config
    cards = [{"id": name, "object": "model", "created": 0, "owned_by": "fairgate",
              "root": config.model, "parent": None, "max_model_len": config.max_model_len}
             for name in config.served_model_names]
    return web.json_response({"object": "list", "data": cards})


# ---- health, load, stats ---------------------------------------------------------------------
async def healthz(request: web.Request) -> web.Response:
    alive = request.app[ENGINE_KEY].is_running
    return web.json_response({"status": "ok" if alive else "down"}, status=200 if alive else 503)


async def readyz(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if not engine.is_running:
        return web.json_response({"status": "not ready"}, status=503)
    return web.json_response({"status": "ready", "model": engine.model_name,
                              "reconfiguring": engine.load()["reconfiguring"]})


async def load(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE_KEY].load())


def _query_seconds(request: web.Request, name: str, default: float | None) -> float | None:
    message = f"'{name}' must be a non-negative number of seconds"
    return query_float(request, name, default, message, lambda s: 0 <= s < math.inf, message)


async def stats(request: web.Request) -> web.Response:
    window = _query_seconds(request, "window", 60.0)
    assert window is not None
    if window == 0:
        raise bad_request("'window' must be > 0 seconds", "window")
    engine = request.app[ENGINE_KEY]
    slos = {name: _query_seconds(request, name, None)
            for name in ("slo_ttft", "slo_tpot", "slo_itl")}  # TTFT, TPOT per request; ITL per gap
    return web.json_response(engine.stats_window(window, **slos))


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS_KEY].registry)
    response = web.Response(body=body)
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    response.charset = "utf-8"
    return response


# ---- reconfiguration -------------------------------------------------------------------------
async def current_config(request: web.Request) -> web.Response:
    """The configuration the engine runs under now (what a reconfigure would go back to)."""
    engine = request.app[ENGINE_KEY]
    return web.json_response({"config": engine.config.to_dict(),
                              "reconfiguring": engine.load()["reconfiguring"]})


async def reconfigure(request: web.Request) -> web.Response:
    """Body: {"changes": {knob: value}, "abort_running": false, "drain_timeout": null}, or the
    knobs at the top level. Answers when the engine runs under the new configuration."""
    engine = request.app[ENGINE_KEY]
    body = await _read_json(request)
    options = ("abort_running", "drain_timeout")
    changes = body.get("changes", {k: v for k, v in body.items() if k not in options})
    abort_running = body.get("abort_running", False)
    drain_timeout = body.get("drain_timeout")
    if not isinstance(changes, dict) or not changes:
        raise ApiError(400, "give the knobs to change in 'changes'", param="changes")
    if not isinstance(abort_running, bool):
        raise ApiError(400, "'abort_running' must be a boolean", param="abort_running")
    if drain_timeout is not None and (isinstance(drain_timeout, bool) or not isinstance(
            drain_timeout, (int, float)) or not 0 <= drain_timeout < math.inf):
        raise ApiError(400, "'drain_timeout' must be a number of seconds", param="drain_timeout")
    before = engine.now()
    try:
        config = await engine.reconfigure(changes, abort_running, drain_timeout)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="changes") from None
    except EngineStopped as exc:
        raise ApiError(503, str(exc), code="engine_stopped") from None
    return web.json_response({"config": config.to_dict(),
                              "drain_time_s": engine.now() - before})

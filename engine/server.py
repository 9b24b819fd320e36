"""The engine's HTTP server: OpenAI API, load and stats for gateways and the tuner, live
reconfiguration, Prometheus metrics.

Errors always use OpenAI's shape; unexpected ones are logged and answered 500 in that shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from engine.async_engine import AsyncEngine, EngineOverloaded, EngineStopped, RequestOutput
from engine.metrics import EngineMetrics
from engine.openai_api import (
    ApiError,
    GenerationRequest,
    ResponseShaper,
    error_body,
    invalid_input,
    parse_json_body,
    parse_request,
    sse,
    usage,
)

logger = logging.getLogger("fairgate.engine.server")

DEFAULT_CLIENT_MAX_SIZE = 4 * 1024 * 1024
ENGINE_KEY = web.AppKey("engine", AsyncEngine)
METRICS_KEY = web.AppKey("metrics", EngineMetrics)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def freeze_startup_heap(app: web.Application) -> None:
    """Move everything allocated at startup (the model, imports, pools) out of the garbage
    collector's reach. A full collection walks every object: with SQLAlchemy or torch loaded that
    is a 50-100 ms pause of the event loop, which lands in the p99 of whatever request is in
    flight. Long-running servers only: call it once, after startup."""
    gc.collect()
    gc.freeze()


def install_fast_event_loop() -> None:
    """Use uvloop when it is installed: it roughly halves the event loop's cost per request,
    which is most of a proxy's work."""
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def make_app(engine: AsyncEngine, *, metrics_compat: str | None = None,
             client_max_size: int = DEFAULT_CLIENT_MAX_SIZE) -> web.Application:
    """An app serving `engine`; its startup starts the engine and its cleanup shuts it down."""
    app = web.Application(middlewares=[error_middleware], client_max_size=client_max_size)
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = EngineMetrics(engine, metrics_compat)
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
    app.router.add_get("/metrics", metrics)
    return app


async def _engine_context(app: web.Application) -> AsyncIterator[None]:
    engine, observer = app[ENGINE_KEY], app[METRICS_KEY]
    engine.add_observer(observer)
    await engine.start()
    yield
    engine.remove_observer(observer)
    await engine.shutdown()


async def _shutdown_engine(app: web.Application) -> None:
    await app[ENGINE_KEY].shutdown()


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = ApiError(exc.status, exc.reason, code=_http_code(exc.status))
        headers = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}
        return web.json_response(error.body(), status=exc.status, headers=headers)
    except Exception:
        logger.exception("unhandled error on %s %s", request.method, request.path)
        return web.json_response(error_body("internal server error", "server_error"), status=500)


def _http_code(status: int) -> str | None:
    return {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)


async def _read_json(request: web.Request) -> dict[str, Any]:
    return parse_json_body(await request.read())  # over client_max_size: aiohttp's 413


# ---- OpenAI API ------------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await _read_json(request)
    parsed = parse_request(body, chat, engine.tokenizer, engine.config, engine.model_name)
    request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    shaper = ResponseShaper(request_id, engine.model_name, chat, parsed.include_usage)
    outputs = engine.generate(request_id, parsed.prompt_token_ids, parsed.params,
                              tenant=parsed.tenant, priority=parsed.priority,
                              tenant_weight=parsed.tenant_weight)
    # aclosing: a client that leaves (write error, cancelled handler) aborts its request
    async with contextlib.aclosing(outputs):
        first = await _first_output(outputs)
        if parsed.stream:
            return await _stream(request, shaper, first, outputs)
        return await _whole(shaper, parsed, first, outputs)


async def _first_output(outputs: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    """The first output, or the request's rejection as an API error (nothing sent yet)."""
    try:
        return await anext(outputs)
    except ValueError as exc:
        raise invalid_input(exc) from None
    except EngineOverloaded as exc:
        seconds = str(max(1, math.ceil(exc.retry_after)))
        raise ApiError(503, str(exc), code="engine_overloaded",
                       headers={"Retry-After": seconds}) from None
    except EngineStopped as exc:
        raise ApiError(503, str(exc), code="engine_stopped") from None


async def _whole(shaper: ResponseShaper, parsed: GenerationRequest, first: RequestOutput,
                 outputs: AsyncGenerator[RequestOutput, None]) -> web.Response:
    last, parts = first, [first.text]
    while not last.finished:
        last = await anext(outputs)
        parts.append(last.text)
    _raise_for_failure(last)
    counts = usage(last.num_prompt_tokens, last.num_output_tokens)
    return web.json_response(shaper.full("".join(parts), last.finish_reason, counts))


def _raise_for_failure(output: RequestOutput) -> None:
    if output.finish_reason == "error":
        raise ApiError(500, "the engine failed while generating this request",
                       code="engine_error")
    if output.finish_reason == "abort":
        raise ApiError(503, "the request was aborted (engine shutting down or reconfiguring)",
                       code="request_aborted")


async def _stream(request: web.Request, shaper: ResponseShaper, first: RequestOutput,
                  outputs: AsyncGenerator[RequestOutput, None]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
    await response.prepare(request)
    try:
        if shaper.chat:
            await response.write(sse(shaper.chunk("", None, role=True)))
        last = await _stream_outputs(response, shaper, first, outputs)
        if last.finish_reason == "error":
            await response.write(sse(error_body("the engine failed while generating this "
                                                "request", "server_error", code="engine_error")))
        if shaper.include_usage:
            counts = usage(last.num_prompt_tokens, last.num_output_tokens)
            await response.write(sse(shaper.usage_chunk(counts)))
        await response.write(b"data: [DONE]\n\n")
    except ConnectionResetError:
        logger.debug("client left during %s", shaper.request_id)
    return response


async def _stream_outputs(response: web.StreamResponse, shaper: ResponseShaper,
                          output: RequestOutput, outputs: AsyncGenerator[RequestOutput, None]
                          ) -> RequestOutput:
    while True:
        if output.text or output.finished:
            await response.write(sse(shaper.chunk(output.text, output.finish_reason)))
        if output.finished:
            return output
        output = await anext(outputs)


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    card = {"id": engine.model_name, "object": "model", "created": 0, "owned_by": "fairgate",
            "max_model_len": engine.config.max_model_len}
    return web.json_response({"object": "list", "data": [card]})


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
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise ApiError(400, f"'{name}' must be a non-negative number of seconds", param=name)
    return value


async def stats(request: web.Request) -> web.Response:
    window = _query_seconds(request, "window", 60.0)
    assert window is not None
    if window == 0:
        raise ApiError(400, "'window' must be > 0 seconds", param="window")
    engine = request.app[ENGINE_KEY]
    return web.json_response(engine.stats_window(
        window, _query_seconds(request, "slo_ttft", None), _query_seconds(request, "slo_itl", None)))


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS_KEY].registry)
    response = web.Response(body=body)
    response.content_type = CONTENT_TYPE_LATEST.split(";")[0]
    response.charset = "utf-8"
    return response


# ---- reconfiguration -------------------------------------------------------------------------
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

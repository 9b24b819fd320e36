"""The load generator: send a workload's requests on schedule to an OpenAI-compatible streaming
endpoint and time every token.

`run_workload(workload, target) -> Report` is the library entry point (the tuner calls it); the
`fairgate bench` command is a thin shell around it. Works against fairgate's gateway and engine,
vLLM and SGLang: requests carry `max_tokens` + `ignore_eos` so outputs have the traced length.

Speed matters: the load generator must never be the bottleneck it measures. One ClientSession
whose connector limit equals the concurrency, requests built just in time, SSE parsed per network
read (`protocol.sse`) and one timestamp per read (not per token).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import yarl

from protocol.openai import server_root
from protocol.sse import SSEReader, read_chunk
from protocol.validators import check_choice, check_http_url, check_number, check_positive_int
from tuner.report import OK, Report, RequestResult
from tuner.traces import TraceRequest
from tuner.workload import (
    TOKENIZERS,
    Limits,
    LoadShape,
    Synthetic,
    TokensToText,
    TraceReplay,
    Workload,
    build_requests,
    get_workload,
)

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class BenchError(Exception):
    """The run cannot start (unreachable server, bad target): one line for the user."""


@dataclass(frozen=True)
class Target:
    """Where to send: base URL (with or without /v1), default key, API flavour, model."""

    url: str
    api_key: str | None = None
    endpoint: str = "completions"
    model: str | None = None  # None = first id of GET /v1/models, else "default"

    def __post_init__(self) -> None:
        check_choice("endpoint", self.endpoint, ENDPOINTS)
        check_http_url("--url", self.url)

    @property
    def base(self) -> str:
        return server_root(self.url)


@dataclass(frozen=True)
class RunOptions:
    max_concurrency: int | None = None  # None = open loop: every request leaves on schedule
    slo_ttft: float | None = None  # seconds, each request's TTFT (goodput)
    slo_tpot: float | None = None  # seconds, each request's TPOT (goodput)
    slo_itl: float | None = None  # seconds, every gap between tokens (ITL attainment)
    request_timeout: float = 600.0
    tokenizer: str = "byte"  # a key of TOKENIZERS, used when no tokens_to_text is given
    salt: int | None = None  # prompt-text salt; None = random, so runs never share a cache
    extra_body: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_concurrency is not None:
            check_positive_int("max_concurrency", self.max_concurrency)
        check_number("request_timeout", self.request_timeout, low=0, open_low=True)
        for name in ("slo_ttft", "slo_tpot", "slo_itl"):
            if getattr(self, name) is not None:
                check_number(name, getattr(self, name), low=0, open_low=True)
        check_choice("tokenizer", self.tokenizer, TOKENIZERS)


@dataclass(frozen=True)
class Progress:
    done: int
    total: int
    failed: int
    elapsed: float


ProgressFn = Callable[[Progress], None]
StopFn = Callable[[RequestResult], bool]  # a request finished; True: send nothing more


async def run_workload(
    workload: Workload | str | Sequence[TraceRequest],
    target: Target | str,
    *,
    shape: LoadShape | None = None,
    limits: Limits | None = None,
    options: RunOptions | None = None,
    tokens_to_text: TokensToText | None = None,
    on_progress: ProgressFn | None = None,
    stop: StopFn | None = None,
) -> Report:
    """Send every request of `workload` (a name, a `Workload`, or ready requests) and measure;
    `stop` (asked as each request finishes) ends the run early."""
    target = Target(target) if isinstance(target, str) else target
    options = options or RunOptions()
    requests = _requests(workload, shape, limits)
    salt = options.salt if options.salt is not None else secrets.randbits(31)
    text = tokens_to_text or TOKENIZERS[options.tokenizer](salt)
    connector = aiohttp.TCPConnector(limit=options.max_concurrency or 0, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=options.request_timeout)
    # No cookies, no decompression: per-request work the measurement never needs.
    async with aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
    ) as session:
        # Any key of the run may ask the models: a mix's tenants may bring their own.
        keys = list(dict.fromkeys([target.api_key, *(r.api_key for r in requests)]))
        model = target.model or await discover_model(session, target, keys)
        sender = _Sender(session, target, model, text, options)
        text(1, 0)  # builds the text pool now, not inside the first timed request
        results, duration = await _dispatch(requests, sender, options, on_progress, stop)
    config = {
        "url": target.url,
        "endpoint": target.endpoint,
        "model": model,
        "requests": len(requests),
        "max_concurrency": options.max_concurrency,
    }
    return Report(results, duration, slo_ttft=options.slo_ttft, slo_tpot=options.slo_tpot,
                  slo_itl=options.slo_itl, config=config)


def _requests(
    workload: Workload | str | Sequence[TraceRequest],
    shape: LoadShape | None,
    limits: Limits | None,
) -> list[TraceRequest]:
    if isinstance(workload, str):
        return build_requests(get_workload(workload), shape, limits)
    if isinstance(workload, Synthetic | TraceReplay):
        return build_requests(workload, shape, limits)
    return list(workload)


def run_workload_sync(*args: Any, **kwargs: Any) -> Report:
    """`run_workload` for callers without an event loop."""
    return asyncio.run(run_workload(*args, **kwargs))


async def discover_model(session: aiohttp.ClientSession, target: Target,
                         api_keys: Sequence[str | None] = ()) -> str:
    """The first model id the server lists, asked with each of `api_keys` (default: the
    target's) until one is not refused; "default" when it lists none. BenchError when it
    refuses them all (401, 403): every request would be refused too, and a guessed model
    would hide why."""
    url = target.base + "/v1/models"
    refused = ""
    for key in api_keys or (target.api_key,):
        try:
            async with session.get(url, headers=_headers(key),
                                   timeout=aiohttp.ClientTimeout(total=10)) as resp:
                if resp.status in (401, 403):
                    refused = f"{resp.status} ({_error_message(await resp.read())})"
                    continue
                if resp.status != 200:
                    return "default"
                return _first_model(await resp.json(content_type=None))
        except (aiohttp.ClientConnectionError, TimeoutError) as exc:
            raise BenchError(f"cannot reach {target.url}: {exc or type(exc).__name__}") from None
        except (aiohttp.ClientError, ValueError):
            return "default"
    why = ("it refused every API key given" if any(api_keys or (target.api_key,)) else
           "it wants an API key: give --api-key KEY")
    raise BenchError(f"GET {url} answered {refused}; {why}")


def _first_model(data: Any) -> str:
    models = data.get("data") if isinstance(data, dict) else None
    if models and isinstance(models[0], dict) and "id" in models[0]:
        return str(models[0]["id"])
    return "default"


def _headers(api_key: str | None) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


async def _dispatch(
    requests: Sequence[TraceRequest],
    sender: _Sender,
    options: RunOptions,
    on_progress: ProgressFn | None,
    stop: StopFn | None = None,
) -> tuple[list[RequestResult], float]:
    """Release each request at its arrival time (or when a concurrency slot frees up). `stop`
    is told each finished request; once it says so, nothing more is sent and the requests in
    flight are cancelled (their results stay without a first token or an end). An error
    raised by `stop` ends the run and is raised here."""
    results = [RequestResult(i, r.tenant, r.priority, r.arrival) for i, r in enumerate(requests)]
    limit = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
    tasks: set[asyncio.Task[None]] = set()
    stopped = asyncio.Event()
    stop_error: list[BaseException] = []

    def finisher(result: RequestResult) -> Callable[[asyncio.Task[None]], None]:
        def finished(task: asyncio.Task[None]) -> None:
            if stop is None or stopped.is_set() or task.cancelled():
                return
            try:
                if stop(result):
                    stopped.set()
            except Exception as exc:  # noqa: BLE001 - re-raised by the dispatcher below
                stop_error.append(exc)
                stopped.set()

        return finished

    t0 = time.perf_counter()
    ticker = asyncio.create_task(_tick(results, t0, on_progress)) if on_progress else None
    stop_waiter: asyncio.Task[Any] = asyncio.create_task(stopped.wait())
    try:
        for req, result in zip(requests, results, strict=True):
            delay = t0 + req.arrival - time.perf_counter()
            if delay > 0:
                await asyncio.wait({stop_waiter}, timeout=delay)
            if stopped.is_set():
                break
            if limit is not None:
                await limit.acquire()
                if stopped.is_set():
                    limit.release()
                    break
            task = asyncio.create_task(sender.send(req, result, t0))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            task.add_done_callback(finisher(result))
            if limit is not None:
                task.add_done_callback(lambda _t: limit.release())
        while tasks and not stopped.is_set():
            done, _ = await asyncio.wait({*tasks, stop_waiter},
                                         return_when=asyncio.FIRST_COMPLETED)
            for finished_task in done - {stop_waiter}:
                finished_task.result()  # a sender's own error surfaces as before
    finally:
        stop_waiter.cancel()
        for task in tasks:
            task.cancel()
        if ticker is not None:
            ticker.cancel()
    if stop_error:
        raise stop_error[0]
    duration = time.perf_counter() - t0
    if on_progress:
        on_progress(_progress(results, duration))
    return results, duration


def _progress(results: list[RequestResult], elapsed: float) -> Progress:
    done = sum(r.e2e is not None or (r.status != OK) for r in results)
    failed = sum(r.status != OK for r in results)
    return Progress(done, len(results), failed, elapsed)


async def _tick(results: list[RequestResult], t0: float, on_progress: ProgressFn) -> None:
    while True:
        on_progress(_progress(results, time.perf_counter() - t0))
        await asyncio.sleep(0.25)


class _Sender:
    """Builds one request's body, sends it and times its stream."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        target: Target,
        model: str,
        text: TokensToText,
        options: RunOptions,
    ) -> None:
        self.session = session
        self.target = target
        self.url = yarl.URL(target.base + ENDPOINTS[target.endpoint])  # parsed once, not per send
        self.model = model
        self.text = text
        self.extra = dict(options.extra_body)
        self._headers: dict[str | None, dict[str, str]] = {}

    def body(self, req: TraceRequest, seed: int) -> bytes:
        prompt = (req.prompt if req.prompt is not None
                  else self.text(req.prompt_tokens, seed, req.prefix_hashes, req.block_tokens))
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": req.output_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        if self.target.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if req.priority is not None:
            body["priority"] = req.priority
        if req.tenant != "default":
            body["user"] = req.tenant
        body.update(self.extra)
        return json.dumps(body).encode()

    def headers(self, api_key: str | None) -> dict[str, str]:
        key = api_key or self.target.api_key
        if key not in self._headers:
            self._headers[key] = _headers(key)
        return self._headers[key]

    async def send(self, req: TraceRequest, result: RequestResult, t0: float) -> None:
        data = self.body(req, result.index)
        result.prompt_tokens = req.prompt_tokens
        start = time.perf_counter()
        result.start = start - t0
        try:
            async with self.session.post(
                self.url, data=data, headers=self.headers(req.api_key)
            ) as resp:
                if resp.status != 200:
                    result.status = f"HTTP {resp.status}"
                    result.error = _error_message(await resp.read())
                elif resp.content_type == "application/json":
                    _read_whole(await resp.read(), start, result)
                else:
                    await _read_stream(resp, start, result)
        except TimeoutError:
            result.status, result.error = "timeout", f"no answer in {self.session.timeout.total} s"
        except aiohttp.ClientConnectorError as exc:
            result.status, result.error = "connection error", str(exc)
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            # A broken or garbled stream is a result to count, never a crash of the whole run.
            result.status, result.error = "stream error", str(exc) or type(exc).__name__


def _error_message(body: bytes) -> str:
    """OpenAI's {"error": {"message": ...}} when present, else the start of the body."""
    text = body.decode("utf-8", errors="replace")
    try:
        err = json.loads(text).get("error")
        message = err.get("message") if isinstance(err, dict) else err
        if message:
            return str(message)
    except (ValueError, AttributeError):
        pass
    return text[:200]


async def _read_stream(resp: aiohttp.ClientResponse, start: float, result: RequestResult) -> None:
    """Stamp each token event (protocol.sse.read_chunk decides which are: the gateway and the
    shadow sender count the same ones); garbled JSON raises ValueError, a stream error."""
    stamps: list[float] = []  # one per token-carrying event
    usage: dict[str, Any] | None = None
    reader = SSEReader()
    async for chunk in resp.content.iter_any():
        now = time.perf_counter()  # events in one network read arrived together
        tokens = 0
        for event in reader.feed(chunk):
            read = read_chunk(event.data)
            if read.error:
                result.status, result.error = "stream error", _error_message(event.data)
                return
            usage = read.usage or usage
            tokens += read.token
        if tokens:
            stamps.extend([now] * tokens)
    _finish(result, start, time.perf_counter(), stamps, usage)


def _finish(
    result: RequestResult,
    start: float,
    end: float,
    stamps: list[float],
    usage: dict[str, Any] | None,
) -> None:
    if not stamps:
        result.status, result.error = "stream error", "the stream ended without any tokens"
        return
    result.ttft = stamps[0] - start
    result.e2e = end - start
    result.itl = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    result.output_tokens = int(usage.get("completion_tokens", 0) if usage else 0) or len(stamps)
    if usage and usage.get("prompt_tokens"):
        result.prompt_tokens = int(usage["prompt_tokens"])


def _read_whole(body: bytes, start: float, result: RequestResult) -> None:
    """A server that ignored `stream: true`: one answer, TTFT = e2e, no gaps."""
    end = time.perf_counter()
    try:
        usage = json.loads(body).get("usage") or {}
    except (ValueError, AttributeError):
        result.status, result.error = "stream error", "the answer is not JSON"
        return
    tokens = int(usage.get("completion_tokens") or 1)
    _finish(result, start, end, [end], {"completion_tokens": tokens, **usage})

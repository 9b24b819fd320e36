"""Where dispatched requests run: the embedded AsyncEngine or remote engines over HTTP.

A backend answers four questions for the dispatcher and the proxy: how many tokens is this
prompt (`count_prompt`), is there room for one more request (`has_room`, from the engine's load
so that queueing happens in the gateway, where fairness applies; a shared engine's room counts
other gateways' requests on it), how loaded is it (`outstanding_tokens`: its queued and running
work, what least-loaded routing weighs), and run this job (`stream` / `complete`). Both kinds
emit OpenAI bytes; the proxy never reformats them.

A backend that fails before any byte of an answer reached the client (`BackendFailed`: the
connection refused, reset or hung up, or a 5xx that is not overload) lets the proxy hand the
request to another replica, once, within the retry budget (gateway/dispatch.py). Each remote
backend tells the pool how every request ended, and the pool ejects a replica that keeps failing
(gateway/outlier.py): ejected, it takes no new requests until its ejection ends.

A remote backend that stops answering (a hung or SIGSTOPped engine) fails its requests with 504
`backend_timeout`: a stream that has no first token within `first_byte_timeout_s` or then goes
silent for `stall_timeout_s`, a non-streamed answer that is not back within `first_byte_timeout_s`
while the backend fails its health checks (its whole answer comes at once, so only liveness
tells a long answer from a hung engine), or whose body stalls. The connection is closed and the
backend is marked down until a health check passes: dispatch goes to the others meanwhile.

Token counting for remote backends: a fairgate engine serving a `random:*` model uses the
byte-level tokenizer (exact); `gateway.tokenizer` names a tokenizer.json for real checkpoints
(exact); otherwise an estimate of one token per 4 characters of UTF-8.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import socket
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from engine.request import SamplingParams
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from gateway.config import (
    DEFAULT_FIRST_BYTE_TIMEOUT_S,
    DEFAULT_STALL_TIMEOUT_S,
    BackendConfig,
    OutlierDetectionConfig,
)
from gateway.outlier import OutlierDetector, Verdict
from gateway.upstream import (
    Response,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamTimeout,
)
from protocol.errors import ApiError
from protocol.openai import (
    OpenAIRequest,
    ResponseWriter,
    prompt_text,
    prompt_token_ids,
    token_choices,
)
from protocol.sse import DONE, SSEReader, encode_event, sse_json

log = logging.getLogger("fairgate.gateway")
KV_HIGH_WATER = 0.95  # above this KV usage the engine is about to preempt; hold new work back
HEALTH_TIMEOUT_S = 2.0  # a health check (/load, /v1/models) not answered in this: down
HEALTH_INTERVAL_S = 1.0  # health checks alone (no load to track: down, or an OpenAI server)


class BackendUnavailable(Exception):
    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class BackendFailed(BackendUnavailable):
    """The backend broke (connection refused, reset or cut) rather than refusing the request:
    while the client has seen no byte of the answer, another replica may take it (once).
    `reason`: the retry's label in fairgate_gateway_retries_total."""

    reason = "reset"


class BackendUnreachable(BackendFailed):
    """No connection to the backend could be made: nothing was sent."""

    reason = "connect_failure"


class BackendErrored(BackendFailed, ApiError):
    """The backend answered a 5xx that is not overload: another replica may take the request,
    and when none does, the client gets 502 `bad_gateway` with the engine's message."""

    reason = "5xx"
    retry_after: float

    def __init__(self, message: str, retry_after: float) -> None:
        ApiError.__init__(self, 502, message, code="bad_gateway")
        self.retry_after = retry_after


RECENT_HORIZON_S = 0.05  # an embedded or OpenAI backend: dispatched work not yet started


class RecentWork:
    """Estimated tokens of requests handed to a backend that its own load figures may not
    show yet (a remote /load is up to one poll old; a dispatched request starts in a later
    event-loop turn)."""

    def __init__(self) -> None:
        self._items: deque[tuple[float, int]] = deque()
        self.total = 0

    def add(self, tokens: int) -> None:
        self._items.append((time.monotonic(), tokens))
        self.total += tokens

    def drop_before(self, t: float) -> int:
        """Forget what was handed before `t` (monotonic); the total left."""
        while self._items and self._items[0][0] < t:
            self.total -= self._items.popleft()[1]
        return self.total


@dataclass
class Job:
    request_id: str
    req: OpenAIRequest
    tenant: str
    priority: str
    prompt_tokens: int  # as counted at admission (remote: possibly an estimate)
    params: SamplingParams  # max_tokens resolved: the request's own, else the context's room
    tenant_weight: float = 1.0  # the tenant's weight, for the engine's `fair` policy
    # The client set no max_tokens and no tenant limit capped the default: a remote engine
    # applies the same default (protocol.openai) to its own exact prompt count.
    default_max_tokens: bool = False

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    def writer(self) -> ResponseWriter:
        return ResponseWriter(self.request_id, self.req.chat, self.req.model or "",
                              self.req.include_usage)


# fairgate engine extensions: the gateway's to set (the caller's tenant, its weight and
# priority), never a client's to pass on
ENGINE_EXTENSIONS = ("tenant", "tenant_weight", "priority")


def engine_body(job: Job, model: str, stream: bool, fairgate: bool) -> dict[str, Any]:
    """The body an engine gets for `job`: the client's, with the model to run, max_tokens
    resolved, usage asked for when streamed, and the fairgate extensions the gateway's own
    (a `fairgate` engine) or none of them (any other server, which gets vLLM's per-tenant
    prefix-cache salt). The shadow copies of a request are this body too."""
    body = {k: v for k, v in job.req.body.items()
            if k not in ENGINE_EXTENSIONS and k != "max_completion_tokens"}
    body.update(model=model, stream=stream, max_tokens=job.max_tokens)
    if job.default_max_tokens:
        del body["max_tokens"]
    if stream:  # always ask for usage: it settles the tenant's charge exactly
        body["stream_options"] = {"include_usage": True}
    if fairgate:
        body.update(tenant=job.tenant, priority=job.priority, tenant_weight=job.tenant_weight)
    else:
        body["cache_salt"] = job.tenant  # vLLM's per-tenant prefix-cache isolation
    return body


@dataclass
class Outcome:
    """What the proxy learns while a job runs (for settling, usage and metrics)."""

    prompt_tokens: int
    completion_tokens: int = 0
    finish_reason: str | None = None
    usage_reported: bool = False  # True once the backend said the exact counts
    chunk_times: list[float] = field(default_factory=list)  # when each token-bearing event left


class Backend(Protocol):
    name: str
    model_name: str
    max_model_len: int
    inflight: int
    healthy: bool
    sent: int  # requests handed to it (`dispatched`), ever

    def capacity(self) -> int: ...
    def seats(self) -> int: ...
    def has_room(self) -> bool: ...
    def outstanding_tokens(self) -> int: ...
    def dispatched(self, tokens: int) -> None: ...
    def count_prompt(self, req: OpenAIRequest) -> int: ...
    async def start(self) -> None: ...
    async def close(self) -> None: ...
    def stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]: ...
    async def complete(self, job: Job, outcome: Outcome) -> bytes: ...


def room_from_load(load: dict[str, Any], inflight: int, slack: int, others: int = 0) -> bool:
    """Dispatch while fewer than max_num_seqs (+ `slack`, so the next step never waits for
    the gateway) are in flight, ours and `others` (other gateways' requests on a shared
    engine), and the KV cache is not about to preempt. The engine's own `waiting` count is not
    used for ours: between steps it holds our just-sent requests, and a remote /load is up to
    one poll old, so it would hold back work the engine has room for."""
    if inflight + others >= int(load.get("max_num_seqs", 64)) + slack:
        return False
    return inflight == 0 or float(load.get("kv_usage", 0.0)) < KV_HIGH_WATER


class EmbeddedBackend:
    """An AsyncEngine in this process."""

    def __init__(self, engine: Any, slack: int = 4, name: str = "embedded") -> None:
        self.engine = engine
        self.name = name
        self.slack = slack
        self.model_name = str(getattr(engine, "model_name", engine.config.model))
        self.max_model_len = int(engine.config.max_model_len)
        self.tokenizer: Tokenizer = engine.tokenizer
        self.inflight = 0
        self.healthy = True
        self.recent = RecentWork()
        self.sent = 0

    def capacity(self) -> int:
        return self.seats() + self.slack

    def seats(self) -> int:
        return int(self.engine.config.max_num_seqs)

    def has_room(self) -> bool:
        return room_from_load(self.engine.load(), self.inflight, self.slack)

    def outstanding_tokens(self) -> int:
        recent = self.recent.drop_before(time.monotonic() - RECENT_HORIZON_S)
        return int(self.engine.load().get("outstanding_tokens", 0)) + recent

    def dispatched(self, tokens: int) -> None:
        self.recent.add(tokens)
        self.sent += 1

    def count_prompt(self, req: OpenAIRequest) -> int:
        return len(prompt_token_ids(req, self.tokenizer))

    async def start(self) -> None:
        await self.engine.start()

    async def close(self) -> None:
        await self.engine.shutdown()

    async def _outputs(self, job: Job) -> AsyncGenerator[Any, None]:
        from engine.async_engine import EngineOverloaded

        try:
            gen = self.engine.generate(job.request_id, prompt_token_ids(job.req, self.tokenizer),
                                       job.params, tenant=job.tenant,
                                       priority=job.priority,
                                       tenant_weight=job.tenant_weight)
            first = await anext(gen)
        except EngineOverloaded as exc:
            raise BackendUnavailable(str(exc), float(exc.retry_after)) from None
        except ValueError as exc:
            raise ApiError(400, str(exc), code="invalid_value") from None
        except StopAsyncIteration:
            return
        except RuntimeError as exc:  # EngineStopped: shutting down or crashed
            raise BackendUnavailable(f"engine unavailable: {exc}", 5.0) from None
        try:
            yield first
            async for out in gen:
                yield out
        except (ValueError, RuntimeError) as exc:  # the engine failed this request mid-way
            raise ApiError(502, f"engine error: {exc}", code="engine_error") from None
        finally:
            await gen.aclose()  # early close aborts the engine request

    async def stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]:
        writer = job.writer()
        opening = writer.role_chunk()  # sent with the first output: errors before it keep
        async for out in self._outputs(job):  # their status code
            _note(outcome, out)
            if out.text or out.finished:
                yield opening + writer.chunk(out.text,
                                             outcome.finish_reason if out.finished else None)
                opening = b""
        if job.req.include_usage:
            yield writer.usage_chunk(outcome.prompt_tokens, outcome.completion_tokens)
        yield DONE

    async def complete(self, job: Job, outcome: Outcome) -> bytes:
        writer = job.writer()
        parts = []
        async for out in self._outputs(job):
            _note(outcome, out)
            parts.append(out.text)
        body = writer.whole("".join(parts), outcome.finish_reason, outcome.prompt_tokens,
                            outcome.completion_tokens)
        return json.dumps(body, separators=(",", ":")).encode()


def _note(outcome: Outcome, out: Any) -> None:
    outcome.completion_tokens = int(out.num_output_tokens)
    outcome.prompt_tokens = int(out.num_prompt_tokens)
    outcome.usage_reported = True
    if out.new_token_ids:
        outcome.chunk_times.append(time.perf_counter())
    if out.finished:
        reason = out.finish_reason
        outcome.finish_reason = str(getattr(reason, "value", reason) or "stop")


class RemoteBackend:
    """A `fairgate engine` server or any OpenAI-compatible server, over HTTP."""

    def __init__(self, config: BackendConfig, *, default_max_model_len: int,
                 tokenizer_file: str | None = None, poll_interval: float = 0.05,
                 retry_after: float = 5.0, slack: int = 4,
                 on_change: Callable[[], None] | None = None,
                 first_byte_timeout: float = DEFAULT_FIRST_BYTE_TIMEOUT_S,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT_S,
                 on_result: Callable[[Backend, Verdict], None] | None = None) -> None:
        """`first_byte_timeout`, `stall_timeout`: the gateway's defaults; the backend's own
        config entry wins. `on_result`: told how each request ended (a pool sets it to its
        outlier detection when none is given)."""
        self.config = config
        self.name = config.base_url
        self.model_name = config.model or ""
        self.max_model_len = config.max_model_len or default_max_model_len
        self.inflight = 0
        self.healthy = False
        self._down_until = 0.0  # monotonic: not healthy again before this
        self.load: dict[str, Any] = {}
        self.recent = RecentWork()  # sent since the last /load was asked for
        self.sent = 0
        self.others = 0  # other gateways' requests on the engine, as of the last /load
        self._own_tokens = 0  # an OpenAI server (no /load): the work of our requests on it
        self.poll_interval = poll_interval
        self.retry_after = retry_after
        self.slack = slack
        self.on_change = on_change
        self.on_result = on_result
        self.first_byte_timeout = _own_or(config.first_byte_timeout_s, first_byte_timeout)
        self.stall_timeout = _own_or(config.stall_timeout_s, stall_timeout)
        self.tokenizer: Tokenizer | None = HFTokenizer(tokenizer_file) if tokenizer_file else None
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._http = UpstreamPool(config.base_url, headers)
        self._poller: asyncio.Task[None] | None = None

    @property
    def fairgate(self) -> bool:
        return self.config.kind == "fairgate"

    def capacity(self) -> int:
        if self.fairgate and self.load:
            return self.seats() + self.slack
        return self.config.max_inflight

    def seats(self) -> int:
        if self.fairgate and self.load:
            return int(self.load.get("max_num_seqs", 64))
        return self.config.max_inflight

    def has_room(self) -> bool:
        if not self.healthy:
            return False
        if self.fairgate:
            return room_from_load(self.load, self.inflight, self.slack, self.others)
        return self.inflight < self.config.max_inflight

    def outstanding_tokens(self) -> int:
        """Queued and running work (estimated tokens), the engine's as of its last /load (every
        gateway's) plus what this gateway sent since; an OpenAI server: ours alone."""
        if self.fairgate:
            return int(self.load.get("outstanding_tokens") or 0) + self.recent.total
        return self._own_tokens + self.recent.drop_before(time.monotonic() - RECENT_HORIZON_S)

    def dispatched(self, tokens: int) -> None:
        self.recent.add(tokens)
        self.sent += 1

    def count_prompt(self, req: OpenAIRequest) -> int:
        if isinstance(req.prompt, list):
            return len(req.prompt)
        if self.tokenizer is not None:
            return len(prompt_token_ids(req, self.tokenizer))
        return len(prompt_text(req).encode()) // 4 + 1  # documented estimate: ~4 bytes a token

    # ---- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.refresh()
        self._poller = asyncio.create_task(self._poll(), name=f"poll {self.name}")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        self._http.close()

    async def refresh(self) -> None:
        """Read /load (fairgate) or /v1/models (others); any failure marks the backend down."""
        asked, ours = time.monotonic(), self.inflight
        try:
            if not self.model_name:
                await self._discover_model()
            elif not self.fairgate:
                await self._get_json("/v1/models")
            if self.fairgate:
                self.load = await self._get_json("/load")
                self.recent.drop_before(asked)
                held = sum(int(self.load.get(k) or 0) for k in ("running", "waiting", "swapped"))
                # what the engine holds beyond ours: other gateways' requests. Approximate for
                # one poll: a request of ours still on its way makes it an undercount; one of
                # ours that ended (or whose client left) after the engine's snapshot, an
                # overcount. Ours that ended while it was asked are gone from its answer too.
                self.others = max(0, held - min(ours, self.inflight))
                self.max_model_len = int(self.config.max_model_len
                                         or self.load.get("max_model_len", self.max_model_len))
            # A backend that timed out stays down for a while even when its web side answers:
            # an engine whose executor hangs still serves /load.
            self.healthy = time.monotonic() >= self._down_until
        except (UpstreamError, ValueError) as exc:
            self.mark_down(str(exc) or repr(exc))
        if self.on_change is not None:
            self.on_change()

    def mark_down(self, reason: str, hold_s: float = 0.0) -> None:
        """Unhealthy (no dispatch here) until a health check passes, and `hold_s` at least."""
        self._down_until = max(self._down_until, time.monotonic() + hold_s)
        if self.healthy:
            log.warning("backend %s is down: %s", self.name, reason)
        self.healthy = False

    async def _poll(self) -> None:
        while True:
            # /load is load tracking; without it (down, or an OpenAI server) this is a health
            # check, and once a second is enough.
            await asyncio.sleep(self.poll_interval if self.healthy and self.fairgate
                                else HEALTH_INTERVAL_S)
            await self.refresh()

    async def _get_json(self, path: str) -> dict[str, Any]:
        resp = await self._http.request("GET", path, timeout=HEALTH_TIMEOUT_S)
        try:
            if resp.status >= 400:
                raise UpstreamError(f"GET {path}: HTTP {resp.status}")
            raw = await resp.read()
        finally:
            resp.close()
        try:
            data = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"GET {path} did not return JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"GET {path} did not return a JSON object")
        return data

    async def _discover_model(self) -> None:
        data = await self._get_json("/v1/models")
        models = data.get("data") or []
        self.model_name = str(models[0]["id"]) if models else "default"
        if self.tokenizer is None and self.model_name.startswith("random:"):
            self.tokenizer = ByteTokenizer()

    # ---- requests ---------------------------------------------------------------------------
    def _body(self, job: Job, stream: bool) -> bytes:
        body = engine_body(job, self.model_name, stream, self.fairgate)
        return json.dumps(body, separators=(",", ":")).encode()

    async def _post(self, job: Job, stream: bool) -> Response:
        """The backend's response to `job` (status < 400; the caller closes it)."""
        path = "/v1/chat/completions" if job.req.endpoint == "chat" else "/v1/completions"
        try:
            resp = await self._http.request(
                "POST", path, self._body(job, stream), timeout=self.first_byte_timeout,
                patience=None if stream else self._while_healthy)
            if resp.status < 400:
                return resp
            try:
                error = await _upstream_error(resp, self.retry_after)
            finally:
                resp.close()
        except UpstreamTimeout as exc:
            raise self._timed_out(exc) from None
        except UpstreamError as exc:
            raise self._unreachable(exc) from None
        raise error

    def _while_healthy(self) -> float | None:
        """A non-streamed answer comes whole at the end: past the first-byte timeout it is
        still awaited while the backend passes its health checks (looked at again as often as
        they run)."""
        return HEALTH_INTERVAL_S if self.healthy else None

    def _unreachable(self, exc: UpstreamError) -> BackendFailed:
        """Down until the next poll finds it again; the request may go to another replica (no
        byte of an answer reached the client; an engine that got it aborts it with the
        connection)."""
        self.mark_down(str(exc))
        kind = BackendUnreachable if isinstance(exc, UpstreamConnectError) else BackendFailed
        return kind(f"engine backend {self.name} unreachable: {exc}", self.retry_after)

    def _timed_out(self, exc: UpstreamTimeout) -> ApiError:
        """A backend that stopped answering answers no one: down until a health check
        passes, and this request fails (its connection is already closed)."""
        self.mark_down(str(exc), hold_s=self.retry_after)
        return ApiError(504, f"engine backend {self.name} timed out: {exc}",
                        code="backend_timeout")

    def _broken(self, exc: UpstreamError) -> BackendFailed:
        """A response cut off after it started: this request failed, the backend may be fine
        (the next poll says); other requests are not turned away for it."""
        return BackendFailed(f"engine backend {self.name} failed mid-response: {exc}",
                                  self.retry_after)

    @contextlib.contextmanager
    def _working(self, job: Job) -> Iterator[None]:
        cost = job.prompt_tokens + job.max_tokens
        self._own_tokens += cost
        try:
            yield
        finally:
            self._own_tokens -= cost

    @contextlib.contextmanager
    def _judged(self) -> Iterator[None]:
        """Tell `on_result` how the request ended: failed (a 5xx that is not overload, no
        connection, a reset, a timeout) or OK (an answer, or a 4xx: the client's mistake).
        Overload and a client that left (GeneratorExit, cancellation) tell nothing."""
        try:
            yield
        except BackendUnavailable as exc:
            if isinstance(exc, BackendFailed):
                self._report(Verdict.FAILED)
            raise
        except ApiError as exc:
            self._report(Verdict.FAILED if exc.status >= 500 else Verdict.OK)
            raise
        self._report(Verdict.OK)

    def _report(self, verdict: Verdict) -> None:
        if self.on_result is not None:
            self.on_result(self, verdict)

    async def stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]:
        with self._working(job), self._judged():
            # closed with this one, so the upstream connection is shut before aclose returns
            async with contextlib.aclosing(self._stream(job, outcome)) as inner:
                async for chunk in inner:
                    yield chunk

    async def _stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]:
        resp = await self._post(job, stream=True)
        reader = SSEReader()
        streaming = False  # the first token came: from now on only a stall times out
        try:
            while data := await resp.next_chunk():
                out = b"".join([_pass_event(e.data, job, outcome) for e in reader.feed(data)])
                if not streaming and outcome.chunk_times:
                    resp.watch_stalls(self.stall_timeout)
                    streaming = True
                if out:
                    yield out
        except UpstreamTimeout as exc:
            raise self._timed_out(exc) from None
        except UpstreamError as exc:
            raise self._broken(exc) from None
        finally:
            resp.close()

    async def complete(self, job: Job, outcome: Outcome) -> bytes:
        with self._working(job), self._judged():
            return await self._complete(job, outcome)

    async def _complete(self, job: Job, outcome: Outcome) -> bytes:
        resp = await self._post(job, stream=False)
        try:
            resp.watch_stalls(self.stall_timeout)
            raw = await resp.read()
        except UpstreamTimeout as exc:
            raise self._timed_out(exc) from None
        except UpstreamError as exc:
            raise self._broken(exc) from None
        finally:
            resp.close()
        try:
            body = json.loads(raw)
            usage = body.get("usage") or {}
            outcome.prompt_tokens = int(usage.get("prompt_tokens", outcome.prompt_tokens))
            outcome.completion_tokens = int(usage.get("completion_tokens", 0))
            outcome.usage_reported = "completion_tokens" in usage
            outcome.finish_reason = (body.get("choices") or [{}])[0].get("finish_reason")
        except (ValueError, AttributeError, TypeError, IndexError):
            raise ApiError(502, "the engine backend returned a malformed response",
                           code="bad_gateway") from None
        body["model"] = job.req.model
        return json.dumps(body, separators=(",", ":")).encode()


def _own_or(own: float | None, default: float) -> float:
    return default if own is None else own


_PLAIN_TOKEN, _PLAIN_TOKEN_SPACED = b'"finish_reason":null', b'"finish_reason": null'
_USAGE_KEY, _USAGE, _USAGE_SPACED = b'"usage"', b'"usage":{', b'"usage": {'
_NULL_USAGE_TAILS = (b',"usage":null}', b', "usage": null}')  # the last key of the object
_ERROR, _ROLE = b'"error"', b'"role"'


def _pass_event(data: bytes, job: Job, outcome: Outcome) -> bytes:
    """One SSE event's data from the backend: note tokens and usage, drop the usage the
    client did not ask for (the event, and the `usage: null` of every chunk: OpenAI sends
    neither then), pass the rest on (re-encoded with LF line ends)."""
    asked = job.req.include_usage
    if not asked and data.endswith(_NULL_USAGE_TAILS):
        # Top-level for sure (it closes the object), so no parse is needed to drop it.
        data = data[:data.rindex(b",")] + b"}"
    if _plain_token(data, asked):
        outcome.chunk_times.append(time.perf_counter())
        if not outcome.usage_reported:
            outcome.completion_tokens += 1
        return encode_event(data)
    if data.strip() == b"[DONE]":
        return DONE
    try:
        obj = json.loads(data)
    except ValueError:
        return b""
    if not isinstance(obj, dict):
        return b""
    usage = obj.get("usage")
    if usage:
        outcome.prompt_tokens = int(usage.get("prompt_tokens", outcome.prompt_tokens))
        outcome.completion_tokens = int(usage.get("completion_tokens", 0))
        outcome.usage_reported = True
    choices = obj.get("choices")
    if "error" in obj:
        return sse_json(obj)
    if not choices:
        return encode_event(data) if (usage and asked) else b""
    if token_choices(choices):
        outcome.chunk_times.append(time.perf_counter())
        if not outcome.usage_reported:
            outcome.completion_tokens += 1
    reason = choices[0].get("finish_reason")
    if reason:
        outcome.finish_reason = reason
    if "usage" in obj and not asked:
        obj.pop("usage")
        return sse_json(obj)
    return encode_event(data)


def _plain_token(data: bytes, asked_for_usage: bool) -> bool:
    """A token and nothing else: the common case, passed on without a JSON parse. These byte
    patterns cannot come from generated text: JSON escapes the quotes inside strings."""
    if (_PLAIN_TOKEN not in data and _PLAIN_TOKEN_SPACED not in data) or (
            _ERROR in data or _ROLE in data):
        return False
    if asked_for_usage:  # `usage: null` passes as it is; counts are read by the slow path
        return _USAGE not in data and _USAGE_SPACED not in data
    return _USAGE_KEY not in data


async def _upstream_error(resp: Response, retry_after: float) -> Exception:
    """An engine's error, kept in OpenAI's shape; overload becomes 503 with Retry-After, another
    5xx a failure another replica may retry."""
    raw = await resp.read()
    try:
        err = json.loads(raw).get("error") or {}
        message = str(err.get("message") or raw[:200].decode(errors="replace"))
    except (ValueError, AttributeError):
        err, message = {}, raw[:200].decode(errors="replace")
    if resp.status in (429, 503):
        header = resp.headers.get("retry-after", "")
        wait = float(header) if header.replace(".", "", 1).isdigit() else retry_after
        return BackendUnavailable(f"engine backend overloaded: {message}", wait)
    if resp.status >= 500:
        return BackendErrored(f"engine backend error (HTTP {resp.status}): {message}",
                              retry_after)
    return ApiError(resp.status, message, code=err.get("code"), param=err.get("param"))


Resolver = Callable[[str, int], Awaitable[list[str]]]


async def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to now (every A and AAAA record), sorted."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class DnsGroup:
    """The replicas behind one host name (`discover: dns`, a Kubernetes headless Service): a
    backend per address it resolves to, added as addresses appear; one whose address is gone
    is drained (no new requests, its streams finish) and then closed. A failed lookup keeps
    what is there."""

    def __init__(self, config: BackendConfig, make: Callable[[BackendConfig], Backend],
                 pool: BackendPool | None = None, resolver: Resolver | None = None) -> None:
        parts = urlsplit(config.url)
        self.config, self.make, self.resolver = config, make, resolver
        self.host = parts.hostname or ""
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.pool = pool
        self.members: dict[str, Backend] = {}  # address -> backend
        self.leaving: dict[str, Backend] = {}
        self.task: asyncio.Task[None] | None = None

    def url_for(self, address: str) -> str:
        parts = urlsplit(self.config.url)
        host = f"[{address}]" if ":" in address else address
        return parts._replace(netloc=f"{host}:{self.port}").geturl()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.discover_interval_s)
            await self.refresh()

    async def refresh(self) -> None:
        assert self.pool is not None
        try:
            found = set(await (self.resolver or resolve)(self.host, self.port))
        except OSError as exc:
            log.warning("discovering %s: %s; keeping its %d backends", self.host, exc,
                        len(self.members))
            found = set(self.members)
        for address in sorted(found - set(self.members)):
            backend = self.leaving.pop(address, None)
            if backend is None:
                backend = self.make(dataclasses.replace(self.config, url=self.url_for(address),
                                                        discover=None))
                await backend.start()
                self.pool.add(backend)
                log.info("discovered %s behind %s", backend.name, self.host)
            self.pool.draining.discard(backend.name)
            self.members[address] = backend
        for address in sorted(set(self.members) - found):
            backend = self.members.pop(address)
            self.pool.draining.add(backend.name)  # no new requests; its streams finish
            self.leaving[address] = backend
            log.info("%s left %s: draining it", backend.name, self.host)
        for address, backend in list(self.leaving.items()):
            if backend.inflight == 0:
                del self.leaving[address]
                self.pool.remove(backend)
                self.pool.draining.discard(backend.name)
                await backend.close()


PREFIX_LOAD_SLACK = 2  # requests a prefix's home may hold over prefix routing's relative bound
PREFIX_HOMES = 65_536  # prefixes remembered (least recently used forgotten first)
HOMES_PER_PREFIX = 4  # replicas remembered per prefix (a hot one spills to more than one)


class PrefixHomes:
    """Where this gateway sent each prompt prefix lately: the replicas likely to hold its KV
    blocks. Keyed by chained hashes of the prompt's leading chunks, so the longest prefix seen
    before wins (a conversation's next turn finds its earlier turns' replica). Bounded (LRU)."""

    def __init__(self, capacity: int = PREFIX_HOMES) -> None:
        self.capacity = capacity
        self._homes: OrderedDict[int, list[str]] = OrderedDict()

    def lookup(self, keys: tuple[int, ...]) -> list[str]:
        """The replicas of the longest prefix known, most recent first."""
        for key in reversed(keys):
            homes = self._homes.get(key)
            if homes is not None:
                self._homes.move_to_end(key)
                return homes
        return []

    def record(self, keys: tuple[int, ...], name: str) -> None:
        for key in keys:
            homes = self._homes.pop(key, [])
            self._homes[key] = [name, *(h for h in homes if h != name)][:HOMES_PER_PREFIX]
        while len(self._homes) > self.capacity:
            self._homes.popitem(last=False)

    def __len__(self) -> int:
        return len(self._homes)


def _load(b: Backend) -> tuple[float, float]:
    return b.outstanding_tokens() / max(1, b.seats()), b.inflight / max(1, b.capacity())


def _ring_point(key: int, name: str) -> int:
    """Where `name` sits on `key`'s ring (rendezvous hashing: the same order for a key on
    every gateway replica, and a backend that leaves moves only its own keys)."""
    digest = hashlib.blake2b(f"{key}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class BackendPool:
    """All backends; dispatch goes to the least loaded with room (outstanding tokens per seat)
    among those that take new requests (`admits`: not draining, not ejected, a canary within
    its share: `limit_share`).

    `headroom` (a fraction of each backend's seats) is kept free of tenants over their weighted
    share: `pick(keep_headroom=True)` finds room for them, `pick()` for tenants under it. A
    light tenant's request then starts in the engine's next step instead of waiting for a
    backlogged tenant's request to finish, and a lone tenant still fills every seat.

    `outliers` (gateway/outlier.py) hears how each remote backend's requests end and ejects a
    replica that keeps failing."""

    def __init__(self, backends: list[Backend], headroom: float = 0.0,
                 groups: list[DnsGroup] | None = None,
                 outlier_detection: OutlierDetectionConfig | None = None) -> None:
        if not backends and not groups:
            raise ValueError("at least one backend is needed")
        self.backends = backends
        self.headroom = headroom
        self.draining: set[str] = set()  # by name: no new dispatch (a reconfigure, a rollout)
        self.groups: list[DnsGroup] = list(groups or [])  # backends found by DNS, one per address
        self.homes = PrefixHomes()  # prefix routing: where each prefix went lately
        self.outliers = OutlierDetector(outlier_detection or OutlierDetectionConfig())
        # a canary's share limit: its share, and each of its model's replicas' `sent` then
        self.shares: dict[str, tuple[float, dict[str, int]]] = {}
        self.results: list[Callable[[Backend, Verdict], None]] = []  # told as `record` is
        for backend in backends:
            self._listen(backend)

    def add(self, backend: Backend) -> None:
        self._listen(backend)
        self.backends.append(backend)

    def remove(self, backend: Backend) -> None:
        self.backends.remove(backend)
        self.outliers.records.pop(backend.name, None)

    def _listen(self, backend: Backend) -> None:
        """A remote backend's request outcomes feed outlier detection."""
        if isinstance(backend, RemoteBackend) and backend.on_result is None:
            backend.on_result = self.record

    def record(self, backend: Backend, verdict: Verdict) -> None:
        """How one of `backend`'s requests ended (`results` are told too); a replica that
        keeps failing is ejected."""
        for hear in self.results:
            hear(backend, verdict)
        replicas = [b.name for b in self.backends if b.model_name == backend.model_name]
        if self.outliers.record(backend.name, verdict, replicas):
            state = self.outliers.state(backend.name)
            log.warning("backend %s ejected for %.0f s (ejection %d): its requests fail",
                        backend.name, state["ejected_until"] - time.time(), state["ejections"])

    def admits(self, b: Backend) -> bool:
        """Whether `b` takes new requests: not draining, not ejected, within its share."""
        return (b.name not in self.draining and not self.outliers.ejected(b.name)
                and self._within_share(b))

    def limit_share(self, name: str, share: float | None) -> None:
        """From now on, at most `share` of its model's requests go to `name` (a canary; the
        others take the rest, or they wait); None lifts the limit."""
        backend = self.by_name(name)
        if share is None or backend is None:
            self.shares.pop(name, None)
            return
        self.shares[name] = (share, {b.name: b.sent for b in self.serves(backend.model_name)})

    def _within_share(self, b: Backend) -> bool:
        """Handed one more, `b` would have less than its share of what its model's replicas
        were handed since its limit was set, plus one (so the first request may go)."""
        if b.name not in self.shares:
            return True
        share, start = self.shares[b.name]
        total = sum(r.sent - start.get(r.name, 0) for r in self.serves(b.model_name))
        return b.sent - start[b.name] < share * (total + 1)

    def available(self, b: Backend) -> bool:
        """Healthy and not ejected: it can serve now (draining: only its own streams)."""
        return b.healthy and not self.outliers.ejected(b.name)

    def replica_counts(self) -> dict[str, dict[str, int]]:
        """Per model served: its replicas, how many can serve now (`available`), how many are
        ejected."""
        counts: dict[str, dict[str, int]] = {}
        for model in self.model_names():
            replicas = [b for b in self.backends if b.model_name == model]
            counts[model] = {"replicas": len(replicas),
                             "available": sum(map(self.available, replicas)),
                             "ejected": sum(self.outliers.ejected(b.name) for b in replicas)}
        return counts

    def ejection_rows(self) -> list[tuple[str, bool, int]]:
        """(name, ejected now, times ejected) per backend: the ejection metrics."""
        rows = []
        for b in self.backends:
            record = self.outliers.records.get(b.name)
            rows.append((b.name, self.outliers.ejected(b.name),
                         record.ejections_total if record else 0))
        return rows

    def by_name(self, name: str) -> Backend | None:
        return next((b for b in self.backends if b.name == name), None)

    @property
    def primary(self) -> Backend:
        return self.backends[0]

    @property
    def healthy(self) -> bool:
        return any(b.healthy for b in self.backends)

    @property
    def max_model_len(self) -> int:
        return min(b.max_model_len for b in self.backends)

    def model_names(self) -> list[str]:
        names = (getattr(b, "model_name", "") for b in self.backends)  # test doubles may lack it
        return list(dict.fromkeys(n for n in names if n))

    def _eligible(self, model: str | None, exclude: Backend | None = None) -> list[Backend]:
        """Backends that may take a request for `model`: not `exclude`, serving it (one that
        has not said its model yet serves any), admitting new requests."""
        return [b for b in self.backends
                if b is not exclude and (model is None or not b.model_name or b.model_name == model)
                and self.admits(b)]

    def _free(self, b: Backend, keep_headroom: bool) -> bool:
        return b.has_room() and not (keep_headroom and b.inflight >= b.seats() - self.reserved(b))

    def pick_affine(self, keys: tuple[int, ...], model: str | None, load_factor: float,
                    keep_headroom: bool = False) -> Backend | None:
        """Prefix routing (`keys`: the prompt's chained prefix hashes, shortest first). The
        replicas this gateway last sent its longest known prefix to (`homes`), while one has
        room and stays within the bound: `load_factor` x the average in-flight count after this
        request, plus PREFIX_LOAD_SLACK requests (a spilled request costs a whole prefill; a
        decoding one barely slows a replica). Otherwise, a prefix new here or one whose homes
        are full: the first on the key's rendezvous-hash order (the same on every gateway
        replica) among those within the bound and within `load_factor` of the least
        outstanding work per seat. None: no room."""
        candidates = self._eligible(model)
        free = [b for b in candidates if self._free(b, keep_headroom)]
        if not free:
            return None
        total = sum(b.inflight for b in candidates) + 1
        bound = math.ceil(load_factor * total / len(candidates)) + PREFIX_LOAD_SLACK
        for name in self.homes.lookup(keys):
            home = next((b for b in free if b.name == name), None)
            if home is not None and home.inflight + 1 <= bound:
                return home
        within = [b for b in free if b.inflight + 1 <= bound] or free
        least = min(_load(b)[0] for b in within)
        ring = sorted(within, key=lambda b: _ring_point(keys[0], b.name))
        return next((b for b in ring if _load(b)[0] <= load_factor * least), ring[0])

    def serves(self, model: str) -> list[Backend]:
        """The backends that serve `model` (one that has not said its model yet serves any)."""
        return [b for b in self.backends if not b.model_name or b.model_name == model]

    def capacity(self) -> int:
        """Room of the backends that take work (seats and slack): what shares are shares of."""
        return sum(b.capacity() for b in self.backends if self.available(b))

    def reserved(self, backend: Backend) -> int:
        """Seats of `backend` kept for tenants under their share (at least one stays shared)."""
        seats = backend.seats()
        return min(math.ceil(self.headroom * seats), seats - 1) if self.headroom > 0 else 0

    def pick(self, keep_headroom: bool = False, exclude: Backend | None = None,
             model: str | None = None) -> Backend | None:
        """The least loaded backend with room (`model`: among those serving it): the fewest
        outstanding tokens (queued and running work) per seat, then the fewest requests in
        flight for its room."""
        free = [b for b in self._eligible(model, exclude) if self._free(b, keep_headroom)]
        return min(free, key=_load, default=None)

    def fallback(self, exclude: Backend, model: str | None) -> Backend | None:
        """For a request whose backend failed before answering: the least loaded other healthy
        backend serving its model, with room or not (the engine queues it; failing a request
        the client was promised is worse than one over the seats)."""
        return self.pick(exclude=exclude, model=model) or min(
            (b for b in self._eligible(model, exclude) if b.healthy), key=_load, default=None)

    async def start(self) -> None:
        for b in self.backends:
            await b.start()
        for group in self.groups:
            await group.refresh()
            group.task = asyncio.create_task(group.run(), name=f"discover {group.host}")

    async def close(self) -> None:
        for group in self.groups:
            if group.task is not None:
                group.task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await group.task
        for b in list(self.backends):
            await b.close()

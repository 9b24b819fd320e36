"""The remote backend: a `fairgate engine` server or any OpenAI-compatible server, over HTTP.

A remote backend that stops answering (a hung or SIGSTOPped engine) fails its requests with 504
`backend_timeout`: a stream that has no first token within `first_byte_timeout_s` or then goes
silent for `stall_timeout_s`, a non-streamed answer that is not back within `first_byte_timeout_s`
while the backend fails its health checks (its whole answer comes at once, so only liveness
tells a long answer from a hung engine), or whose body stalls. The connection is closed and the
backend is marked down until a health check passes: dispatch goes to the others meanwhile.

Token counting: a fairgate engine serving a `random:*` model uses the byte-level tokenizer
(exact); `gateway.tokenizer` names a tokenizer.json for real checkpoints (exact); otherwise an
estimate of one token per 4 characters of UTF-8. A stream's events pass through
gateway/backends/stream.py, which notes its tokens and usage.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import Any

from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from gateway.backends.base import (
    RECENT_HORIZON_S,
    Backend,
    BackendErrored,
    BackendFailed,
    BackendUnavailable,
    BackendUnreachable,
    Job,
    Outcome,
    RecentWork,
    engine_body,
    room_from_load,
)
from gateway.backends.stream import pass_chunk
from gateway.config import DEFAULT_FIRST_BYTE_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S, BackendConfig
from gateway.outlier import Verdict
from gateway.upstream import (
    Response,
    UpstreamConnectError,
    UpstreamError,
    UpstreamPool,
    UpstreamTimeout,
)
from protocol import fastjson
from protocol.errors import ApiError
from protocol.openai import OpenAIRequest, prompt_text, prompt_token_ids
from protocol.sse import PlainTokens, SSEReader

log = logging.getLogger("fairgate.gateway")
HEALTH_TIMEOUT_S = 2.0  # a health check (/load, /v1/models) not answered in this: down
HEALTH_INTERVAL_S = 1.0  # health checks alone (no load to track: down, or an OpenAI server)


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
        self.model_aliases: tuple[str, ...] = ()  # other names requests may give for it
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
        # the backend's own tokenizer (the engine's, template included), else gateway.tokenizer,
        # which only counts: it may be another model's than this engine's
        self.tokenizer: Tokenizer | None = (
            engine_tokenizer(config.tokenizer) if config.tokenizer is not None
            else HFTokenizer(tokenizer_file) if tokenizer_file else None)
        self._count_random_models_exactly((self.model_name,))
        headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._http = UpstreamPool(config.base_url, headers)
        self._poller: asyncio.Task[None] | None = None

    @property
    def fairgate(self) -> bool:
        return self.config.kind == "fairgate"

    @property
    def engines_tokenizer(self) -> bool:
        """This gateway holds the engine's own tokenizer: its prompts go as token ids."""
        return self.fairgate and self.config.tokenizer is not None

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
        ids = [str(m["id"]) for m in models if isinstance(m, dict) and "id" in m]
        self.model_name = ids[0] if ids else "default"
        # its other served names, and the model each card is of (`root`, vLLM's field)
        roots = [str(m["root"]) for m in models if isinstance(m, dict) and m.get("root")]
        self.model_aliases = tuple(dict.fromkeys([*ids[1:], *roots]))
        self._count_random_models_exactly((self.model_name, *self.model_aliases))

    def _count_random_models_exactly(self, names: tuple[str, ...]) -> None:
        """A `random:*` model's tokenizer is the byte tokenizer: without a tokenizer of its
        own, a backend serving one counts its prompts with it (exact; they still go as text:
        encoding bytes costs the engine less than reading and checking a list of ids,
        bench/RESULTS.md, issue 28), whether its model was configured or discovered."""
        if self.tokenizer is None and any(n.startswith("random:") for n in names):
            self.tokenizer = ByteTokenizer()

    # ---- requests ---------------------------------------------------------------------------
    def _body(self, job: Job, stream: bool) -> bytes:
        body = engine_body(job, self.model_name, stream, self.fairgate, self.prompt_ids(job.req))
        return fastjson.dumps(body)

    def prompt_ids(self, req: OpenAIRequest) -> list[int] | None:
        """The prompt as the engine's own token ids, rendered once here (admission counted
        them) so the engine does not tokenize it again; None when this gateway does not hold
        the engine's tokenizer, or the prompt already is ids."""
        if not self.engines_tokenizer or isinstance(req.prompt, list):
            return None
        assert self.tokenizer is not None  # the backend's own: set with config.tokenizer
        return prompt_token_ids(req, self.tokenizer)

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

    def _broken(self, exc: UpstreamError) -> ApiError | BackendFailed:
        """A response cut off after it started: this request failed, the backend may be fine
        (the next poll says); other requests are not turned away for it. One that stopped
        answering is `_timed_out`."""
        if isinstance(exc, UpstreamTimeout):
            return self._timed_out(exc)
        return BackendFailed(f"engine backend {self.name} failed mid-response: {exc}",
                                  self.retry_after)

    def _judge(self, exc: BaseException | None) -> None:
        """Tell `on_result` how a request ended (`exc`: what it raised, None for an answer):
        failed (a 5xx that is not overload, no connection, a reset, a timeout) or OK (an
        answer, or a 4xx: the client's mistake). Overload and a client that left
        (GeneratorExit, cancellation) tell nothing."""
        if exc is None:
            self._report(Verdict.OK)
        elif isinstance(exc, BackendFailed):
            self._report(Verdict.FAILED)
        elif isinstance(exc, ApiError):
            self._report(Verdict.FAILED if exc.status >= 500 else Verdict.OK)

    def _report(self, verdict: Verdict) -> None:
        if self.on_result is not None:
            self.on_result(self, verdict)

    async def stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]:
        with _Running(self, job):
            resp = await self._post(job, stream=True)
            reader, plain = SSEReader(), PlainTokens()
            streaming = False  # the first token came: from now on only a stall times out
            try:
                while data := await resp.next_chunk():
                    out = pass_chunk(reader, plain, data, job, outcome)
                    if not streaming and outcome.chunk_times:
                        resp.watch_stalls(self.stall_timeout)
                        streaming = True
                    if out:
                        yield out
            except UpstreamError as exc:
                raise self._broken(exc) from None
            finally:
                resp.close()  # the upstream connection is shut before aclose() returns

    async def complete(self, job: Job, outcome: Outcome) -> bytes:
        with _Running(self, job):
            return await self._complete(job, outcome)

    async def _complete(self, job: Job, outcome: Outcome) -> bytes:
        resp = await self._post(job, stream=False)
        try:
            resp.watch_stalls(self.stall_timeout)
            raw = await resp.read()
        except UpstreamError as exc:
            raise self._broken(exc) from None
        finally:
            resp.close()
        try:
            body = fastjson.loads(raw)
            usage = body.get("usage") or {}
            outcome.prompt_tokens = int(usage.get("prompt_tokens", outcome.prompt_tokens))
            outcome.completion_tokens = int(usage.get("completion_tokens", 0))
            outcome.usage_reported = "completion_tokens" in usage
            outcome.finish_reason = (body.get("choices") or [{}])[0].get("finish_reason")
        except (ValueError, AttributeError, TypeError, IndexError):
            raise ApiError(502, "the engine backend returned a malformed response",
                           code="bad_gateway") from None
        if body.get("model") == job.req.model:
            return raw  # the usual answer: passed on as the engine wrote it, not encoded again
        body["model"] = job.req.model
        return fastjson.dumps(body)


class _Running:
    """A request on `backend`: its tokens in the backend's own count while it runs, and how it
    ended told to `on_result` (`RemoteBackend._judge`). A class rather than a generator-based
    context manager: this runs on every request, where the two of those it replaced took about
    3 µs and it takes 0.7."""

    __slots__ = ("backend", "cost")

    def __init__(self, backend: RemoteBackend, job: Job) -> None:
        self.backend, self.cost = backend, job.prompt_tokens + job.max_tokens

    def __enter__(self) -> None:
        self.backend._own_tokens += self.cost

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 traceback: object) -> None:
        self.backend._judge(exc)
        self.backend._own_tokens -= self.cost


@functools.lru_cache(maxsize=16)
def engine_tokenizer(path: str) -> HFTokenizer:
    """A backend's `tokenizer`: the engine's model folder, or a tokenizer.json in it, read as
    the engine reads it (special tokens and chat template from tokenizer_config.json). One
    object per path: the replicas of a model share it, and a prompt rendered for one (at
    admission) is not rendered again for another (`prompt_token_ids` memoises per tokenizer)."""
    folder = Path(path)
    try:
        return HFTokenizer.from_folder(folder if folder.is_dir() else folder.parent)
    except (OSError, ValueError) as exc:
        raise ValueError(f"gateway.backends[].tokenizer {path!r}: {exc}") from None


def _own_or(own: float | None, default: float) -> float:
    return default if own is None else own


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

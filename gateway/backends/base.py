"""What every backend shares: the job a backend runs, the outcome it reports, the `Backend`
protocol the dispatcher and the proxy call, and the errors that tell the proxy whether another
replica may take the request (`BackendFailed`) or not."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.request import SamplingParams
from protocol.errors import ApiError
from protocol.openai import PROMPT_IDS, OpenAIRequest, ResponseWriter

KV_HIGH_WATER = 0.95  # above this KV usage the engine is about to preempt; hold new work back


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
ENGINE_EXTENSIONS = ("tenant", "tenant_weight", "priority", PROMPT_IDS)


def engine_body(job: Job, model: str, stream: bool, fairgate: bool,
                prompt_ids: list[int] | None = None) -> dict[str, Any]:
    """The body an engine gets for `job`: the client's, with the model to run, max_tokens
    resolved, usage asked for when streamed, and the fairgate extensions the gateway's own
    (a `fairgate` engine: `prompt_ids`, the prompt as that engine's tokens, when the caller
    has them) or none of them (any other server, which gets vLLM's per-tenant prefix-cache
    salt). The shadow copies of a request are this body too, without the ids."""
    body = {k: v for k, v in job.req.body.items()
            if k not in ENGINE_EXTENSIONS and k != "max_completion_tokens"}
    body.update(model=model, stream=stream, max_tokens=job.max_tokens)
    if job.default_max_tokens:
        del body["max_tokens"]
    if stream:  # always ask for usage: it settles the tenant's charge exactly
        body["stream_options"] = {"include_usage": True}
    if fairgate:
        body.update(tenant=job.tenant, priority=job.priority, tenant_weight=job.tenant_weight)
        if prompt_ids is not None:
            body[PROMPT_IDS] = prompt_ids
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

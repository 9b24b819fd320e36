"""What the serving path publishes about each request, for the layers above it to subscribe to.

A request admitted (charged and queued), its first token written to the client, its end
(whatever it was: served, refused after admission, failed, abandoned). The control plane's
shadow copies, canary window and trace capture are subscribers (control/app.py); the gateway
never calls them by name, as the engine never calls its metrics by name (EngineObserver).

Observers run on the event loop, inline, in the order they were added: they must be quick and
must not block. One that raises is logged and counted (`Gateway.observer_errors`), and the
request goes on as if it had not been observed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gateway.backends import Job
from protocol.measures import SLO, RequestTiming
from protocol.openai import OpenAIRequest


class _AboutAJob:
    """What an event about one job reads from it."""

    __slots__ = ()
    job: Job

    @property
    def request_id(self) -> str:
        return self.job.request_id

    @property
    def tenant(self) -> str:
        return self.job.tenant

    @property
    def priority(self) -> str:
        return self.job.priority

    @property
    def model(self) -> str:
        return self.job.req.model or ""  # the served model's name (the alias resolved)

    @property
    def request(self) -> OpenAIRequest:
        return self.job.req


@dataclass(frozen=True, slots=True)
class RequestAdmitted(_AboutAJob):
    """Charged and queued, not yet dispatched."""

    job: Job  # what goes to the backend: its id, the request, tenant, priority, sampling
    slo: SLO  # the tenant's targets
    arrival: float  # perf_counter, when the gateway admitted it


@dataclass(frozen=True, slots=True)
class FirstToken:
    """A stream's first token-bearing chunk was written to the client."""

    request_id: str
    tenant: str
    backend: str
    arrival: float  # perf_counter
    at: float  # perf_counter, when the backend's chunk carrying it arrived

    @property
    def ttft(self) -> float:
        return self.at - self.arrival


@dataclass(frozen=True, slots=True)
class RequestFinished(_AboutAJob):
    """Settled: the request's end, exactly once for every admitted request."""

    job: Job
    slo: SLO
    status: int  # the HTTP status the client got (499: it hung up first)
    backend: str | None  # None: never dispatched (queue timeout, client gone while queued)
    timing: RequestTiming  # as the gateway saw it, from `arrival` to its end
    prompt_tokens: int
    completion_tokens: int

    @property
    def arrival(self) -> float:
        return self.timing.start


class RequestObserver(Protocol):
    """A subscriber to the serving path's request events (`Gateway.add_observer`). Subclass
    it and override what you need: each method does nothing by default."""

    def admitted(self, event: RequestAdmitted) -> None:
        return None

    def first_token(self, event: FirstToken) -> None:
        return None

    def finished(self, event: RequestFinished) -> None:
        return None

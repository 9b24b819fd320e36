"""The request pipeline between HTTP and the backends: estimate, admit, queue, run, settle.

`Gateway.prepare` turns a validated request into an `Admission` (cost estimated, rate charged,
queued). `Admission.wait` waits for dispatch; `Admission.settle` ends it, whatever happened:
settle the rate and VTC charges to the actual tokens (or refund them when nothing ran), record
usage, observe metrics. Every path through a request calls `settle` exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.openai_api import sampling_params
from gateway.admission import (
    Charge,
    CostEstimate,
    Limiter,
    OutputEstimator,
    RateLimited,
    RateLimiter,
    estimate_cost,
)
from gateway.backends import Backend, BackendPool, Job, Outcome
from gateway.config import GatewayConfig
from gateway.dispatch import Dispatcher
from gateway.events import FirstToken, RequestAdmitted, RequestFinished, RequestObserver
from gateway.fairqueue import FairQueue, QueueBounds, QueuedRequest, QueueFull
from gateway.metrics import GatewayMetrics
from gateway.replicas.redis_fair_share import SharedFairState
from protocol.errors import ApiError, bad_request
from protocol.measures import RequestTiming
from protocol.openai import OpenAIRequest, prompt_text, resolve_max_tokens
from tenants import (
    LedgerFullError,
    Principal,
    TenantInfo,
    UsageEvent,
    UsageLedger,
    slo_outcomes,
)

log = logging.getLogger("fairgate.gateway")
_ids = itertools.count()
_ID_PREFIX = os.urandom(4).hex()
PREFIX_CHUNK_CHARS = 256  # prefix routing keys a prompt at every multiple of this
SEED_TIMEOUT_S = 1.0  # a tenant's output history read waits this long, then the default stands
Event = TypeVar("Event", RequestAdmitted, FirstToken, RequestFinished)


@dataclass
class Admission:
    gateway: Gateway
    principal: Principal
    job: Job
    cost: CostEstimate
    charge: Charge
    item: QueuedRequest
    arrival: float  # perf_counter
    created_at: float  # epoch
    backend: Backend | None = None
    dispatched_at: float | None = None
    outcome: Outcome = field(init=False)
    settled: bool = False
    first_token_published: bool = False

    def __post_init__(self) -> None:
        self.outcome = Outcome(prompt_tokens=self.cost.prompt_tokens)

    @property
    def tenant(self) -> TenantInfo:
        return self.principal.tenant

    async def wait(self, future: asyncio.Future[Backend], timeout: float) -> Backend:
        """The backend this request was dispatched to; a queue timeout is a 503 saying so."""
        if future.done() and not future.cancelled():  # dispatched as it was admitted
            self.backend = future.result()
            self.dispatched_at = time.perf_counter()
            return self.backend
        try:
            async with asyncio.timeout(timeout):
                self.backend = await future
        except TimeoutError:
            self.gateway.dispatcher.abandon(self.item)
            raise ApiError(503, f"request waited {timeout:g} s in tenant {self.tenant.name}'s "
                           "queue without being dispatched (queue timeout); the gateway is at "
                           "capacity", code="queue_timeout", retry_after=timeout) from None
        self.dispatched_at = time.perf_counter()
        return self.backend

    def timing(self, status: int) -> RequestTiming:
        """Its timing as the gateway saw it, ending now: for the metrics and the ledger."""
        out = self.outcome
        return RequestTiming(self.arrival, out.chunk_times, out.completion_tokens,
                             time.perf_counter(), ok=status == 200)

    def settle(self, status: int) -> None:
        if self.settled:
            return
        self.settled = True
        self.gateway.finish(self, status)

    def streamed(self) -> None:
        """A chunk of its stream was written to the client: the first with a token publishes
        `first_token`."""
        times = self.outcome.chunk_times
        if self.first_token_published or not times or self.backend is None:
            return
        self.first_token_published = True
        if handlers := self.gateway.on_first_token:
            event = FirstToken(self.job.request_id, self.tenant.name, self.backend.name,
                               self.arrival, times[0])
            for handler in handlers:
                self.gateway.notify(handler, event)


class Gateway:
    def __init__(self, config: GatewayConfig, pool: BackendPool, ledger: UsageLedger | None,
                 metrics: GatewayMetrics, limiter: Limiter | None = None) -> None:
        self.config = config
        self.observers: list[RequestObserver] = []  # gateway/events.py: the layers above
        # each event's handlers: the observers' methods that do something (_subscribe)
        self.on_admitted: tuple[Callable[[RequestAdmitted], None], ...] = ()
        self.on_first_token: tuple[Callable[[FirstToken], None], ...] = ()
        self.on_finished: tuple[Callable[[RequestFinished], None], ...] = ()
        self.observer_errors = 0  # observers that raised (logged; the request went on)
        self.pool = pool
        self.ledger = ledger
        self.metrics = metrics
        self.limiter: Limiter = limiter or RateLimiter()  # gateway.redis: gateway/replicas
        # gateway.redis: queue bounds and fair share over replicas (replicas/redis_fair_share.py)
        self.replica_fair_share: SharedFairState | None = None
        self.estimator = OutputEstimator()
        self.queue = FairQueue(config.dispatch)
        self.dispatcher = Dispatcher(self.queue, self.pool, metrics, config.prefix_load_factor,
                                     config.retry_budget)
        metrics.outliers.read = pool.ejection_rows

    # ---- admission --------------------------------------------------------------------------
    async def admit(self, principal: Principal, req: OpenAIRequest) -> tuple[
            Admission, asyncio.Future[Backend]]:
        """Estimate, charge and queue; ApiError for every rejection (nothing charged then)."""
        tenant = principal.tenant
        self._check_ready(req)
        priority = req.priority or tenant.default_priority
        if priority not in tenant.allowed_priorities:
            raise ApiError(403, f"priority {priority!r} is not allowed for this key's tenant "
                           f"(allowed: {', '.join(tenant.allowed_priorities)})",
                           code="priority_not_allowed", param="priority")
        cost, max_tokens = await self._estimate(tenant, req)
        params = sampling_params(req, max_tokens)  # the engine's rules, before any charge
        charge = await self._charge(tenant, cost)
        job = Job(f"{_ID_PREFIX}-{next(_ids)}", req, tenant.name, priority,
                  cost.prompt_tokens, params, tenant.weight,
                  default_max_tokens=req.max_tokens is None and tenant.limits.max_tokens is None)
        item = QueuedRequest(tenant.name, cost.prompt_tokens, cost.output_tokens, priority,
                             tenant.weight, model=req.model, affinity=self._affinity(tenant, req))
        adm = Admission(self, principal, job, cost, charge, item, time.perf_counter(),
                        time.time())
        try:
            future = self.dispatcher.submit(item, self._bounds(tenant))
        except QueueFull as exc:
            self.limiter.refund(charge)
            raise self._over_limit(tenant, exc.reason, exc.retry_after, str(exc)) from None
        if self.on_admitted:
            admitted = RequestAdmitted(job, tenant.slo, adm.arrival)
            for handler in self.on_admitted:
                self.notify(handler, admitted)
        return adm, future

    # ---- request events (gateway/events.py) ---------------------------------------------------
    def add_observer(self, observer: RequestObserver) -> None:
        self.observers = [*self.observers, observer]  # copied: one may be added mid-publish
        self._subscribe()

    def remove_observer(self, observer: RequestObserver) -> None:
        self.observers = [o for o in self.observers if o is not observer]
        self._subscribe()

    def _subscribe(self) -> None:
        """Each event's handlers, in the observers' order: a method left as RequestObserver's
        no-op is not called, and no event is built for an event nobody handles."""
        def handlers(name: str) -> tuple[Any, ...]:
            return tuple(getattr(o, name) for o in self.observers
                         if getattr(type(o), name) is not getattr(RequestObserver, name))
        self.on_admitted = handlers("admitted")
        self.on_first_token = handlers("first_token")
        self.on_finished = handlers("finished")

    def notify(self, method: Callable[[Event], None], event: Event) -> None:
        """One observer's `method` with `event`: one that raises is logged and counted, never
        the request's failure."""
        try:
            method(event)
        except Exception:
            self.observer_errors += 1
            log.exception("request observer %s failed on %s", method.__qualname__,
                          type(event).__name__)

    def _affinity(self, tenant: TenantInfo, req: OpenAIRequest) -> tuple[int, ...]:
        """Prefix routing's keys: hashes of the tenant (the prefix cache's salt) and the
        prompt's first PREFIX_CHUNK_CHARS, 2 x as many, ... up to `prefix_chars` (a partial last
        chunk included); none with least-loaded routing or one backend."""
        if self.config.routing != "prefix" or len(self.pool.backends) < 2:
            return ()
        head = prompt_text(req)[:self.config.prefix_chars]
        running = hashlib.blake2b(tenant.name.encode() + b"\x00", digest_size=8)
        keys = []
        for start in range(0, max(len(head), 1), PREFIX_CHUNK_CHARS):
            running.update(head[start:start + PREFIX_CHUNK_CHARS].encode())
            keys.append(int.from_bytes(running.copy().digest(), "big"))
        return tuple(keys)

    def _check_ready(self, req: OpenAIRequest) -> None:
        if not self.pool.healthy:
            raise ApiError(503, "no engine backend is reachable; try again shortly",
                           code="backend_unavailable",
                           retry_after=self.config.backend_retry_after_s)
        names = self.pool.model_names()
        if req.model is None or req.model == "default":
            req.model = names[0] if names else "default"
        elif req.model in names:
            pass  # a served id (resolve_model's first answer), the usual case
        elif (model := self.pool.resolve_model(req.model)) is not None:
            req.model = model  # an alias (a served model's path): the id it stands for
        else:
            raise ApiError(404, f"The model {req.model!r} does not exist; this gateway serves: "
                           f"{', '.join(names) or 'none yet'}", code="model_not_found",
                           param="model")
        if not self.pool.serving_now(req.model):
            serving = ", ".join(b.name for b in self.pool.serves(req.model))
            raise ApiError(503, f"the model {req.model!r} is served by {serving}, none of them "
                           "reachable (or all ejected for failing) now; try again shortly",
                           code="model_unavailable", retry_after=self.config.backend_retry_after_s)
        if self.ledger is not None and self.ledger.pending >= 2 * self.ledger.max_pending:
            raise ApiError(503, "usage recording is behind; try again shortly",
                           code="ledger_full", retry_after=1.0)

    async def _estimate(self, tenant: TenantInfo, req: OpenAIRequest) -> tuple[
            CostEstimate, int]:
        """The admission cost and the max_tokens the request runs with: the prompt counted by,
        and held to the context length of, the backends serving its model."""
        backends = self.pool.held_to(req.model)
        prompt_tokens = backends[0].count_prompt(req)
        limit = tenant.limits.max_tokens
        if limit is not None and req.max_tokens is not None and req.max_tokens > limit:
            raise bad_request(f"max_tokens ({req.max_tokens}) exceeds this tenant's limit "
                              f"({limit})", "max_tokens", "max_tokens_exceeded")
        max_model_len = (backends[0].max_model_len if len(backends) == 1
                         else min(b.max_model_len for b in backends))
        resolved = resolve_max_tokens(req, prompt_tokens, max_model_len)
        if req.max_tokens is not None:
            return CostEstimate(prompt_tokens, req.max_tokens), req.max_tokens
        max_tokens = min(resolved, limit or resolved)  # the default, within the tenant's limit
        if not req.chat:  # completions default to 16: known, no estimate needed
            return CostEstimate(prompt_tokens, max_tokens), max_tokens
        if self.estimator.needs_seed(tenant.name):
            await self._seed(tenant.name)
        cost = estimate_cost(prompt_tokens, None, self.estimator.estimate(tenant.name),
                             self.config.default_output_tokens, max_tokens)
        return cost, max_tokens

    async def _seed(self, tenant: str) -> None:
        """The tenant's output-length estimate from its history in the ledger; the default
        when the database fails or is slower than SEED_TIMEOUT_S (the read goes on, shielded:
        cancelling a statement can cost a connection more than letting it end)."""
        value = None
        if self.ledger is not None:
            read = asyncio.ensure_future(self.ledger.output_tokens_percentile(
                tenant, self.config.output_estimate_window_s, 90))
            read.add_done_callback(lambda done: done.cancelled() or done.exception())
            try:
                async with asyncio.timeout(SEED_TIMEOUT_S):
                    value = await asyncio.shield(read)
            except Exception as exc:  # the estimate falls back to the default; never fail here
                log.warning("output-length history unavailable: %s", type(exc).__name__)
        self.estimator.seed(tenant, value)

    async def _charge(self, tenant: TenantInfo, cost: CostEstimate) -> Charge:
        try:
            return await self.limiter.charge(tenant.name, tenant.limits, cost.total)
        except RateLimited as exc:
            raise self._over_limit(tenant, exc.reason, exc.retry_after, str(exc)) from None

    def _over_limit(self, tenant: TenantInfo, reason: str, retry_after: float | None,
                    message: str) -> ApiError:
        """A limit's 429, counted under `reason`: the limit's code with its Retry-After, or
        request_too_large without one for a request over it by itself (no retry helps)."""
        self.metrics.child("rejections", tenant.name, reason).inc()
        return ApiError(429, message, code=reason if retry_after is not None
                        else "request_too_large", retry_after=retry_after)

    def _bounds(self, tenant: TenantInfo) -> QueueBounds:
        limits = tenant.limits
        return QueueBounds(limits.max_queued_requests or self.config.max_queued_requests,
                           limits.max_queued_tokens or self.config.max_queued_tokens,
                           limits.max_concurrent)

    def queue_timeout(self, tenant: TenantInfo) -> float:
        return tenant.limits.queue_timeout_s or self.config.queue_timeout_s

    # ---- the end of every request ------------------------------------------------------------
    def finish(self, adm: Admission, status: int) -> None:
        payload = adm.item.payload
        if adm.backend is None and adm.item.state == "dispatched" and payload.done() \
                and not payload.cancelled():
            # Dispatched in the same turn the waiter was cancelled: give the slot back.
            self.dispatcher.release(adm.item, adm.item.payload.result(), 0, 0)
            adm.item.state = "removed"
        out, ran = adm.outcome, adm.backend is not None
        if adm.backend is None:
            adm.gateway.dispatcher.abandon(adm.item)
            self.limiter.refund(adm.charge)  # never ran: charged nothing
        else:
            self.limiter.settle(adm.charge, out.prompt_tokens + out.completion_tokens)
            self.dispatcher.release(adm.item, adm.backend, out.prompt_tokens,
                                    out.completion_tokens)
            if status == 200 and out.finish_reason is not None:
                self.estimator.observe(adm.tenant.name, out.completion_tokens)
        timing = adm.timing(status)
        if self.on_finished:
            finished = RequestFinished(adm.job, adm.tenant.slo, status,
                                       adm.backend.name if adm.backend else None, timing,
                                       out.prompt_tokens, out.completion_tokens)
            for handler in self.on_finished:
                self.notify(handler, finished)
        self._observe(adm, status, ran, timing)
        self._record(adm, status, timing)

    def _observe(self, adm: Admission, status: int, ran: bool, timing: RequestTiming) -> None:
        m, name, out = self.metrics, adm.tenant.name, adm.outcome
        m.child("requests", name, str(status)).inc()
        if status in (429, 503) and not ran:
            reason = "queue_timeout" if adm.item.state == "removed" else "backend"
            m.child("rejections", name, reason).inc()
        if adm.dispatched_at is not None:
            m.child("queue_time", name).observe(adm.dispatched_at - adm.arrival)
        if ran:
            m.child("e2e", name).observe(timing.e2e)
            m.child("tokens", name, "in").inc(out.prompt_tokens)
            m.child("tokens", name, "out").inc(out.completion_tokens)
        if adm.job.req.stream:  # only a stream has a first token to time
            m.observe_stream(name, timing, adm.tenant.slo)

    def _record(self, adm: Admission, status: int, timing: RequestTiming) -> None:
        out = adm.outcome
        queue_time = (adm.dispatched_at or timing.end) - adm.arrival
        ran = adm.backend is not None
        tenant = adm.tenant
        # against the tenant's targets: the service's failures (429, 5xx) miss; a client's
        # mistake (another 4xx) and a non-streamed answer (no first token or gaps to time) are
        # not counted either way
        counted = (status == 200 and adm.job.req.stream) or status == 429 or status >= 500
        event = UsageEvent(tenant=tenant.name, key_id=adm.principal.key_id,
                           model=adm.job.req.model or "", priority=adm.job.priority,
                           prompt_tokens=out.prompt_tokens if ran else 0,
                           completion_tokens=out.completion_tokens if ran else 0,
                           status=status, queue_time=queue_time, ttft=timing.ttft,
                           e2e=timing.e2e, created_at=adm.created_at, tpot=timing.tpot,
                           backend=adm.backend.name if adm.backend is not None else None,
                           **(slo_outcomes(tenant.slo, timing) if counted else {}))
        if self.config.log_requests:  # tenant, status and timings only: never keys or bodies
            log.info("tenant=%s status=%d prompt=%d completion=%d queue=%.3fs e2e=%.3fs",
                     event.tenant, status, event.prompt_tokens, event.completion_tokens,
                     queue_time, event.e2e or 0.0)
        if self.ledger is None:
            return
        with contextlib.suppress(RuntimeError):  # LedgerFullError: admission already says 503
            self.ledger.record(event)

    def record_rejection(self, principal: Principal, req: OpenAIRequest | None,
                         status: int) -> None:
        """A request turned away before admission (400, 403, 404, 429, 503): usage says so."""
        name = principal.tenant.name
        self.metrics.child("requests", name, str(status)).inc()
        if self.ledger is None:
            return
        tenant = principal.tenant
        # turned away by the service (429, 503): a miss of every target the tenant set; a
        # client's mistake (400, 403, 404) is not counted
        turned_away = RequestTiming(0.0, (), 0, 0.0, ok=False)
        event = UsageEvent(tenant=name, key_id=principal.key_id,
                           model=(req.model or "") if req else "", priority=(req and req.priority)
                           or principal.tenant.default_priority, prompt_tokens=0,
                           completion_tokens=0, status=status,
                           **(slo_outcomes(tenant.slo, turned_away) if status in (429, 503)
                              else {}))
        with contextlib.suppress(LedgerFullError, RuntimeError):
            self.ledger.record(event)

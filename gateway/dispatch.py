"""The dispatcher: hands queued requests to backends while a backend has room.

It runs inline (on every push and every finish) rather than as a task woken by events, so an
idle gateway dispatches a request in the same event-loop turn it was admitted: no added hop.
A ticker re-runs it for room that appears without a finish here (remote /load updates, KV
freed by other clients of a shared engine).

Headroom (`fair` only): while any tenant is over its weighted share of the seats, a few seats
of every backend (`BackendPool.headroom`) stay free for tenants under theirs, and so do the
engine-side waiting slots (`backend_waiting_slack`). A backlogged tenant fills the rest; a
light tenant's request is dispatched at once and starts in the engine's next step, instead of
waiting for a seat to turn over and then behind the backlogged tenant's slack in the engine's
waiting queue. A tenant alone is under its share of everything, so it still uses every seat:
no capacity idles while only one tenant has work.

Gateway replicas (`gateway.redis`): while a tenant waits on another replica, a tenant here over
its share of the seats (counted on every replica) waits for that one to take its share first;
the other replica fills the room this one leaves. The room itself counts the other replicas'
requests on a shared engine (from its /load).

Failover: a request whose replica failed before any byte of an answer goes to another one,
once, while the retry budget allows (`RetryBudget`).
"""

from __future__ import annotations

import asyncio
import math
import time

from gateway.backends import Backend, BackendErrored, BackendFailed, BackendPool, BackendUnreachable
from gateway.config import RetryBudgetConfig
from gateway.fairqueue import Admit, FairQueue, QueueBounds, QueuedRequest
from gateway.metrics import GatewayMetrics

HOLD_S = 0.05  # room held for a tenant waiting elsewhere this long is given to anyone here
# fairgate_gateway_retries_total's and _retries_refused_total's labels, exported at zero from
# the start (a panel of a counter that never moved shows 0, not nothing)
RETRY_REASONS = tuple(failure.reason for failure in (BackendFailed, BackendUnreachable,
                                                      BackendErrored))
REFUSED_REASONS = ("budget", "no_replica")


class RetryBudget:
    """Envoy's retry budget: retries under way at most `budget_percent` of the requests active
    (dispatched and queued), and `min_retry_concurrency` however few those are. When a pool is
    failing as a whole, retries then add a fifth to its load instead of doubling it."""

    def __init__(self, config: RetryBudgetConfig) -> None:
        self.config = config
        self.under_way: set[int] = set()  # id() of the requests on their retry

    def allows(self, active: int) -> bool:
        percent = math.floor(active * self.config.budget_percent / 100)
        return len(self.under_way) < max(self.config.min_retry_concurrency, percent)

    def start(self, item: QueuedRequest) -> None:
        self.under_way.add(id(item))

    def end(self, item: QueuedRequest) -> None:
        self.under_way.discard(id(item))


class Dispatcher:
    def __init__(self, queue: FairQueue, pool: BackendPool, metrics: GatewayMetrics,
                 load_factor: float = 1.25, retry_budget: RetryBudgetConfig | None = None) -> None:
        self.queue = queue
        self.pool = pool
        self.metrics = metrics
        self.load_factor = load_factor  # prefix routing's bound on a replica's load
        self.retries = RetryBudget(retry_budget or RetryBudgetConfig())
        self._held_since: float | None = None  # the cross-replica gate held all back since
        for reason in RETRY_REASONS:
            metrics.child("retries", reason)
        for reason in REFUSED_REASONS:
            metrics.child("retries_refused", reason)

    def submit(self, item: QueuedRequest, bounds: QueueBounds) -> asyncio.Future[Backend]:
        """Queue `item` (QueueFull when its tenant's queue is full); the future resolves to the
        backend it was dispatched to."""
        future: asyncio.Future[Backend] = asyncio.get_running_loop().create_future()
        item.payload = future
        self.queue.push(item, bounds)
        self.pump()
        if not future.done():  # dispatched: pump set its class's depth after taking it
            self._gauge(item)
        return future

    def pump(self) -> None:
        while self.queue.size:
            picked = self._next()
            if picked is None:
                return
            item, backend, keep_headroom = picked
            self._gauge(item)
            if item.affinity:  # the replica that likely holds its prefix
                backend = self.pool.pick_affine(item.affinity, item.model, self.load_factor,
                                                keep_headroom) or backend
                self.pool.homes.record(item.affinity, backend.name)
            self._hand(item, backend)

    def _hand(self, item: QueuedRequest, backend: Backend) -> None:
        future: asyncio.Future[Backend] = item.payload
        if future.done():  # its waiter is gone; nothing ran
            self.queue.finish(item, 0, 0)
            return
        self._seat(backend, 1)
        backend.dispatched(item.cost)
        future.set_result(backend)

    def _next(self) -> tuple[QueuedRequest, Backend, bool] | None:
        """The request to dispatch, its backend, and whether the headroom was kept: anyone's
        where seats outside the headroom are free, else only a tenant's under its share (into
        the headroom). In a pool of several models, the next request whose model has a backend
        with room, and that one (headroom is not kept there)."""
        gate, patient = self._gate()
        if self.pool.several_models():
            return self._next_by_model(gate, patient)
        keeps_headroom = self.queue.policy != "fcfs" and self.pool.headroom > 0
        # room outside the headroom is room (the stricter pick first: one pick, usually)
        shared = self.pool.pick(keep_headroom=True) if keeps_headroom else None
        backend = shared or self.pool.pick()
        if backend is None:
            self._held_since = None  # no room: nothing is being held
            return None
        if shared is not None or not keeps_headroom:
            item = self.queue.pop(gate)
            self._held(gate, item, patient)
            return None if item is None else (item, backend, keeps_headroom)
        room, weight = self.pool.capacity(), self.queue.active_weight()
        item = self.queue.pop(lambda tq, _: self.queue.under_share(tq, room, weight))
        return None if item is None else (item, backend, False)

    def _gate(self) -> tuple[Admit | None, bool]:
        """With tenants waiting on other gateway replicas (`gateway.redis`): who may take a
        seat here (FairQueue.gate), and whether room has stayed free for HOLD_S while it held
        everyone back (then anyone may, until the room is used up); else (None, False)."""
        if self.queue.policy == "fcfs" or not self.queue.remote_backlog():
            self._held_since = None
            return None, False
        patient = (self._held_since is not None
                   and time.monotonic() - self._held_since >= HOLD_S)
        return self.queue.gate(self.pool.capacity(), self.queue.active_weight(), patient), patient

    def _held(self, gate: Admit | None, item: QueuedRequest | None, patient: bool) -> None:
        """After a pop with room: note when the gate first held every request back (and look
        again once it turns patient); a dispatch on its merits ends the hold, one made only out
        of patience keeps it (the room that was held is given away until it is used up)."""
        if gate is None or (item is not None and not patient):
            self._held_since = None
        elif item is None and self._held_since is None:
            self._held_since = time.monotonic()
            asyncio.get_running_loop().call_later(HOLD_S, self.pump)

    def _next_by_model(self, gate: Admit | None,
                       patient: bool) -> tuple[QueuedRequest, Backend, bool] | None:
        rooms: dict[str | None, Backend | None] = {}

        def room(model: str | None) -> Backend | None:
            if model not in rooms:
                rooms[model] = self.pool.pick(model=model)
            return rooms[model]

        item = self.queue.pop(lambda tq, queued: room(queued.model) is not None
                              and (gate is None or gate(tq, queued)), past_heads=True)
        if item is None and not any(rooms.values()):
            self._held_since = None  # no room for anything queued: nothing is being held
        else:
            self._held(gate, item, patient)
        if item is None:
            return None
        backend = room(item.model)
        assert backend is not None  # the pop only takes a request whose model has room
        return item, backend, False

    def failover(self, item: QueuedRequest, failed: Backend, model: str | None,
                 reason: str = "unknown") -> Backend | None:
        """`item`'s backend failed before any byte of an answer (`reason`: how, the
        exception's `reason`): another healthy one that serves its model takes it now, with
        room if one has it (its slot moves; its tenant's counters are unchanged: it is the
        same request), or None: no other replica, or the retry budget is spent."""
        active = self.queue.size + sum(b.inflight for b in self.pool.backends)
        if not self.retries.allows(active):
            self.metrics.child("retries_refused", "budget").inc()
            return None
        other = self.pool.fallback(failed, model)
        if other is None:
            self.metrics.child("retries_refused", "no_replica").inc()
            return None
        self.retries.start(item)
        self._seat(failed, -1)
        self._seat(other, 1)
        other.dispatched(item.cost)
        self.metrics.child("failovers", failed.name).inc()
        self.metrics.child("retries", reason).inc()
        return other

    def abandon(self, item: QueuedRequest) -> bool:
        """The waiter gave up (timeout, disconnect). True when it was still queued."""
        removed = self.queue.remove(item)
        if removed:
            self._gauge(item)
        return removed

    def release(self, item: QueuedRequest, backend: Backend, input_tokens: int,
                output_tokens: int) -> None:
        self._seat(backend, -1)
        self.retries.end(item)
        self.queue.finish(item, input_tokens, output_tokens)
        self.pump()

    def _seat(self, backend: Backend, change: int) -> None:
        """`backend.inflight` and its gauge, changed together."""
        backend.inflight += change
        self.metrics.child("inflight", backend.name).set(backend.inflight)

    def _gauge(self, item: QueuedRequest) -> None:
        depth = self.queue.class_depth(item.tenant, item.priority)
        self.metrics.set_gauge("queue_depth", depth, item.tenant, item.priority)


async def tick(dispatcher: Dispatcher, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        if dispatcher.queue.size:
            dispatcher.pump()

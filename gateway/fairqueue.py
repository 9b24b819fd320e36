"""Bounded per-tenant queues and the order they are served in (pure logic, no I/O).

`fair`: the interactive class always goes before batch (batch fills idle capacity); within a
class the backlogged tenant with the smallest virtual token counter goes next (VTC, Sheng et al.
2024). A dispatch charges the tenant's counter with the VTC cost (protocol.fairness, the cost the
engine's `fair` policy charges too) of the request's estimated input and output tokens divided
by its weight; `finish` settles the difference to the actual tokens. A tenant that
becomes backlogged is lifted by protocol.fairness.lifted_counter (the engine's rule too), so
idleness earns no credit to burst with later. `fcfs`: arrival order across all tenants, the
baseline.

Shares of seats: a tenant's weighted share of the backends' room is room * weight / the
weights of the tenants active now or lately (SHARE_WINDOW_S, so a light tenant between two
requests keeps its place). `pop(admit)` lets the dispatcher restrict a pick to tenants under
their share when only the headroom it keeps for them is free (see gateway.dispatch).

Other gateway replicas (`gateway.redis`, gateway/replicas/redis_fair_share.py): `remote` holds their
tenants' queued and running counts as of the last sync (a few tens of milliseconds old). Queue
bounds count a tenant's requests queued on every replica; shares count its requests running on
every replica and the weights of tenants active anywhere; `gate` holds back a tenant
over its share while a tenant backlogged anywhere is under its own (so a tenant that reaches
the gateway only through one replica still gets its share of the engines every replica feeds);
and `add_remote_service` advances a tenant's counter by its service elsewhere, so the virtual
counters are one set across replicas.

Bounds (queued requests, queued estimated tokens) are checked on push. A full queue answers with
when a slot frees: the tenant's running requests finish at their expected times (the tenant's
recent seconds per output token times each request's estimated output, less the time it has run
already), each finish dispatches the next queued request in its seat, and the wait is the time
until enough queued requests have left. Before any request of the gateway has finished, the
tenant's recent drain rate stands in.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from protocol.fairness import VTC_COST, VTCCost, lifted_counter
from protocol.priority import PRIORITIES
from protocol.validators import check_choice

DISPATCH_POLICIES = ("fair", "fcfs")  # fcfs: the baseline, arrival order across tenants
CLASSES = PRIORITIES  # the priority classes, in the order they are served
DRAIN_WINDOW_S = 30.0
SHARE_WINDOW_S = 5.0  # a tenant seen this recently still counts when seats are shared out
_NO_DRAIN_RETRY_S = 5.0  # nothing drained lately: a guess, bounded so clients come back
_MAX_RETRY_S = 60.0
_PACE_SMOOTHING = 0.3  # EWMA weight of the newest finished request's seconds per output token
_OVERDUE_LEFT = 0.25  # a request past its expected time: assume this fraction of it still left
_RETRY_MARGIN_S = 0.05  # a client that waits exactly Retry-After arrives just after the slot frees


@dataclass(frozen=True)
class QueueBounds:
    max_requests: int | None = None
    max_tokens: int | None = None
    max_concurrent: int | None = None  # dispatched and unfinished


@dataclass(frozen=True)
class RemoteTenant:
    """A tenant on the other gateway replicas, summed over them (as of the last sync)."""

    queued_requests: int = 0
    queued_tokens: int = 0
    running: int = 0
    weight: float = 1.0
    ready: tuple[int, ...] = ()  # per class (CLASSES' order): queued where it may run now

    @property
    def active(self) -> bool:
        return bool(self.queued_requests or self.running)

    def ready_up_to(self, rank: int) -> int:
        """Ready to run in the classes served before or with CLASSES[rank]."""
        return sum(self.ready[:rank + 1])


NO_REMOTE = RemoteTenant()


class QueueFull(Exception):
    """Over `reason` (queue_requests | queue_tokens); `retry_after` None: it never fits."""

    def __init__(self, reason: str, retry_after: float | None, message: str) -> None:
        super().__init__(message)
        self.reason = reason  # queue_requests | queue_tokens
        self.retry_after = retry_after


@dataclass(eq=False)
class QueuedRequest:
    tenant: str
    input_tokens: int
    output_tokens: int  # estimated
    priority: str = "interactive"
    weight: float = 1.0
    payload: Any = None  # what the caller waits on; the queue never looks at it
    seq: int = 0
    enqueued_at: float = 0.0
    dispatched_at: float = 0.0
    state: str = "new"  # new -> queued -> dispatched -> finished | removed
    model: str | None = None  # only backends serving it may take it
    # prefix routing: its prompt's chained prefix hashes, shortest first (empty: least loaded)
    affinity: tuple[int, ...] = ()

    @property
    def cost(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass
class TenantQueue:
    name: str
    weight: float = 1.0
    bounds: QueueBounds = field(default_factory=QueueBounds)
    queues: dict[str, deque[QueuedRequest]] = field(
        default_factory=lambda: {c: deque() for c in CLASSES})
    queued_requests: int = 0
    queued_tokens: int = 0
    running: int = 0
    counter: float = 0.0  # VTC virtual service, in weighted tokens
    served: float = 0.0  # the weighted tokens this replica charged it (what others add)
    drained: deque[tuple[float, int]] = field(default_factory=deque)  # (time, cost) dispatched
    last_active: float = float("-inf")  # last push, dispatch or finish
    inflight: dict[int, QueuedRequest] = field(default_factory=dict)  # dispatched, by seq
    pace: float | None = None  # seconds per estimated output token, recent finishes (EWMA)

    def drain_rates(self, now: float) -> tuple[float, float]:
        """(requests/s, tokens/s) dispatched over the last DRAIN_WINDOW_S."""
        while self.drained and self.drained[0][0] < now - DRAIN_WINDOW_S:
            self.drained.popleft()
        if not self.drained:
            return 0.0, 0.0
        span = max(now - self.drained[0][0], 1.0)
        return len(self.drained) / span, sum(c for _, c in self.drained) / span


# may this tenant's next request (of the class looked at: the item given) be dispatched now?
Admit = Callable[[TenantQueue, "QueuedRequest"], bool]


def _offered(tq: TenantQueue, queue: deque[QueuedRequest], admit: Admit,
             past_heads: bool) -> QueuedRequest | None:
    """The request of `queue` (non-empty) that `tq` offers `admit`: its head, or with
    `past_heads` its first request `admit` takes; None when it takes none."""
    if not past_heads:
        return queue[0] if admit(tq, queue[0]) else None
    return next((item for item in queue if admit(tq, item)), None)


class FairQueue:
    def __init__(self, policy: str = "fair", cost: VTCCost = VTC_COST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = check_choice("dispatch policy", policy, DISPATCH_POLICIES)
        self.cost = cost
        self.clock = clock
        self.tenants: dict[str, TenantQueue] = {}
        self._active: dict[str, set[str]] = {c: set() for c in CLASSES}  # backlogged tenants
        self._seq = itertools.count()
        self._last_dispatched: str | None = None  # the floor (its counter) with none backlogged
        self.pace: float | None = None  # every tenant's pace: the estimate for a new tenant
        self.size = 0
        # the other gateway replicas' tenants (gateway.redis), replaced whole by each sync
        self.remote: dict[str, RemoteTenant] = {}
        self.on_change: Callable[[], None] | None = None  # a dispatch or a finish happened

    def __len__(self) -> int:
        return self.size

    # ---- push ---------------------------------------------------------------------------------
    def push(self, item: QueuedRequest, bounds: QueueBounds | None = None) -> None:
        """Queue `item`, or raise QueueFull leaving everything unchanged."""
        if item.priority not in CLASSES:
            raise ValueError(f"unknown priority {item.priority!r}")
        tq = self._tenant(item.tenant, item.weight, bounds)
        self._check_room(tq, item)
        if not any(tq.queues[c] for c in CLASSES):
            self._lift(tq)
        item.seq, item.enqueued_at, item.state = next(self._seq), self.clock(), "queued"
        tq.queues[item.priority].append(item)
        self._active[item.priority].add(tq.name)
        tq.queued_requests += 1
        tq.queued_tokens += item.cost
        tq.last_active = item.enqueued_at
        self.size += 1
        if self.on_change is not None:
            self.on_change()

    def _tenant(self, name: str, weight: float, bounds: QueueBounds | None) -> TenantQueue:
        tq = self.tenants.get(name)
        if tq is None:
            tq = self.tenants[name] = TenantQueue(name, weight, bounds or QueueBounds())
        else:  # weights and limits may change while the gateway runs
            tq.weight = weight
            if bounds is not None:
                tq.bounds = bounds
        return tq

    def _check_room(self, tq: TenantQueue, item: QueuedRequest) -> None:
        b, now = tq.bounds, self.clock()
        elsewhere = self.remote.get(tq.name, NO_REMOTE)
        queued_requests = tq.queued_requests + elsewhere.queued_requests
        queued_tokens = tq.queued_tokens + elsewhere.queued_tokens
        if b.max_requests is not None and queued_requests + 1 > b.max_requests:
            excess = queued_requests + 1 - b.max_requests
            raise QueueFull("queue_requests", self._retry(tq, now, excess, "requests"),
                            f"too many queued requests for tenant {tq.name} "
                            f"(max_queued_requests={b.max_requests})")
        if b.max_tokens is not None and queued_tokens + item.cost > b.max_tokens:
            if item.cost > b.max_tokens:  # never fits; say so, without a retry that cannot help
                raise QueueFull("queue_tokens", None,
                                f"this request's estimated cost ({item.cost} tokens) exceeds "
                                f"your max_queued_tokens ({b.max_tokens}) by itself; lower "
                                "max_tokens or shorten the prompt")
            excess = queued_tokens + item.cost - b.max_tokens
            raise QueueFull("queue_tokens", self._retry(tq, now, excess, "tokens"),
                            f"too many queued tokens for tenant {tq.name} "
                            f"(max_queued_tokens={b.max_tokens})")

    def _retry(self, tq: TenantQueue, now: float, excess: int, unit: str) -> float:
        """Seconds until `excess` queued requests (or tokens) of `tq` have been dispatched."""
        wait = self._slot_frees(tq, now, excess, unit)
        if wait is None:  # no finish seen yet: the recent drain rate is all there is
            requests, tokens = tq.drain_rates(now)
            rate = requests if unit == "requests" else tokens
            return _NO_DRAIN_RETRY_S if rate <= 0 else min(_MAX_RETRY_S, excess / rate)
        return min(_MAX_RETRY_S, wait + _RETRY_MARGIN_S)

    def _slot_frees(self, tq: TenantQueue, now: float, excess: int, unit: str) -> float | None:
        """Replay the tenant's seats forward: each running request ends at its expected time and
        its seat takes the next queued request; None without a pace or a running request."""
        pace = tq.pace if tq.pace is not None else self.pace
        if pace is None or not tq.inflight:
            return None

        def expected(item: QueuedRequest) -> float:
            return pace * (item.output_tokens + 1)

        ends = []
        for running in tq.inflight.values():
            length = expected(running)
            left = length - (now - running.dispatched_at)
            ends.append(now + max(left, _OVERDUE_LEFT * length))
        heapq.heapify(ends)
        freed = 0
        for queued in (i for c in CLASSES for i in tq.queues[c]):
            at = heapq.heappop(ends)
            freed += 1 if unit == "requests" else queued.cost
            if freed >= excess:
                return at - now
            heapq.heappush(ends, at + expected(queued))
        return None

    def _lift(self, tq: TenantQueue) -> None:
        others = (self.tenants[t].counter for c in CLASSES for t in self._active[c]
                  if t != tq.name)
        last = self._last_dispatched
        tq.counter = lifted_counter(tq.counter, others, None if last is None
                                    else self.tenants[last].counter)

    # ---- pop ----------------------------------------------------------------------------------
    def pop(self, admit: Admit | None = None, past_heads: bool = False) -> QueuedRequest | None:
        """The next request to dispatch (its tenant's counter charged), or None; with `admit`,
        only from tenants it accepts (fair only: fcfs serves arrival order or nothing).
        `past_heads`: `admit` judges each request, not only its tenant (a pool of several
        models: whether the request's model has room), so each tenant offers its first
        request `admit` takes: one for a model with room never waits behind its own for a
        full one."""
        picked = (self._pick_fcfs(admit, past_heads) if self.policy == "fcfs"
                  else self._pick_fair(admit, past_heads))
        if picked is None:
            return None
        tq, item = picked
        self._take(tq, item)
        self._last_dispatched = tq.name
        charge = self.cost.cost(item.input_tokens, item.output_tokens) / tq.weight
        tq.counter += charge
        tq.served += charge
        tq.running += 1
        tq.last_active = item.dispatched_at = self.clock()
        tq.drained.append((tq.last_active, item.cost))
        tq.inflight[item.seq] = item
        item.state = "dispatched"
        if self.on_change is not None:
            self.on_change()
        return item

    def _pick_fair(self, admit: Admit | None,
                   past_heads: bool) -> tuple[TenantQueue, QueuedRequest] | None:
        for cls in CLASSES:
            best: tuple[float, int, TenantQueue, QueuedRequest] | None = None
            for name in self._active[cls]:
                tq = self.tenants[name]
                if not self._can_run(tq):
                    continue
                queue = tq.queues[cls]
                item = queue[0] if admit is None else _offered(tq, queue, admit, past_heads)
                if item is not None and (best is None or (tq.counter, item.seq) < best[:2]):
                    best = (tq.counter, item.seq, tq, item)
            if best is not None:
                return best[2], best[3]
        return None

    def _pick_fcfs(self, admit: Admit | None,
                   past_heads: bool) -> tuple[TenantQueue, QueuedRequest] | None:
        """Arrival order; with `admit`, the earliest request it accepts (a pool of several
        models: the earliest request whose model has room)."""
        offered = ((tq, q[0] if admit is None else _offered(tq, q, admit, past_heads))
                   for tq in self._eligible() for q in tq.queues.values() if q)
        first = min(((item.seq, tq, item) for tq, item in offered if item is not None),
                    key=lambda h: h[0], default=None)
        return None if first is None else (first[1], first[2])

    def _eligible(self) -> Iterator[TenantQueue]:
        names = set().union(*self._active.values())
        return (self.tenants[n] for n in names if self._can_run(self.tenants[n]))

    def _can_run(self, tq: TenantQueue) -> bool:
        """Under its max_concurrent, counting its requests running on other replicas."""
        cap = tq.bounds.max_concurrent
        return cap is None or self.running(tq.name) < cap

    def _head(self, tq: TenantQueue) -> QueuedRequest | None:
        if self.policy == "fcfs":
            heads = [q[0] for q in tq.queues.values() if q]
            return min(heads, key=lambda i: i.seq, default=None)
        return next((tq.queues[c][0] for c in CLASSES if tq.queues[c]), None)

    def _take(self, tq: TenantQueue, item: QueuedRequest) -> None:
        queue = tq.queues[item.priority]
        if queue and queue[0] is item:
            queue.popleft()
        else:
            queue.remove(item)
        if not queue:
            self._active[item.priority].discard(tq.name)
        tq.queued_requests -= 1
        tq.queued_tokens -= item.cost
        self.size -= 1

    # ---- leave --------------------------------------------------------------------------------
    def remove(self, item: QueuedRequest) -> bool:
        """Take a still-queued request out (timeout, disconnect): no charge at all."""
        if item.state != "queued":
            return False
        self._take(self.tenants[item.tenant], item)
        item.state = "removed"
        if self.on_change is not None:
            self.on_change()
        return True

    def finish(self, item: QueuedRequest, input_tokens: int, output_tokens: int) -> None:
        """A dispatched request ended: settle its counter charge to the actual tokens."""
        if item.state != "dispatched":
            return
        tq = self.tenants[item.tenant]
        estimated = self.cost.cost(item.input_tokens, item.output_tokens)
        actual = self.cost.cost(input_tokens, output_tokens)
        tq.counter += (actual - estimated) / tq.weight
        tq.served += (actual - estimated) / tq.weight
        tq.running -= 1
        tq.last_active = self.clock()
        tq.inflight.pop(item.seq, None)
        if output_tokens > 0:  # a request that produced nothing says nothing about its pace
            pace = (tq.last_active - item.dispatched_at) / (item.output_tokens + 1)
            tq.pace = _smooth(tq.pace, pace)
            self.pace = _smooth(self.pace, pace)
        item.state = "finished"
        if self.on_change is not None:
            self.on_change()

    # ---- shares -------------------------------------------------------------------------------
    def active_weight(self) -> float:
        """The weights of the tenants that share the seats now: queued, running or lately seen
        here, or queued or running on another replica."""
        since = self.clock() - SHARE_WINDOW_S
        here = {name: tq.weight for name, tq in self.tenants.items()
                if tq.queued_requests or tq.running or tq.last_active >= since}
        there = {name: r.weight for name, r in self.remote.items()
                 if r.active and name not in here}
        return sum(here.values()) + sum(there.values())

    def running(self, name: str) -> int:
        """The tenant's requests running on every replica."""
        tq = self.tenants.get(name)
        return (tq.running if tq else 0) + self.remote.get(name, NO_REMOTE).running

    def under_share(self, tq: TenantQueue, room: int, active_weight: float) -> bool:
        """Fewer of `tq`'s requests run (on every replica) than its weighted share of `room`
        (requests)."""
        return self._under(self.running(tq.name), tq.weight, room, active_weight)

    @staticmethod
    def _under(running: int, weight: float, room: int, active_weight: float) -> bool:
        return running * max(active_weight, weight) < room * weight

    def remote_backlog(self) -> bool:
        """Some tenant waits on another replica (then `gate` matters)."""
        return any(sum(r.ready) for r in self.remote.values())

    def gate(self, room: int, active_weight: float, patient: bool = False) -> Admit:
        """Who may take a seat here while tenants wait on other replicas: a tenant under its
        share, or one with no other tenant waiting anywhere (in its class or a class served
        before it) at or under its own. What the other replicas run is a sync old, so one that
        looks exactly at its share may be one under (a request of it just ended and its
        replica is about to fill the seat). `patient`: the room stayed free a while all the
        same (that replica cannot use it: its backends are down or full for it), so anyone
        here takes it (work-conserving). Batch never goes while interactive work here is held.
        Computed once per call (each admit is then cheap)."""
        if patient:
            return lambda tq, head: True
        rank = {c: i for i, c in enumerate(CLASSES)}
        waiting: list[dict[str, float]] = [{} for _ in CLASSES]  # by class rank: up to it
        for name, tq in self.tenants.items():
            if not self._can_run(tq):
                continue
            for r in range(len(CLASSES)):
                if any(tq.queues[c] for c in CLASSES[:r + 1]):
                    waiting[r][name] = tq.weight
        for name, remote in self.remote.items():
            for r in range(len(CLASSES)):
                if remote.ready_up_to(r):
                    waiting[r][name] = max(remote.weight, waiting[r].get(name, 0.0))
        holding = [{name for name, weight in by_rank.items()
                    if self._under(self.running(name) - 1, weight, room, active_weight)}
                   for by_rank in waiting]
        local_first = [any(self._can_run(self.tenants[n]) for c in CLASSES[:r]
                           for n in self._active[c]) for r in range(len(CLASSES))]

        def admit(tq: TenantQueue, head: QueuedRequest) -> bool:
            r = rank[head.priority]
            if local_first[r]:  # a class served before this one waits here: it goes first
                return False
            if self.under_share(tq, room, active_weight):
                return True
            return not (holding[r] - {tq.name})

        return admit

    def add_remote_service(self, service: dict[str, float]) -> None:
        """Weighted tokens other replicas charged these tenants since the last sync: their
        counters here advance by as much (one set of virtual counters across replicas)."""
        for name, amount in service.items():
            tq = self.tenants.get(name)
            if tq is not None and amount:
                tq.counter += amount

    # ---- views --------------------------------------------------------------------------------
    def depth(self, tenant: str) -> tuple[int, int]:
        tq = self.tenants.get(tenant)
        return (tq.queued_requests, tq.queued_tokens) if tq else (0, 0)

    def class_depth(self, tenant: str, priority: str) -> int:
        """How many of `tenant`'s requests of class `priority` are queued."""
        tq = self.tenants.get(tenant)
        return len(tq.queues[priority]) if tq else 0

    def snapshot(self) -> dict[str, dict[str, Any]]:
        return {name: {"queued_requests": tq.queued_requests, "queued_tokens": tq.queued_tokens,
                       "running": tq.running, "counter": round(tq.counter, 1),
                       "weight": tq.weight} for name, tq in self.tenants.items()}

    def shared_view(self) -> dict[str, list[float]]:
        """What this replica tells the others: [queued requests, queued tokens, running, weight,
        served, then per class (CLASSES' order) the requests queued and free to run] of each
        tenant active lately."""
        since = self.clock() - DRAIN_WINDOW_S
        return {name: [tq.queued_requests, tq.queued_tokens, tq.running, tq.weight,
                       round(tq.served, 3),
                       *(len(tq.queues[c]) if self._can_run(tq) else 0 for c in CLASSES)]
                for name, tq in self.tenants.items()
                if tq.queued_requests or tq.running or tq.last_active >= since}


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else old + _PACE_SMOOTHING * (new - old)

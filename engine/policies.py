"""Waiting-queue orders: which waiting request the scheduler considers next.

Every queue keeps its requests sorted by a key that does not change while they wait, so
adding and removing are O(log n) and a step reads only the head it needs. `prefix` and `fair`
compute their order from state that changes between steps (the cache, the tenants' counters).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Iterator

from engine.config import EngineConfig
from engine.request import Request
from protocol.fairness import VTC_COST, lifted_counter

SortKey = tuple[float, ...]


class SortedRequests:
    """Requests sorted by a key fixed at insertion (the key ends with the unique `seq`)."""

    def __init__(self, key: Callable[[Request], SortKey]) -> None:
        self._key = key
        self._keys: list[SortKey] = []
        self._requests: list[Request] = []
        self._key_of: dict[Request, SortKey] = {}

    def add(self, request: Request) -> None:
        key = self._key(request)
        index = bisect.bisect_right(self._keys, key)
        self._keys.insert(index, key)
        self._requests.insert(index, request)
        self._key_of[request] = key

    def remove(self, request: Request) -> None:
        index = bisect.bisect_left(self._keys, self._key_of.pop(request))
        assert self._requests[index] is request
        del self._keys[index]
        del self._requests[index]

    def __contains__(self, request: Request) -> bool:
        return request in self._key_of

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def head(self) -> Request:
        return self._requests[0]


class WaitingQueue:
    """fcfs: arrival order (a request preempted by recompute keeps its place)."""

    accounts_service = False  # True: the scheduler reports computed tokens through charge()

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._queue = SortedRequests(self.key)

    def key(self, request: Request) -> SortKey:
        return (request.arrival_time, request.seq)

    def add(self, request: Request) -> None:
        self._queue.add(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, request: Request) -> bool:
        return request in self._queue

    def ordered(self, now: float) -> Iterator[Request]:
        """Requests in the order to admit them, over a snapshot: the caller may add and remove
        while iterating."""
        return iter(list(self._queue))

    # hooks for policies that account service (fair)
    def activate(self, tenant: str, active_tenants: Collection[str]) -> None:
        """`tenant`, with nothing waiting or running, just submitted a request."""

    def charge(self, request: Request, num_tokens: int) -> None:
        """`num_tokens` of the request's tokens were computed this step."""

    def far_ahead_tenants(self, active: Collection[str]) -> frozenset[str]:
        """Waiting tenants so far over their share that their prefills should not lengthen the
        steps of the `active` tenants behind them."""
        return frozenset()


class PriorityQueue(WaitingQueue):
    """priority: interactive before batch, then arrival."""

    def key(self, request: Request) -> SortKey:
        return (request.priority_rank, request.arrival_time, request.seq)


class ShortestJobFirstQueue(WaitingQueue):
    """sjf: least estimated remaining work first, with aging: a request's estimate shrinks by
    `sjf_aging_tokens_per_s` for every second it waits, so a long request is eventually first.
    work - rate * (now - arrival) orders like work + rate * arrival, a key fixed at insertion."""

    def key(self, request: Request) -> SortKey:
        rate = self.config.sjf_aging_tokens_per_s
        return (request.estimated_remaining_work() + rate * request.arrival_time, request.seq)


class PrefixAwareQueue(WaitingQueue):
    """prefix: longest cached prefix first (its prefill is cheapest), then arrival."""

    def __init__(self, config: EngineConfig, cached_tokens: Callable[[Request], int]) -> None:
        super().__init__(config)
        self._cached_tokens = cached_tokens

    def ordered(self, now: float) -> Iterator[Request]:
        return iter(sorted(self._queue, key=lambda r: -self._cached_tokens(r)))


class FairShareQueue(WaitingQueue):
    """fair: per-tenant virtual token counters (VTC). Each tenant's counter grows by the VTC cost
    of the tokens computed for it (protocol.fairness: the cost the gateway charges too) divided
    by its weight; the tenant with the smallest counter goes next. A tenant that becomes active is
    lifted by protocol.fairness.lifted_counter (the rule the gateway lifts by), so it cannot bank
    credit while idle and then starve the others."""

    accounts_service = True

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.weights: dict[str, float] = {}
        self.counters: dict[str, float] = {}
        self._last_served: str | None = None  # the tenant charged last
        self._per_tenant: dict[str, SortedRequests] = {}

    def add(self, request: Request) -> None:
        queue = self._per_tenant.get(request.tenant)
        if queue is None:
            queue = self._per_tenant[request.tenant] = SortedRequests(self.key)
        queue.add(request)
        self._queue.add(request)

    def remove(self, request: Request) -> None:
        queue = self._per_tenant[request.tenant]
        queue.remove(request)
        if not queue:
            del self._per_tenant[request.tenant]
        self._queue.remove(request)

    def activate(self, tenant: str, active_tenants: Collection[str]) -> None:
        others = (self.counters.get(t, 0.0) for t in active_tenants if t != tenant)
        last = None if self._last_served is None else self.counters[self._last_served]
        self.counters[tenant] = lifted_counter(self.counters.get(tenant, 0.0), others, last)

    def charge(self, request: Request, num_tokens: int) -> None:
        weight = self.weights.get(request.tenant, 1.0)
        cost = step_cost(request, num_tokens)
        self.counters[request.tenant] = self.counters.get(request.tenant, 0.0) + cost / weight
        self._last_served = request.tenant

    def far_ahead_tenants(self, active: Collection[str]) -> frozenset[str]:
        """More than `fair_far_ahead_tokens` of weighted service (VTC cost / weight) ahead of the
        least-served active tenant. Such a tenant's new prefills stay out of steps that start a
        tenant behind it, and are few per step (see `Scheduler._schedule_waiting`): each
        256-token prefill adds ~8 ms to an H100 step of an 8B model, time a tenant under its
        share waits for its first token. Tenants within that distance of each other are not
        limited, so backlogged tenants keep their weighted shares, and a tenant alone is never
        far ahead."""
        if len(active) < 2:
            return frozenset()
        limit = min(self.counters.get(t, 0.0) for t in active) + self.config.fair_far_ahead_tokens
        return frozenset(t for t in self._per_tenant if self.counters.get(t, 0.0) > limit)

    def ordered(self, now: float) -> Iterator[Request]:
        # Simulate charging each yielded request's prefill (what charge() adds if it runs whole
        # this step) so one step interleaves tenants.
        counters = {t: self.counters.get(t, 0.0) for t in self._per_tenant}
        cursors = {t: iter(list(q)) for t, q in self._per_tenant.items()}
        heads = {t: next(c) for t, c in cursors.items()}
        while heads:
            tenant = min(heads, key=lambda t: (counters[t], heads[t].arrival_time, heads[t].seq))
            request = heads[tenant]
            yield request
            prefill = VTC_COST.cost(request.num_remaining_tokens, 1)
            counters[tenant] += prefill / self.weights.get(tenant, 1.0)
            following = next(cursors[tenant], None)
            if following is None:
                del heads[tenant]
            else:
                heads[tenant] = following


def step_cost(request: Request, num_tokens: int) -> float:
    """VTC cost of a step that computed `num_tokens` of `request`, seen after the step advanced
    num_computed_tokens and before its sampled token is appended: a prefill chunk's tokens (a
    recompute's included) are input tokens, and a step that samples adds one output token. A
    decode step computes only the previous output token, charged when it was sampled, so a
    request that is never preempted costs VTC_COST.cost(prompt tokens, output tokens), as in
    the gateway. (A recompute's last chunk of a single output token looks like a decode and is
    charged like one.)"""
    samples = request.num_computed_tokens == request.num_tokens
    decode = samples and num_tokens == 1 and request.num_computed_tokens > request.num_prompt_tokens
    return VTC_COST.cost(0 if decode else num_tokens, 1 if samples else 0)


def make_waiting_queue(config: EngineConfig,
                       cached_tokens: Callable[[Request], int]) -> WaitingQueue:
    if config.policy == "priority":
        return PriorityQueue(config)
    if config.policy == "sjf":
        return ShortestJobFirstQueue(config)
    if config.policy == "prefix":
        return PrefixAwareQueue(config, cached_tokens)
    if config.policy == "fair":
        return FairShareQueue(config)
    return WaitingQueue(config)

"""Dispatch headroom: a tenant under its weighted share is dispatched at once while a backlogged
tenant saturates the backend; a tenant alone still uses every seat (work conservation)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gateway.backends import BackendPool
from gateway.dispatch import Dispatcher
from gateway.fairqueue import FairQueue, QueueBounds, QueuedRequest
from gateway.metrics import GatewayMetrics
from tests.support.waiting import next_loop_turn


@dataclass
class Seats:
    """A backend with `seats` engine seats and `slack` engine-side waiting slots."""

    seats_: int = 8
    slack: int = 2
    name: str = "seats"
    inflight: int = 0
    healthy: bool = True

    def seats(self) -> int:
        return self.seats_

    def capacity(self) -> int:
        return self.seats_ + self.slack

    def has_room(self) -> bool:
        return self.inflight < self.capacity()

    def outstanding_tokens(self) -> int:
        return 0  # by requests in flight alone

    def dispatched(self, tokens: int) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Rig:
    def __init__(self, policy: str = "fair", headroom: float = 0.25, seats: int = 8) -> None:
        self.clock = Clock()
        self.backend = Seats(seats)
        self.queue = FairQueue(policy, clock=self.clock)
        self.dispatcher = Dispatcher(self.queue, BackendPool([self.backend], headroom),  # type: ignore[list-item]
                                     GatewayMetrics())
        self.running: list[QueuedRequest] = []

    def submit(self, tenant: str, n: int = 1, priority: str = "interactive",
               weight: float = 1.0) -> list[QueuedRequest]:
        items = [QueuedRequest(tenant, 100, 50, priority, weight) for _ in range(n)]
        for it in items:
            self.dispatcher.submit(it, QueueBounds())
        self.running = [it for it in self._all() if it.state == "dispatched"]
        return items

    def finish(self, item: QueuedRequest) -> None:
        self.dispatcher.release(item, self.backend, item.input_tokens, item.output_tokens)  # type: ignore[arg-type]

    def dispatched(self, tenant: str) -> int:
        return self.queue.tenants[tenant].running

    def _all(self) -> list[QueuedRequest]:
        return self.running + [it for tq in self.queue.tenants.values()
                               for q in tq.queues.values() for it in q]


async def test_lone_tenant_uses_every_seat_and_slot() -> None:
    rig = Rig()
    rig.submit("a", 50)
    assert rig.dispatched("a") == rig.backend.capacity() == 10  # headroom and slack included


async def test_under_share_tenant_dispatched_at_once_beside_a_backlog() -> None:
    rig = Rig()
    (b0,) = rig.submit("b")
    rig.finish(b0)  # b was here a moment ago: it still counts when seats are shared out
    rig.clock.now += 1.0
    a = rig.submit("a", 50)
    assert rig.dispatched("a") == 8 - 2  # over its share: the headroom (2 of 8) stays free
    for _ in range(3):
        (b,) = rig.submit("b")
        assert b.state == "dispatched"  # at once, into a free seat: no turnover needed
    assert rig.backend.inflight == 9
    rig.finish(next(it for it in a if it.state == "dispatched"))
    assert rig.dispatched("a") == 5  # a does not refill into the headroom b is using


async def test_interactive_tenant_beside_batch_backlog() -> None:
    rig = Rig()
    rig.submit("i")[0].state = "dispatched"
    rig.clock.now += 0.5
    rig.submit("x", 40, priority="batch")
    assert rig.backend.inflight == 1 + 5  # i's one, and x up to the shared seats
    for _ in range(2):
        assert rig.submit("i")[0].state == "dispatched"


async def test_newcomer_gets_the_first_freed_seat_after_a_lone_tenant_filled_all() -> None:
    rig = Rig()
    a = rig.submit("a", 50)
    (b,) = rig.submit("b")
    assert b.state == "queued" and rig.backend.inflight == 10
    rig.finish(a[0])
    assert b.state == "dispatched"  # b is under its share, a is now over it
    rig.finish(a[1])
    assert rig.backend.inflight == 9  # a stays out of the headroom while b is around


async def test_weighted_share_decides_who_may_use_the_headroom() -> None:
    rig = Rig(seats=16)  # headroom 4; shares of 16 seats + 2 slack at 1:3 are 4.5 and 13.5
    rig.submit("b", 1, weight=3.0)
    rig.submit("a", 40, weight=1.0)
    assert rig.dispatched("a") == 11  # 16 - 4 shared seats, less b's one
    rig.submit("b", 10, weight=3.0)
    assert rig.dispatched("b") == 1 + 6  # b, under its share, fills headroom and slack


async def test_headroom_expires_when_the_other_tenant_is_long_gone() -> None:
    rig = Rig()
    (b,) = rig.submit("b")
    rig.finish(b)
    rig.submit("a", 50)
    assert rig.dispatched("a") == 6
    rig.clock.now += 60.0
    rig.dispatcher.pump()  # what the ticker does
    assert rig.dispatched("a") == 10  # alone again: every seat


@pytest.mark.parametrize("policy,headroom", [("fcfs", 0.25), ("fair", 0.0)])
async def test_fcfs_and_zero_headroom_keep_no_seats_back(policy: str, headroom: float) -> None:
    rig = Rig(policy, headroom)
    (b0,) = rig.submit("b")
    rig.finish(b0)
    rig.submit("a", 50)
    assert rig.dispatched("a") == 10
    assert rig.submit("b")[0].state == "queued"


def test_a_backend_keeps_at_least_one_shared_seat() -> None:
    pool = BackendPool([Seats(1), Seats(8), Seats(64)], headroom=0.125)  # type: ignore[list-item]
    assert [pool.reserved(b) for b in pool.backends] == [0, 1, 8]


async def test_no_future_is_left_pending_for_dispatched_items() -> None:
    rig = Rig()
    items = rig.submit("a", 12)
    await next_loop_turn()
    assert sum(it.payload.done() for it in items) == rig.dispatched("a") == 10

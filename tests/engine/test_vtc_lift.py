"""One VTC lift (protocol.fairness.lifted_counter) in the engine's `fair` policy and the gateway's
FairQueue: driven through the same history (tenants' requests arriving, one request served at a
time and finished when served), both serve the same tenants in the same order and hold the same
counters after every event."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.policies import FairShareQueue
from gateway.fairqueue import FairQueue, QueuedRequest

WEIGHTS = {"a": 1.0, "b": 2.0, "c": 0.5}
Event = tuple[str, str, int]  # ("arrive", tenant, prompt tokens) | ("serve", "", 0)


class EngineSide:
    """The engine with one seat: a step admits one request, and with max_tokens 1 ends it."""

    def __init__(self) -> None:
        self.engine = LLMEngine(EngineConfig(
            executor="sim", sim_model="tiny", policy="fair", max_num_seqs=1,
            max_num_batched_tokens=256, max_model_len=1024, num_kv_blocks=256,
            enable_prefix_caching=False))  # a cached prefix would be charged less
        self.tenants: dict[str, str] = {}

    def arrive(self, tenant: str, prompt: int) -> None:
        request_id = f"r{len(self.tenants)}"
        self.tenants[request_id] = tenant
        self.engine.add_request(request_id, [7] * prompt, SamplingParams(max_tokens=1),
                                tenant=tenant, tenant_weight=WEIGHTS[tenant],
                                arrival_time=float(len(self.tenants)))

    def serve(self) -> str | None:
        if not self.engine.has_unfinished():
            return None
        step = self.engine.step()
        (request_id,) = step.scheduled
        assert request_id in step.finished
        return self.tenants[request_id]

    def counters(self) -> dict[str, float]:
        queue = self.engine.scheduler.waiting
        assert isinstance(queue, FairShareQueue)
        return dict(queue.counters)


class GatewaySide:
    def __init__(self) -> None:
        self.queue = FairQueue()

    def arrive(self, tenant: str, prompt: int) -> None:
        self.queue.push(QueuedRequest(tenant, prompt, 1, weight=WEIGHTS[tenant]))

    def serve(self) -> str | None:
        item = self.queue.pop()
        if item is None:
            return None
        self.queue.finish(item, item.input_tokens, 1)
        return item.tenant

    def counters(self) -> dict[str, float]:
        return {name: tq.counter for name, tq in self.queue.tenants.items()}


def replay(events: list[Event]) -> tuple[list[tuple[str | None, dict[str, float]]], ...]:
    """What each side served and its counters, after every event."""
    sides: tuple[EngineSide | GatewaySide, ...] = (EngineSide(), GatewaySide())
    seen: tuple[list[tuple[str | None, dict[str, float]]], ...] = ([], [])
    for kind, tenant, prompt in events:
        for side, log in zip(sides, seen, strict=True):
            served = None
            if kind == "serve":
                served = side.serve()
            else:
                side.arrive(tenant, prompt)
            log.append((served, side.counters()))
    return seen


def assert_alike(events: list[Event]) -> None:
    engine, gateway = replay(events)
    for index, ((served, mine), (theirs_served, theirs)) in enumerate(
            zip(engine, gateway, strict=True)):
        where = f"after event {index} of {events}"
        assert served == theirs_served, where
        assert mine == pytest.approx(theirs), where


SERVE: Event = ("serve", "", 0)
arrival = st.tuples(st.just("arrive"), st.sampled_from(sorted(WEIGHTS)), st.integers(1, 200))
# bursts of arrivals, each followed by some serves: the queues drain to empty now and then, when
# the lift falls back on the tenant served last (about one history in five tells that rule from
# the engine's former "largest counter")
bursts = st.lists(st.tuples(st.lists(arrival, min_size=1, max_size=4), st.integers(0, 6)),
                  max_size=8)
events = bursts.map(lambda bs: [e for arrivals, serves in bs for e in [*arrivals, *[SERVE] * serves]])


@settings(max_examples=100, deadline=None)
@given(events)
def test_engine_and_gateway_lift_alike_on_the_same_history(history: list[Event]) -> None:
    assert_alike(history)


def test_with_none_backlogged_both_lift_to_the_tenant_served_last() -> None:
    # a (200 tokens) and b (10) queued together and served; c comes when nothing is queued.
    # The engine used to lift c to the largest counter (a's, 202), the gateway to the counter
    # its last dispatch started from (0); now both start c where b, served last, is.
    history: list[Event] = [("arrive", "a", 200), ("arrive", "b", 10), SERVE, SERVE,
                            ("arrive", "c", 5)]
    assert_alike(history)
    engine, _ = replay(history)
    counters = engine[-1][1]
    assert [served for served, _ in engine[2:4]] == ["a", "b"]
    assert counters["c"] == counters["b"] == pytest.approx(12 / WEIGHTS["b"])
    assert counters["c"] < counters["a"]

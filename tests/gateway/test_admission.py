"""Rate limits with estimate-and-settle, Retry-After math, cost estimates."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gateway.service
from gateway.admission import (
    OutputEstimator,
    RateLimited,
    RateLimiter,
    estimate_cost,
)
from tenants import TenantLimits
from tests.gateway.helpers import start_gateway


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_requests_per_min_retry_after_is_when_the_oldest_leaves() -> None:
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    limits = TenantLimits(requests_per_min=2)
    limiter.admit("a", limits, 10)
    clock.t += 20
    limiter.admit("a", limits, 10)
    clock.t += 5
    with pytest.raises(RateLimited) as info:
        limiter.admit("a", limits, 10)
    assert info.value.reason == "requests_per_min"
    assert info.value.retry_after == pytest.approx(35.0)  # first charge at t0 leaves at t0+60
    clock.t += 35.01
    limiter.admit("a", limits, 10)


def test_tokens_charged_by_estimate_then_settled_to_actual() -> None:
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    limits = TenantLimits(tokens_per_min=1000)
    charge = limiter.admit("a", limits, 900)
    with pytest.raises(RateLimited) as info:  # the estimate blocks at once: no overshoot
        limiter.admit("a", limits, 200)
    assert info.value.reason == "tokens_per_min"
    assert info.value.retry_after == pytest.approx(60.0)
    limiter.settle(charge, 100)  # it used far less than estimated
    limiter.admit("a", limits, 800)
    assert limiter.usage("a") == (2, 900)


def test_retry_after_counts_only_the_charges_that_must_leave() -> None:
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    limits = TenantLimits(tokens_per_min=100)
    for _ in range(4):
        limiter.admit("a", limits, 25)
        clock.t += 10
    with pytest.raises(RateLimited) as info:
        limiter.admit("a", limits, 40)  # needs 40 freed: the first two charges (at 0 and 10)
    assert info.value.retry_after == pytest.approx(60 + 10 - 40)


def test_refund_and_separate_tenants() -> None:
    limiter = RateLimiter(clock=Clock())
    limits = TenantLimits(requests_per_min=1, tokens_per_min=50)
    charge = limiter.admit("a", limits, 50)
    limiter.admit("b", limits, 50)  # b has its own window
    limiter.refund(charge)
    assert limiter.usage("a") == (0, 0)
    limiter.admit("a", limits, 50)


def test_a_request_larger_than_the_limit_never_fits() -> None:
    limiter = RateLimiter(clock=Clock())
    with pytest.raises(RateLimited) as info:
        limiter.admit("a", TenantLimits(tokens_per_min=100), 101)
    assert info.value.retry_after is None
    assert limiter.usage("a") == (0, 0)


def test_settling_an_expired_charge_changes_nothing() -> None:
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    limits = TenantLimits(tokens_per_min=100)
    charge = limiter.admit("a", limits, 90)
    clock.t += 61
    limiter.admit("a", limits, 90)
    limiter.settle(charge, 5)
    assert limiter.usage("a") == (1, 90)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "settle", "refund", "wait"]),
                          st.integers(0, 500), st.integers(0, 40)), max_size=60))
def test_the_window_sums_what_its_charges_hold_now(ops: list[tuple[str, int, int]]) -> None:
    """Whatever order charges come, settle, are refunded and leave in: the window's counts are
    those of the charges within the last minute, as last settled; and what it keeps of them is
    never tracked by the garbage collector."""
    clock = Clock()
    limiter = RateLimiter(clock=clock)
    charges = []
    for op, amount, which in ops:
        if op == "admit":
            charges.append(limiter.admit("a", TenantLimits(), amount))
        elif op == "wait":
            clock.t += amount / 10  # up to 50 s
        elif charges:
            charge = charges[which % len(charges)]
            if op == "settle":
                limiter.settle(charge, amount)
            else:
                limiter.refund(charge)
        inside = [c for c in charges if c.at > clock.t - 60]
        assert limiter.usage("a") == (sum(c.requests for c in inside),
                                      sum(c.tokens for c in inside))
    window = limiter._windows.get("a")
    if window is not None:
        gc.collect(0)  # tuples of numbers are let go after a young collection
        assert not any(gc.is_tracked(entry) for entry in window.log)
        assert not any(gc.is_tracked(figures) for figures in window.figures.values())


def test_unlimited_tenant_is_never_limited() -> None:
    limiter = RateLimiter(clock=Clock())
    for _ in range(1000):
        limiter.admit("a", TenantLimits(), 10_000)


def test_estimate_uses_max_tokens_else_p90_capped_by_context() -> None:
    assert estimate_cost(10, 20, 500, 256, 90).total == 30
    assert estimate_cost(10, None, 50, 256, 90).output_tokens == 50
    assert estimate_cost(10, None, None, 256, 90).output_tokens == 90  # capped by context left


def test_output_estimator_p90() -> None:
    est = OutputEstimator()
    assert est.estimate("a") is None
    for n in range(1, 101):
        est.observe("a", n)
    assert est.estimate("a") == 90  # the nearest rank: the 90th of 100
    for n in range(101, 1101):  # a full window slides on: the last 1,000 are 101..1100
        est.observe("a", n)
    assert est.estimate("a") == 1000
    est.seed("b", 42.4)
    assert est.estimate("b") == 42 and not est.needs_seed("b")


async def test_a_slow_output_history_leaves_the_default_estimate(
        aiohttp_client: Any, db_url: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A tenant's first chat request without max_tokens reads its output history from the
    ledger; a database that does not answer within SEED_TIMEOUT_S leaves the default estimate
    and the request goes on (the read ends in the background)."""
    monkeypatch.setattr(gateway.service, "SEED_TIMEOUT_S", 0.05)
    h = await start_gateway(aiohttp_client, db_url, gateway={"default_output_tokens": 7})
    release = asyncio.Event()

    async def stuck(tenant: str, window_s: float, q: float) -> float | None:
        await release.wait()
        return 99.0

    monkeypatch.setattr(h.gateway.ledger, "output_tokens_percentile", stuck)
    chat = {"model": "random:tiny", "messages": [{"role": "user", "content": "hi"}]}
    resp = await asyncio.wait_for(h.post("acme", chat, "/v1/chat/completions"), 30)
    assert resp.status == 200, await resp.text()
    assert "output-length history unavailable: TimeoutError" in caplog.text
    estimator = h.gateway.estimator  # seeded without the history: only the answer's length
    assert not estimator.needs_seed("acme") and estimator.estimate("acme") != 99
    release.set()

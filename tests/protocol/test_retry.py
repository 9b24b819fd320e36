"""protocol.retry: how many tries, how long each pause (doubling, capped, jittered), a failure
not to retry passing through at once, and the deadline; on a fake clock that the fake sleep
advances, so no test waits in real time."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.retry import Backoff, retry_async, retry_sync


class Locked(Exception):
    pass


class FakeTime:
    def __init__(self) -> None:
        self.now = 100.0
        self.pauses: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, pause: float) -> None:
        self.pauses.append(pause)
        self.now += pause

    async def async_sleep(self, pause: float) -> None:
        self.sleep(pause)


def failing(times: int, error: Callable[[], BaseException] = Locked) -> Callable[[], str]:
    """An operation that fails `times` times, then answers; `.calls` counts the tries."""
    def attempt() -> str:
        attempt.calls += 1  # type: ignore[attr-defined]
        if attempt.calls <= times:  # type: ignore[attr-defined]
            raise error()
        return "done"

    attempt.calls = 0  # type: ignore[attr-defined]
    return attempt


def run_sync(attempt: Callable[[], str], backoff: Backoff, fake: FakeTime, rand: float = 0.0,
             **options: object) -> str:
    return retry_sync(attempt, backoff, sleep=fake.sleep, clock=fake.clock,
                      rand=lambda: rand, **options)  # type: ignore[arg-type]


def run_async(attempt: Callable[[], str], backoff: Backoff, fake: FakeTime, rand: float = 0.0,
              **options: object) -> str:
    async def call() -> str:
        return attempt()

    return asyncio.run(retry_async(call, backoff, sleep=fake.async_sleep, clock=fake.clock,
                                   rand=lambda: rand, **options))  # type: ignore[arg-type]


RUNNERS = [run_sync, run_async]


@pytest.mark.parametrize("run", RUNNERS)
def test_pauses_double_up_to_the_cap(run: Callable[..., str]) -> None:
    fake, attempt = FakeTime(), failing(6)
    assert run(attempt, Backoff(first_s=0.1, max_s=1.0, attempts=10), fake) == "done"
    assert attempt.calls == 7  # type: ignore[attr-defined]
    assert fake.pauses == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


@pytest.mark.parametrize("run", RUNNERS)
def test_the_last_failure_passes_through_when_the_tries_are_used_up(
        run: Callable[..., str]) -> None:
    fake, attempt = FakeTime(), failing(10)
    with pytest.raises(Locked):
        run(attempt, Backoff(first_s=0.1, max_s=1.0, attempts=3), fake)
    assert attempt.calls == 3  # type: ignore[attr-defined]
    assert len(fake.pauses) == 2


@pytest.mark.parametrize("run", RUNNERS)
def test_a_failure_not_to_retry_passes_through_at_once(run: Callable[..., str]) -> None:
    fake, attempt = FakeTime(), failing(1, error=lambda: KeyError("bug"))
    with pytest.raises(KeyError):
        run(attempt, Backoff(first_s=0.1, max_s=1.0, attempts=5), fake, retry_on=Locked)
    assert attempt.calls == 1 and fake.pauses == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("run", RUNNERS)
def test_when_refuses_a_failure_of_a_retried_type(run: Callable[..., str]) -> None:
    fake, attempt = FakeTime(), failing(1, error=lambda: Locked("disk full"))
    with pytest.raises(Locked):
        run(attempt, Backoff(first_s=0.1, max_s=1.0, attempts=5), fake, retry_on=Locked,
            when=lambda exc: "locked" in str(exc))
    assert attempt.calls == 1 and fake.pauses == []  # type: ignore[attr-defined]


@pytest.mark.parametrize("run", RUNNERS)
def test_no_pause_ends_past_the_deadline(run: Callable[..., str]) -> None:
    fake, attempt = FakeTime(), failing(100)
    deadline = fake.now + 2.0
    seen: list[float] = []
    with pytest.raises(Locked):
        run(attempt, Backoff(first_s=0.1, max_s=1.0), fake, deadline=deadline,
            on_retry=lambda exc, pause: seen.append(pause))
    # 0.1 + 0.2 + 0.4 + 0.8 = 1.5 s; the next pause (1.0) would end at 2.5 s: given up
    assert fake.pauses == pytest.approx([0.1, 0.2, 0.4, 0.8]) == seen
    assert fake.now <= deadline
    assert attempt.calls == 5  # type: ignore[attr-defined]


@pytest.mark.parametrize("run", RUNNERS)
def test_jitter_shortens_a_pause_by_at_most_its_fraction(run: Callable[..., str]) -> None:
    fake = FakeTime()
    run(failing(3), Backoff(first_s=1.0, max_s=1.0, attempts=5, jitter=0.25), fake, rand=0.999)
    assert all(0.75 <= p <= 1.0 for p in fake.pauses) and fake.pauses[0] < 1.0


@given(st.floats(0.0, 10.0), st.floats(0.0, 60.0), st.integers(1, 10_000),
       st.floats(0.0, 0.99), st.floats(0.0, 0.999))
def test_every_pause_is_within_its_bounds(first: float, extra: float, failures: int,
                                          jitter: float, rand: float) -> None:
    backoff = Backoff(first_s=first, max_s=first + extra, jitter=jitter)
    pause = backoff.pause(failures, rand)
    assert 0.0 <= pause <= backoff.max_s
    assert pause >= (1 - jitter) * min(backoff.max_s, first)


def test_a_cancellation_is_never_retried() -> None:
    fake = FakeTime()

    async def cancelled() -> str:
        raise asyncio.CancelledError

    async def call() -> str:
        return await retry_async(cancelled, Backoff(first_s=0.1, max_s=1.0, attempts=5),
                                 retry_on=BaseException, sleep=fake.async_sleep,
                                 clock=fake.clock)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(call())
    assert fake.pauses == []


@pytest.mark.parametrize(("knobs", "message"), [
    ({"first_s": -1.0, "max_s": 1.0}, "first_s"),
    ({"first_s": 2.0, "max_s": 1.0}, "max_s"),
    ({"first_s": 0.1, "max_s": 1.0, "attempts": 0}, "attempts"),
    ({"first_s": 0.1, "max_s": 1.0, "jitter": 1.0}, "jitter"),
])
def test_a_bad_backoff_names_its_field(knobs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Backoff(**knobs)  # type: ignore[arg-type]

"""Wrong admin keys have a failed-attempt budget per client address (issue 25, item 12): the
dashboard's login form had one, a bearer key on /admin/* had none (4,000 wrong keys drew no
429). Both now spend the one budget (`Authenticator.admin_key_matches`): past it, that address
gets 429 with Retry-After, even for the right key, while other addresses are not held back.

Every surface runs the same table: a wrong key, the right key, and what each answers."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tests.gateway.helpers import Harness, start_gateway

ADMIN_KEY = "admin-key-0123456789"
BURST = 3
OTHER_ADDRESS = "127.0.0.2"  # the loopback network: another client address on this machine


@dataclass(frozen=True)
class Answer:
    status: int
    location: str | None
    error: dict[str, Any] | None
    retry_after: str | None


async def _answer(resp: aiohttp.ClientResponse) -> Answer:
    error = (await resp.json()).get("error") if resp.content_type == "application/json" else None
    return Answer(resp.status, resp.headers.get("Location"), error,
                  resp.headers.get("Retry-After"))


Ask = Callable[[aiohttp.ClientSession, str, str], Awaitable[Answer]]


async def bearer(session: aiohttp.ClientSession, base: str, key: str) -> Answer:
    async with session.get(f"{base}/admin/queues",
                           headers={"Authorization": f"Bearer {key}"}) as resp:
        return await _answer(resp)


async def login_form(session: aiohttp.ClientSession, base: str, key: str) -> Answer:
    async with session.post(f"{base}/dashboard/login", data={"key": key},
                            allow_redirects=False) as resp:
        return await _answer(resp)


# surface: (how to ask, what a wrong key gets, what the right key gets)
SURFACES: dict[str, tuple[Ask, Callable[[Answer], bool], Callable[[Answer], bool]]] = {
    "bearer on /admin/*": (
        bearer,
        lambda a: a.status == 401 and a.error is not None
        and a.error["code"] == "invalid_admin_key",
        lambda a: a.status == 200),
    "dashboard login form": (
        login_form,
        lambda a: a.status == 303 and a.location == "/dashboard/login?failed=1",
        lambda a: a.status == 303 and a.location == "/dashboard"),
}


def held_back(answer: Answer) -> bool:
    return (answer.status == 429 and answer.error is not None
            and answer.error["code"] == "too_many_invalid_keys"
            and answer.retry_after is not None and float(answer.retry_after) > 0)


@pytest.fixture
async def gateway(aiohttp_client: Any, db_url: str) -> Harness:
    # refilled far slower than the test runs: the budget is exactly BURST wrong keys
    return await start_gateway(aiohttp_client, db_url, gateway={
        "admin_key": ADMIN_KEY, "auth_failures_per_s": 0.001, "auth_failure_burst": BURST})


@pytest.fixture
async def sessions() -> AsyncIterator[tuple[aiohttp.ClientSession, aiohttp.ClientSession]]:
    """A client from 127.0.0.1 and one from OTHER_ADDRESS."""
    async with aiohttp.ClientSession() as here, aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(local_addr=(OTHER_ADDRESS, 0))) as other:
        yield here, other


def base(h: Harness) -> str:
    return str(h.client.make_url("")).rstrip("/")


@pytest.mark.parametrize("surface", SURFACES)
async def test_wrong_admin_keys_are_held_back_past_the_budget(
        gateway: Harness, sessions: tuple[aiohttp.ClientSession, aiohttp.ClientSession],
        surface: str) -> None:
    ask, wrong, right = SURFACES[surface]
    here, other = sessions
    url = base(gateway)
    assert right(await ask(here, url, ADMIN_KEY))  # a right key spends nothing
    for attempt in range(BURST):
        answer = await ask(here, url, f"not-the-admin-key-{attempt}")
        assert wrong(answer), (attempt, answer)
    answer = await ask(here, url, "not-the-admin-key-either")
    assert held_back(answer), answer
    assert held_back(await ask(here, url, ADMIN_KEY))  # spent: no guess is checked, not one
    assert right(await ask(other, url, ADMIN_KEY))  # another address: its own budget
    assert wrong(await ask(other, url, "not-the-admin-key"))


@pytest.mark.parametrize(("spent_on", "asked_on"),
                         list(itertools.permutations(SURFACES, 2)))
async def test_the_surfaces_spend_one_budget(
        gateway: Harness, sessions: tuple[aiohttp.ClientSession, aiohttp.ClientSession],
        spent_on: str, asked_on: str) -> None:
    here, _ = sessions
    url = base(gateway)
    spend, wrong, _ = SURFACES[spent_on]
    for attempt in range(BURST):
        assert wrong(await spend(here, url, f"not-the-admin-key-{attempt}"))
    ask = SURFACES[asked_on][0]
    assert held_back(await ask(here, url, "not-the-admin-key"))
    assert held_back(await ask(here, url, ADMIN_KEY))

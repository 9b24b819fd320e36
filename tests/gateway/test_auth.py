"""The authenticator's hot path: cached keys need no lookup; expired ones share one."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

from gateway.auth import Authenticator
from protocol.errors import ApiError
from tenants import Principal, TenantStore
from tenants.keys import generate_key
from tests.support.waiting import next_loop_turn, wait_for


def bearer_request(key: str) -> Any:
    return make_mocked_request("POST", "/v1/completions", headers={"Authorization": f"Bearer {key}"})


async def test_cached_key_is_answered_without_a_lookup(store: TenantStore, monkeypatch: Any) -> None:
    await store.create_tenant("acme")
    _, key = await store.create_key("acme")
    auth = Authenticator(store, admin_key=None)
    lookups = 0
    real = store.authenticate_key

    async def counting(plaintext: str) -> Principal | None:
        nonlocal lookups
        lookups += 1
        return await real(plaintext)

    monkeypatch.setattr(store, "authenticate_key", counting)
    first = await auth.tenant(bearer_request(key))
    for _ in range(5):
        assert (await auth.tenant(bearer_request(key))).key_id == first.key_id
    assert lookups == 1


async def test_requests_after_expiry_share_one_lookup(store: TenantStore, monkeypatch: Any) -> None:
    await store.create_tenant("acme")
    _, key = await store.create_key("acme")
    auth = Authenticator(store, admin_key=None)
    lookups = 0
    gate = asyncio.Event()
    real = store.authenticate_key

    async def slow(plaintext: str) -> Principal | None:
        nonlocal lookups
        lookups += 1
        await gate.wait()
        return await real(plaintext)

    monkeypatch.setattr(store, "authenticate_key", slow)
    waiters = [asyncio.create_task(auth.tenant(bearer_request(key))) for _ in range(8)]
    await next_loop_turn()  # every waiter has asked (none suspends before the lookup)
    await wait_for(lambda: lookups == 1)  # and the one lookup is under way
    gate.set()
    principals = await asyncio.gather(*waiters)
    assert lookups == 1 and {p.tenant.name for p in principals} == {"acme"}


async def test_unknown_key_is_401_and_remembered(store: TenantStore, monkeypatch: Any) -> None:
    auth = Authenticator(store, admin_key=None)
    unknown = generate_key()
    for _ in range(3):
        with pytest.raises(ApiError) as err:
            await auth.tenant(bearer_request(unknown))
        assert err.value.status == 401

    async def must_not_run(plaintext: str) -> Principal | None:
        raise AssertionError("a remembered unknown key must not reach the database")

    monkeypatch.setattr(store, "authenticate_key", must_not_run)
    with pytest.raises(ApiError):
        await auth.tenant(bearer_request(unknown))

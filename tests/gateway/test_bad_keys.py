"""A flood of bad keys costs the database little (issue 13, defect 8): keys of the wrong shape
never reach it, and each client address has a bounded budget of failed lookups, which keys that
authenticated lately never spend."""

from __future__ import annotations

import string
from typing import Any
from unittest import mock

import pytest
from aiohttp.test_utils import make_mocked_request
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.auth import Authenticator
from protocol.errors import ApiError
from tenants import Principal, TenantStore
from tenants.keys import KEY_BODY_LEN, generate_key, looks_like_key


def from_address(key: str, address: str = "10.0.0.1") -> Any:
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        (address, 40000) if name == "peername" else default)
    return make_mocked_request("POST", "/v1/completions", transport=transport,
                               headers={"Authorization": f"Bearer {key}"})


@pytest.fixture
def lookups(store: TenantStore, monkeypatch: Any) -> list[str]:
    """The keys that reached the database."""
    seen: list[str] = []
    real = store.authenticate_key

    async def counting(plaintext: str) -> Principal | None:
        seen.append(plaintext)
        return await real(plaintext)

    monkeypatch.setattr(store, "authenticate_key", counting)
    return seen


def test_generated_keys_have_the_shape_the_gateway_accepts() -> None:
    for _ in range(200):
        assert looks_like_key(generate_key())


@settings(max_examples=300, deadline=None)
@given(st.one_of(
    st.text(max_size=80),
    st.text(alphabet=string.ascii_letters + string.digits + "_-", min_size=KEY_BODY_LEN,
            max_size=KEY_BODY_LEN).map(lambda body: "sk-" + body),  # another vendor's prefix
    st.integers(0, 80).filter(lambda n: n != KEY_BODY_LEN).map(lambda n: "fg-" + "a" * n),
    st.sampled_from("+/=.~ \t\n\x00é").map(lambda c: "fg-" + "a" * (KEY_BODY_LEN - 1) + c),
))
def test_only_the_exact_key_shape_looks_like_a_key(text: str) -> None:
    assert not looks_like_key(text)


async def test_malformed_keys_never_reach_the_database(store: TenantStore,
                                                       lookups: list[str]) -> None:
    auth = Authenticator(store, admin_key=None)
    for key in ("fg-short", "sk-" + "a" * KEY_BODY_LEN, "fg-" + "a" * (KEY_BODY_LEN + 1),
                "fg-" + "a" * (KEY_BODY_LEN - 1) + "=", "x" * 5000):
        with pytest.raises(ApiError) as err:
            await auth.tenant(from_address(key))
        assert err.value.status == 401 and err.value.code == "invalid_api_key"
    assert lookups == []


async def test_failed_lookups_per_address_are_bounded(store: TenantStore,
                                                      lookups: list[str]) -> None:
    auth = Authenticator(store, admin_key=None, failures_per_s=0.001, failure_burst=5)
    statuses = []
    for _ in range(40):
        with pytest.raises(ApiError) as err:
            await auth.tenant(from_address(generate_key()))
        statuses.append(err.value.status)
    assert statuses[:5] == [401] * 5 and set(statuses[5:]) == {429}
    assert len(lookups) == 5
    with pytest.raises(ApiError) as err:
        await auth.tenant(from_address(generate_key()))
    assert err.value.code == "too_many_invalid_keys" and err.value.retry_after is not None
    # another address has its own budget
    with pytest.raises(ApiError) as err:
        await auth.tenant(from_address(generate_key(), "10.0.0.2"))
    assert err.value.status == 401 and len(lookups) == 6


async def test_a_key_seen_valid_is_not_held_back_by_its_addresss_budget(
        store: TenantStore, lookups: list[str]) -> None:
    await store.create_tenant("acme")
    _, key = await store.create_key("acme")
    store.cache_ttl = 0.0  # every request re-checks the key: the case a flood would hurt
    auth = Authenticator(store, admin_key=None, failures_per_s=0.001, failure_burst=2)
    assert (await auth.tenant(from_address(key))).tenant.name == "acme"
    for _ in range(10):  # the budget of this address is spent
        with pytest.raises(ApiError):
            await auth.tenant(from_address(generate_key()))
    for _ in range(3):
        assert (await auth.tenant(from_address(key))).tenant.name == "acme"
    assert lookups.count(key) == 4  # looked up each time (its cache entry expired), not held back


async def test_the_budget_refills(store: TenantStore, lookups: list[str],
                                  monkeypatch: Any) -> None:
    now = [1000.0]
    monkeypatch.setattr("gateway.auth.time.monotonic", lambda: now[0])
    auth = Authenticator(store, admin_key=None, failures_per_s=2.0, failure_burst=2)
    for expected in (401, 401, 429):
        with pytest.raises(ApiError) as err:
            await auth.tenant(from_address(generate_key()))
        assert err.value.status == expected
    assert err.value.retry_after == pytest.approx(0.5)
    now[0] += 0.5  # one lookup's worth refilled
    with pytest.raises(ApiError) as err:
        await auth.tenant(from_address(generate_key()))
    assert err.value.status == 401

from __future__ import annotations

import hashlib
import hmac
import math

import pytest

from protocol.measures import SLO, RequestTiming
from tenants import (
    KEY_PREFIX,
    TenantError,
    TenantInfo,
    TenantLimits,
    generate_key,
    hash_key,
    slo_outcomes,
)
from tenants.db import normalize_url
from tenants.keys import hashes_equal, is_valid_hash, looks_like_key


@pytest.mark.parametrize(
    "field", ["requests_per_min", "tokens_per_min", "max_concurrent", "max_queued_requests",
              "max_queued_tokens", "max_tokens", "queue_timeout_s"],
)
@pytest.mark.parametrize("bad", [0, -1, math.inf, True, "10"])
def test_limits_reject_non_positive_and_non_numbers(field: str, bad: object) -> None:
    with pytest.raises(TenantError, match=field):
        TenantLimits(**{field: bad})  # type: ignore[arg-type]


def test_limits_int_fields_reject_fractions_but_timeout_accepts_them() -> None:
    with pytest.raises(TenantError, match="integer"):
        TenantLimits(max_tokens=1.5)  # type: ignore[arg-type]
    assert TenantLimits(queue_timeout_s=0.5).queue_timeout_s == 0.5
    assert TenantLimits().max_tokens is None  # unlimited by default


@pytest.mark.parametrize("weight", [0, -2.0, None, math.nan])
def test_weight_must_be_positive(weight: object) -> None:
    with pytest.raises(TenantError, match="weight"):
        TenantInfo(name="acme", weight=weight)  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["", "-x", "a b", "x" * 65, "acme/1"])
def test_bad_names(name: str) -> None:
    with pytest.raises(TenantError, match="tenant name"):
        TenantInfo(name=name)


def test_a_tenants_three_slos() -> None:
    info = TenantInfo("acme", slo_ttft_p99_s=0.5, slo_tpot_p99_s=0.05, slo_itl_p99_s=0.2)
    assert info.slo == SLO(ttft_s=0.5, tpot_s=0.05, itl_s=0.2)
    assert TenantInfo("bare").slo.unset
    for field in ("slo_ttft_p99_s", "slo_tpot_p99_s", "slo_itl_p99_s"):
        with pytest.raises(TenantError, match=f"{field} must be > 0") as caught:
            TenantInfo("acme", **{field: 0})  # type: ignore[arg-type]
        assert caught.value.field == field


def test_slo_outcomes_fill_only_the_targets_a_tenant_sets() -> None:
    timing = RequestTiming(0.0, (0.25, 0.3125, 0.4375, 0.5), 4, 0.5)  # TPOT 1/12, gaps 1/16, 1/8
    assert slo_outcomes(SLO(), timing) == {}
    assert slo_outcomes(SLO(ttft_s=0.2, tpot_s=0.1, itl_s=0.0625), timing) == {
        "slo_ttft": False, "slo_tpot": True, "itl_gaps_met": 2, "itl_gaps": 3}
    assert slo_outcomes(SLO(itl_s=1.0), RequestTiming(0.0, (), 0, 0.0, ok=False)) == {
        "itl_gaps_met": 0, "itl_gaps": 1}  # turned away: a missed gap


def test_priorities_checked_and_normalised() -> None:
    info = TenantInfo(name="a", default_priority="batch", allowed_priorities=["batch"])  # type: ignore[arg-type]
    assert info.allowed_priorities == ("batch",)
    with pytest.raises(TenantError, match="not in allowed_priorities"):
        TenantInfo(name="a", default_priority="interactive", allowed_priorities=("batch",))
    with pytest.raises(TenantError, match="unknown priority"):
        TenantInfo(name="a", allowed_priorities=("interactive", "urgent"))
    with pytest.raises(TenantError, match="non-empty"):
        TenantInfo(name="a", allowed_priorities=())


def test_key_format_and_hashes() -> None:
    key = generate_key()
    assert key.startswith(KEY_PREFIX) and len(key) >= 40 and looks_like_key(key)
    assert generate_key() != key
    plain, keyed = hash_key(key), hash_key(key, "s3cret")
    assert plain.startswith("sha256:") and keyed.startswith("hmac-sha256:")
    assert is_valid_hash(plain) and is_valid_hash(keyed)
    assert hash_key(key, "other") != keyed and hash_key(key) == plain
    assert hashes_equal(plain, hash_key(key)) and not hashes_equal(plain, keyed)
    assert key not in plain and key not in keyed
    assert not looks_like_key("sk-123") and not looks_like_key("fg-") and not looks_like_key(None)


def test_keyed_hashes_are_rfc_2104_hmacs_every_time() -> None:
    """Stored hashes outlive releases: hash_key keys one HMAC per secret and copies it for each
    key, so every hash must still be HMAC-SHA256 of the key alone, the hundredth as the first,
    whichever keys and secrets came between."""
    keys = [generate_key() for _ in range(3)]
    for _ in range(100):
        for secret in ("s3cret", b"s3cret", "other", "\u00e9t\u00e9"):
            raw = secret.encode() if isinstance(secret, str) else secret
            for key in keys:
                expected = hmac.new(raw, key.encode(), hashlib.sha256).hexdigest()
                assert hash_key(key, secret) == "hmac-sha256:" + expected
        assert hash_key(keys[0]) == "sha256:" + hashlib.sha256(keys[0].encode()).hexdigest()


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("sqlite:///x.db", "sqlite+aiosqlite:///x.db"),
        ("sqlite+aiosqlite:///x.db", "sqlite+aiosqlite:///x.db"),
        ("postgresql://u:p@h:5432/d", "postgresql+asyncpg://u:p@h:5432/d"),
        ("postgres://u@h/d", "postgresql+asyncpg://u@h/d"),
    ],
)
def test_normalize_url(url: str, expected: str) -> None:
    assert normalize_url(url) == expected


@pytest.mark.parametrize("url", ["mysql://x/y", "postgresql+psycopg2://h/d", "not a url"])
def test_normalize_url_rejects(url: str) -> None:
    with pytest.raises(TenantError):
        normalize_url(url)


def test_strictest_slos_are_the_enabled_tenants_lowest_targets_each() -> None:
    from tenants.values import TenantInfo, strictest_slos

    tenants = [TenantInfo("loose", slo_ttft_p99_s=2.0, slo_tpot_p99_s=0.1),
               TenantInfo("strict", slo_ttft_p99_s=0.5, slo_itl_p99_s=0.2),
               TenantInfo("off", slo_ttft_p99_s=0.01, slo_tpot_p99_s=0.001, enabled=False)]
    assert strictest_slos(tenants) == {"slo_ttft_p99_s": (0.5, "strict"),
                                       "slo_tpot_p99_s": (0.1, "loose"),
                                       "slo_itl_p99_s": (0.2, "strict")}
    assert strictest_slos([]) == {}

"""protocol.http's two request parses that the engine server and the gateway share: the bearer
token of an Authorization header, and a number in the query string."""

from __future__ import annotations

import math

import pytest
from aiohttp.test_utils import make_mocked_request

from protocol.errors import ApiError
from protocol.http import bearer, query_float


@pytest.mark.parametrize(("header", "token"), [
    ("Bearer sk-1", "sk-1"),
    ("bearer sk-1", "sk-1"),  # the scheme in any case
    ("BEARER sk-1", "sk-1"),
    ("Bearer   sk-1  ", "sk-1"),  # spaces around the token
    ("Bearer", None),
    ("Bearer    ", None),
    ("Basic dXNlcjpwYXNz", None),
    ("sk-1", None),
    ("", None),
    (None, None),  # no header at all
])
def test_bearer_token(header: str | None, token: str | None) -> None:
    headers = {} if header is None else {"Authorization": header}
    assert bearer(make_mocked_request("GET", "/v1/models", headers=headers)) == token


def number(query: str, default: float | None = 60.0) -> float | None:
    request = make_mocked_request("GET", f"/stats?{query}")
    return query_float(request, "window", default, "not a number",
                       lambda s: 0 < s < math.inf, "must be > 0")


@pytest.mark.parametrize(("query", "value"), [
    ("", 60.0), ("other=1", 60.0), ("window=2.5", 2.5), ("window=1e3", 1000.0),
])
def test_query_float_reads_the_number_or_the_default(query: str, value: float) -> None:
    assert number(query) == value


def test_query_float_absent_without_a_default_is_none() -> None:
    assert number("", default=None) is None


@pytest.mark.parametrize(("query", "message"), [
    ("window=abc", "not a number"), ("window=", "not a number"),
    ("window=0", "must be > 0"), ("window=-1", "must be > 0"),
    ("window=nan", "must be > 0"), ("window=inf", "must be > 0"),
])
def test_query_float_refuses_with_a_400_naming_the_parameter(query: str, message: str) -> None:
    with pytest.raises(ApiError) as caught:
        number(query)
    assert (caught.value.status, caught.value.param, caught.value.message) == (
        400, "window", message)

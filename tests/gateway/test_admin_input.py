"""The admin API's input: every bad name or field is a 400 in OpenAI's error shape whose `param`
names the field, never a 500; integer limits are bounded by their database column on SQLite and
on PostgreSQL."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.app import make_app
from gateway.config import GatewayConfig
from gateway.state import STORE
from protocol.priority import PRIORITIES
from tenants import TenantLimits
from tenants.values import INT_COLUMN_MAX
from tests.gateway.helpers import SIM_ENGINE, ServerThread, completion, start_gateway
from tests.tenants.conftest import (  # noqa: F401 - fixtures: the stored-value tests run on both
    database_url,
    postgres_database,
    postgres_unreachable,
    postgres_url,
    sqlite_path,
)
from tests.tenants.test_names import BAD_NAMES

ADMIN = {"Authorization": "Bearer admin-key-0123456789"}
INT_LIMITS = [n for n in TenantLimits.names() if not n.endswith("_s")]


def error_of(status: int, text: str) -> dict[str, Any]:
    """The error of a 400 answer, checked to be OpenAI's shape with a printable message."""
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error" and error["code"]
    assert isinstance(error["message"], str) and error["message"].isprintable(), error
    return error


async def post_tenant(h: Any, body: Any) -> tuple[int, str]:
    data = body if isinstance(body, bytes) else json.dumps(body)
    resp = await h.client.post("/admin/tenants", data=data, headers=ADMIN)
    return resp.status, await resp.text()


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"name": "a", "limits": {"max_tokens": 2**64}}, "limits.max_tokens", "at most 2147483647"),
        ({"name": "a", "limits": {"max_tokens": 1.5}}, "limits.max_tokens", "positive integer"),
        ({"name": "a", "limits": {"max_concurrent": True}}, "limits.max_concurrent", "got True"),
        ({"name": "a", "limits": {"queue_timeout_s": "30"}}, "limits.queue_timeout_s", "number"),
        ({"name": "a", "limits": {"max_token": 1}}, "limits.max_token", "did you mean max_tokens"),
        ({"name": "a", "limits": [1]}, "limits", "limits must be a mapping"),
        ({"name": "a", "limits": "none"}, "limits", "limits must be a mapping"),
        ({"name": "a", "allowed_priorities": "batch"}, "allowed_priorities",
         "must be a non-empty list of priorities"),
        ({"name": "a", "allowed_priorities": [[1]]}, "allowed_priorities", "non-empty list"),
        ({"name": "a", "allowed_priorities": []}, "allowed_priorities", "non-empty list"),
        ({"name": "a", "allowed_priorities": {"batch": 1}}, "allowed_priorities", "list"),
        ({"name": "a", "allowed_priorities": ["urgent"]}, "allowed_priorities", "'urgent'"),
        ({"name": "a", "default_priority": ["batch"]}, "default_priority", "unknown priority"),
        ({"name": "a", "default_priority": "batch", "allowed_priorities": ["interactive"]},
         "default_priority", "not in allowed_priorities"),
        ({"name": "a", "weight": "2"}, "weight", "weight must be a finite number"),
        ({"name": "a", "weight": True}, "weight", "got True"),
        ({"name": "a", "weight": 1e308}, "weight", "weight must be in"),
        ({"name": "a", "weight": 1e-300}, "weight", "weight must be in"),
        ({"name": "a", "weight": 2**1100}, "weight", "weight must be a finite number"),
        (b'{"name": "a", "weight": NaN}', "weight", "got nan"),
        (b'{"name": "a", "limits": {"queue_timeout_s": 1e999}}', "limits.queue_timeout_s",
         "got inf"),
        ({"name": "a", "slo_ttft_p99_s": "1.5"}, "slo_ttft_p99_s", "slo_ttft_p99_s must be"),
        ({"name": "a", "slo_tpot_p99_s": 0}, "slo_tpot_p99_s", "slo_tpot_p99_s must be > 0"),
        ({"name": "a", "slo_itl_p99_s": -1}, "slo_itl_p99_s", "slo_itl_p99_s must be > 0"),
        ({"name": "a", "enabled": "yes"}, "enabled", "enabled must be true or false"),
        ({"name": "a", "wieght": 2}, "wieght", "did you mean weight"),
        ({"name": "a", "id": 7}, "id", "unknown tenant setting(s): id"),
        ({"name": "a", "lim\nits": {}}, "'lim\\nits'", "unknown tenant setting(s): 'lim\\nits'"),
        ({"name": 5}, "name", "invalid tenant name 5"),
        ({"weight": 2}, "name", "missing 'name'"),
    ],
)
async def test_bad_tenant_fields_are_400_naming_the_field(
    aiohttp_client: Any, db_url: str, body: Any, param: str, message: str
) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    error = error_of(*await post_tenant(h, body))
    assert error["param"] == param and message in error["message"], error
    resp = await h.client.get("/admin/tenants", headers=ADMIN)
    assert [t["name"] for t in (await resp.json())["data"]] == ["acme"]  # nothing written


async def test_a_duplicate_tenant_is_409(aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    status, text = await post_tenant(h, {"name": "acme"})
    error = json.loads(text)["error"]
    assert status == 409 and error["param"] == "name" and error["code"] == "tenant_exists"
    assert "tenant 'acme' already exists" in error["message"]


@pytest.mark.parametrize("name", BAD_NAMES)
async def test_bad_names_are_400_on_every_admin_endpoint(
    aiohttp_client: Any, db_url: str, name: str
) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    answers = [await post_tenant(h, {"name": name})]
    for method, path in [("POST", f"/admin/tenants/{quote(name, safe='')}/keys"),
                         ("GET", f"/admin/usage/{quote(name, safe='')}")]:
        resp = await h.client.request(method, path, headers=ADMIN)
        answers.append((resp.status, await resp.text()))
    for answer in answers:
        error = error_of(*answer)
        assert error["param"] == "name" and BAD_NAMES[name] in error["message"]
        assert error["message"].isascii()
    resp = await h.client.post("/admin/tenants/ghost/keys", headers=ADMIN)  # valid but unknown
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "tenant_not_found"


async def test_usage_of_a_name_that_is_no_tenant_and_used_nothing_is_404(
    aiohttp_client: Any, db_url: str
) -> None:
    """A misspelt name is not a tenant that used nothing; a tenant that used nothing is, and a
    deleted tenant's usage outlives it (usage names the tenant)."""
    h = await start_gateway(aiohttp_client, db_url)
    resp = await h.client.get("/admin/usage/acmee", headers=ADMIN)
    error = (await resp.json())["error"]
    assert resp.status == 404 and error["code"] == "tenant_not_found"
    assert "'acmee'" in error["message"] and error["param"] == "name"
    resp = await h.client.get("/admin/usage/acmee?window_s=60", headers=ADMIN)
    assert resp.status == 404 and "in the last 60 s" in (await resp.json())["error"]["message"]
    assert (await post_tenant(h, {"name": "idle"}))[0] == 201
    resp = await h.client.get("/admin/usage/idle", headers=ADMIN)
    assert resp.status == 200 and (await resp.json())["requests"] == 0
    assert (await h.post("acme", completion())).status == 200
    await h.app[STORE].delete_tenant("acme")
    resp = await h.client.get("/admin/usage/acme", headers=ADMIN)
    assert resp.status == 200 and (await resp.json())["requests"] == 1


async def test_integer_limits_are_bounded_by_their_column(
    aiohttp_client: Any, database_url: str  # noqa: F811 - the fixture imported above
) -> None:
    h = await start_gateway(aiohttp_client, database_url)
    at_bound = dict.fromkeys(INT_LIMITS, INT_COLUMN_MAX)
    status, text = await post_tenant(h, {"name": "big", "limits": at_bound})
    assert status == 201, text
    assert json.loads(text)["limits"] == {**at_bound, "queue_timeout_s": None}
    listed = await (await h.client.get("/admin/tenants", headers=ADMIN)).json()
    [big] = [t for t in listed["data"] if t["name"] == "big"]
    assert big["limits"] == json.loads(text)["limits"]  # read back from the database
    for limit in INT_LIMITS:
        error = error_of(*await post_tenant(h, {"name": "over",
                                                 "limits": {limit: INT_COLUMN_MAX + 1}}))
        assert error["param"] == f"limits.{limit}" and "at most 2147483647" in error["message"]


# -- random bodies -------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=8)
names = (st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,70}", fullmatch=True)
         | st.text(max_size=70) | json_values)
numbers = st.floats() | st.integers(-2**40, 2**70) | json_values
limits = st.fixed_dictionaries({}, optional={n: numbers for n in TenantLimits.names()}) | json_values
fields = {
    "name": names,
    "weight": numbers,
    "default_priority": st.sampled_from([*PRIORITIES, "urgent"]) | json_values,
    "allowed_priorities": st.lists(st.sampled_from([*PRIORITIES, "urgent"])) | json_values,
    "limits": limits,
    "slo_ttft_p99_s": numbers,
    "slo_tpot_p99_s": numbers,
    "slo_itl_p99_s": numbers,
    "enabled": st.booleans() | json_values,
}
bodies = st.builds(lambda known, other: {**other, **known},
                   st.fixed_dictionaries({}, optional=fields),
                   st.dictionaries(st.text(max_size=8), json_values, max_size=2))


@pytest.fixture
def admin_gateway(db_url: str) -> Any:
    config = GatewayConfig(demo_tenant=False, admin_key="admin-key-0123456789")
    with ServerThread(make_app(config, engine=SIM_ENGINE, database=db_url)) as server:
        yield server


def _names_a_field(param: str, body: dict[str, Any]) -> bool:
    given_ = {*body, *(ascii(k) for k in body)}
    if param == "default_priority" and "allowed_priorities" in body:
        return True  # the default, sent or not, is outside the allowed list that was sent
    return param == "name" or any(param == k or param.startswith(f"{k}.") for k in given_)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies)
def test_random_bodies_never_5xx(admin_gateway: ServerThread, body: dict[str, Any]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", admin_gateway.port, timeout=30)
    try:
        conn.request("POST", "/admin/tenants", body=json.dumps(body).encode(),
                     headers={**ADMIN, "Content-Type": "application/json"})
        resp = conn.getresponse()
        status, text = resp.status, resp.read().decode()
    finally:
        conn.close()
    if status == 201:
        assert json.loads(text)["name"] == body["name"]
        return
    if status == 409:  # a name an earlier example created
        assert json.loads(text)["error"]["param"] == "name"
        return
    error = error_of(status, text)
    assert error["param"] is None or _names_a_field(error["param"], body), (error, body)

"""schemathesis against the served gateway: requests generated from the gateway's own
/openapi.json, bodies and parameters the document allows and ones it does not, with good
keys and bad: every operation is sent its own scheme's key, the admin key and a tenant's key
(whatever it asks for), an unknown key, a malformed one and none. Not one answer is a 5xx,
every answer is one the document lists (status, content type, headers, body schema), and the
usage ledger still flushes afterwards."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control.app import make_app
from engine import EngineConfig
from gateway.config import GatewayConfig, JobsConfig
from gateway.state import GATEWAY
from tenants import generate_key
from tests.gateway.helpers import ServerThread, create_tenants

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402

ADMIN_KEY = "admin-key-0123456789"
METRICS_TOKEN = "metrics-token-0123456789"
# A short context keeps the sim engine's answers short: a chat without max_tokens generates
# the rest of the context.
ENGINE = EngineConfig(executor="sim", max_model_len=128, max_num_seqs=16,
                      max_num_batched_tokens=256)
# generated requests per operation and mode: at least 2,000 in all
EXAMPLES = {"POST /v1/completions": 450, "POST /v1/chat/completions": 300,
            "POST /admin/tenants": 150}
DEFAULT_EXAMPLES = 60
MIN_REQUESTS = 2000
CONFIG = schemathesis.Config.from_dict({
    # Unknown query parameters are ignored, as unknown body fields are; the keys are this
    # test's to choose (good and bad), not the generator's.
    "generation": {"allow-extra-parameters": False, "with-security-parameters": False},
    # an invalid body may also be too large (413)
    "checks": {"negative_data_rejection": {"expected-statuses": [
        400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429]}},
})
# A body the document allows may still be refused: what no document says (the model's context
# length and vocabulary, a model name this gateway does not serve, min_tokens over max_tokens,
# a default_priority outside allowed_priorities, a tenant name already taken) is a 400 or 404.
# A tune job spec may combine fields that do not go together (a workload in shadow mode, trials
# and timeout_s), name a workload or knob that does not exist, or a job that is not there.
MAY_REFUSE_VALID = ("POST /v1/completions", "POST /v1/chat/completions", "POST /admin/tenants",
                    "POST /admin/tune-jobs", "POST /admin/tune-jobs/{id}/apply")


@pytest.fixture
def served(tmp_path: Any) -> Iterator[tuple[ServerThread, str]]:
    """The gateway with the embedded engine (sim executor) and a SQLite tenant database and
    usage ledger, on a real port; and the key of its tenant."""
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'schemathesis.db'}"
    keys = asyncio.run(create_tenants(db_url, {"acme": {}}))
    # jobs are queued, never run here (max_running 0): no study runs beside the generator
    # every request comes from one address and a third carry a key the operation does not
    # take: with a failed-key budget the run would be the budget's 429s (tests/gateway/
    # test_bad_keys.py and test_admin_budget.py hold that), so there is none here
    config = GatewayConfig(demo_tenant=False, admin_key=ADMIN_KEY, metrics_token=METRICS_TOKEN,
                           jobs=JobsConfig(dir=str(tmp_path / "jobs"), max_running=0),
                           auth_failures_per_s=0)
    with ServerThread(make_app(config, engine=ENGINE, database=db_url)) as server:
        yield server, keys["acme"]


def _keys(tenant_key: str) -> dict[str, str]:
    return {"tenantKey": tenant_key, "adminKey": ADMIN_KEY, "metricsToken": METRICS_TOKEN}


# the key a request carries: its scheme's, mostly; else the admin key or a tenant's whatever
# the operation asks for (one of them is the wrong one), or one of the bad ones
AUTH = st.sampled_from(["good"] * 4 + ["adminKey", "tenantKey"] * 2
                       + ["unknown key", "not a key", "none"])


def _scheme(operation: Any) -> str | None:
    """The security scheme the operation asks for (its first), None when it asks for none."""
    schemes = [name for requirement in operation.definition.raw.get("security", [])
               for name in requirement]
    return schemes[0] if schemes else None


def _key_sent(operation: Any, auth: str) -> str:
    """Which key a request carries: a scheme's (adminKey, tenantKey, metricsToken) or another."""
    return (_scheme(operation) or "none") if auth == "good" else auth


def _headers(operation: Any, auth: str, keys: dict[str, str]) -> dict[str, str]:
    sent = _key_sent(operation, auth)
    if sent == "none":
        return {}
    key = keys.get(sent) or {"unknown key": generate_key(), "not a key": "sk-not-a-key"}[sent]
    return {"Authorization": f"Bearer {key}"}


def _usage(server: ServerThread, key: str) -> dict[str, Any]:
    resp = requests.get(f"{server.url}/v1/usage", headers={"Authorization": f"Bearer {key}"},
                        timeout=30)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_generated_requests_get_documented_answers_and_no_5xx(
        served: tuple[ServerThread, str]) -> None:
    server, tenant_key = served
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=CONFIG)
    schema.validate()
    before = _usage(server, tenant_key)["requests"]
    statuses: collections.Counter[tuple[str, int]] = collections.Counter()
    sent: collections.Counter[tuple[str, str]] = collections.Counter()  # (operation, key)
    keys = _keys(tenant_key)
    with requests.Session() as session:
        for result in schema.get_all_operations():
            operation = result.ok()
            modes = [GenerationMode.POSITIVE]
            if operation.body or operation.query or operation.path_parameters:
                modes.append(GenerationMode.NEGATIVE)
            for mode in modes:
                _fuzz(server, session, operation, mode, keys, statuses, sent)
    total = sum(statuses.values())
    assert total >= MIN_REQUESTS, statuses
    assert not [k for k in statuses if k[1] >= 500], statuses
    # every operation was sent both keys
    operations = {label for label, _ in sent}
    missing = [(label, key) for label in operations for key in ("adminKey", "tenantKey")
               if not sent[(label, key)]]
    assert not missing, missing
    assert any(status == 200 for (label, status) in statuses if label.startswith("POST /v1"))

    ledger = server.app[GATEWAY].ledger
    server.run(ledger.flush())
    assert ledger.pending == 0
    assert _usage(server, tenant_key)["requests"] > before


def _fuzz(server: ServerThread, session: requests.Session, operation: Any,
          mode: GenerationMode, keys: dict[str, str],
          statuses: collections.Counter[tuple[str, int]],
          sent: collections.Counter[tuple[str, str]]) -> None:
    examples = EXAMPLES.get(operation.label, DEFAULT_EXAMPLES)

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode), auth=AUTH)
    def run(case: Any, auth: str) -> None:
        headers = _headers(operation, auth, keys)
        sent[(operation.label, _key_sent(operation, auth))] += 1
        response = case.call(base_url=server.url, session=session, headers=headers,
                             timeout=30)
        statuses[(operation.label, response.status_code)] += 1
        assert response.status_code < 500, (f"{case.as_curl_command(headers=headers)}\n-> "
                                             f"{response.status_code} {response.text[:500]}")
        excluded = [positive_data_acceptance] if operation.label in MAY_REFUSE_VALID else []
        case.validate_response(response, headers=headers, excluded_checks=excluded)

    run()

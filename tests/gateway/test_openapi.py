"""GET /openapi.json: a valid OpenAPI 3.1 document listing every route the gateway serves, whose
request schemas accept exactly the bodies `parse_request` accepts and whose tenant schema
accepts exactly what `tenants.values` does."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
from hypothesis import HealthCheck, given, settings

from control.openapi import ROUTES, document
from engine import SamplingParams
from gateway.openapi import tenant_create_schema
from protocol.errors import ApiError
from protocol.openai import REQUEST_FIELDS, SAMPLING_FIELDS, Field, parse_request
from protocol.openapi import field_schema, request_schema
from tenants import TenantError
from tenants.values import tenant_from_mapping
from tests.gateway.helpers import start_gateway

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

EXAMPLES = {"completions": 300, "chat": 100}  # chat bodies are slow to generate


def test_the_document_is_valid_openapi() -> None:
    schemathesis.openapi.from_dict(document()).validate()


async def test_served_without_a_key_and_lists_every_route(aiohttp_client: Any,
                                                          db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url)
    resp = await h.client.get("/openapi.json")
    assert resp.status == 200 and await resp.json() == document()
    served = {(r.method.lower(), r.resource.canonical) for r in h.app.router.routes()
              if r.method != "HEAD" and r.resource is not None}
    assert served == {(route.method, route.path) for route in ROUTES}


def test_every_operation_documents_its_errors_in_openais_shape() -> None:
    doc = document()
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            for status, response in operation["responses"].items():
                if int(status) >= 400 and path != "/readyz":
                    schema = response["content"]["application/json"]["schema"]
                    assert schema == {"$ref": "#/components/schemas/Error"}, (method, path)
                if status in ("429", "503") and path != "/readyz":
                    assert "Retry-After" in response["headers"], (method, path)
            if path.startswith(("/v1/", "/admin/")):
                assert operation["security"], (method, path)


# ---- the request schemas and parse_request agree ---------------------------------------------
def _accepted(body: dict[str, Any], endpoint: str) -> bool:
    try:
        parse_request(body, endpoint)
    except ApiError as exc:
        assert exc.status == 400 and exc.param, exc.message
        return False
    return True


@pytest.mark.parametrize(("endpoint", "path"), [("completions", "/v1/completions"),
                                                ("chat", "/v1/chat/completions")])
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generated_bodies_are_valid_exactly_when_parsed(endpoint: str, path: str,
                                                        mode: GenerationMode) -> None:
    """Bodies generated from the document (valid ones and invalid ones): the schema and the
    parser give the same verdict on every one."""
    validator = jsonschema_rs.validator_for(request_schema(endpoint))
    operation = schemathesis.openapi.from_dict(document())[path]["POST"]
    verdicts = set()

    @settings(max_examples=EXAMPLES[endpoint], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        if not isinstance(case.body, dict):
            return  # not an object: parse_json_body's 400, before parse_request
        valid = validator.is_valid(case.body)
        assert _accepted(case.body, endpoint) == valid, case.body
        verdicts.add(valid)

    check()
    assert verdicts == {mode == GenerationMode.POSITIVE} or verdicts == {True, False}


def _edges(spec: Field) -> list[Any]:
    """Values at and beyond a field's bounds, and of the wrong type."""
    values: list[Any] = [None, "7", True, [], {}]
    for bound in (spec.minimum, spec.maximum):
        if bound is not None:
            step = 1 if spec.kind == "integer" else 1e-9
            values += [bound - step, bound, bound + step]
    if spec.kind == "number":
        values += [0.5, 2, 10**400, -(10**400), math.nan, math.inf]
    if spec.kind == "integer":
        values += [0, 1, 2.0, 2.5, 2**63, 2**31, -(2**63) - 1]
    if spec.allowed is not None:
        values += [*spec.allowed, "none", 0.0, 1.0, False, {"type": "text"}, "batch"]
    if spec.max_length is not None:
        values += ["x" * spec.max_length, "x" * (spec.max_length + 1)]
    return values


SCALARS = [f for f in REQUEST_FIELDS if f.kind in ("integer", "number", "string", "boolean",
                                                   "any", "max_tokens")]


@pytest.mark.parametrize("spec", SCALARS, ids=lambda f: f.name)
def test_each_fields_bounds_are_the_documents(spec: Field) -> None:
    validator = jsonschema_rs.validator_for(field_schema(spec))
    body = {"messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}
    endpoint = "chat" if "chat" in spec.endpoints else "completions"
    for value in _edges(spec):
        if isinstance(value, float) and not math.isfinite(value):
            valid = False  # JSON Schema has no NaN or infinity; JSON neither
        else:
            valid = validator.is_valid(value)
        assert _accepted({**body, spec.name: value}, endpoint) == valid, (spec.name, value)


def test_the_sampling_ranges_are_the_engines() -> None:
    """Every value the table allows, SamplingParams takes; for the numbers, the ranges are
    the same (the integers may be narrower here: no overflow downstream)."""
    for spec in (f for f in REQUEST_FIELDS if f.name in SAMPLING_FIELDS):
        for bound in (spec.minimum, spec.maximum):
            if bound is None or (spec.exclusive_minimum and bound == spec.minimum):
                continue
            value = 0 if spec.name == "top_k" and bound == -1 else bound  # -1: off, the engine's 0
            SamplingParams(**{spec.name: value, "max_tokens": max(1, int(value)) if spec.name
                              == "min_tokens" else 16})
            if spec.kind == "number":
                outside = bound + 1e-6 if bound == spec.maximum else bound - 1e-6
                with pytest.raises(ValueError, match=spec.name):
                    SamplingParams(**{spec.name: outside})
        if spec.exclusive_minimum:
            with pytest.raises(ValueError, match=spec.name):
                SamplingParams(**{spec.name: spec.minimum})


# ---- the tenant schema and tenants.values agree ----------------------------------------------
def _tenant_accepted(body: Any) -> bool:
    try:
        tenant_from_mapping(body)
    except TenantError:
        return False
    return True


def _integral_floats(limits: Any) -> bool:
    """A limit of 1.0: an integer to JSON Schema, not to tenants.values (which takes JSON
    integers only, 1 and not 1.0; JSON Schema cannot tell them apart)."""
    return isinstance(limits, dict) and any(
        isinstance(v, float) and v.is_integer() and not k.endswith("_s") for k, v in limits.items())


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generated_tenants_are_valid_exactly_when_accepted(mode: GenerationMode) -> None:
    validator = jsonschema_rs.validator_for(tenant_create_schema())
    operation = schemathesis.openapi.from_dict(document())["/admin/tenants"]["POST"]

    @settings(max_examples=200, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        body = case.body
        if not isinstance(body, dict) or _integral_floats(body.get("limits")):
            return
        assert _tenant_accepted(body) == validator.is_valid(body), body

    check()


@pytest.mark.parametrize(("body", "valid"), [
    ({"name": "a", "default_priority": "batch", "allowed_priorities": ["interactive"]}, False),
    ({"name": "a", "allowed_priorities": ["batch"]}, False),  # the default: interactive
    ({"name": "a", "default_priority": "batch", "allowed_priorities": ["batch"]}, True),
    ({"name": "a", "default_priority": "batch"}, True),  # allowed: every priority
])
def test_the_default_priority_rule_is_the_documents(body: dict[str, Any], valid: bool) -> None:
    """The rule between two fields: the schema says it, and says what tenants.values does."""
    assert jsonschema_rs.validator_for(tenant_create_schema()).is_valid(body) is valid
    assert _tenant_accepted(body) is valid


# ---- the rules no schema can say are in the operations' descriptions ---------------------------
@pytest.mark.parametrize(("method", "path", "rule"), [
    ("post", "/v1/completions", "min_tokens must not exceed max_tokens"),
    ("post", "/v1/chat/completions", "min_tokens must not exceed max_tokens"),
    ("get", "/admin/capture", "until must be after since"),
    ("post", "/admin/tune-jobs", "rate x duration"),
    ("post", "/admin/tune-jobs", "set.sim_profile"),
])
def test_a_rule_between_fields_is_in_the_operations_description(method: str, path: str,
                                                                rule: str) -> None:
    assert rule in document()["paths"][path][method]["description"]


async def test_the_rules_the_document_leaves_to_its_description_are_the_servers(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    """Each body or query the document's schemas allow, answered 400 naming the field its
    operation's description names."""
    h = await start_gateway(aiohttp_client, db_url,
                            gateway={"capture": {"path": str(tmp_path / "capture.jsonl")}})
    tenant = {"Authorization": f"Bearer {h.keys['acme']}"}
    admin = {"Authorization": "Bearer admin-key-0123456789"}
    for path, body in [("/v1/completions", {"model": "random:tiny", "prompt": "hi",
                                            "max_tokens": 2, "min_tokens": 3}),
                       ("/v1/chat/completions", {"model": "random:tiny", "max_tokens": 2,
                                                 "min_tokens": 3, "messages": [
                                                     {"role": "user", "content": "hi"}]})]:
        endpoint = "chat" if "chat" in path else "completions"
        assert jsonschema_rs.validator_for(request_schema(endpoint)).is_valid(body)
        resp = await h.client.post(path, json=body, headers=tenant)
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "min_tokens"
    resp = await h.client.get("/admin/capture?since=100&until=100", headers=admin)
    assert resp.status == 400 and (await resp.json())["error"]["param"] == "until"


def test_a_job_spec_with_a_workload_and_captured_minutes_is_invalid_in_the_document() -> None:
    """The schema says what the server says: one of workload or captured_minutes (mode
    shadow: neither), and a sim profile by name."""
    from control.jobs import parse_spec

    spec = {"workload": "uniform", "slo_ttft_p99_s": 1.0, "rate": 5, "duration": 10}
    validator = jsonschema_rs.validator_for(document()["components"]["schemas"]["TuneJobSpec"])
    for body, valid in [(spec, True), ({**spec, "captured_minutes": 5}, False),
                        ({**spec, "workload": None, "captured_minutes": 5}, True),
                        ({**spec, "workload": None}, False),
                        ({"mode": "shadow", "shadow": "x", "slo_ttft_p99_s": 1.0,
                          "captured_minutes": 5}, False),
                        ({**spec, "set": {"sim_profile": "l4-llama8b"}}, True),
                        ({**spec, "set": {"sim_profile": "/dev/zero"}}, False),
                        ({**spec, "set": {"sim_profile": ".hidden"}}, False),
                        ({**spec, "set": {"model": "/models/llama"}}, False),
                        ({**spec, "set": {"sim_model": "nope"}}, False)]:
        assert validator.is_valid(body) is valid, body
        if not valid:  # and the server refuses it too
            with pytest.raises(ApiError):
                parse_spec(body, {"x": "http://127.0.0.1:9"}, {})


# ---- the sim profile an upload holds and the document agree -------------------------------------
def _profile_accepted(body: Any) -> bool:
    from control.jobs import profile_from_upload

    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    try:
        profile_from_upload(raw, as_json=not isinstance(body, bytes))
    except ApiError as exc:
        assert exc.status == 400, exc.message
        return False
    return True


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_generated_sim_profiles_are_valid_exactly_when_accepted(mode: GenerationMode) -> None:
    from control.jobs import SIM_PROFILE_SCHEMA

    validator = jsonschema_rs.validator_for(SIM_PROFILE_SCHEMA)
    operation = schemathesis.openapi.from_dict(document())["/admin/sim-profiles/{name}"]["PUT"]
    verdicts = set()

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def check(case: Any) -> None:
        body = case.body
        valid = not isinstance(body, bytes) and validator.is_valid(body)  # bytes: no mapping
        assert _profile_accepted(body) == valid, body
        verdicts.add(valid)

    check()
    assert mode == GenerationMode.NEGATIVE or verdicts == {True}

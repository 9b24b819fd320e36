"""GET /openapi.json: a valid OpenAPI 3.1 document listing every route the gateway serves, whose
request schemas accept exactly the bodies `parse_request` accepts and whose tenant schema
accepts exactly what `tenants.values` does."""

from __future__ import annotations

import math
from typing import Any

import jsonschema_rs
import pytest
from hypothesis import HealthCheck, given, settings

from engine import SamplingParams
from gateway.openapi import ROUTES, document, tenant_create_schema
from protocol.errors import ApiError
from protocol.openai import REQUEST_FIELDS, SAMPLING_FIELDS, Field, parse_request
from protocol.openapi import field_schema, request_schema
from protocol.priority import PRIORITIES
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
        if validator.is_valid(body) and body.get("default_priority", "interactive") not in (
                body.get("allowed_priorities", PRIORITIES)):
            return  # the one rule between fields the document does not spell
        assert _tenant_accepted(body) == validator.is_valid(body), body

    check()

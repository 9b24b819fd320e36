"""GET /openapi.json: the gateway's OpenAPI 3.1 document, assembled, never written by hand.

The request, response and error bodies are `protocol.openapi`'s (written from the field table
`parse_request` reads); the tenant bodies come from `tenants.values`' dataclass fields; every
route the gateway serves is one `Route` below, and the control plane adds its own (`ApiParts`,
control/openapi.py; tests/gateway/test_openapi.py checks the list against the app's router).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import typing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from protocol import openapi as protocol_schemas
from protocol.openapi import Schema, nullable
from protocol.priority import PRIORITIES
from tenants import KeyInfo, TenantInfo, TenantLimits
from tenants import values as tenant_values
from tenants.keys import KEY_ID_PATTERN

# ---- the tenant bodies, from tenants.values' dataclasses -------------------------------------
# tenants.values' rules as JSON Schema: every limit is a positive integer its database column
# holds, every weight, SLO and timeout a number > 0.
_TYPE_SCHEMAS: dict[Any, Schema] = {
    int: {"type": "integer", "minimum": 1, "maximum": tenant_values.INT_COLUMN_MAX},
    float: {"type": "number", "exclusiveMinimum": 0},
    bool: {"type": "boolean"},
    str: {"type": "string"},
}
TENANT_NAME: Schema = {"type": "string", "pattern": f"^(?:{tenant_values.NAME_RE.pattern})$",
                       "description": f"A tenant name: {tenant_values.NAME_RULE}."}
_FIELD_RULES: dict[str, Schema] = {
    "name": TENANT_NAME,
    "weight": {"minimum": tenant_values.WEIGHT_RANGE[0],
               "maximum": tenant_values.WEIGHT_RANGE[1]},
    "default_priority": {"enum": list(PRIORITIES)},
    "allowed_priorities": {"minItems": 1, "items": {"enum": list(PRIORITIES)}},
}


def dataclass_schema(cls: type, exclude: tuple[str, ...] = ()) -> Schema:
    """A dataclass's fields as a closed JSON object (unknown keys are refused, as its
    constructor does): types from the annotations, null where optional, the defaults."""
    hints = typing.get_type_hints(cls)
    properties: dict[str, Schema] = {}
    required = []
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        properties[f.name] = {**annotation_schema(hints[f.name]), **_FIELD_RULES.get(f.name, {})}
        if f.default is not dataclasses.MISSING:
            default = f.default
            properties[f.name]["default"] = list(default) if isinstance(default, tuple) else default
        elif f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    return {"type": "object", "properties": properties, "required": required,
            "additionalProperties": False}


def annotation_schema(annotation: Any) -> Schema:
    args = typing.get_args(annotation)
    if type(None) in args:  # X | None
        (inner,) = (a for a in args if a is not type(None))
        return nullable(annotation_schema(inner))
    if dataclasses.is_dataclass(annotation):
        return dataclass_schema(typing.cast(type, annotation))
    if typing.get_origin(annotation) is tuple:
        return {"type": "array", "items": annotation_schema(args[0])}
    return dict(_TYPE_SCHEMAS[annotation])


def tenant_create_schema() -> Schema:
    """The body of POST /admin/tenants: a TenantInfo without its database id; `limits` null
    means no limits; its default_priority one of its allowed_priorities."""
    schema = dataclass_schema(TenantInfo, exclude=("id",))
    schema["properties"]["limits"] = nullable(dataclass_schema(TenantLimits))
    schema["allOf"] = default_priority_allowed()
    return schema


def default_priority_allowed() -> list[Schema]:
    """default_priority (given, or its default) is among allowed_priorities (when given)."""
    default = TenantInfo.default_priority

    def allowed(priority: str) -> Schema:
        return {"properties": {"allowed_priorities": {"contains": {"const": priority}}}}

    return [{"if": {"required": ["default_priority"],
                    "properties": {"default_priority": {"const": p}}}, "then": allowed(p)}
            for p in PRIORITIES] + [
        {"if": {"not": {"required": ["default_priority"]}}, "then": allowed(default)}]


def object_schema(**properties: Schema) -> Schema:
    return {"type": "object", "required": list(properties), "properties": properties}


STRING: Schema = {"type": "string"}
COUNT: Schema = {"type": "integer", "minimum": 0}
GATEWAY_SCHEMAS: dict[str, Schema] = {
    "TenantCreate": tenant_create_schema(),
    "Tenant": dataclass_schema(TenantInfo),
    "TenantList": object_schema(data={"type": "array", "items": dataclass_schema(TenantInfo)}),
    "Key": object_schema(id=STRING, tenant=STRING, key={**STRING, "description": "The key's "
                                                  "plaintext: shown this once, never again."}),
    "KeyInfo": {**dataclass_schema(KeyInfo), "description": "A key's public facts (never the "
                "key)."},
    "ModelList": object_schema(object={"const": "list"}, data={"type": "array", "items": object_schema(
        id=STRING, object={"const": "model"}, created=COUNT, owned_by=STRING)}),
    "TenantUsage": object_schema(object={"const": "usage"}, tenant=STRING,
                           window_s={"type": ["number", "null"]}, requests=COUNT,
                           prompt_tokens=COUNT, completion_tokens=COUNT,
                           by_status={"type": "object", "additionalProperties": COUNT,
                                      "description": "requests by HTTP status"}),
    "Queues": object_schema(policy=STRING, tenants={"type": "object"},
                      backends={"type": "array", "items": {"type": "object"}}),
    "Health": object_schema(status={"const": "ok"}),
    "Ready": {"type": "object", "required": ["ready"],
              "properties": {"ready": {"type": "boolean"}, "checks": {"type": "object"}}},
}


# ---- responses -------------------------------------------------------------------------------
RETRY_AFTER = {"Retry-After": {"description": "Whole seconds to wait before retrying.",
                               "schema": {"type": "integer", "minimum": 1}}}
ERRORS: dict[int, str] = {
    400: "The request is invalid; `param` names the field at fault.",
    401: "No key, or not a valid one.",
    403: "The key's tenant may not do this (a priority it is not allowed).",
    404: "Not found: the model, the tenant, or an API this gateway has turned off.",
    408: "The request body did not arrive within gateway.client_timeout_s.",
    409: "A conflict: a tenant of that name exists already, or a tune job is not in a state "
         "for this, or its engine is busy with another.",
    413: "The request body is larger than gateway.max_body_bytes.",
    429: "Over the tenant's rate limit or queue bounds, larger than its budget, or too many "
         "invalid keys from this address; Retry-After says when to try again.",
    502: "An engine backend answered with an error or a malformed response.",
    503: "No engine backend is reachable, the request waited its queue timeout, usage "
         "recording is behind or the tenant database does not answer; see Retry-After.",
    504: "The request did not finish within the gateway's timeouts.",
}


def _error_response(status: int) -> Schema:
    response: Schema = {"description": ERRORS[status], "content": {
        "application/json": {"schema": ref("Error")}}}
    if status in (429, 503):
        response["headers"] = RETRY_AFTER
    return response


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def json_answer(name: str, description: str) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": ref(name)}}}


def _answer(name: str, event: str) -> Schema:
    return {"description": "The answer: whole, or with \"stream\": true as server-sent events "
                           "(the schema of text/event-stream is one event's).",
            "content": {"application/json": {"schema": ref(name)},
                        "text/event-stream": {"schema": ref(event)}}}


# ---- routes ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    method: str
    path: str
    summary: str
    responses: dict[int, Schema]  # the answers other than errors, by status
    errors: tuple[int, ...] = ()
    security: str | None = None  # a security scheme's name
    body: str | None = None  # the request body's schema name
    parameters: tuple[Schema, ...] = ()
    description: str = ""  # the rules between fields that no schema can say
    body_types: tuple[str, ...] = ("application/json",)


_INFERENCE_ERRORS = (400, 401, 403, 404, 408, 413, 429, 502, 503, 504)
WINDOW_PARAM = {"name": "window_s", "in": "query", "required": False,
           "description": "Only the last window_s seconds; omitted: all time.",
           "schema": {"type": "number", "exclusiveMinimum": 0}}
TENANT_PARAM = {"name": "name", "in": "path", "required": True, "schema": TENANT_NAME}
MIN_TOKENS_RULE = "min_tokens must not exceed max_tokens (a 400 names min_tokens)."


ROUTES = (
    Route("post", "/v1/completions", "A completion (OpenAI's API).",
          {200: _answer("Completion", "CompletionEvent")}, _INFERENCE_ERRORS, "tenantKey",
          "CompletionRequest", description=MIN_TOKENS_RULE),
    Route("post", "/v1/chat/completions", "A chat completion (OpenAI's API).",
          {200: _answer("ChatCompletion", "ChatCompletionEvent")}, _INFERENCE_ERRORS,
          "tenantKey", "ChatCompletionRequest",
          description="min_tokens must not exceed max_tokens (or max_completion_tokens, which "
                      "wins over it; a 400 names min_tokens)."),
    Route("get", "/v1/models", "The models this gateway serves.",
          {200: json_answer("ModelList", "The models.")}, (401, 429, 503), "tenantKey"),
    Route("get", "/v1/usage", "The caller's own tenant's usage.",
          {200: json_answer("TenantUsage", "Requests and tokens.")}, (400, 401, 404, 429, 503),
          "tenantKey", parameters=(WINDOW_PARAM,)),
    Route("get", "/admin/tenants", "Every tenant.", {200: json_answer("TenantList", "The tenants.")},
          (401, 404, 503), "adminKey"),
    Route("post", "/admin/tenants", "Create a tenant.", {201: json_answer("Tenant", "Created.")},
          (400, 401, 404, 408, 409, 413, 503), "adminKey", "TenantCreate",
          description="default_priority must be one of allowed_priorities (the schema says so "
                      "too); a name already taken is a 409."),
    Route("post", "/admin/tenants/{name}/keys", "A new API key for a tenant.",
          {201: json_answer("Key", "Created.")}, (400, 401, 404, 503), "adminKey",
          parameters=(TENANT_PARAM,)),
    Route("delete", "/admin/keys/{id}", "Revoke a key (idempotent): refused at once here, and "
          "on the other replicas at once with gateway.redis (else within their 5 s key cache).",
          {200: json_answer("KeyInfo", "Revoked.")}, (401, 404, 503), "adminKey",
          parameters=({"name": "id", "in": "path", "required": True,
                       "schema": {"type": "string", "pattern": KEY_ID_PATTERN}},)),
    Route("get", "/admin/usage/{name}", "A tenant's usage (a deleted tenant's too); a 404 for "
          "a name that is no tenant and has no usage.",
          {200: json_answer("TenantUsage", "Requests and tokens.")}, (400, 401, 404, 503), "adminKey",
          parameters=(TENANT_PARAM, WINDOW_PARAM)),
    Route("get", "/admin/queues", "The fair queue and the backends, now.",
          {200: json_answer("Queues", "The queues.")}, (401, 404), "adminKey"),
    Route("get", "/health", "Liveness (the path vLLM and SGLang serve).",
          {200: json_answer("Health", "Alive.")}),
    Route("get", "/healthz", "Liveness.", {200: json_answer("Health", "Alive.")}),
    Route("get", "/readyz", "Readiness: a backend is reachable (the database away is reported "
          "as degraded, not unready).",
          {200: json_answer("Ready", "Ready."), 503: json_answer("Ready", "Not ready, and why.")}),
    Route("get", "/metrics", "Prometheus metrics (only with gateway.metrics_token here; the "
          "metrics listener serves them too).",
          {200: {"description": "The Prometheus text format.",
                 "content": {"text/plain": {"schema": STRING}}}}, (401, 404), "metricsToken"),
    Route("get", "/openapi.json", "This document.",
          {200: {"description": "OpenAPI 3.1.",
                 "content": {"application/json": {"schema": {"type": "object"}}}}}),
)
SECURITY_SCHEMES = {
    "tenantKey": {"type": "http", "scheme": "bearer",
                  "description": "A tenant's API key (`fairgate keys create`)."},
    "adminKey": {"type": "http", "scheme": "bearer", "description": "gateway.admin_key."},
    "metricsToken": {"type": "http", "scheme": "bearer", "description": "gateway.metrics_token."},
}


def _operation(route: Route) -> Schema:
    responses = {str(status): r for status, r in route.responses.items()}
    errors = set(route.errors)
    if route.security == "adminKey":  # wrong admin keys spend the failed-attempt budget
        errors.add(429)
    responses.update({str(status): _error_response(status) for status in sorted(errors)})
    operation: Schema = {"summary": route.summary, "responses": responses}
    if route.description:
        operation["description"] = route.description
    if route.security is not None:
        operation["security"] = [{route.security: []}]
    if route.body is not None:
        operation["requestBody"] = {"required": True, "content": {
            media: {"schema": ref(route.body)} for media in route.body_types}}
    if route.parameters:
        operation["parameters"] = list(route.parameters)
    return operation


@dataclass(frozen=True, eq=False)  # hashed by identity: document() keeps one per parts
class ApiParts:
    """The routes and component schemas a layer above the gateway adds to its document (the
    control plane's: control/openapi.py), set on the app under OPENAPI_PARTS."""

    routes: tuple[Route, ...]
    schemas: dict[str, Schema]


OPENAPI_PARTS = web.AppKey("openapi_parts", ApiParts)
NO_PARTS = ApiParts((), {})  # the serving app's own: gateway.app.make_app sets it


@functools.cache
def document(parts: ApiParts = NO_PARTS) -> Schema:
    """The whole document, the serving path's routes and `parts`' (built once: it depends on
    no setting)."""
    paths: dict[str, Schema] = {}
    for route in ROUTES + parts.routes:
        paths.setdefault(route.path, {})[route.method] = _operation(route)
    return {"openapi": protocol_schemas.OPENAPI_VERSION,
            "info": {"title": "fairgate gateway", "version": _version(),
                     "description": "OpenAI's completions and chat completions API, shared "
                                    "fairly between tenants."},
            "paths": paths,
            "components": {"schemas": {**protocol_schemas.schemas(), **GATEWAY_SCHEMAS,
                                       **parts.schemas},
                           "securitySchemes": SECURITY_SCHEMES}}


def _version() -> str:
    try:
        return importlib.metadata.version("fairgate")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(document(request.app[OPENAPI_PARTS]))

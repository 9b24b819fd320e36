"""GET /openapi.json: the gateway's OpenAPI 3.1 document, assembled, never written by hand.

The request, response and error bodies are `protocol.openapi`'s (written from the field table
`parse_request` reads); the tenant bodies come from `tenants.values`' dataclass fields; every
route the gateway serves is one `Route` below (tests/gateway/test_openapi.py checks the list
against the app's router).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import typing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from gateway.admin import CAPTURE_MEDIA_TYPE, MAX_CAPTURE_LIMIT
from gateway.canary import MAX_CANARY_WEIGHT
from gateway.config import (
    BACKEND_KINDS,
    MODEL_NAME_PATTERN,
    SHADOW_NAME_PATTERN,
    SHADOW_URL_PATTERN,
)
from gateway.jobs import (
    JOB_FILES,
    JOB_ID_PATTERN,
    JOB_RULES,
    MAX_PROFILE_BYTES,
    PROFILE_NAME_PATTERN,
    SIM_PROFILE_SCHEMA,
    job_spec_schema,
)
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


def _object(**properties: Schema) -> Schema:
    return {"type": "object", "required": list(properties), "properties": properties}


STRING: Schema = {"type": "string"}
COUNT: Schema = {"type": "integer", "minimum": 0}
SHADOW_NAME: Schema = {"type": "string", "pattern": SHADOW_NAME_PATTERN}
_SHADOW_URL: Schema = {"type": "string", "description": "http(s)://host[:port][/v1]",
                       "pattern": SHADOW_URL_PATTERN}
_SHADOW_CHANGE: dict[str, Schema] = {
    "sample": {"type": "number", "minimum": 0, "maximum": 1},
    "tenants": {"oneOf": [{"const": "all"}, {"type": "array", "minItems": 1,
                                             "items": TENANT_NAME}]},
    "max_inflight": {"type": "integer", "minimum": 1, "maximum": 1024},
    "max_queue": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
    "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 86400}}

GATEWAY_SCHEMAS: dict[str, Schema] = {
    "TenantCreate": tenant_create_schema(),
    "Tenant": dataclass_schema(TenantInfo),
    "TenantList": _object(data={"type": "array", "items": dataclass_schema(TenantInfo)}),
    "Key": _object(id=STRING, tenant=STRING, key={**STRING, "description": "The key's "
                                                  "plaintext: shown this once, never again."}),
    "KeyInfo": {**dataclass_schema(KeyInfo), "description": "A key's public facts (never the "
                "key)."},
    "ModelList": _object(object={"const": "list"}, data={"type": "array", "items": _object(
        id=STRING, object={"const": "model"}, created=COUNT, owned_by=STRING)}),
    "TenantUsage": _object(object={"const": "usage"}, tenant=STRING,
                           window_s={"type": ["number", "null"]}, requests=COUNT,
                           prompt_tokens=COUNT, completion_tokens=COUNT,
                           by_status={"type": "object", "additionalProperties": COUNT,
                                      "description": "requests by HTTP status"}),
    "Queues": _object(policy=STRING, tenants={"type": "object"},
                      backends={"type": "array", "items": {"type": "object"}}),
    "ShadowCreate": {"type": "object", "required": ["name", "url"],
                     "additionalProperties": False,
                     "properties": {"name": SHADOW_NAME, "url": _SHADOW_URL,
                                    "kind": {"enum": list(BACKEND_KINDS)},
                                    "model": nullable({"type": "string",
                                                       "pattern": MODEL_NAME_PATTERN}),
                                    "api_key": nullable({"type": "string",
                                                         "pattern": "^[!-~]+$"}),
                                    "admin_key": nullable({"type": "string",
                                                           "pattern": "^[!-~]+$"}),
                                    **_SHADOW_CHANGE}},
    "ShadowChange": {"type": "object", "additionalProperties": False,
                     "properties": _SHADOW_CHANGE},
    "Shadow": _object(name=STRING, url=STRING, kind=STRING, sample={"type": "number"},
                      queued=COUNT, sent=COUNT, dropped=COUNT, failed=COUNT, pairs=COUNT),
    "ShadowList": _object(shadows={"type": "array", "items": {"$ref": "#/components/schemas/Shadow"}}),
    "ShadowStats": {"type": "object", "description": "The pairs completed in the window: "
                    "live and shadow percentiles (ttft, tpot and e2e per request; itl over "
                    "every gap), SLO attainment per tenant (slo_attainment: requests within "
                    "their TTFT and TPOT targets; itl_attainment: gaps within the ITL target), "
                    "shadow/live ratios and p99 differences with a 95% bootstrap interval "
                    "(ttft, tpot, e2e).",
                    "properties": {"name": STRING, "window_s": {"type": "number"},
                                   "pairs": COUNT, "mirrored_rate_rps": {"type": "number"},
                                   "note": STRING, "live": {"type": "object"},
                                   "shadow": {"type": "object"},
                                   "ratio": {"type": "object"},
                                   "p99_difference": {"type": "object"}}},
    "TuneJob": {"type": "object", "required": ["id", "state", "spec", "progress"],
                "description": "A job: its state, progress (trials done of planned, elapsed, "
                               "estimate left), best trial so far, links to its files, the "
                               "apply's steps, and (one job) every trial.",
                "properties": {"id": STRING, "state": {"enum": [
                    "queued", "running", "succeeded", "failed", "cancelled", "interrupted"]},
                    "spec": {"type": "object"}, "progress": {"type": "object"},
                    "best": nullable({"type": "object"}), "apply": nullable({"type": "object"}),
                    "links": {"type": "object"}, "trials": {"type": "array"}}},
    "TuneJobList": _object(jobs={"type": "array", "items": {"$ref": "#/components/schemas/TuneJob"}}),
    "TuneApply": {"type": "object", "required": ["backend"], "additionalProperties": False,
                  "properties": {"backend": {**STRING, "description": "The replica to try the "
                                             "config on first (its URL)."},
                                 "canary_window_s": {"type": "number", "exclusiveMinimum": 0,
                                                     "maximum": 86400},
                                 "min_requests": {"type": "integer", "minimum": 1,
                                                  "maximum": 1000000},
                                 "max_wait_s": {"type": "number", "exclusiveMinimum": 0,
                                                "maximum": 604800},
                                 "canary_weight": {
                                     "type": "number", "exclusiveMinimum": 0,
                                     "maximum": MAX_CANARY_WEIGHT,
                                     "description": "The most of its model's requests the "
                                     "canary is sent while it is judged (default: an even "
                                     "share of the model's replicas, at most 0.25; a model "
                                     "with one replica sends it all of them)."}}},
    "TuneApplyRecord": {"type": "object", "required": ["state", "backend", "steps"],
                        "properties": {"state": {"enum": [
                            "applying", "canary", "promoting", "promoted", "rolling_back",
                            "rolled_back", "failed"]}, "backend": STRING,
                            "config": {"type": "object"}, "previous": {"type": "object"},
                            "steps": {"type": "array"}}},
    "SloTenants": _object(generated_at={"type": "number"}, target={"type": "number"},
                          tenants={"type": "array", "items": {"type": "object"}}, note=STRING),
    "SloTenant": {"type": "object", "required": ["name", "slo", "series", "state"],
                  "properties": {"name": STRING, "slo": {"$ref": "#/components/schemas/SloTargets"},
                                 "series": {"type": "array"}, "state": STRING}},
    "SloTargets": {"type": "object", "required": ["ttft_p99_s", "tpot_p99_s", "itl_p99_s"],
                   "description": "A tenant's p99 targets: TTFT and TPOT per request, ITL per "
                                  "gap between two tokens pooled over requests (null: none).",
                   "properties": {name: nullable({"type": "number"}) for name in (
                       "ttft_p99_s", "tpot_p99_s", "itl_p99_s")}},
    "Engines": _object(generated_at={"type": "number"}, engines={"type": "array"},
                       jobs_running=COUNT),
    "Deleted": _object(deleted=STRING),
    "SimProfile": SIM_PROFILE_SCHEMA,
    "SimProfileInfo": {"type": "object", "required": ["name"],
                       "description": "A held profile: what was measured, its context and KV "
                                      "cache and its fit; or, a file put there by hand that "
                                      "does not load, why (`error`).",
                       "properties": {"name": STRING, "model": STRING, "device": STRING,
                                      "dtype": STRING, "max_position": COUNT,
                                      "kv_tokens": COUNT, "fit": {"type": "object"},
                                      "error": STRING}},
    "SimProfileList": _object(profiles={"type": "array",
                                        "items": {"$ref": "#/components/schemas/SimProfileInfo"}}),
    "Health": _object(status={"const": "ok"}),
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
        "application/json": {"schema": _ref("Error")}}}
    if status in (429, 503):
        response["headers"] = RETRY_AFTER
    return response


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str, description: str) -> Schema:
    return {"description": description, "content": {"application/json": {"schema": _ref(name)}}}


def _answer(name: str, event: str) -> Schema:
    return {"description": "The answer: whole, or with \"stream\": true as server-sent events "
                           "(the schema of text/event-stream is one event's).",
            "content": {"application/json": {"schema": _ref(name)},
                        "text/event-stream": {"schema": _ref(event)}}}


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
_WINDOW = {"name": "window_s", "in": "query", "required": False,
           "description": "Only the last window_s seconds; omitted: all time.",
           "schema": {"type": "number", "exclusiveMinimum": 0}}
_TENANT = {"name": "name", "in": "path", "required": True, "schema": TENANT_NAME}
_SHADOW = {"name": "name", "in": "path", "required": True, "schema": SHADOW_NAME}
_JOB = {"name": "id", "in": "path", "required": True,
        "schema": {"type": "string", "pattern": JOB_ID_PATTERN}}
_PROFILE = {"name": "name", "in": "path", "required": True,
            "schema": {"type": "string", "pattern": PROFILE_NAME_PATTERN}}
MIN_TOKENS_RULE = "min_tokens must not exceed max_tokens (a 400 names min_tokens)."


def _epoch_param(name: str, description: str) -> Schema:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": {"type": "number", "minimum": 0}}


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
          {200: _json("ModelList", "The models.")}, (401, 429, 503), "tenantKey"),
    Route("get", "/v1/usage", "The caller's own tenant's usage.",
          {200: _json("TenantUsage", "Requests and tokens.")}, (400, 401, 404, 429, 503),
          "tenantKey", parameters=(_WINDOW,)),
    Route("get", "/admin/tenants", "Every tenant.", {200: _json("TenantList", "The tenants.")},
          (401, 404, 503), "adminKey"),
    Route("post", "/admin/tenants", "Create a tenant.", {201: _json("Tenant", "Created.")},
          (400, 401, 404, 408, 409, 413, 503), "adminKey", "TenantCreate",
          description="default_priority must be one of allowed_priorities (the schema says so "
                      "too); a name already taken is a 409."),
    Route("post", "/admin/tenants/{name}/keys", "A new API key for a tenant.",
          {201: _json("Key", "Created.")}, (400, 401, 404, 503), "adminKey",
          parameters=(_TENANT,)),
    Route("delete", "/admin/keys/{id}", "Revoke a key (idempotent): refused at once here, and "
          "on the other replicas at once with gateway.redis (else within their 5 s key cache).",
          {200: _json("KeyInfo", "Revoked.")}, (401, 404, 503), "adminKey",
          parameters=({"name": "id", "in": "path", "required": True,
                       "schema": {"type": "string", "pattern": KEY_ID_PATTERN}},)),
    Route("get", "/admin/usage/{name}", "A tenant's usage.",
          {200: _json("TenantUsage", "Requests and tokens.")}, (400, 401, 404, 503), "adminKey",
          parameters=(_TENANT, _WINDOW)),
    Route("get", "/admin/queues", "The fair queue and the backends, now.",
          {200: _json("Queues", "The queues.")}, (401, 404), "adminKey"),
    Route("get", "/admin/shadow", "The shadow targets and their counters.",
          {200: _json("ShadowList", "The targets.")}, (401, 404), "adminKey"),
    Route("post", "/admin/shadow", "Start a shadow target, or replace the one of that name.",
          {200: _json("Shadow", "Replaced."), 201: _json("Shadow", "Started.")},
          (400, 401, 404, 408, 413), "adminKey", "ShadowCreate"),
    Route("patch", "/admin/shadow/{name}", "Change a target's sample, tenants or bounds.",
          {200: _json("Shadow", "Changed.")}, (400, 401, 404, 408, 413), "adminKey",
          "ShadowChange", parameters=(_SHADOW,)),
    Route("delete", "/admin/shadow/{name}", "Stop a shadow target.",
          {200: _json("Deleted", "Stopped.")}, (401, 404), "adminKey", parameters=(_SHADOW,)),
    Route("get", "/admin/shadow/{name}/stats", "Paired live and shadow latency over a window.",
          {200: _json("ShadowStats", "The pairs' statistics.")}, (400, 401, 404), "adminKey",
          parameters=(_SHADOW, {"name": "window", "in": "query", "required": False,
                                "description": "Seconds (default 300).",
                                "schema": {"type": "number", "exclusiveMinimum": 0}},
                      {"name": "sent_after", "in": "query", "required": False,
                       "description": "Only copies sent after this time (epoch seconds).",
                       "schema": {"type": "number"}},
                      {"name": "detail", "in": "query", "required": False,
                       "description": "1: every pair's [ttft, tpot, e2e, tokens, ok].",
                       "schema": {"enum": ["0", "1", "true", "false"]}})),
    Route("get", "/admin/capture", "The captured requests of a time span, as a fairgate trace.",
          {200: {"description": "A fairgate JSONL trace (tuner/traces.py): a header comment, "
                                "then one request a line, the first at arrival 0; empty when "
                                "no request arrived in the span.",
                 "content": {CAPTURE_MEDIA_TYPE: {"schema": STRING}}}},
          (400, 401, 404, 503), "adminKey", description="until must be after since (a 400 "
          "names until).",
          parameters=(_epoch_param("since", "From this time (epoch seconds; default 0)."),
                      _epoch_param("until", "Before this time (epoch seconds; default: now)."),
                      {"name": "limit", "in": "query", "required": False,
                       "description": "Only the most recent N requests of the span.",
                       "schema": {"type": "integer", "minimum": 1,
                                  "maximum": MAX_CAPTURE_LIMIT}})),
    Route("post", "/admin/tune-jobs", "Start a tuning job (queued behind the running ones).",
          {201: _json("TuneJob", "Queued.")}, (400, 401, 404, 408, 409, 413, 503), "adminKey",
          "TuneJobSpec", description=JOB_RULES),
    Route("get", "/admin/tune-jobs", "Every tuning job.", {200: _json("TuneJobList", "Jobs.")},
          (401, 404, 503), "adminKey"),
    Route("get", "/admin/tune-jobs/{id}", "A job with its trials.",
          {200: _json("TuneJob", "The job.")}, (401, 404, 503), "adminKey",
          parameters=(_JOB,)),
    Route("delete", "/admin/tune-jobs/{id}", "Cancel a job: its running trial stops and its "
          "engine goes back to its knobs.", {200: _json("TuneJob", "Cancelled.")},
          (401, 404, 409, 503), "adminKey", parameters=(_JOB,)),
    Route("post", "/admin/tune-jobs/{id}/resume", "Queue an interrupted, failed or cancelled "
          "job again; its study keeps every finished trial.",
          {200: _json("TuneJob", "Queued.")}, (401, 404, 409, 503), "adminKey",
          parameters=(_JOB,)),
    Route("post", "/admin/tune-jobs/{id}/apply", "Apply the job's best config to one replica "
          "as a canary, then promote it or roll it back on live SLOs.",
          {202: _json("TuneApplyRecord", "Started; the job's `apply` shows each step.")},
          (400, 401, 404, 408, 409, 413, 503), "adminKey", "TuneApply", parameters=(_JOB,)),
    Route("get", "/admin/tune-jobs/{id}/files/{name}", "One of a job's files.",
          {200: {"description": "The file.", "content": {
              t: {"schema": STRING} for t in ("text/html", "text/markdown", "application/yaml",
                                               "text/csv", "text/plain")}}},
          (401, 404, 503), "adminKey",
          parameters=(_JOB, {"name": "name", "in": "path", "required": True,
                             "schema": {"enum": list(JOB_FILES)}})),
    Route("get", "/admin/sim-profiles", "The sim profiles a tune job may name "
          "(set.sim_profile).", {200: _json("SimProfileList", "The profiles.")}, (401, 404),
          "adminKey"),
    Route("put", "/admin/sim-profiles/{name}", "Upload a `fairgate tune calibrate` profile "
          "under a name: a tune job's set.sim_profile names it.",
          {200: _json("SimProfileInfo", "Replaced."), 201: _json("SimProfileInfo", "Kept.")},
          (400, 401, 404, 408, 413, 503), "adminKey", "SimProfile", (_PROFILE,),
          description=f"The profile as `fairgate tune calibrate --out` writes it (YAML; JSON "
                      f"too), at most {MAX_PROFILE_BYTES} bytes, checked as the simulator loads "
                      "it and kept by the gateway (jobs.dir/sim-profiles, mode 0600).",
          body_types=("application/yaml", "application/json")),
    Route("get", "/admin/slo/tenants", "Every tenant's latency against its SLO: attainment "
          "over 1 h, 24 h and 30 days (of requests: TTFT and TPOT, together and each; of gaps: "
          "ITL), the 30-day error budget left, burn rates over 1 h and 6 h (requests', and "
          "gaps' as itl_*), its state (ok, at_risk, breaching, no_data: the worse of the two).",
          {200: _json("SloTenants", "The tenants.")}, (401, 404, 503), "adminKey"),
    Route("get", "/admin/slo/tenants/{name}", "One tenant's SLO figures, limits, queue and "
          "series minute by minute.", {200: _json("SloTenant", "The tenant.")},
          (400, 401, 404, 503), "adminKey",
          parameters=(_TENANT, {"name": "hours", "in": "query", "required": False,
                                "description": "The series' span (default 6).",
                                "schema": {"type": "number", "exclusiveMinimum": 0,
                                           "maximum": 168}})),
    Route("get", "/admin/engines", "Per backend: health, load, knobs and signs of trouble.",
          {200: _json("Engines", "The engines.")}, (401, 404), "adminKey"),
    Route("get", "/dashboard", "The SLO dashboard (HTML): the login form first without a "
          "session.", {200: {"description": "The page.",
                             "content": {"text/html": {"schema": STRING}}},
                       303: {"description": "To /dashboard/login."}}, (401, 404, 429)),
    Route("get", "/dashboard/app.js", "The dashboard's script (served by fairgate; no CDN).",
          {200: {"description": "JavaScript.",
                 "content": {"text/javascript": {"schema": STRING}}}}),
    Route("get", "/dashboard/login", "The dashboard's login form.",
          {200: {"description": "The form.", "content": {"text/html": {"schema": STRING}}}}),
    Route("post", "/dashboard/login", "Log in with the admin key (a form field `key`): a "
          "Secure, HTTP-only, SameSite=Strict session cookie.",
          {303: {"description": "To the dashboard, or back to the form."}}, (403, 404, 429)),
    Route("post", "/dashboard/logout", "End the session.",
          {303: {"description": "To the login form."}}, (403,)),
    Route("get", "/health", "Liveness (the path vLLM and SGLang serve).",
          {200: _json("Health", "Alive.")}),
    Route("get", "/healthz", "Liveness.", {200: _json("Health", "Alive.")}),
    Route("get", "/readyz", "Readiness: a backend is reachable (the database away is reported "
          "as degraded, not unready).",
          {200: _json("Ready", "Ready."), 503: _json("Ready", "Not ready, and why.")}),
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
            media: {"schema": _ref(route.body)} for media in route.body_types}}
    if route.parameters:
        operation["parameters"] = list(route.parameters)
    return operation


@functools.cache
def document() -> Schema:
    """The whole document (built once: it depends on no setting)."""
    paths: dict[str, Schema] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method] = _operation(route)
    return {"openapi": protocol_schemas.OPENAPI_VERSION,
            "info": {"title": "fairgate gateway", "version": _version(),
                     "description": "OpenAI's completions and chat completions API, shared "
                                    "fairly between tenants."},
            "paths": paths,
            "components": {"schemas": {**protocol_schemas.schemas(), **GATEWAY_SCHEMAS,
                                       "TuneJobSpec": job_spec_schema()},
                           "securitySchemes": SECURITY_SCHEMES}}


def _version() -> str:
    try:
        return importlib.metadata.version("fairgate")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


async def openapi_json(request: web.Request) -> web.Response:
    return web.json_response(document())

"""The control plane's part of GET /openapi.json: its routes (shadow targets, the capture,
tune jobs, sim profiles, the SLO dashboard and its JSON) and their bodies, added to the gateway's
document (gateway/openapi.py) as `PARTS` by control/app.py.
"""

from __future__ import annotations

from control.admin import CAPTURE_MEDIA_TYPE, MAX_CAPTURE_LIMIT
from control.canary import MAX_CANARY_WEIGHT
from control.jobs import (
    JOB_FILES,
    JOB_ID_PATTERN,
    JOB_RULES,
    MAX_PROFILE_BYTES,
    PROFILE_NAME_PATTERN,
    SIM_PROFILE_SCHEMA,
    job_spec_schema,
)
from gateway import openapi as serving
from gateway.config import (
    BACKEND_KINDS,
    MODEL_NAME_PATTERN,
    SHADOW_NAME_PATTERN,
    SHADOW_URL_PATTERN,
)
from gateway.openapi import (
    COUNT,
    STRING,
    TENANT_NAME,
    TENANT_PARAM,
    ApiParts,
    Route,
    json_answer,
    object_schema,
)
from protocol.openapi import Schema, nullable

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

# why copies of a shadow target failed: one row per (status, code)
_FAILURE: Schema = object_schema(
    status={**nullable({"type": "integer"}), "description": "The target's HTTP status; null: "
            "no answer (connect_failed, timeout, connection_broken)"},
    code={**STRING, "description": "The target's error code (or type), else ours: "
          "connect_failed, timeout, connection_broken, stream_error, stream_incomplete"},
    count=COUNT, message=STRING, last_at={"type": "number", "description": "Epoch seconds"})

SCHEMAS: dict[str, Schema] = {
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
    "Shadow": object_schema(name=STRING, url=STRING, kind=STRING, sample={"type": "number"},
                      tenants={"type": "array", "items": STRING}, max_inflight=COUNT,
                      max_queue=COUNT, timeout_s={"type": "number"}, queued=COUNT,
                      inflight=COUNT, outstanding=COUNT, sent=COUNT, dropped=COUNT,
                      failed=COUNT, pairs=COUNT,
                      model={**nullable(STRING), "description": "The target's model: the "
                             "configured one, else the one it serves (its /v1/models; copies "
                             "of requests for the default alias go under it), null until it "
                             "said"},
                      failures={"type": "array", "description": "Failed copies by reason, "
                                "most first", "items": _FAILURE}),
    "ShadowList": object_schema(shadows={"type": "array", "items": {"$ref": "#/components/schemas/Shadow"}}),
    "ShadowStats": {"type": "object", "description": "The pairs completed in the window: "
                    "live and shadow percentiles (ttft, tpot and e2e per request; itl over "
                    "every gap), SLO attainment per tenant (slo_attainment: requests within "
                    "their TTFT and TPOT targets; itl_attainment: gaps within the ITL target), "
                    "shadow/live ratios and p99 differences with a 95% bootstrap interval "
                    "(ttft, tpot, e2e).",
                    "properties": {"name": STRING, "window_s": {"type": "number"},
                                   "pairs": COUNT, "mirrored_rate_rps": {"type": "number"},
                                   "sample": {"type": "number"},
                                   "note": STRING, "live": {"type": "object"},
                                   "shadow": {"type": "object"},
                                   "ratio": {"type": "object"},
                                   "p99_difference": {"type": "object"},
                                   "shadow_wait": {"type": "object"},
                                   "samples": {"type": "object", "description": "With "
                                               "detail=1: every pair's live and shadow rows"}}},
    "TuneJob": {"type": "object", "required": ["id", "state", "spec", "progress"],
                "description": "A job: its state, progress (trials done of planned, elapsed, "
                               "estimate left), best trial so far, links to its files, the "
                               "apply's steps, and (one job) every trial.",
                "properties": {"id": STRING, "state": {"enum": [
                    "queued", "running", "succeeded", "failed", "cancelled", "interrupted"]},
                    "spec": {"type": "object"}, "progress": {"type": "object"},
                    "best": nullable({"type": "object"}), "apply": nullable({"type": "object"}),
                    "links": {"type": "object"}, "trials": {"type": "array"}}},
    "TuneJobList": object_schema(jobs={"type": "array", "items": {"$ref": "#/components/schemas/TuneJob"}}),
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
    "SloTenants": object_schema(generated_at={"type": "number"}, target={"type": "number"},
                          tenants={"type": "array", "items": {"type": "object"}}, note=STRING),
    "SloTenant": {"type": "object", "required": ["name", "slo", "series", "state"],
                  "properties": {"name": STRING, "slo": {"$ref": "#/components/schemas/SloTargets"},
                                 "series": {"type": "array"}, "state": STRING}},
    "SloTargets": {"type": "object", "required": ["ttft_p99_s", "tpot_p99_s", "itl_p99_s"],
                   "description": "A tenant's p99 targets: TTFT and TPOT per request, ITL per "
                                  "gap between two tokens pooled over requests (null: none).",
                   "properties": {name: nullable({"type": "number"}) for name in (
                       "ttft_p99_s", "tpot_p99_s", "itl_p99_s")}},
    "Engines": object_schema(generated_at={"type": "number"}, engines={"type": "array"},
                       jobs_running=COUNT),
    "Deleted": object_schema(deleted=STRING),
    "SimProfile": SIM_PROFILE_SCHEMA,
    "SimProfileInfo": {"type": "object", "required": ["name"],
                       "description": "A held profile: what was measured, its context and KV "
                                      "cache and its fit; or, a file put there by hand that "
                                      "does not load, why (`error`).",
                       "properties": {"name": STRING, "model": STRING, "device": STRING,
                                      "dtype": STRING, "max_position": COUNT,
                                      "kv_tokens": COUNT, "fit": {"type": "object"},
                                      "noise": nullable({"type": "object"}),
                                      "wake": nullable({"type": "object"}),
                                      "error": STRING}},
    "SimProfileList": object_schema(profiles={"type": "array",
                                        "items": {"$ref": "#/components/schemas/SimProfileInfo"}}),
    "TuneJobSpec": job_spec_schema(),
}

_SHADOW = {"name": "name", "in": "path", "required": True, "schema": SHADOW_NAME}
_JOB = {"name": "id", "in": "path", "required": True,
        "schema": {"type": "string", "pattern": JOB_ID_PATTERN}}
_PROFILE = {"name": "name", "in": "path", "required": True,
            "schema": {"type": "string", "pattern": PROFILE_NAME_PATTERN}}

def _epoch_param(name: str, description: str) -> Schema:
    return {"name": name, "in": "query", "required": False, "description": description,
            "schema": {"type": "number", "minimum": 0}}


CONTROL_ROUTES = (
    Route("get", "/admin/shadow", "The shadow targets and their counters.",
          {200: json_answer("ShadowList", "The targets.")}, (401, 404), "adminKey"),
    Route("post", "/admin/shadow", "Start a shadow target, or replace the one of that name.",
          {200: json_answer("Shadow", "Replaced."), 201: json_answer("Shadow", "Started.")},
          (400, 401, 404, 408, 413), "adminKey", "ShadowCreate"),
    Route("patch", "/admin/shadow/{name}", "Change a target's sample, tenants or bounds.",
          {200: json_answer("Shadow", "Changed.")}, (400, 401, 404, 408, 413), "adminKey",
          "ShadowChange", parameters=(_SHADOW,)),
    Route("delete", "/admin/shadow/{name}", "Stop a shadow target.",
          {200: json_answer("Deleted", "Stopped.")}, (401, 404), "adminKey", parameters=(_SHADOW,)),
    Route("get", "/admin/shadow/{name}/stats", "Paired live and shadow latency over a window.",
          {200: json_answer("ShadowStats", "The pairs' statistics.")}, (400, 401, 404), "adminKey",
          parameters=(_SHADOW, {"name": "window", "in": "query", "required": False,
                                "description": "Seconds (default 300).",
                                "schema": {"type": "number", "exclusiveMinimum": 0}},
                      {"name": "sent_after", "in": "query", "required": False,
                       "description": "Only copies sent after this time (epoch seconds).",
                       "schema": {"type": "number"}},
                      {"name": "detail", "in": "query", "required": False,
                       "description": "1: every pair's [ttft, tpot, e2e, tokens, ok, "
                                      "token times].",
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
          {201: json_answer("TuneJob", "Queued.")}, (400, 401, 404, 408, 409, 413, 503), "adminKey",
          "TuneJobSpec", description=JOB_RULES),
    Route("get", "/admin/tune-jobs", "Every tuning job.", {200: json_answer("TuneJobList", "Jobs.")},
          (401, 404, 503), "adminKey"),
    Route("get", "/admin/tune-jobs/{id}", "A job with its trials.",
          {200: json_answer("TuneJob", "The job.")}, (401, 404, 503), "adminKey",
          parameters=(_JOB,)),
    Route("delete", "/admin/tune-jobs/{id}", "Cancel a job: its running trial stops and its "
          "engine goes back to its knobs.", {200: json_answer("TuneJob", "Cancelled.")},
          (401, 404, 409, 503), "adminKey", parameters=(_JOB,)),
    Route("post", "/admin/tune-jobs/{id}/resume", "Queue an interrupted, failed or cancelled "
          "job again; its study keeps every finished trial.",
          {200: json_answer("TuneJob", "Queued.")}, (401, 404, 409, 503), "adminKey",
          parameters=(_JOB,)),
    Route("post", "/admin/tune-jobs/{id}/apply", "Apply the job's best config to one replica "
          "as a canary, then promote it or roll it back on live SLOs.",
          {202: json_answer("TuneApplyRecord", "Started; the job's `apply` shows each step.")},
          (400, 401, 404, 408, 409, 413, 503), "adminKey", "TuneApply", parameters=(_JOB,)),
    Route("get", "/admin/tune-jobs/{id}/files/{name}", "One of a job's files.",
          {200: {"description": "The file.", "content": {
              t: {"schema": STRING} for t in ("text/html", "text/markdown", "application/yaml",
                                               "text/csv", "text/plain")}}},
          (401, 404, 503), "adminKey",
          parameters=(_JOB, {"name": "name", "in": "path", "required": True,
                             "schema": {"enum": list(JOB_FILES)}})),
    Route("get", "/admin/sim-profiles", "The sim profiles a tune job may name "
          "(set.sim_profile).", {200: json_answer("SimProfileList", "The profiles.")}, (401, 404),
          "adminKey"),
    Route("put", "/admin/sim-profiles/{name}", "Upload a `fairgate tune calibrate` profile "
          "under a name: a tune job's set.sim_profile names it.",
          {200: json_answer("SimProfileInfo", "Replaced."), 201: json_answer("SimProfileInfo", "Kept.")},
          (400, 401, 404, 408, 413, 503), "adminKey", "SimProfile", (_PROFILE,),
          description=f"The profile as `fairgate tune calibrate --out` writes it (YAML; JSON "
                      f"too), at most {MAX_PROFILE_BYTES} bytes, checked as the simulator loads "
                      "it and kept by the gateway (jobs.dir/sim-profiles, mode 0600).",
          body_types=("application/yaml", "application/json")),
    Route("get", "/admin/slo/tenants", "Every tenant's latency against its SLO: attainment "
          "over 1 h, 24 h and 30 days (of requests: TTFT and TPOT, together and each; of gaps: "
          "ITL), the 30-day error budget left, burn rates over 1 h and 6 h (requests', and "
          "gaps' as itl_*), its state (ok, at_risk, breaching, no_data: the worse of the two).",
          {200: json_answer("SloTenants", "The tenants.")}, (401, 404, 503), "adminKey"),
    Route("get", "/admin/slo/tenants/{name}", "One tenant's SLO figures, limits, queue and "
          "series minute by minute.", {200: json_answer("SloTenant", "The tenant.")},
          (400, 401, 404, 503), "adminKey",
          parameters=(TENANT_PARAM, {"name": "hours", "in": "query", "required": False,
                                "description": "The series' span (default 6).",
                                "schema": {"type": "number", "exclusiveMinimum": 0,
                                           "maximum": 168}})),
    Route("get", "/admin/engines", "Per backend: health, load, knobs and signs of trouble.",
          {200: json_answer("Engines", "The engines.")}, (401, 404), "adminKey"),
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
)
PARTS = ApiParts(CONTROL_ROUTES, SCHEMAS)
ROUTES = serving.ROUTES + CONTROL_ROUTES  # every route of control.app.make_app's app


def document() -> Schema:
    """The whole document a gateway with its control plane serves."""
    return serving.document(PARTS)

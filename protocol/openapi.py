"""The OpenAI API's JSON Schemas as fairgate speaks it, for OpenAPI 3.1 documents.

Written from `protocol.openai`'s field table, never by hand: a request schema describes the
bodies `parse_request` accepts, with the same types, ranges and defaults. The response and
error schemas are the shapes `protocol.openai.ResponseWriter` and `protocol.errors` write.

    request_schema("chat")    # the body of POST /v1/chat/completions
    schemas()                 # every schema here by name, for an OpenAPI `components.schemas`
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from protocol.openai import (
    CHAT_ROLES,
    ENDPOINTS,
    INCLUDE_USAGE,
    MAX_STOP_SEQUENCES,
    MAX_TOKEN_ID,
    REQUEST_FIELDS,
    Field,
    request_fields,
)

OPENAPI_VERSION = "3.1.0"  # JSON Schema 2020-12: "type": [..., "null"], exclusiveMinimum
Schema = dict[str, Any]
REQUEST_SCHEMA_NAMES = {"completions": "CompletionRequest", "chat": "ChatCompletionRequest"}


def nullable(schema: Schema) -> Schema:
    """`schema`, or null (an omitted field and a null one mean the same to the parser)."""
    kind = schema.get("type")
    if isinstance(kind, str):
        return {**schema, "type": [kind, "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


# ---- requests ------------------------------------------------------------------------------
def request_schema(endpoint: str) -> Schema:
    fields = request_fields(endpoint)
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return {"type": "object", "title": REQUEST_SCHEMA_NAMES[endpoint],
            "description": f"The body of POST {path}. Fields not listed are ignored.",
            "properties": {f.name: field_schema(f) for f in fields},
            "required": [f.name for f in fields if f.required],
            "additionalProperties": True}


def field_schema(spec: Field) -> Schema:
    schema = {**_KIND_SCHEMAS[spec.kind](spec), "description": spec.description}
    if spec.default is not None:
        schema["default"] = list(spec.default) if isinstance(spec.default, tuple) else spec.default
    return schema


def _scalar_schema(spec: Field) -> Schema:
    schema: Schema = {"type": [spec.kind, "null"]}
    if spec.minimum is not None:
        schema["exclusiveMinimum" if spec.exclusive_minimum else "minimum"] = spec.minimum
    if spec.maximum is not None:
        schema["maximum"] = spec.maximum
    if spec.max_length is not None:
        schema["maxLength"] = spec.max_length
    if spec.allowed is not None:
        schema["enum"] = [*spec.allowed, None]
    return schema


def _any(spec: Field) -> Schema:
    if spec.allowed is None:
        return {}
    return {"enum": [*spec.allowed, *([] if None in spec.allowed else [None])]}


TEXT: Schema = {"type": "string", "minLength": 1}
TOKEN_IDS: Schema = {"type": "array", "minItems": 1,
                     "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID}}


def _prompt(spec: Field) -> Schema:
    return {"anyOf": [TEXT, TOKEN_IDS,
                      {"type": "array", "minItems": 1, "maxItems": 1, "items": TEXT},
                      {"type": "array", "minItems": 1, "maxItems": 1, "items": TOKEN_IDS}]}


TEXT_PART: Schema = {"type": "object", "required": ["type", "text"],
                     "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
CONTENT: Schema = {"anyOf": [{"type": "string"}, {"type": "array", "items": TEXT_PART}]}


def _messages(spec: Field) -> Schema:
    others = [role for role in CHAT_ROLES if role != "assistant"]
    message = {"type": "object", "required": ["role", "content"],
               "properties": {"role": {"enum": others}, "content": CONTENT}}
    # an assistant turn that only called tools has no content
    assistant = {"type": "object", "required": ["role"],
                 "properties": {"role": {"const": "assistant"}, "content": nullable(CONTENT)}}
    return {"type": "array", "minItems": 1, "items": {"anyOf": [message, assistant]}}


def _stop(spec: Field) -> Schema:
    return nullable({"anyOf": [TEXT, {"type": "array", "maxItems": MAX_STOP_SEQUENCES,
                                      "items": TEXT}]})


def _token_ids(spec: Field) -> Schema:
    return nullable({**TOKEN_IDS, "minItems": 0})


def _stream_options(spec: Field) -> Schema:
    return nullable({"type": "object",
                     "properties": {INCLUDE_USAGE.name: field_schema(INCLUDE_USAGE)}})


_KIND_SCHEMAS: dict[str, Callable[[Field], Schema]] = {
    "integer": _scalar_schema, "number": _scalar_schema, "string": _scalar_schema,
    "boolean": _scalar_schema, "any": _any,
    "max_tokens": lambda spec: _scalar_schema(dataclasses.replace(spec, kind="integer")),
    "prompt": _prompt, "messages": _messages, "stop": _stop, "token_ids": _token_ids,
    "stream_options": _stream_options,
}
assert {f.kind for f in REQUEST_FIELDS} <= set(_KIND_SCHEMAS), "a field kind without a schema"


# ---- responses -----------------------------------------------------------------------------
COUNT: Schema = {"type": "integer", "minimum": 0}
USAGE: Schema = {"type": "object", "required": ["prompt_tokens", "completion_tokens",
                                                "total_tokens"],
                 "properties": {"prompt_tokens": COUNT, "completion_tokens": COUNT,
                                "total_tokens": COUNT}}
FINISH_REASON: Schema = {"type": ["string", "null"],
                         "description": "stop, length, abort; null until the last chunk"}


def _response(obj: str, choice: Schema, usage: Schema, description: str) -> Schema:
    return {"type": "object", "description": description,
            "required": ["id", "object", "created", "model", "choices"],
            "properties": {"id": {"type": "string"}, "object": {"const": obj},
                           "created": {"type": "integer"}, "model": {"type": "string"},
                           "choices": {"type": "array", "items": choice}, "usage": usage}}


def _choice(**properties: Schema) -> Schema:
    return {"type": "object", "required": ["index", "finish_reason"],
            "properties": {"index": COUNT, **properties, "logprobs": {"type": "null"},
                           "finish_reason": FINISH_REASON}}


TEXT_OUT: Schema = {"type": ["string", "null"]}
COMPLETION = _response("text_completion", _choice(text=TEXT_OUT), USAGE, "A completion.")
CHAT_COMPLETION = _response(
    "chat.completion", _choice(message={"type": "object", "properties": {
        "role": {"const": "assistant"}, "content": TEXT_OUT}}), USAGE, "A chat completion.")
COMPLETION_CHUNK = _response(
    "text_completion", _choice(text=TEXT_OUT), nullable(USAGE),
    "One event of a completion stream. With stream_options.include_usage every chunk has "
    "usage null and a last chunk with no choices carries it.")
CHAT_COMPLETION_CHUNK = _response(
    "chat.completion.chunk", _choice(delta={"type": "object", "properties": {
        "role": {"const": "assistant"}, "content": TEXT_OUT}}), nullable(USAGE),
    "One event of a chat stream; the first carries the role, the last the finish reason.")
ERROR: Schema = {
    "type": "object", "required": ["error"], "description": "OpenAI's error object.",
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"],
                             "properties": {"message": {"type": "string"},
                                            "type": {"type": "string"},
                                            "param": {"type": ["string", "null"]},
                                            "code": {"type": ["string", "null"]}}}}}


def stream_event(chunk: Schema) -> Schema:
    """One server-sent event of a stream (OpenAPI before 3.2 has a text/event-stream `schema`
    describe each event): a chunk, an error after the stream started, or the closing [DONE]."""
    data = {"type": "string", "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [chunk, ERROR]}}
    return {"type": "object", "required": ["data"],
            "description": "`data: <chunk JSON>` per event, then `data: [DONE]`; an error "
                           "after the stream started is a `data: <Error JSON>` event.",
            "properties": {"event": {"type": "string"},
                           "data": {"anyOf": [{"const": "[DONE]"}, data]}}}


def schemas() -> dict[str, Schema]:
    """Every schema of the protocol, by the name an OpenAPI document gives it."""
    return {**{REQUEST_SCHEMA_NAMES[e]: request_schema(e) for e in ENDPOINTS},
            "Completion": COMPLETION, "ChatCompletion": CHAT_COMPLETION,
            "CompletionChunk": COMPLETION_CHUNK, "ChatCompletionChunk": CHAT_COMPLETION_CHUNK,
            "CompletionEvent": stream_event(COMPLETION_CHUNK),
            "ChatCompletionEvent": stream_event(CHAT_COMPLETION_CHUNK), "Usage": USAGE,
            "Error": ERROR}

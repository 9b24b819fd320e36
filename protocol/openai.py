"""The OpenAI API (completions and chat completions), once, for every fairgate surface.

The engine server, the gateway (embedded and remote engines), the load generator and the fake
server all read and write requests through this module, so a body means the same thing
wherever it is sent: one set of validation rules, one set of defaults (OpenAI's and vLLM's:
`temperature` 1.0, `max_tokens` 16 on completions and the rest of the context on chat), one
chat rendering (the model's own template whenever a tokenizer is known), one set of
unsupported fields answered 400, one response shape.

    req = parse_request(parse_json_body(raw), "chat")     # ApiError(400) naming the field
    ids = prompt_token_ids(req, tokenizer)                # template-rendered for chat
    max_tokens = resolve_max_tokens(req, len(ids), max_model_len)
    SamplingParams(max_tokens=max_tokens, **req.sampling) # engine-side ranges (engine.openai_api)

Every field the API knows is one `Field` in `REQUEST_FIELDS`: its type, range, default and
description. `parse_request` reads its checks from that table and `protocol.openapi` writes
the OpenAPI schemas from it, so the document and the parser cannot disagree. Unknown fields
are ignored (clients send many optional ones); known fields must have the right type and
range. The ranges of the sampling numbers are the engine's `SamplingParams` rules (which
`engine.openai_api.sampling_params` still applies, with the rules between fields such as
min_tokens <= max_tokens).
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from protocol import fastjson
from protocol.errors import ApiError, bad_request
from protocol.fairness import WEIGHT_RANGE
from protocol.priority import PRIORITIES
from protocol.sse import sse_plain
from protocol.validators import check_bool, check_int, check_number

ENDPOINTS = ("completions", "chat")
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_SEQUENCES = 16
MAX_MODEL_NAME = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default for /v1/completions
INT64 = (-(2**63), 2**63 - 1)


class ChatTokenizer(Protocol):
    """What rendering and counting need of a tokenizer (engine.tokenizer's classes fit)."""

    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass
class OpenAIRequest:
    endpoint: str  # "completions" | "chat"
    model: str | None  # None: the server's own model
    body: dict[str, Any]  # the client's body, passed on to remote engines
    prompt: str | list[int] | None = None  # completions: text or token ids
    messages: list[dict[str, str]] | None = None  # chat: validated, content flattened to text
    max_tokens: int | None = None  # as sent; None: the default (`resolve_max_tokens`)
    stream: bool = False
    include_usage: bool = False
    priority: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keywords, defaults in
    tenant: str = ""  # fairgate engine extensions, set by the gateway for the fair policy
    tenant_weight: float | None = None
    token_ids: list[int] | None = None  # the rendered prompt, once a surface has computed it
    token_ids_of: object | None = None  # the tokenizer that rendered token_ids; None: given

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"


def server_root(url: str) -> str:
    """An OpenAI base URL given with or without its /v1 (as clients and servers spell it)
    as the server's root, where /v1/..., /health and /load hang."""
    base = url.rstrip("/")
    return base[:-3] if base.endswith("/v1") else base


# ---- the body ------------------------------------------------------------------------------
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _read_utf8(raw: bytes) -> Any:
    return json.loads(raw.decode("utf-8"))  # UTF-8 only: json.loads would guess UTF-16 or 32


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 for empty, non-UTF-8, non-JSON, non-object bodies and for
    strings no tokenizer can encode (lone surrogates, which JSON can spell as \\ud800)."""
    if not raw:
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = fastjson.loads(raw, _read_utf8)
    except UnicodeError:
        raise bad_request("the request body is not valid UTF-8 text", code="invalid_json") from None
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}",
                          code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    # Only an escape can produce a surrogate: valid UTF-8 bytes never decode to one.
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeError:
            raise bad_request("the request contains a string that is not valid Unicode (a lone "
                              "surrogate such as \\ud800)", code="invalid_unicode") from None
    return body


# ---- the fields ----------------------------------------------------------------------------
INT32_MAX = 2**31 - 1
MAX_TOKEN_ID = INT32_MAX  # every vocabulary is far smaller; the engine checks its own size
# max_tokens, min_tokens, top_k: beyond any model's context or vocabulary, and so never an
# overflow in an int32 tensor or a database column downstream
MAX_COUNT = INT32_MAX
EMPTY: tuple[Any, ...] = (None, False, 0, "", [], {})  # leaves an unsupported feature unset
TENANT_WEIGHT_RANGE = WEIGHT_RANGE  # protocol.fairness: where a weight keeps the counters sane


@dataclass(frozen=True)
class Field:
    """One request field, as `parse_request` reads it and `protocol.openapi` documents it.

    `kind` is a JSON type (integer, number, boolean, string), `any`, or a shape with its own
    reader here and its own schema in protocol.openapi (prompt, messages, max_tokens, stop,
    token_ids, stream_options). Omitted and null mean the same: `default`."""

    name: str
    kind: str
    description: str
    endpoints: tuple[str, ...] = ENDPOINTS
    default: Any = None
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False  # the minimum itself is refused (top_p > 0)
    max_length: int | None = None
    allowed: tuple[Any, ...] | None = None  # the only values accepted, besides null
    refusal: str | None = None  # the message for any other value: a feature not supported
    required: bool = False


def _unsupported(name: str) -> Field:
    return Field(name, "any", "Not supported: omit it or send an empty value.", allowed=EMPTY,
                 refusal=f"'{name}' is not supported")


_SAMPLING_NUMBER = "; the engine's SamplingParams range"
PROMPT_IDS = "prompt_token_ids"
# In the order parse_request checks them: the first bad field is the one a 400 names.
REQUEST_FIELDS = (
    Field("model", "string", "A model id from GET /v1/models; omitted, empty or \"default\": "
          "the server's first model.", max_length=MAX_MODEL_NAME),
    Field("prompt", "prompt", "The prompt: text or token ids, or a batch of one of either.",
          endpoints=("completions",), required=True),
    Field("messages", "messages", "The conversation, rendered through the model's chat "
          "template.", endpoints=("chat",), required=True),
    Field("n", "integer", "Choices to generate: only 1 is supported.", minimum=1, allowed=(1,),
          refusal="only n=1 is supported"),
    Field("best_of", "integer", "Only 1 is supported.", minimum=1, allowed=(1,),
          refusal="only best_of=1 is supported"),
    Field("echo", "boolean", "Not supported: only false.", allowed=(False,),
          refusal="echo is not supported"),
    Field("logprobs", "any", "Not supported: omit it, or send null, false or 0.",
          allowed=(None, False, 0), refusal="logprobs are not supported"),
    Field("top_logprobs", "any", "Not supported: omit it, or send null or 0.", allowed=(None, 0),
          refusal="logprobs are not supported"),
    *(_unsupported(name) for name in ("tools", "functions", "logit_bias", "suffix",
                                      "guided_json", "guided_regex", "guided_choice",
                                      "guided_grammar", "structured_outputs")),
    Field("tool_choice", "any", "Only \"none\" (tools are not supported).",
          allowed=(None, "none"), refusal="'tool_choice' is not supported (tools are not "
          "supported)"),
    Field("response_format", "any", "Only {\"type\": \"text\"}.",
          allowed=(None, {"type": "text"}),
          refusal="only response_format {\"type\": \"text\"} is supported"),
    Field("max_tokens", "max_tokens", "Tokens to generate at most; default: 16 on completions, "
          "the rest of the context on chat. More than the context leaves: 400 "
          "context_length_exceeded.", minimum=1, maximum=MAX_COUNT),
    Field("max_completion_tokens", "max_tokens", "max_tokens under its newer chat name; set, it "
          "wins over max_tokens.", endpoints=("chat",), minimum=1, maximum=MAX_COUNT),
    Field("stream", "boolean", "Answer as server-sent events, ended by `data: [DONE]`.",
          default=False),
    Field("stream_options", "stream_options", "With stream: include_usage adds a last chunk "
          "carrying the token counts."),
    Field("priority", "string", "The priority class; omitted: the tenant's default_priority "
          "(403 when the tenant may not use it).", allowed=PRIORITIES),
    Field("temperature", "number", "Sampling temperature; 0 is greedy" + _SAMPLING_NUMBER,
          default=1.0, minimum=0.0, maximum=100.0),
    Field("top_p", "number", "Nucleus sampling: the smallest set of tokens with this much "
          "probability" + _SAMPLING_NUMBER, default=1.0, minimum=0.0, maximum=1.0,
          exclusive_minimum=True),
    Field("top_k", "integer", "Sample among the k likeliest tokens; -1 or 0: off (more than the "
          "vocabulary is off too).", default=-1, minimum=-1, maximum=MAX_COUNT),
    Field("min_p", "number", "Drop tokens less likely than min_p times the likeliest"
          + _SAMPLING_NUMBER, default=0.0, minimum=0.0, maximum=1.0),
    Field("presence_penalty", "number", "Penalty on tokens already present" + _SAMPLING_NUMBER,
          default=0.0, minimum=-2.0, maximum=2.0),
    Field("frequency_penalty", "number", "Penalty per occurrence of a token" + _SAMPLING_NUMBER,
          default=0.0, minimum=-2.0, maximum=2.0),
    Field("repetition_penalty", "number", "vLLM's multiplicative repetition penalty; 1 is off"
          + _SAMPLING_NUMBER, default=1.0, minimum=0.0, maximum=10.0, exclusive_minimum=True),
    Field("seed", "integer", "Sampling seed (an int64): the same seed and request give the same "
          "tokens.", minimum=INT64[0], maximum=INT64[1]),
    Field("min_tokens", "integer", "Tokens generated before EOS or a stop may end the answer; "
          "at most max_tokens.", default=0, minimum=0, maximum=MAX_COUNT),
    Field("ignore_eos", "boolean", "Keep generating past the end-of-sequence token.",
          default=False),
    Field("stop", "stop", f"A string or up to {MAX_STOP_SEQUENCES} strings that end the answer "
          "(left out of it).", default=()),
    Field("stop_token_ids", "token_ids", "Token ids that end the answer.", default=()),
    Field("tenant", "string", "fairgate engine extension: the tenant the engine's fair policy "
          "accounts the request to; the gateway sends the caller's own.", default=""),
    Field("tenant_weight", "number", "fairgate engine extension: that tenant's fair-share "
          "weight; the gateway sends the caller's own.", minimum=TENANT_WEIGHT_RANGE[0],
          maximum=TENANT_WEIGHT_RANGE[1]),
    Field(PROMPT_IDS, "token_ids", "fairgate engine extension: the prompt as this engine's token "
          "ids (a chat already rendered through its template), from a gateway that tokenized it "
          "with the engine's own tokenizer; the engine runs them instead of tokenizing `prompt` "
          "or `messages` again. Omitted or empty: the engine tokenizes. A gateway ignores it "
          "from clients.", default=()),
)
FIELDS = {f.name: f for f in REQUEST_FIELDS}
INCLUDE_USAGE = Field("include_usage", "boolean", "Add a last chunk with the token counts.",
                      default=False)
# the SamplingParams keywords the table fills, named as the engine names them
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed", "min_tokens", "ignore_eos",
                   "stop", "stop_token_ids")


_ENDPOINT_FIELDS = {e: tuple(f for f in REQUEST_FIELDS if e in f.endpoints) for e in ENDPOINTS}
# parse_request reads only the fields a body sends (a chat request sends 3-6 of about 50), and
# the required ones, in the table's order: (position, field) by name, and the defaults
_ENDPOINT_SPECS = {e: {f.name: (i, f) for i, f in enumerate(fields)}
                   for e, fields in _ENDPOINT_FIELDS.items()}
_ENDPOINT_REQUIRED = {e: tuple((i, f) for i, f in enumerate(fields) if f.required)
                      for e, fields in _ENDPOINT_FIELDS.items()}
_ENDPOINT_DEFAULTS = {e: {f.name: f.default for f in fields}
                      for e, fields in _ENDPOINT_FIELDS.items()}


def request_fields(endpoint: str) -> tuple[Field, ...]:
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
    return _ENDPOINT_FIELDS[endpoint]


# ---- requests ------------------------------------------------------------------------------
def parse_request(body: dict[str, Any], endpoint: str) -> OpenAIRequest:
    """A validated request; ApiError(400) naming the first bad field (in the table's order)."""
    request_fields(endpoint)  # the endpoint checked
    specs = _ENDPOINT_SPECS[endpoint]
    # most fields are omitted (or null): their default, without a reader
    read = dict(_ENDPOINT_REQUIRED[endpoint])  # position -> field
    read.update(specs[name] for name, value in body.items() if value is not None and name in specs)
    values = dict(_ENDPOINT_DEFAULTS[endpoint])
    for position in sorted(read):
        spec = read[position]
        values[spec.name] = read_field(spec, body.get(spec.name))
    max_tokens = values.get("max_completion_tokens")
    stream = values["stream"]
    sampling = {name: values[name] for name in SAMPLING_FIELDS}
    if sampling["top_k"] == -1:
        sampling["top_k"] = 0  # -1 is vLLM's spelling of "off"; the engine's is 0
    return OpenAIRequest(endpoint, values["model"] or None, body, prompt=values.get("prompt"),
                         messages=values.get("messages"),
                         max_tokens=values["max_tokens"] if max_tokens is None else max_tokens,
                         stream=stream, include_usage=bool(values["stream_options"]) and stream,
                         priority=values["priority"], sampling=sampling,
                         tenant=values["tenant"], tenant_weight=values["tenant_weight"],
                         token_ids=list(values[PROMPT_IDS]) or None)


def read_field(spec: Field, value: Any) -> Any:
    """The field's value as sent (its default when omitted or null); ApiError(400) naming it."""
    value = _SHAPES.get(spec.kind, _read_scalar)(spec, value)
    return spec.default if value is None else value


def _read_scalar(spec: Field, value: Any) -> Any:
    if value is None:
        return None
    try:
        value = _TYPE_CHECKS[spec.kind](spec, value)
    except ValueError as exc:
        raise bad_request(str(exc), spec.name) from None
    if spec.allowed is not None and not any(_json_equal(value, a) for a in spec.allowed):
        raise bad_request(spec.refusal or f"'{spec.name}' must be one of "
                          f"{', '.join(map(str, spec.allowed))}, got {value!r}", spec.name)
    return value


def _json_equal(a: Any, b: Any) -> bool:
    """JSON's equality (JSON Schema's `enum`): true is not 1, 1.0 is 1."""
    return isinstance(a, bool) == isinstance(b, bool) and a == b


def _integral(value: Any) -> Any:
    """1.0 as 1: JSON has one number type, and JSON Schema's integers include 1.0."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _check_integer(spec: Field, value: Any) -> int:
    low, high = (None if b is None else int(b) for b in (spec.minimum, spec.maximum))
    return check_int(f"'{spec.name}'", _integral(value), low, high)


def _check_number(spec: Field, value: Any) -> float:
    return float(check_number(f"'{spec.name}'", value, spec.minimum, spec.maximum,
                              open_low=spec.exclusive_minimum))


def _check_string(spec: Field, value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"'{spec.name}' must be a string, got {type(value).__name__}")
    if spec.max_length is not None and len(value) > spec.max_length:
        raise ValueError(f"'{spec.name}' must be at most {spec.max_length} characters")
    return value


_TYPE_CHECKS: dict[str, Callable[[Field, Any], Any]] = {
    "integer": _check_integer, "number": _check_number, "string": _check_string,
    "boolean": lambda spec, value: check_bool(f"'{spec.name}'", value),
    "any": lambda spec, value: value,
    "max_tokens": _check_integer,  # an integer whose reader says too large as a context error
}


def _prompt(spec: Field, prompt: Any) -> str | list[int]:
    where = "prompt"
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt, where = prompt[0], "prompt[0]"  # a batch of one is what many clients send
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, str | list) for p in prompt):
        raise bad_request("batched prompts are not supported: send one prompt per request",
                          "prompt")
    if not isinstance(prompt, list) or not prompt:
        raise bad_request("'prompt' is required: a non-empty string or a non-empty list of "
                          f"token ids (integers in [0, {MAX_TOKEN_ID}])", "prompt")
    return _token_id_list(prompt, "prompt", where)


def _token_id_list(values: list[Any], param: str, where: str) -> list[int]:
    if values and set(map(type, values)) == {int} and (
            min(values) >= 0 and max(values) <= MAX_TOKEN_ID):
        return list(values)  # plain ints in range, checked in C: a long prompt costs µs
    ids = [_integral(t) for t in values]
    for i, (token_id, sent) in enumerate(zip(ids, values, strict=True)):
        if (isinstance(token_id, bool) or not isinstance(token_id, int)
                or not 0 <= token_id <= MAX_TOKEN_ID):
            raise bad_request(f"'{param}' token ids must be integers in [0, {MAX_TOKEN_ID}]; "
                              f"{where}[{i}] is {_shown(sent)}", param)
    return ids


def _shown(value: Any, limit: int = 40) -> str:
    """A value as the client wrote it (JSON), cut short."""
    text = json.dumps(value, ensure_ascii=False, default=repr)
    return text if len(text) <= limit else text[:limit] + "..."


def _messages(spec: Field, messages: Any) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required and must be a non-empty list", "messages")
    return [_message(m, i) for i, m in enumerate(messages)]


def _message(message: Any, index: int) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"{param} must be an object", param)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"{param}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                          f"{param}.role")
    content = message.get("content")
    if content is None and role == "assistant":  # an assistant turn that only called tools
        content = ""
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad_request(f"{param}.content must be a string or a list of text parts",
                          f"{param}.content")
    return {"role": role, "content": content}


def _max_tokens(spec: Field, value: Any) -> int | None:
    number = _integral(value)
    if (isinstance(number, int) and not isinstance(number, bool)
            and spec.maximum is not None and number > spec.maximum):
        raise context_length_exceeded(f"'{spec.name}' is {number}, more tokens than any "
                                      f"model's context ({int(spec.maximum)})", spec.name)
    return _read_scalar(spec, value)


def _stream_options(spec: Field, options: Any) -> bool | None:
    if options is None:
        return None
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return read_field(INCLUDE_USAGE, options.get(INCLUDE_USAGE.name))


def _stop(spec: Field, stop: Any) -> tuple[str, ...] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES
            or not all(isinstance(s, str) and s for s in stops)):
        raise bad_request(f"'stop' must be a non-empty string or a list of up to "
                          f"{MAX_STOP_SEQUENCES} non-empty strings", "stop")
    return tuple(stops)


def _token_ids(spec: Field, ids: Any) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if not isinstance(ids, list):
        raise bad_request(f"'{spec.name}' must be a list of token ids (integers in "
                          f"[0, {MAX_TOKEN_ID}])", spec.name)
    return tuple(_token_id_list(ids, spec.name, spec.name))


_SHAPES: dict[str, Callable[[Field, Any], Any]] = {
    "prompt": _prompt, "messages": _messages, "max_tokens": _max_tokens, "stop": _stop,
    "token_ids": _token_ids, "stream_options": _stream_options,
}


# ---- the prompt ----------------------------------------------------------------------------
def prompt_token_ids(req: OpenAIRequest, tokenizer: ChatTokenizer) -> list[int]:
    """The prompt as the engine runs it: token ids as given (`prompt` or the `prompt_token_ids`
    extension), text encoded, chat rendered through the model's chat template when it has one.
    Memoised on the request for this tokenizer: another one (a backend of another model)
    renders its own."""
    if req.token_ids is None or req.token_ids_of not in (None, tokenizer):
        if req.messages is not None:
            req.token_ids, req.token_ids_of = render_chat(req.messages, tokenizer), tokenizer
        elif isinstance(req.prompt, list):
            req.token_ids, req.token_ids_of = req.prompt, None
        else:
            req.token_ids = tokenizer.encode(req.prompt or "")
            req.token_ids_of = tokenizer
    return req.token_ids


def prompt_text(req: OpenAIRequest) -> str:
    """The prompt as text without a tokenizer (for estimates): the plain chat rendering."""
    if req.messages is not None:
        return default_chat_text(req.messages)
    return req.prompt if isinstance(req.prompt, str) else ""


def render_chat(messages: list[dict[str, str]], tokenizer: ChatTokenizer) -> list[int]:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        return tokenizer.encode(render_template(template, messages, tokenizer),
                                add_special_tokens=False)  # templates add BOS themselves
    return tokenizer.encode(default_chat_text(messages))


def default_chat_text(messages: list[dict[str, str]]) -> str:
    """The plain template when the model has none: role tags, then the assistant's turn."""
    turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return turns + "<|assistant|>\n"


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise bad_request(f"chat template: {message}", "messages")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_template(template: str, messages: list[dict[str, str]],
                    tokenizer: ChatTokenizer) -> str:
    """The Hugging Face chat template rendered in jinja2's sandbox."""
    import jinja2

    def special(token_id: int | None) -> str:
        return "" if token_id is None else tokenizer.decode([token_id], skip_special_tokens=False)

    eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
    try:
        return str(_compile(template).render(messages=messages, add_generation_prompt=True,
                                             bos_token=special(tokenizer.bos_token_id),
                                             eos_token=special(eos)))
    except ApiError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
        # the template is the model's code: whatever it trips on is about these messages
        raise bad_request(f"the chat template failed: {exc}", "messages") from None


def resolve_max_tokens(req: OpenAIRequest, prompt_tokens: int, max_model_len: int) -> int:
    """The request's max_tokens, else the default: 16 on completions, what the context leaves
    on chat; 400 when it cannot fit (naming max_tokens when the client set it)."""
    what = "messages" if req.chat else "prompt"
    max_tokens = req.max_tokens
    if max_tokens is None and not req.chat:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    if max_tokens is None:
        if prompt_tokens >= max_model_len:
            raise context_length_exceeded(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"{what} has {prompt_tokens} tokens, leaving no room for a completion. Please "
                f"shorten the {what}.", what)
        return max_model_len - prompt_tokens
    if prompt_tokens + max_tokens > max_model_len:
        raise context_length_exceeded(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {what}, "
            f"{max_tokens} for the completion). Please reduce the length of the {what} or "
            f"max_tokens.", what if req.max_tokens is None else "max_tokens")
    return max_tokens


def context_length_exceeded(message: str, param: str) -> ApiError:
    return bad_request(message, param, "context_length_exceeded")


def invalid_value(exc: ValueError) -> ApiError:
    """A ValueError from the engine's validation (SamplingParams, add_request) as a 400 that
    names the field when the message starts with one."""
    message = str(exc)
    if "max_model_len" in message:
        return context_length_exceeded(message, "max_tokens")
    head = message.split(" ", 1)[0].split("[", 1)[0].strip("'")
    return bad_request(message, head if head.isidentifier() else None)


# ---- responses -----------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseWriter:
    """The OpenAI objects of one response: whole, or streamed as SSE events (a chat stream
    opens with the role-only delta, as OpenAI's does)."""

    def __init__(self, request_id: str, chat: bool, model: str,
                 include_usage: bool = False) -> None:
        self.chat = chat
        self.include_usage = include_usage
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self._head: dict[str, Any] = {"id": self.id,
                                      "object": "chat.completion.chunk" if chat
                                      else "text_completion",
                                      "created": int(time.time()), "model": model}

    def _event(self, choice: dict[str, Any]) -> bytes:
        chunk: dict[str, Any] = {**self._head, "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return sse_plain(chunk)  # strings, integers and nulls: orjson writes json's bytes

    def role_chunk(self) -> bytes:
        """The opening event of a chat stream (nothing for completions)."""
        if not self.chat:
            return b""
        return self._event({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def chunk(self, text: str, finish_reason: str | None) -> bytes:
        if self.chat:
            delta = {"content": text} if text or finish_reason is None else {}
            return self._event({"index": 0, "delta": delta, "logprobs": None,
                                "finish_reason": finish_reason})
        return self._event({"index": 0, "text": text, "logprobs": None,
                            "finish_reason": finish_reason})

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return sse_plain({**self._head, "choices": [],
                         "usage": usage(prompt_tokens, completion_tokens)})

    def whole(self, text: str, finish_reason: str | None, prompt_tokens: int,
              completion_tokens: int) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": text},
                                      "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head, "object": "chat.completion" if self.chat else "text_completion",
                "choices": [choice], "usage": usage(prompt_tokens, completion_tokens)}


def error_event(error: ApiError) -> bytes:
    """An error after the stream started: the status line is gone, so it travels as an event
    (the caller ends the stream with `protocol.sse.DONE`)."""
    return sse_plain(error.body())

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

Unknown fields are ignored (clients send many optional ones); known fields must have the
right type. Value ranges are the engine's `SamplingParams` rules, applied by every surface
through `engine.openai_api.sampling_params`.
"""

from __future__ import annotations

import functools
import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from protocol.errors import ApiError, bad_request
from protocol.priority import PRIORITIES
from protocol.sse import sse_json

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


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 for empty, non-UTF-8, non-JSON, non-object bodies and for
    strings no tokenizer can encode (lone surrogates, which JSON can spell as \\ud800)."""
    if not raw:
        raise bad_request("the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw.decode("utf-8"))
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


# ---- typed fields --------------------------------------------------------------------------
def _integer(body: dict[str, Any], name: str, low: int = INT64[0],
             high: int | None = INT64[1]) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {type(value).__name__}", name)
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad_request(f"'{name}' must be an integer {bounds}, got {value}", name)
    return value


def _number(body: dict[str, Any], name: str) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad_request(f"'{name}' must be a number, got {type(value).__name__}", name)
    try:
        number = float(value)
    except OverflowError:  # an integer too large for a float
        number = math.inf
    if not math.isfinite(number):
        raise bad_request(f"'{name}' must be a finite number", name)
    return number


def _boolean(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {type(value).__name__}", name)
    return value


def _string(body: dict[str, Any], name: str, max_length: int | None = None) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise bad_request(f"'{name}' must be a string, got {type(value).__name__}", name)
    if max_length is not None and len(value) > max_length:
        raise bad_request(f"'{name}' must be at most {max_length} characters", name)
    return value


# ---- requests ------------------------------------------------------------------------------
def parse_request(body: dict[str, Any], endpoint: str) -> OpenAIRequest:
    """A validated request; ApiError(400) naming the first bad field."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {endpoint!r}")
    model = _string(body, "model", MAX_MODEL_NAME) or None
    req = OpenAIRequest(endpoint, model, body)
    if req.chat:
        req.messages = _messages(body)
    else:
        req.prompt = _completion_prompt(body)
    _check_unsupported(body, endpoint)
    req.max_tokens = _max_tokens(body, req.chat)
    req.stream = bool(_boolean(body, "stream"))
    req.include_usage = _include_usage(body) and req.stream
    req.priority = _priority(body)
    req.sampling = _sampling(body)
    req.tenant = _string(body, "tenant") or ""
    req.tenant_weight = _tenant_weight(body)
    return req


def _completion_prompt(body: dict[str, Any]) -> str | list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one is what many clients send
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        return prompt
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, str | list) for p in prompt):
        raise bad_request("batched prompts are not supported: send one prompt per request",
                          "prompt")
    raise bad_request("'prompt' is required: a non-empty string or a non-empty list of token "
                      "ids (integers >= 0)", "prompt")


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    messages = body.get("messages")
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


_UNSUPPORTED_IF_SET = ("tools", "functions", "logit_bias", "suffix", "guided_json",
                       "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


def _check_unsupported(body: dict[str, Any], endpoint: str) -> None:
    """Fields that would change the output: refused, never silently ignored."""
    if _integer(body, "n", 1) not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    if _integer(body, "best_of", 1) not in (None, 1):
        raise bad_request("only best_of=1 is supported", "best_of")
    if _boolean(body, "echo"):
        raise bad_request("echo is not supported", "echo")
    if body.get("logprobs") not in (None, False, 0) or body.get("top_logprobs") not in (None, 0):
        raise bad_request("logprobs are not supported", "logprobs")
    for name in _UNSUPPORTED_IF_SET:
        if body.get(name):
            raise bad_request(f"'{name}' is not supported", name)
    if body.get("tool_choice") not in (None, "none"):
        raise bad_request("'tool_choice' is not supported (tools are not supported)",
                          "tool_choice")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad_request("only response_format {\"type\": \"text\"} is supported",
                          "response_format")


def _max_tokens(body: dict[str, Any], chat: bool) -> int | None:
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None \
        else "max_tokens"
    return _integer(body, name, 1, None)  # too large: the context-length error says why


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    return bool(_boolean(options, "include_usage"))


def _priority(body: dict[str, Any]) -> str | None:
    value = body.get("priority")
    if value is not None and value not in PRIORITIES:
        raise bad_request(f"'priority' must be one of {', '.join(PRIORITIES)}, got {value!r}",
                          "priority")
    return value


def _tenant_weight(body: dict[str, Any]) -> float | None:
    weight = _number(body, "tenant_weight")
    if weight is not None and weight <= 0:
        raise bad_request("'tenant_weight' must be a finite number > 0", "tenant_weight")
    return weight


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES
            or not all(isinstance(s, str) and s for s in stops)):
        raise bad_request(f"'stop' must be a non-empty string or a list of up to "
                          f"{MAX_STOP_SEQUENCES} non-empty strings", "stop")
    return tuple(stops)


def _stop_token_ids(body: dict[str, Any]) -> tuple[int, ...]:
    ids = body.get("stop_token_ids")
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64[1] for t in ids):
        raise bad_request("'stop_token_ids' must be a list of token ids (integers >= 0)",
                          "stop_token_ids")
    return tuple(ids)


# SamplingParams keyword -> (reader, the value when the field is omitted)
_NUMBERS = {"temperature": 1.0, "top_p": 1.0, "min_p": 0.0, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "repetition_penalty": 1.0}


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    """Every SamplingParams field, the omitted ones at OpenAI's / vLLM's defaults."""
    values: dict[str, Any] = {}
    for name, default in _NUMBERS.items():
        number = _number(body, name)
        values[name] = default if number is None else number
    top_k = _integer(body, "top_k", -1)
    values["top_k"] = 0 if top_k in (None, -1) else top_k  # -1: vLLM's spelling of "off"
    values["seed"] = _integer(body, "seed")
    values["min_tokens"] = _integer(body, "min_tokens", 0) or 0
    values["ignore_eos"] = bool(_boolean(body, "ignore_eos"))
    values["stop"] = _stop(body)
    values["stop_token_ids"] = _stop_token_ids(body)
    return values


# ---- the prompt ----------------------------------------------------------------------------
def prompt_token_ids(req: OpenAIRequest, tokenizer: ChatTokenizer) -> list[int]:
    """The prompt as the engine runs it (memoised on the request): token ids as given, text
    encoded, chat rendered through the model's chat template when it has one."""
    if req.token_ids is None:
        if req.messages is not None:
            req.token_ids = render_chat(req.messages, tokenizer)
        elif isinstance(req.prompt, list):
            req.token_ids = req.prompt
        else:
            req.token_ids = tokenizer.encode(req.prompt or "")
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
        return sse_json(chunk)

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
        return sse_json({**self._head, "choices": [],
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


def token_choices(choices: Any) -> int:
    """How many of a streamed chunk's choices carry generated text. Empty text still counts (a
    byte-level token may decode to nothing yet) unless it is the chat role preamble or the
    bare finish marker."""
    count = 0
    for choice in choices or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if isinstance(delta, dict):
            text = delta.get("content")
            opening = "role" in delta
        else:
            text, opening = choice.get("text"), False
        if text or (text == "" and choice.get("finish_reason") is None and not opening):
            count += 1
    return count


def error_event(error: ApiError) -> bytes:
    """An error after the stream started: the status line is gone, so it travels as an event
    (the caller ends the stream with `protocol.sse.DONE`)."""
    return sse_json(error.body())

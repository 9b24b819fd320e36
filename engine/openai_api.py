"""OpenAI request parsing and response shaping for the engine server.

Every field is type-checked here, before anything reaches SamplingParams or the tokenizer, so
bad input becomes a 400 naming the field (OpenAI's error shape), never a 500.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.request import PRIORITIES, SamplingParams
from engine.tokenizer import Tokenizer

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or default_error_type(status)
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)


def default_error_type(status: int) -> str:
    if status >= 500:
        return "server_error"
    return {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            429: "rate_limit_error"}.get(status, "invalid_request_error")


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def invalid_input(exc: ValueError, param: str | None = None) -> ApiError:
    """A ValueError from validation; the context-length one gets OpenAI's code."""
    message = str(exc)
    if "max_model_len" in message:
        return ApiError(400, message, param="max_tokens", code="context_length_exceeded")
    return ApiError(400, message, param=param)


def parse_json_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw.decode("utf-8"))
        # lone surrogates (\ud800) decode fine but cannot be tokenised: refuse them here once
        json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeError:
        raise ApiError(400, "the request body is not valid UTF-8 text") from None
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


# ---- typed fields ----------------------------------------------------------------------------
def _field(body: dict[str, Any], name: str, kinds: tuple[type, ...], default: Any = None,
           required: bool = False) -> Any:
    value = body.get(name)
    if value is None:
        if required:
            raise ApiError(400, f"'{name}' is a required field", param=name)
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join("number" if k is float else k.__name__ for k in kinds)
        raise ApiError(400, f"'{name}' must be {names}, got {type(value).__name__}", param=name)
    return value


def _number(body: dict[str, Any], name: str, default: float) -> float:
    return float(_field(body, name, (int, float), default))


def _string_list(body: dict[str, Any], name: str) -> tuple[str, ...]:
    value = _field(body, name, (str, list), ())
    items = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(s, str) and s for s in items):
        raise ApiError(400, f"'{name}' must be a string or a list of non-empty strings", param=name)
    return items


def _int_list(body: dict[str, Any], name: str) -> tuple[int, ...]:
    value = _field(body, name, (list,), [])
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ApiError(400, f"'{name}' must be a list of integers", param=name)
    return tuple(value)


def sampling_params(body: dict[str, Any], max_tokens: int) -> SamplingParams:
    top_k = _field(body, "top_k", (int,), 0)
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0),
            top_p=_number(body, "top_p", 1.0),
            top_k=0 if top_k == -1 else top_k,  # vLLM spells "off" as -1
            min_p=_number(body, "min_p", 0.0),
            seed=_field(body, "seed", (int,)),
            stop=_string_list(body, "stop"),
            stop_token_ids=_int_list(body, "stop_token_ids"),
            ignore_eos=_field(body, "ignore_eos", (bool,), False),
            min_tokens=_field(body, "min_tokens", (int,), 0),
            presence_penalty=_number(body, "presence_penalty", 0.0),
            frequency_penalty=_number(body, "frequency_penalty", 0.0),
            repetition_penalty=_number(body, "repetition_penalty", 1.0))
    except ValueError as exc:
        raise invalid_input(exc) from None


def _check_unsupported(body: dict[str, Any]) -> None:
    n = _field(body, "n", (int,), 1)
    if n != 1:
        raise ApiError(400, "only n=1 is supported", param="n")
    best_of = _field(body, "best_of", (int,), 1)
    if best_of != 1:
        raise ApiError(400, "only best_of=1 is supported", param="best_of")
    if _field(body, "echo", (bool,), False):
        raise ApiError(400, "echo is not supported", param="echo")
    logprobs = _field(body, "logprobs", (bool, int), False)
    if logprobs is not False and logprobs != 0:
        raise ApiError(400, "logprobs are not supported", param="logprobs")


# ---- requests --------------------------------------------------------------------------------
@dataclass
class GenerationRequest:
    chat: bool
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    tenant: str
    priority: str
    tenant_weight: float | None = None  # the tenant's weight for the engine's `fair` policy


def parse_request(body: dict[str, Any], chat: bool, tokenizer: Tokenizer, config: EngineConfig,
                  model_name: str) -> GenerationRequest:
    model = _field(body, "model", (str,), model_name)
    if model != model_name:
        raise ApiError(404, f"the model '{model}' does not exist; this engine serves "
                       f"'{model_name}'", param="model", code="model_not_found")
    _check_unsupported(body)
    prompt = chat_prompt(body, tokenizer) if chat else completion_prompt(body, tokenizer)
    max_tokens = _max_tokens(body, chat, len(prompt), config.max_model_len)
    stream = _field(body, "stream", (bool,), False)
    options = _field(body, "stream_options", (dict,), {})
    include_usage = _field(options, "include_usage", (bool,), False)
    priority = _field(body, "priority", (str,), "interactive")
    if priority not in PRIORITIES:
        raise ApiError(400, f"'priority' must be one of: {', '.join(PRIORITIES)}", param="priority")
    return GenerationRequest(chat, prompt, sampling_params(body, max_tokens), stream,
                             include_usage, _field(body, "tenant", (str,), ""), priority,
                             _tenant_weight(body))


def _tenant_weight(body: dict[str, Any]) -> float | None:
    value = _field(body, "tenant_weight", (int, float))
    if value is None:
        return None
    try:
        weight = float(value)
    except OverflowError:  # an integer too large for a float
        weight = math.inf
    if not 0 < weight < math.inf:
        raise ApiError(400, "'tenant_weight' must be a finite number > 0", param="tenant_weight")
    return weight


def _max_tokens(body: dict[str, Any], chat: bool, prompt_len: int, max_model_len: int) -> int:
    name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
    # OpenAI's defaults: 16 for completions, "up to the context length" for chat
    default = max(1, max_model_len - prompt_len) if chat else 16
    value = _field(body, name, (int,), default)
    if value < 1:
        raise ApiError(400, f"'{name}' must be at least 1, got {value}", param=name)
    if prompt_len + value > max_model_len:
        raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens "
                       f"(max_model_len); the prompt has {prompt_len} tokens and {name} is "
                       f"{value}; shorten the prompt or lower {name}", param=name,
                       code="context_length_exceeded")
    return value


def completion_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    prompt = _field(body, "prompt", (str, list), required=True)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise ApiError(400, "'prompt' must be a string or a non-empty list of token ids (one prompt "
                   "per request)", param="prompt")


def chat_prompt(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    messages = _field(body, "messages", (list,), required=True)
    if not messages:
        raise ApiError(400, "'messages' must not be empty", param="messages")
    plain = [_message(m, i) for i, m in enumerate(messages)]
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str) and template:
        text = render_template(template, plain, tokenizer)
        if text is not None:
            return tokenizer.encode(text, add_special_tokens=False)  # templates add BOS
    return tokenizer.encode(default_chat_text(plain))


def _message(message: Any, index: int) -> dict[str, str]:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{param} must be an object", param=param)
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise ApiError(400, f"{param}.role must be one of: {', '.join(CHAT_ROLES)}",
                       param=f"{param}.role")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        if not all(isinstance(p, dict) and p.get("type") == "text"
                   and isinstance(p.get("text"), str) for p in content):
            raise ApiError(400, f"{param}.content parts must be text parts",
                           param=f"{param}.content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"{param}.content must be a string or a list of text parts",
                       param=f"{param}.content")
    return {"role": role, "content": content}


def default_chat_text(messages: list[dict[str, str]]) -> str:
    """The plain template when the model has none: role tags, then the assistant's turn."""
    turns = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return turns + "<|assistant|>\n"


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ApiError(400, f"chat template: {message}", param="messages")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


def render_template(template: str, messages: list[dict[str, str]],
                    tokenizer: Tokenizer) -> str | None:
    """The HF chat template rendered with jinja2; None when jinja2 is not installed."""
    try:
        import jinja2
    except ImportError:
        return None
    special = functools.partial(_token_text, tokenizer)
    try:
        return str(_compile(template).render(
            messages=messages, add_generation_prompt=True,
            bos_token=special(tokenizer.bos_token_id),
            eos_token=special(tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None)))
    except ApiError:
        raise
    except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
        # the template is the model's code: whatever it trips on is about these messages
        raise ApiError(400, f"the chat template failed: {exc}", param="messages") from None


def _token_text(tokenizer: Tokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.decode([token_id], skip_special_tokens=False)


# ---- responses -------------------------------------------------------------------------------
@dataclass
class ResponseShaper:
    """Builds the OpenAI objects of one response (whole or streamed chunks)."""

    request_id: str
    model: str
    chat: bool
    include_usage: bool = False
    created: int = 0

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def _base(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created,
                "model": self.model}

    def chunk(self, text: str, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": text} if role else (
                {"content": text} if text or finish_reason is None else {})
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None,
                                      "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        chunk = {**self._base(True), "choices": [choice]}
        if self.include_usage:
            chunk["usage"] = None  # OpenAI: null on every chunk but the last
        return chunk

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self._base(True), "choices": [], "usage": usage}

    def full(self, text: str, finish_reason: str | None, usage: dict[str, int]) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason,
                                      "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._base(False), "choices": [choice], "usage": usage}


def usage(num_prompt_tokens: int, num_output_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_output_tokens,
            "total_tokens": num_prompt_tokens + num_output_tokens}


def sse(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"

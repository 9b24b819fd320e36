"""OpenAI request validation and response shapes (completions and chat completions).

`parse_request` turns a JSON body into a `ParsedRequest` or raises a 400 `ApiError` naming the
field. Unknown fields are ignored (clients send many optional ones); known fields must have the
right type and range. The response helpers build the bodies and SSE events the embedded backend
sends; remote backends' bytes are passed through as they come.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import ApiError, bad_request

PRIORITIES = ("interactive", "batch")
MAX_STOP_SEQUENCES = 16


@dataclass
class ParsedRequest:
    endpoint: str  # "completions" | "chat"
    model: str
    prompt: str | list[int]  # text (chat rendered with the template) or prompt token ids
    body: dict[str, Any]  # the client's body, for remote backends
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    priority: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams keyword arguments


def _number(body: dict[str, Any], name: str, low: float, high: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad_request(f"'{name}' must be a number, got {type(value).__name__}", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be between {low} and {high}, got {value}", name)
    return float(value)


def _integer(body: dict[str, Any], name: str, low: int, high: int = 2**63 - 1) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer, got {type(value).__name__}", name)
    if not low <= value <= high:
        raise bad_request(f"'{name}' must be an integer >= {low}, got {value}", name)
    return value


def _boolean(body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{name}' must be true or false, got {type(value).__name__}", name)
    return value


def parse_request(body: Any, endpoint: str) -> ParsedRequest:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("'model' is required and must be a string", "model", "missing_model")
    prompt = _chat_prompt(body) if endpoint == "chat" else _completion_prompt(body)
    _check_unsupported(body, endpoint)
    stream = bool(_boolean(body, "stream"))
    return ParsedRequest(endpoint=endpoint, model=model, prompt=prompt, body=body,
                         max_tokens=_max_tokens(body, endpoint), stream=stream,
                         include_usage=stream and _include_usage(body),
                         priority=_priority(body), sampling=_sampling(body))


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
    if isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("batched prompts are not supported: send one prompt per request",
                          "prompt")
    raise bad_request("'prompt' is required: a non-empty string or list of token ids", "prompt")


def _chat_prompt(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' is required and must be a non-empty list", "messages")
    parts = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise bad_request(f"messages[{i}] must be an object", f"messages[{i}]")
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"messages[{i}].role must be system, user, assistant or tool, "
                              f"got {role!r}", f"messages[{i}].role")
        parts.append(f"<|{role}|>\n{_content(message.get('content'), i)}\n")
    # A neutral template: the embedded model is byte-level and remote servers apply their own.
    return "".join(parts) + "<|assistant|>\n"


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        return "".join(p["text"] for p in content)
    if content is None:
        return ""
    raise bad_request(f"messages[{i}].content must be a string or a list of text parts",
                      f"messages[{i}].content")


def _check_unsupported(body: dict[str, Any], endpoint: str) -> None:
    if _integer(body, "n", 1) not in (None, 1):
        raise bad_request("only n=1 is supported", "n")
    if _integer(body, "best_of", 1) not in (None, 1):
        raise bad_request("only best_of=1 is supported", "best_of")
    if _boolean(body, "echo"):
        raise bad_request("echo is not supported", "echo")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") is not None:
        raise bad_request("logprobs are not supported by the gateway", "logprobs")
    if body.get("tools") or body.get("functions"):
        raise bad_request("tools and functions are not supported", "tools")
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise bad_request("only response_format {\"type\": \"text\"} is supported",
                          "response_format")


def _max_tokens(body: dict[str, Any], endpoint: str) -> int | None:
    value = _integer(body, "max_tokens", 1)
    if endpoint == "chat":
        newer = _integer(body, "max_completion_tokens", 1)
        value = newer if newer is not None else value
    return value


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


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    values: dict[str, Any] = {
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 1e-9, 1.0),
        "min_p": _number(body, "min_p", 0.0, 1.0),
        "presence_penalty": _number(body, "presence_penalty", -2.0, 2.0),
        "frequency_penalty": _number(body, "frequency_penalty", -2.0, 2.0),
        "repetition_penalty": _number(body, "repetition_penalty", 1e-9, 10.0),
        "top_k": _integer(body, "top_k", 0),
        "seed": _integer(body, "seed", -(2**63)),
        "min_tokens": _integer(body, "min_tokens", 0),
        "ignore_eos": _boolean(body, "ignore_eos"),
        "stop": _stop(body) or None,
    }
    if body.get("top_k") == -1:  # vLLM's spelling of "off"
        values["top_k"] = 0
    return {k: v for k, v in values.items() if v is not None}


def check_sampling(sampling: dict[str, Any], max_tokens: int) -> None:
    """Combinations a single field check cannot see."""
    if sampling.get("min_tokens", 0) > max_tokens:
        raise bad_request(f"min_tokens ({sampling['min_tokens']}) must be <= max_tokens "
                          f"({max_tokens})", "min_tokens")


# ---- responses (embedded backend) ----------------------------------------------------------

def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseWriter:
    """OpenAI bodies and SSE events for one request."""

    def __init__(self, request_id: str, endpoint: str, model: str) -> None:
        self.chat = endpoint == "chat"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        self._head = {"id": prefix + request_id,
                      "object": "chat.completion.chunk" if self.chat else "text_completion",
                      "created": int(time.time()), "model": model}
        self._first = True

    def chunk(self, text: str, finish_reason: str | None) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {"content": text}
            if self._first:
                delta["role"] = "assistant"
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        self._first = False
        return sse({**self._head, "choices": [choice]})

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return sse({**self._head, "choices": [], "usage": usage_dict(prompt_tokens,
                                                                      completion_tokens)})

    def whole(self, text: str, finish_reason: str | None, prompt_tokens: int,
              completion_tokens: int) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant",
                                                              "content": text},
                                      "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head, "object": obj, "choices": [choice],
                "usage": usage_dict(prompt_tokens, completion_tokens)}


DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def sse_error(error: ApiError) -> bytes:
    """An error after the stream started: the status line is gone, so it travels as an event."""
    return sse(error.body()) + DONE

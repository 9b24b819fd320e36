"""SSE pass-through: a remote engine's stream events on their way to the client.

Each event's data is read once (protocol.sse.read_chunk: which events carry a token), its
tokens and usage noted in the job's `Outcome`, and passed on as the engine sent it, re-encoded
with LF line ends, except for the usage the client did not ask for: the usage event and the
`usage: null` of every chunk are dropped (OpenAI sends neither then). The gateway always asks an
engine for usage, since it settles the tenant's charge exactly.

`pass_chunk` takes a whole read: the whole plain token events it opens with (the bulk of every
stream) are told apart by `protocol.sse.PlainTokens` and go on as they came, which is what the
events one by one would give (`tests/gateway/test_stream_events.py` holds the two to each other
over any stream cut into any reads); the rest of the read goes event by event. The tokens of one
read are noted with one time: they left together.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.backends.base import Job, Outcome
from protocol import fastjson
from protocol.errors import ApiError
from protocol.sse import (
    DONE,
    PLAIN_TOKEN,
    PlainTokens,
    SSEReader,
    StreamChunk,
    encode_event,
    read_chunk,
    sse_json,
)

_USAGE_KEY = b'"usage"'
_NULL_USAGE_TAILS = (b',"usage":null}', b', "usage": null}')  # the last key of the object
_NULL_USAGE_ENDS = tuple(tail + b"\n\n" for tail in _NULL_USAGE_TAILS)


def pass_chunk(reader: SSEReader, plain: PlainTokens, data: bytes, job: Job,
               outcome: Outcome) -> bytes:
    """One read of the backend's stream: what goes on to the client (b"" for nothing), each
    event as `pass_event` passes it. The whole plain token events a read opens with (the bulk
    of a stream) are told apart by `plain` (the stream's) and go on as they came, their tokens
    noted at once; what follows them goes through `reader` and `pass_event`, event by event."""
    if reader.starts_event(data):
        end, tokens = plain.prefix(data)
        head = data[:end]
        if tokens and not job.req.include_usage and _USAGE_KEY in head:
            for tail in _NULL_USAGE_ENDS:  # an event's last key: top-level for sure
                head = head.replace(tail, b"}\n\n")
            if _USAGE_KEY in head:  # a usage key elsewhere: only a parse can drop it
                tokens = 0
        if tokens:
            if tokens == 1:  # an engine's read as it generates: one token
                outcome.chunk_times.append(time.perf_counter())
            else:
                outcome.chunk_times.extend([time.perf_counter()] * tokens)
            if not outcome.usage_reported:
                outcome.completion_tokens += tokens
            if end == len(data):
                return head
            return head + _one_by_one(reader, data[end:], job, outcome)
    return _one_by_one(reader, data, job, outcome)


def _one_by_one(reader: SSEReader, data: bytes, job: Job, outcome: Outcome) -> bytes:
    return b"".join([pass_event(e.data, job, outcome) for e in reader.feed(data)])


def pass_event(data: bytes, job: Job, outcome: Outcome) -> bytes:
    """One SSE event's data from the backend: what goes on to the client (b"" for nothing),
    with its token and usage noted in `outcome`."""
    asked = job.req.include_usage
    if not asked and data.endswith(_NULL_USAGE_TAILS):
        # Top-level for sure (it closes the object), so no parse is needed to drop it.
        data = data[:data.rindex(b",")] + b"}"
    try:
        chunk = read_chunk(data)
    except ValueError:  # not JSON: nothing a client could read
        return b""
    if chunk is PLAIN_TOKEN:
        if asked or _USAGE_KEY not in data:  # the common case: passed on without a parse
            _note_token(outcome)
            return encode_event(data)
        chunk = StreamChunk(token=True, body=fastjson.loads(data))  # a usage key to drop
    if chunk.done:
        return DONE
    body = chunk.body
    if body is None:  # JSON, not an object
        return b""
    try:
        return _pass_object(data, body, chunk, asked, outcome)
    except (AttributeError, TypeError, ValueError):  # choices or usage of the wrong shape
        raise ApiError(502, "the engine backend sent a stream event this gateway cannot read "
                       "(its choices or usage are malformed)", code="bad_gateway") from None


def _pass_object(data: bytes, body: dict[str, Any], chunk: StreamChunk, asked: bool,
                 outcome: Outcome) -> bytes:
    usage = chunk.usage
    if usage:
        outcome.prompt_tokens = int(usage.get("prompt_tokens", outcome.prompt_tokens))
        outcome.completion_tokens = int(usage.get("completion_tokens", 0))
        outcome.usage_reported = True
    if chunk.error:
        return sse_json(body)
    choices = body.get("choices")
    if not choices:
        return encode_event(data) if (usage and asked) else b""
    if chunk.token:
        _note_token(outcome)
    reason = choices[0].get("finish_reason")
    if reason:
        outcome.finish_reason = reason
    if "usage" in body and not asked:
        body.pop("usage")
        return sse_json(body)
    return encode_event(data)


def _note_token(outcome: Outcome) -> None:
    """A token event left: its time, and one token more until the engine says the count."""
    outcome.chunk_times.append(time.perf_counter())
    if not outcome.usage_reported:
        outcome.completion_tokens += 1

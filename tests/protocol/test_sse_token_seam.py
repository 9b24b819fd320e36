"""The seam between the three readers of a token stream: the gateway (a remote backend's stream
passed through to the client), the load generator and the shadow sender count the same token
events at the same times on one recorded stream, so their TTFT, ITL and token counts agree.

Each reader gets the recording one network read at a time, the clock (`time.perf_counter`, which
all three stamp with) set to the read's recorded arrival; each request was sent at 0."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from itertools import pairwise
from typing import Any

import pytest

from control.shadow_worker import _Target
from engine.request import SamplingParams
from gateway.backends import Job, Outcome, RemoteBackend
from gateway.config import BackendConfig, ShadowConfig
from protocol.openai import parse_request
from tuner.loadgen import _read_stream
from tuner.report import RequestResult

# Recorded as vLLM streams a chat answer with include_usage: the role chunk ahead of the first
# token (here in a read of its own), an event split across two reads, an empty content for a
# token whose bytes the detokenizer holds back (the first byte of "é"), the finish reason on
# the last token, then the usage chunk and [DONE] in one read.
CHAT: list[tuple[float, bytes]] = [
    (0.050, b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
            b'"logprobs":null,"finish_reason":null}],"usage":null}\n\n'),
    (0.120, b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"content":"Hel"},"logprobs":null,'
            b'"finish_reason":null}],"usage":null}\n\n'),
    (0.140, b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"content":"lo"},"logprobs":null,'
            b'"finish_reason":null}],"usage":null}\n\ndata: {"id":"chatcmpl-1","object":"chat.'),
    (0.160, b'completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":'
            b'{"content":""},"logprobs":null,"finish_reason":null}],"usage":null}\n\n'),
    (0.180, b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"content":"\xc3\xa9"},"logprobs":null,'
            b'"finish_reason":null}],"usage":null}\n\n'),
    (0.200, b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[{"index":0,"delta":{"content":"!"},"logprobs":null,'
            b'"finish_reason":"stop"}],"usage":null}\n\n'),
    (0.210, b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m",'
            b'"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":5,"total_tokens":12}}'
            b'\n\ndata: [DONE]\n\n'),
]
CHAT_STAMPS = [0.120, 0.140, 0.160, 0.180, 0.200]  # "Hel", "lo", "", "é", "!"

# A completions stream as fairgate's engine writes it: spaced JSON is the other spelling, CRLF
# line ends, the bare finish marker after the last token.
COMPLETIONS: list[tuple[float, bytes]] = [
    (0.300, b'data: {"id": "cmpl-2", "choices": [{"index": 0, "text": "a", "logprobs": null, '
            b'"finish_reason": null}]}\r\n\r\n'),
    (0.325, b'data: {"id": "cmpl-2", "choices": [{"index": 0, "text": "", "logprobs": null, '
            b'"finish_reason": null}]}\r\n\r\ndata: {"id": "cmpl-2", "choices": [{"index": 0, '
            b'"text": "b", "logprobs": null, "finish_reason": null}]}\r\n\r\n'),
    (0.350, b'data: {"id": "cmpl-2", "choices": [{"index": 0, "text": "", "logprobs": null, '
            b'"finish_reason": "length"}]}\r\n\r\n'),
    (0.360, b'data: {"id": "cmpl-2", "choices": [], "usage": {"prompt_tokens": 2, '
            b'"completion_tokens": 3, "total_tokens": 5}}\r\n\r\ndata: [DONE]\r\n\r\n'),
]
COMPLETIONS_STAMPS = [0.300, 0.325, 0.325]  # "a", "" and "b" (one read), not the finish marker

RECORDINGS = {"vllm chat": (CHAT, CHAT_STAMPS, 5, "chat"),
              "fairgate completions": (COMPLETIONS, COMPLETIONS_STAMPS, 3, "completions")}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Replay:
    """The recording as a response: what the gateway's and the shadow sender's upstream pool
    return (`next_chunk`) and what the load generator's aiohttp session does (`content`)."""

    status = 200

    def __init__(self, reads: list[tuple[float, bytes]], clock: Clock) -> None:
        self.reads, self.clock = list(reads), clock

    async def next_chunk(self) -> bytes:
        if not self.reads:
            return b""
        self.clock.now, data = self.reads.pop(0)
        return data

    def watch_stalls(self, timeout: float) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def content(self) -> Replay:
        return self

    async def iter_any(self) -> AsyncIterator[bytes]:
        while data := await self.next_chunk():
            yield data


class ReplayHttp:
    """The remote backend's upstream pool, answering every request with the recording."""

    def __init__(self, replay: Replay) -> None:
        self.replay = replay

    async def request(self, *args: Any, **kwargs: Any) -> Replay:
        return self.replay

    def close(self) -> None:
        pass


async def _through_the_gateway(reads: list[tuple[float, bytes]], clock: Clock,
                               endpoint: str) -> tuple[Outcome, list[tuple[float, bytes]]]:
    """The outcome the gateway settles and times the request by, and what its client got."""
    backend = RemoteBackend(BackendConfig("http://engine.test:8000", kind="openai", model="m"),
                            default_max_model_len=2048)
    backend._http = ReplayHttp(Replay(reads, clock))  # type: ignore[assignment]
    body = {"model": "m", "stream": True, "stream_options": {"include_usage": True},
            **({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat"
               else {"prompt": "hi"})}
    job = Job("r1", parse_request(body, endpoint), "acme", "interactive", 2,
              SamplingParams(max_tokens=16))
    outcome = Outcome(prompt_tokens=2)
    client: list[tuple[float, bytes]] = []
    async for data in backend.stream(job, outcome):
        client.append((clock.now, data))
    await backend.close()
    return outcome, client


async def _through_the_load_generator(reads: list[tuple[float, bytes]],
                                      clock: Clock) -> RequestResult:
    result = RequestResult(index=0, tenant="acme", priority=None, scheduled=0.0)
    await _read_stream(Replay(reads, clock), 0.0, result)  # type: ignore[arg-type]
    return result


async def _through_the_shadow_sender(reads: list[tuple[float, bytes]],
                                     clock: Clock) -> tuple[list[float], int | None, Any]:
    """The stamps, the usage's token count, and why the copy failed (None: it did not)."""
    target = _Target(ShadowConfig("s", "http://shadow.test:8000"), lambda target, message: None)
    stamps: list[float] = []
    try:
        tokens, failure = await target._read(Replay(reads, clock), stamps)
    finally:
        await target.close()
    return stamps, tokens, failure


def _stamps(result: RequestResult) -> list[float]:
    assert result.ok and result.ttft is not None, result.error
    stamps = [result.ttft]
    for gap in result.itl:
        stamps.append(stamps[-1] + gap)
    return stamps


@pytest.mark.parametrize("name", RECORDINGS)
async def test_gateway_load_generator_and_shadow_count_the_same_tokens(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reads, expected, completion_tokens, endpoint = RECORDINGS[name]
    clock = Clock()
    monkeypatch.setattr(time, "perf_counter", clock)

    outcome, client = await _through_the_gateway(reads, clock, endpoint)
    loadgen = await _through_the_load_generator(reads, clock)
    shadow_stamps, shadow_tokens, shadow_failure = await _through_the_shadow_sender(reads, clock)
    client_view = await _through_the_load_generator(client, clock)

    assert outcome.chunk_times == pytest.approx(expected)
    assert _stamps(loadgen) == pytest.approx(expected)
    assert shadow_stamps == pytest.approx(expected) and shadow_failure is None
    assert _stamps(client_view) == pytest.approx(expected)  # the pass-through dropped none
    # TTFT and ITL, as each side reports them
    assert outcome.chunk_times[0] == loadgen.ttft == shadow_stamps[0] == client_view.ttft
    gaps = [b - a for a, b in pairwise(expected)]
    assert loadgen.itl == pytest.approx(gaps) and client_view.itl == pytest.approx(gaps)
    # the token count: the engine's usage wherever it was given
    assert outcome.completion_tokens == loadgen.output_tokens == shadow_tokens
    assert outcome.completion_tokens == client_view.output_tokens == completion_tokens
    assert outcome.finish_reason in ("stop", "length")

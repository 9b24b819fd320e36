"""The engine sends a stream in one send per token: the headers and the chat role chunk go with
the first token, and the last token with the rest of the end (the usage, [DONE], the chunked
body's end). A client reads the same events in the same order; a gateway in front reads two
fewer times a stream."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from engine.async_engine import AsyncEngine
from engine.server import make_app
from tests.support.engines import sim_config
from tests.support.sends import record_sends

MakeClient = Callable[..., Awaitable[TestClient[web.Request, web.Application]]]


def _events(sends: list[bytes]) -> list[list[Any]]:
    """The SSE events of each send (the chunked framing and the headers left out)."""
    out = []
    for data in sends:
        lines = [line for line in data.split(b"\n") if line.startswith(b"data: ")]
        out.append(["[DONE]" if line.strip() == b"data: [DONE]" else json.loads(line[6:])
                    for line in lines])
    return out


@pytest.mark.parametrize("chat", [True, False])
async def test_a_stream_goes_in_one_send_per_token(aiohttp_client: MakeClient,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   chat: bool) -> None:
    client = await aiohttp_client(make_app(AsyncEngine(sim_config())))
    sends = record_sends(monkeypatch)
    body: dict[str, Any] = {"model": "random:tiny", "max_tokens": 4, "stream": True,
                            "stream_options": {"include_usage": True}}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    resp = await client.post("/v1/chat/completions" if chat else "/v1/completions", json=body)
    received = await resp.read()
    assert resp.status == 200
    (server,) = sends.values()  # the one connection the server accepted, send by send
    assert server[0].startswith(b"HTTP/1.1 200")
    events = _events(server)
    texts = [[c["delta"].get("content") if chat else c["text"] for c in e["choices"]]
             for send in events for e in send if e != "[DONE]" and e["choices"]]
    tokens = [t for t in texts if t != [""]]  # the role chunk's empty content aside
    assert len(server) == len(tokens) == 4  # a send per token, and nothing else alone
    first, last = events[0], events[-1]
    if chat:  # the role chunk opens the first send, before the first token
        assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        first = first[1:]
    assert len(first) == 1 and first[0]["choices"][0]["finish_reason"] is None
    assert last[0]["choices"][0]["finish_reason"] == "length"
    assert last[1]["choices"] == [] and last[1]["usage"]["completion_tokens"] == 4
    assert last[2:] == ["[DONE]"] and server[-1].endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert b"".join(server).count(b"data: ") == received.count(b"data: ")

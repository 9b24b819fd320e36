"""Property-based fuzzing of the HTTP API: whatever arrives, the answer is never a 500 and an
error is always OpenAI's JSON shape."""

from __future__ import annotations

import http.client
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.helpers import ServerThread


def texts(max_size: int) -> st.SearchStrategy[str]:
    """Text, sometimes with lone surrogates (JSON escapes them as \\ud800): unencodable."""
    return st.text(max_size=max_size) | st.text(
        alphabet=st.characters(categories=["Cs", "L", "N"]), max_size=max_size)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | texts(30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)

fields = {
    "model": st.sampled_from(["random:tiny", "nope", ""]) | json_values,
    "prompt": texts(60) | json_values,
    "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "bot"]), "content": texts(20)
         | json_values}), max_size=3) | json_values,
    "max_tokens": st.integers(-5, 3000) | json_values,
    "stream": st.booleans() | json_values,
    "temperature": st.floats(-1, 3) | json_values,
    "top_p": st.floats(0, 1) | json_values,
    "stop": st.lists(st.text(max_size=3), max_size=3) | json_values,
    "n": st.integers(0, 3),
    "priority": st.sampled_from(["interactive", "batch", "urgent"]),
    "stream_options": json_values,
    "min_tokens": st.integers(-1, 20),
    "seed": st.integers(-2**64, 2**64),
}
bodies = st.fixed_dictionaries({}, optional=fields)
raw_bodies = st.binary(max_size=200) | st.just(b'{"model": "random:tiny", "prompt": "' +
                                               b"x" * 5000 + b'"}')


def _send(server: ServerThread, key: str, path: str, data: bytes) -> tuple[int, bytes, str]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.request("POST", path, body=data, headers={"Authorization": f"Bearer {key}",
                                                       "Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp.getheader("Content-Type", "")
    finally:
        conn.close()


def _check(status: int, body: bytes, content_type: str) -> None:
    assert status != 500 and status < 600, body[:300]
    if status >= 400:
        err = json.loads(body)["error"]
        assert isinstance(err["message"], str) and err["type"]
    elif content_type.startswith("text/event-stream"):
        assert body.endswith(b"data: [DONE]\n\n")
    else:
        assert json.loads(body)["choices"]


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=bodies, chat=st.booleans())
def test_fuzzed_bodies_never_500(served_gateway: tuple[ServerThread, str], body: dict[str, Any],
                                 chat: bool) -> None:
    server, key = served_gateway
    path = "/v1/chat/completions" if chat else "/v1/completions"
    _check(*_send(server, key, path, json.dumps(body).encode()))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=raw_bodies, chat=st.booleans())
def test_raw_bytes_never_500(served_gateway: tuple[ServerThread, str], data: bytes,
                             chat: bool) -> None:
    server, key = served_gateway
    _check(*_send(server, key, "/v1/chat/completions" if chat else "/v1/completions", data))

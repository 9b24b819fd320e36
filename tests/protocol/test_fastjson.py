"""protocol.fastjson against the standard library: the same value, or the same error, always."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import fastjson
from protocol.openai import parse_json_body

_FLOATS = st.floats(allow_nan=True, allow_infinity=True)
_INTS = st.one_of(st.integers(-(2**70), 2**70), st.integers(-1000, 1000))
_TEXT = st.text(st.characters(codec=None))  # every code point, lone surrogates among them
_SCALARS = st.one_of(st.none(), st.booleans(), _INTS, _FLOATS, _TEXT)
VALUES = st.recursive(_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(_TEXT, inner, max_size=4)), max_leaves=20)


def same(a: Any, b: Any) -> bool:
    """Equal as JSON values, type for type (1 is not 1.0 nor True) and NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def outcome(read: Any, raw: bytes) -> tuple[str, Any]:
    try:
        return "value", read(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeError among them
        return type(exc).__name__, str(exc)


def assert_reads_alike(raw: bytes) -> None:
    fast, std = outcome(fastjson.loads, raw), outcome(json.loads, raw)
    assert fast[0] == std[0], (raw, fast, std)
    assert same(fast[1], std[1]), (raw, fast, std)


@settings(max_examples=400)
@given(VALUES, st.booleans(), st.sampled_from([None, 1]))
def test_loads_reads_any_json_as_the_standard_library(value: Any, ascii_only: bool,
                                                      indent: int | None) -> None:
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    assert_reads_alike(text.encode("utf-8", "surrogatepass"))


@settings(max_examples=400)
@given(VALUES, st.data())
def test_loads_reads_broken_json_as_the_standard_library(value: Any, data: st.DataObject) -> None:
    raw = bytearray(json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    at = data.draw(st.integers(0, len(raw)))
    raw[at:at + data.draw(st.integers(0, 3))] = data.draw(st.binary(max_size=3))
    assert_reads_alike(bytes(raw))


@pytest.mark.parametrize("raw", [
    b'{"a": 123456789012345678901234567890}',  # orjson: a float; Python: exact
    b'{"a": -9223372036854775809}', b'{"a": 18446744073709551615}',
    b'{"a": NaN, "b": -Infinity}', b'{"a": 1e400}', b'{"a": "\\ud800"}',
    b'\xef\xbb\xbf{"a": 1}', b'{"a": "\xff"}', b"[" * 2000 + b"]" * 2000, b"", b"{",
    b'{"a": "\\u00e9 \xc3\xa9", "b": [1.5, -0.0, 1E5, true, null]}',
    '"\u00e9"'.encode("utf-16"),  # json.loads guesses the encoding of bytes; orjson refuses
])
def test_loads_edges(raw: bytes) -> None:
    assert_reads_alike(raw)


@settings(max_examples=400)
@given(VALUES)
def test_dumps_writes_the_standard_librarys_value(value: Any) -> None:
    try:
        expected = json.loads(json.dumps(value))
    except RecursionError:
        return
    out = fastjson.dumps(value)
    assert isinstance(out, bytes) and b"\n" not in out
    assert same(json.loads(out), expected)


@pytest.mark.parametrize("value", [
    {"a": math.nan}, {"a": [math.inf, -math.inf]}, {"a": 2**64}, {1: "a"}, {"a": "\ud800"},
    {"a": None, "b": 1e-05},
])
def test_dumps_edges(value: Any) -> None:
    """orjson writes NaN and the infinities as null and refuses the rest: the standard
    library's JSON, which keeps them, is what goes."""
    assert same(json.loads(fastjson.dumps(value)), json.loads(json.dumps(value)))


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"prompt": "\xff"}', "not valid UTF-8"),
    ('{"a": 1}'.encode("utf-16"), "not valid UTF-8"),  # UTF-8 only, never a guessed encoding
    (b'\xef\xbb\xbf{"a": 1}', "not valid JSON: Unexpected UTF-8 BOM"),
    (b"{not json", "not valid JSON: Expecting property name"),
    (b'{"prompt": "\\ud800"}', "not valid Unicode"),
    (b"[1]", "must be a JSON object"),
])
def test_request_bodies_keep_their_errors(raw: bytes, message: str) -> None:
    with pytest.raises(Exception, match=message) as caught:
        parse_json_body(raw)
    assert getattr(caught.value, "status", None) == 400


def test_request_body_with_a_long_integer_keeps_it_exact() -> None:
    """orjson would read it as a float: the body goes by the standard library."""
    body = parse_json_body(b'{"seed": 123456789012345678901234567890, "n": 1.5}')
    assert body == {"seed": 123456789012345678901234567890, "n": 1.5}
    assert type(body["seed"]) is int


_PLAIN_SCALARS = st.one_of(st.none(), st.booleans(), _INTS, _TEXT)
PLAIN_VALUES = st.recursive(_PLAIN_SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(_TEXT, inner, max_size=4)), max_leaves=20)


def standard_plain(value: Any) -> tuple[str, Any]:
    try:
        return "bytes", json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()
    except (UnicodeError, RecursionError) as exc:
        return "error", type(exc).__name__


@settings(max_examples=500)
@given(PLAIN_VALUES)
def test_dumps_plain_writes_the_standard_librarys_bytes(value: Any) -> None:
    """Without floats, byte for byte: control characters, quotes, U+2028, characters past the
    BMP, lone surrogates (an error either way), integers past 64 bits."""
    try:
        fast: tuple[str, Any] = ("bytes", fastjson.dumps_plain(value))
    except (UnicodeError, RecursionError) as exc:
        fast = ("error", type(exc).__name__)
    assert fast == standard_plain(value)


@settings(max_examples=300)
@given(st.text(st.characters(codec="utf-8")), st.sampled_from([None, "stop", "length"]),
       st.booleans(), st.booleans(), st.integers(0, 2**40), st.text(max_size=20))
def test_stream_events_are_the_standard_librarys_bytes(text: str, finish: str | None,
                                                        chat: bool, include_usage: bool,
                                                        tokens: int, model: str) -> None:
    """What an engine streams (ResponseWriter) and an error event: the bytes sse_json wrote."""
    from protocol.errors import bad_request
    from protocol.openai import ResponseWriter, error_event
    from protocol.sse import sse_json

    writer = ResponseWriter("req-1", chat, model, include_usage)
    for event in (writer.chunk(text, finish), writer.role_chunk(),
                  writer.usage_chunk(tokens, tokens + 1)):
        if event:
            assert event == sse_json(json.loads(event[len(b"data: "):]))
    error = bad_request(text or "x", "messages")
    assert error_event(error) == sse_json(error.body())

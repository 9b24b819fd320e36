"""protocol.sse against the WHATWG rules: random streams with random line ends and random read
boundaries, plus one table test per rule (several from the spec's own examples)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.sse import DONE, SSEEvent, SSEReader, encode_event, sse_json

BOM = b"\xef\xbb\xbf"


def read(*chunks: bytes) -> list[SSEEvent]:
    reader = SSEReader()
    events = [e for chunk in chunks for e in reader.feed(chunk)]
    return events + reader.close()


def per_feed(*chunks: bytes) -> list[list[bytes]]:
    """The data of the events each feed returned."""
    reader = SSEReader()
    return [[e.data for e in reader.feed(chunk)] for chunk in chunks]


# --- the property test: what was written is what is read ------------------------------------

# Field values: any text without line ends (NUL is fine in data, never in ids).
_value = st.text(st.characters(blacklist_characters="\r\n", codec="utf-8"), max_size=12)
_name = st.text(st.characters(blacklist_characters="\r\n:", codec="utf-8"), max_size=6)


@dataclass
class Written:
    """One event as a list of lines (no line ends yet) and what a reader must report for it."""

    lines: list[bytes]
    data: list[bytes]  # its data lines; none = nothing is dispatched
    event: bytes
    id: bytes | None  # the id field it sets, None = it sets none


@st.composite
def written_events(draw: st.DrawFn) -> Written:
    data = [v.encode() for v in draw(st.lists(_value, max_size=3))]
    event = draw(_name).encode() if draw(st.booleans()) else None
    ident = draw(_value.filter(lambda v: "\0" not in v)).encode() if draw(st.booleans()) else None
    fields = [(b"data", v) for v in data]
    if event is not None:
        fields.insert(draw(st.integers(0, len(fields))), (b"event", event))
    if ident is not None:
        fields.insert(draw(st.integers(0, len(fields))), (b"id", ident))
    lines = []
    for name, value in fields:
        if draw(st.booleans()):
            lines.append(b":" + draw(_value).encode())  # a comment
        if value == b"" and draw(st.booleans()):
            lines.append(name)  # no colon: an empty value
        elif value[:1] == b" " or draw(st.booleans()):
            lines.append(name + b": " + value)
        else:
            lines.append(name + b":" + value)  # the optional space left out
    lines += [b""] * draw(st.integers(1, 3))  # the blank line, sometimes more
    return Written(lines, data, event or b"", ident)


def expected(written: list[Written]) -> list[SSEEvent]:
    events, last_id = [], None
    for w in written:
        last_id = w.id if w.id is not None else last_id
        if w.data:
            events.append(SSEEvent(b"\n".join(w.data), w.event or b"message", last_id))
    return events


def serialise(lines: list[bytes], ends: list[bytes]) -> bytes:
    out, previous = [], b""
    for line, end in zip(lines, ends, strict=True):
        if previous == b"\r" and not line and end == b"\n":
            end = b"\r\n"  # CR then an empty LF line would be one CRLF: a different stream
        out += [line, end]
        previous = end
    return b"".join(out)


@settings(max_examples=200, deadline=None)
@given(
    written=st.lists(written_events(), max_size=8),
    unfinished=st.lists(_value.map(lambda v: b"data: " + v.encode()), max_size=2),
    bom=st.booleans(),
    data=st.data(),
)
def test_random_streams_read_back_exactly(
    written: list[Written], unfinished: list[bytes], bom: bool, data: st.DataObject
) -> None:
    lines = [line for w in written for line in w.lines] + unfinished
    ends = data.draw(
        st.lists(st.sampled_from([b"\r\n", b"\n", b"\r"]), min_size=len(lines), max_size=len(lines))
    )
    stream = (BOM if bom else b"") + serialise(lines, ends)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    assert read(*chunks) == expected(written)  # the unfinished event is discarded at EOF


@settings(max_examples=200, deadline=None)
@given(payload=st.binary(max_size=64), cuts=st.lists(st.integers(0, 200), max_size=6))
def test_encode_event_round_trips(payload: bytes, cuts: list[int]) -> None:
    wire = encode_event(payload)
    assert wire.endswith(b"\n\n") and b"\r" not in wire
    points = sorted(min(c, len(wire)) for c in cuts)
    chunks = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]
    # SSE cannot carry a CR: each CR or CRLF in the payload comes back as one LF
    assert read(*chunks) == [SSEEvent(payload.replace(b"\r\n", b"\n").replace(b"\r", b"\n"))]


# --- one table per rule ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chunks", "events"),
    [
        ((b"data: a\r", b"\ndata: b\r\n\r\n"), [[], [b"a\nb"]]),  # CR|LF is one line end
        ((b"data: a\r", b"\r"), [[], [b"a"]]),  # CR CR: a line end, then a blank line
        ((b"data: a\r", b"\n", b"\n"), [[], [], [b"a"]]),  # CRLF then LF
        ((b"data: a\r", b"", b"\n\r\n"), [[], [], [b"a"]]),  # an empty read keeps the CR
        ((b"data: a\n\r", b"\ndata: b\n\n"), [[b"a"], [b"b"]]),  # LF CR|LF: the CRLF is blank
        ((b"data: a\r\n\r\n",), [[b"a"]]),
        ((b"data: a\r\rdata: b\n\n",), [[b"a", b"b"]]),
        ((b"data: a\n", b"\n"), [[], [b"a"]]),  # the blank line alone in the next read
        ((b"data: a", b"\n", b"data: b\n", b"\n"), [[], [], [], [b"a\nb"]]),
    ],
)
def test_line_ends_across_reads(chunks: tuple[bytes, ...], events: list[list[bytes]]) -> None:
    assert per_feed(*chunks) == events


def test_mixed_line_ends_byte_by_byte() -> None:
    stream = b"event: e\r\ndata: x\rdata: \xe2\x82\xac\n\r\ndata: y\r\r"
    expect = [SSEEvent(b"x\n\xe2\x82\xac", b"e"), SSEEvent(b"y")]
    assert read(*[stream[i : i + 1] for i in range(len(stream))]) == expect
    assert read(stream) == expect


@pytest.mark.parametrize(
    ("chunks", "data"),
    [
        ((BOM + b"data: x\n\n",), [b"x"]),
        ((b"\xef", b"\xbb", b"\xbfdata: x\n\n"), [b"x"]),  # a BOM split across reads
        ((BOM + BOM + b"data: x\n\ndata: y\n\n",), [b"y"]),  # one BOM only: "\ufeffdata" is a field
        ((b"data: x\n\n" + BOM + b"data: y\n\n",), [b"x"]),  # not at the start: part of a name
        ((b"\xef\xbbdata: x\n\n",), []),  # a BOM's start is not a BOM
    ],
)
def test_a_leading_bom_is_ignored(chunks: tuple[bytes, ...], data: list[bytes]) -> None:
    assert [e.data for e in read(*chunks)] == data


@pytest.mark.parametrize(
    ("stream", "data"),
    [
        (b"data:test\n\n", [b"test"]),  # the spec's example: these two are the same event
        (b"data: test\n\n", [b"test"]),
        (b"data:  test\n\n", [b" test"]),  # one space only
        (b"data:\n\n", [b""]),
        (b"data\n\n", [b""]),  # no colon: a field name with an empty value
        (b"data\n\ndata\ndata\n\ndata:", [b"", b"\n"]),  # the spec's example; the last is cut off
        (b"data: YHOO\ndata: +2\ndata: 10\n\n", [b"YHOO\n+2\n10"]),  # multi-line data
        (b"data: a:b: c\n\n", [b"a:b: c"]),  # only the first colon separates
        (b": keep-alive\n\n:\n\n", []),  # comments
        (b"data: x\n: note\ndata: y\n\n", [b"x\ny"]),
        (b"\n\n\n", []),  # blank lines with no data dispatch nothing
        (b"event: e\nid: 1\n\n", []),
        (b"Data: x\n\ndata : x\n\nfoo: x\n\n", []),  # names are exact; unknown ones ignored
    ],
)
def test_field_rules(stream: bytes, data: list[bytes]) -> None:
    assert [e.data for e in read(stream)] == data


def test_event_and_id_fields() -> None:
    stream = (
        b"event: add\nid: 7\ndata: a\n\n"
        b"data: b\n\n"  # the type resets to message, the last event ID carries over
        b"event: skip\n\ndata: c\n\n"  # a type with no data is dropped with its event
        b"id: 8\0\ndata: d\n\n"  # an id with NUL is ignored
        b"id\nevent\ndata: e\n\n"  # empty id: reset to b""; empty type: message
    )
    assert read(stream) == [
        SSEEvent(b"a", b"add", b"7"),
        SSEEvent(b"b", b"message", b"7"),
        SSEEvent(b"c", b"message", b"7"),
        SSEEvent(b"d", b"message", b"7"),
        SSEEvent(b"e", b"message", b""),
    ]
    assert read(b"data: x\n\n") == [SSEEvent(b"x", b"message", None)]


def test_retry_field() -> None:
    reader = SSEReader()
    reader.feed(b"retry: 1500\n\nretry: 2x\n\nretry: -1\n\n")
    assert reader.retry == 1500


@pytest.mark.parametrize("stream", [b"data: x", b"data: x\n", b"data: x\r", b"data: x\r\n"])
def test_an_unfinished_event_is_discarded_at_eof(stream: bytes) -> None:
    reader = SSEReader()
    assert reader.feed(stream) == []
    assert reader.close() == []
    assert reader.feed(b"data: y\n\n") == [SSEEvent(b"y")]  # a fresh stream after close


def test_encode_event() -> None:
    assert encode_event(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert encode_event(b"a\nb\r\nc") == b"data: a\ndata: b\ndata: c\n\n"
    assert encode_event(b"") == b"data: \n\n"
    assert read(encode_event(b"line1\n\nline3\n")) == [SSEEvent(b"line1\n\nline3\n")]
    assert read(DONE) == [SSEEvent(b"[DONE]")]


def test_sse_json() -> None:
    obj = {"text": 'a\nb\r\u20ac "q"', "n": [1, None]}
    wire = sse_json(obj)
    assert wire == encode_event(json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode())
    assert "€".encode() in wire and wire.count(b"\n") == 2
    [event] = read(wire)
    assert json.loads(event.data) == obj


def test_events_are_frozen() -> None:
    event = SSEEvent(b"x")
    with pytest.raises(AttributeError):
        event.data = b"y"  # type: ignore[misc]

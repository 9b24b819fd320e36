"""A remote engine's stream event the gateway cannot read (choices or usage of the wrong shape)
is a 502 in OpenAI's error shape, which the relay sends as the stream's error event, not an
exception that ends the stream as a 500."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.request import SamplingParams
from gateway.backends import Job, Outcome
from gateway.backends.stream import pass_chunk, pass_event
from protocol.errors import ApiError
from protocol.openai import ResponseWriter, parse_request
from protocol.sse import SSEReader


def _job() -> Job:
    req = parse_request({"model": "m", "prompt": "hi", "stream": True}, "completions")
    return Job("r1", req, "acme", "interactive", 2, SamplingParams(max_tokens=16))


@pytest.mark.parametrize("event", [
    {"choices": "oops"},
    {"choices": [7]},
    {"choices": [{"text": "a"}], "usage": {"prompt_tokens": "many", "completion_tokens": 1}},
    {"choices": [], "usage": {"completion_tokens": [1]}},
])
def test_a_malformed_event_is_a_bad_gateway(event: dict[str, object]) -> None:
    with pytest.raises(ApiError) as raised:
        pass_event(json.dumps(event).encode(), _job(), Outcome(prompt_tokens=2))
    assert raised.value.status == 502 and raised.value.code == "bad_gateway"


def test_a_well_formed_event_passes_and_counts_its_token() -> None:
    outcome = Outcome(prompt_tokens=2)
    out = pass_event(json.dumps({"choices": [{"text": "a", "finish_reason": None}]}).encode(),
                     _job(), outcome)
    assert out.startswith(b"data: ") and outcome.completion_tokens == 1


# ---- a whole read at once (pass_chunk) against its events one by one (pass_event) -------------
def _text() -> st.SearchStrategy[str]:
    # generated text that looks like the keys the byte checks search for, and quotes, escapes,
    # line ends and non-ASCII
    return st.lists(st.sampled_from([
        "tok", " ", "\"", "\\", "\n", "\r", "é", "😀", '"finish_reason":null', '"usage": {',
        '"error"', ',"usage":null}', '"content": "x', "data: "]), max_size=4).map("".join)


def _event(kind: str, text: str, spaced: bool, null_usage: bool, chat: bool) -> bytes:
    if kind == "done":
        return b"data: [DONE]\n\n"
    if kind == "comment":
        return b": keep-alive\n\n"
    if kind == "not-json":
        return b"data: {oops\n\n"
    counts = {"prompt_tokens": 3, "completion_tokens": 7, "total_tokens": 10}
    if kind == "usage":
        body: dict[str, object] = {"choices": [], "usage": counts}
    elif kind == "error":
        body = {"error": {"message": text, "type": "server_error"}}
    else:
        reason = "length" if kind == "finish" else None
        if chat:
            delta = {"role": "assistant", "content": ""} if kind == "role" else (
                {} if kind == "finish" else {"content": text or "t"})
            choice: dict[str, object] = {"index": 0, "delta": delta, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": "" if kind == "finish" else text or "t",
                      "finish_reason": reason}
        body = {"id": "x", "object": "chunk", "choices": [choice]}
        if kind == "token+usage":  # continuous usage stats: counts on every token
            body["usage"] = counts
        elif kind == "usage-first":  # a null usage that is not the object's last key
            body = {"usage": None, **body}
        elif null_usage:
            body["usage"] = None
    payload = json.dumps(body, ensure_ascii=False,
                         separators=(", ", ": ") if spaced else (",", ":")).encode()
    if kind == "two-lines":  # one event's JSON over two data lines (joined with LF)
        payload = payload.replace(b",", b",\ndata: ", 1)
    return b"data: " + payload + b"\n\n"


_EVENT = st.builds(
    _event, st.sampled_from(["token"] * 24 + ["token+usage", "usage-first", "two-lines"] * 2 + [
        "finish", "role", "usage", "error", "done", "comment", "not-json"]),
    _text(), st.booleans(), st.booleans(), st.booleans())
_LINE_ENDS = st.sampled_from([b"\n"] * 12 + [b"\r\n", b"\r"])


@settings(max_examples=300)
@given(reads=st.lists(st.tuples(st.lists(st.tuples(_EVENT, _LINE_ENDS), min_size=1, max_size=4),
                                st.none() | st.integers(0, 2000)), min_size=1, max_size=6),
       asked=st.booleans(), bom=st.booleans())
def test_a_read_at_once_gives_what_its_events_one_by_one_give(
        reads: list[tuple[list[tuple[bytes, bytes]], int | None]], asked: bool,
        bom: bool) -> None:
    """Reads of whole events (most of them), some cut once more anywhere; line ends LF, CRLF
    or CR per event; the stream opened with a UTF-8 BOM or not."""
    pieces = [b"\xef\xbb\xbf"] if bom else []
    for events, cut in reads:
        data = b"".join(event.replace(b"\n", end) for event, end in events)
        if cut is None:
            pieces.append(data)
        else:
            pieces += [data[: cut % (len(data) + 1)], data[cut % (len(data) + 1):]]
    req = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         "stream": True, "stream_options": {"include_usage": asked}}, "chat")
    job = Job("r1", req, "acme", "interactive", 2, SamplingParams(max_tokens=16))
    whole, single = Outcome(prompt_tokens=2), Outcome(prompt_tokens=2)
    fast_reader, slow_reader = SSEReader(), SSEReader()
    for data in pieces:
        fast = pass_chunk(fast_reader, data, job, whole)
        slow = b"".join([pass_event(e.data, job, single) for e in slow_reader.feed(data)])
        assert fast == slow
        assert len(whole.chunk_times) == len(single.chunk_times)
        assert (whole.completion_tokens, whole.prompt_tokens, whole.usage_reported,
                whole.finish_reason) == (single.completion_tokens, single.prompt_tokens,
                                         single.usage_reported, single.finish_reason)


def test_a_read_of_plain_tokens_goes_on_as_it_came(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast way is taken (the read comes back as the same object) for a read of plain token
    events, with each event's null usage dropped when the client did not ask for usage."""
    token = _event("token", "tok", False, False, True)
    reader = SSEReader()
    read = token * 3
    outcome = Outcome(prompt_tokens=2)
    with monkeypatch.context() as patched:  # no event is read one by one
        patched.setattr("gateway.backends.stream.pass_event", None)
        assert pass_chunk(reader, read, _job(), outcome) is read
        assert outcome.completion_tokens == 3 and len(outcome.chunk_times) == 3
        with_null = _event("token", "tok", False, True, True)
        assert pass_chunk(reader, with_null * 2, _job(), outcome) == token * 2


def test_a_read_that_ends_an_event_begun_before_it_is_read_event_by_event() -> None:
    """A read can look like whole plain token events and still be the last line of an event the
    reader holds the start of: the reader decides, not the regular expression."""
    event = _event("two-lines", "tok", False, False, True)
    head, _, rest = event.partition(b"\n")
    fast_reader, slow_reader = SSEReader(), SSEReader()
    whole, single = Outcome(prompt_tokens=2), Outcome(prompt_tokens=2)
    for data in (_event("role", "", False, False, True), head + b"\n", rest):
        fast = pass_chunk(fast_reader, data, _job(), whole)
        slow = b"".join([pass_event(e.data, _job(), single) for e in slow_reader.feed(data)])
        assert fast == slow
    assert fast == event and whole.completion_tokens == single.completion_tokens == 1


@pytest.mark.parametrize("chat", [True, False])
def test_a_fairgate_engines_tokens_go_the_fast_way(chat: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The seam with fairgate's own engine: its token events (ResponseWriter, asked for usage
    as the gateway always asks) are the plain tokens the regular expression knows, so a
    change to how the engine writes them that loses the fast way fails here."""
    engine = ResponseWriter("r1", chat, "m", include_usage=True)
    read = b"".join(engine.chunk(text, None) for text in ("Hel", "lo", " wor", "ld"))
    outcome = Outcome(prompt_tokens=2)
    single = Outcome(prompt_tokens=2)
    expected = b"".join([pass_event(e.data, _job(), single) for e in SSEReader().feed(read)])
    with monkeypatch.context() as patched:
        patched.setattr("gateway.backends.stream.pass_event", None)
        assert pass_chunk(SSEReader(), read, _job(), outcome) == expected
    assert outcome.completion_tokens == single.completion_tokens == 4
    assert b'"usage"' not in expected  # the client did not ask: each null usage dropped

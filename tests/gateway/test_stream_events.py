"""A remote engine's stream event the gateway cannot read (choices or usage of the wrong shape)
is a 502 in OpenAI's error shape, which the relay sends as the stream's error event, not an
exception that ends the stream as a 500."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import protocol.sse
from engine.request import SamplingParams
from gateway.backends import Job, Outcome
from gateway.backends.stream import pass_chunk, pass_event
from protocol.errors import ApiError
from protocol.openai import ResponseWriter, parse_request
from protocol.sse import PLAIN_TOKEN, PlainTokens, SSEReader, is_token_chunk, read_chunk


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
        '"error"', ',"usage":null}', '"content": "x', "data: ", "error", "usage"]),
        max_size=4).map("".join)


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


_KINDS = ["token"] * 24 + ["token+usage", "usage-first", "two-lines"] * 2 + [
    "finish", "role", "usage", "error", "done", "comment", "not-json"]
_EVENT = st.builds(_event, st.sampled_from(_KINDS), _text(), st.booleans(), st.booleans(),
                   st.booleans())
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
    fast_reader, slow_reader, plain = SSEReader(), SSEReader(), PlainTokens()
    for data in pieces:
        fast = pass_chunk(fast_reader, plain, data, job, whole)
        slow = b"".join([pass_event(e.data, job, single) for e in slow_reader.feed(data)])
        assert fast == slow
        assert len(whole.chunk_times) == len(single.chunk_times)
        assert (whole.completion_tokens, whole.prompt_tokens, whole.usage_reported,
                whole.finish_reason) == (single.completion_tokens, single.prompt_tokens,
                                         single.usage_reported, single.finish_reason)


# Not JSON: raw bytes where a token event's text goes, the template's edges around them. The
# byte checks read no JSON, so the fast way must tell these apart as read_chunk does.
_RAW_TEXTS = ['a", "usage": {"x": "b', 'a", "error": "b', 'a"b', "a\nb", "a\rb", "a\n\ndata: b",
              "", "a\\", "\\", 'a", "finish_reason": "stop', "error", "usage"]


def _raw_event(raw: str, spaced: bool, null_usage: bool, chat: bool) -> bytes:
    return _event("token", "\0", spaced, null_usage, chat).replace(b"\\u0000", raw.encode())


def _stream_events(form: tuple[bool, bool, bool]) -> st.SearchStrategy[list[bytes]]:
    """An engine's stream: every event in one format, most texts plain words, some as in
    `_text`, a few raw bytes."""
    text = st.one_of(st.sampled_from(["tok", " a", "b c", "é", "\n", "x\n", "\t", "a\\"]),
                     _text())
    event = st.builds(_event, st.sampled_from(_KINDS), text, *map(st.just, form))
    raw = st.builds(_raw_event, st.sampled_from(_RAW_TEXTS), *map(st.just, form))
    return st.lists(st.one_of(*[event] * 6, raw), min_size=1, max_size=24)


_STREAM_EVENTS = st.tuples(st.booleans(), st.booleans(), st.booleans()).flatmap(_stream_events)


@settings(max_examples=300)
@given(events=_STREAM_EVENTS, cuts=st.lists(st.integers(0, 6000), max_size=3),
       asked=st.booleans())
def test_a_stream_in_one_format_read_at_once_gives_its_events_one_by_one(
        events: list[bytes], cuts: list[int], asked: bool) -> None:
    """As above, with every event of the stream written alike (an engine's way), so most plain
    tokens are the same template around another text: the way the bulk of a stream goes."""
    stream = b"".join(events)
    bounds = sorted({0, len(stream), *(cut % (len(stream) + 1) for cut in cuts)})
    req = parse_request({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                         "stream": True, "stream_options": {"include_usage": asked}}, "chat")
    job = Job("r1", req, "acme", "interactive", 2, SamplingParams(max_tokens=16))
    whole, single = Outcome(prompt_tokens=2), Outcome(prompt_tokens=2)
    fast_reader, slow_reader, plain = SSEReader(), SSEReader(), PlainTokens()
    for start, stop in itertools.pairwise(bounds):
        data = stream[start:stop]
        fast = pass_chunk(fast_reader, plain, data, job, whole)
        slow = b"".join([pass_event(e.data, job, single) for e in slow_reader.feed(data)])
        assert fast == slow
    assert len(whole.chunk_times) == len(single.chunk_times)
    assert (whole.completion_tokens, whole.usage_reported, whole.finish_reason) == (
        single.completion_tokens, single.usage_reported, single.finish_reason)


def _a_plain_token(event: bytes) -> bool:
    """What the fast way may call a plain token: one `data: ` line whose JSON is a token with
    no usage counts and no error to read."""
    if not _one_data_line(event):
        return False
    try:
        body = json.loads(event[6:])
    except ValueError:
        return False
    return (isinstance(body, dict) and "error" not in body
            and not isinstance(body.get("usage"), dict) and is_token_chunk(body))


@settings(max_examples=300)
@given(streams=st.lists(_STREAM_EVENTS, min_size=1, max_size=3))
def test_plain_tokens_are_the_longest_run_of_tokens_a_read_opens_with(
        streams: list[list[bytes]]) -> None:
    """`PlainTokens.prefix` directly, read after read on one recogniser (its template carried
    over): the events it takes are what `read_chunk` calls plain tokens (or, for a text of
    exactly `error`, a token with nothing to read that it parses to be sure), and the event
    after them is one that `read_chunk` would not call a plain token."""
    plain = PlainTokens()
    for events in streams:
        end, count = plain.prefix(b"".join(events))
        assert end == sum(len(event) for event in events[:count])
        assert all(_read_as_plain(event[:-2]) or _a_plain_token(event[:-2])
                   for event in events[:count])
        if count < len(events):
            assert not _read_as_plain(events[count][:-2])


def _one_data_line(event: bytes) -> bool:
    return event.startswith(b"data: ") and b"\n" not in event and b"\r" not in event


def _read_as_plain(event: bytes) -> bool:
    if not _one_data_line(event):
        return False
    try:
        return read_chunk(event[6:]) is PLAIN_TOKEN
    except ValueError:  # not JSON
        return False


def test_no_template_from_an_open_choice_across_the_text() -> None:
    """Not JSON, but read_chunk's plain token: the open choice begins at the text's opening
    quote. The same bytes around another text hold no open choice, so they are no template."""
    first = b'data: {"choices":[{"text":"finish_reason":null}]}'
    second = b'data: {"choices":[{"text":"abc":null}]}'
    assert _read_as_plain(first) and not _read_as_plain(second)
    assert PlainTokens().prefix(first + b"\n\n" + second + b"\n\n") == (len(first) + 2, 1)


def test_the_bulk_of_a_read_is_told_by_the_template(monkeypatch: pytest.MonkeyPatch) -> None:
    """One full check for a read of sixteen tokens from one engine (the rest are its template
    around other texts), and none for the next read of the same stream; the fourteen between
    the first and the last are told at once, not one by one."""
    checked = _count_full_checks(monkeypatch)
    templated: list[int] = []
    one_by_one = PlainTokens._templated

    def counted(self: PlainTokens, data: bytes, end: int, cut: int) -> bool:
        templated.append(end)
        return one_by_one(self, data, end, cut)

    monkeypatch.setattr(PlainTokens, "_templated", counted)
    engine = ResponseWriter("r1", True, "m", include_usage=True)
    plain = PlainTokens()
    read = b"".join(engine.chunk(f" word{i}", None) for i in range(16))
    assert plain.prefix(read + engine.chunk("", "stop")) == (len(read), 16)
    assert len(checked) == 2  # the first token, and the finish event that ends the run
    assert len(templated) == 3  # the first, the last token, the finish event
    assert plain.prefix(read) == (len(read), 16) and len(checked) == 2 and plain._misses == 0


@pytest.mark.parametrize("raw", _RAW_TEXTS)
@pytest.mark.parametrize("spaced", [True, False])
def test_raw_bytes_in_a_templates_text_are_told_as_read_chunk_tells_them(raw: str,
                                                                        spaced: bool) -> None:
    """A template learned, then an event that is its head and tail around raw bytes (not
    JSON): alone in a read, and in the middle of a read of template events. The run of plain
    tokens ends where read_chunk's does (the text `error` excepted, as in PlainTokens)."""
    token = _event("token", "tok", spaced, False, True)
    odd = _raw_event(raw, spaced, False, True)

    def run(read: bytes) -> tuple[int, int]:
        events = [event + b"\n\n" for event in read[:-2].split(b"\n\n")]
        taken = list(itertools.takewhile(lambda event: _read_as_plain(event[:-2]) or (
            raw == "error" and _a_plain_token(event[:-2])), events))
        return sum(map(len, taken)), len(taken)

    plain = PlainTokens()
    assert plain.prefix(token) == (len(token), 1)
    assert plain.prefix(odd + token) == run(odd + token)
    read = token * 3 + odd + token * 3
    assert PlainTokens().prefix(read) == run(read)


def test_a_stream_whose_tokens_differ_stops_learning(monkeypatch: pytest.MonkeyPatch) -> None:
    """Token events that differ by more than their text (a field that varies per event): each
    is checked in full, and after the third template in a row that missed none is learned
    (no template is tried). A new stream (recogniser) learns again."""
    checked = _count_full_checks(monkeypatch)
    events = [b'data: {"choices":[{"delta":{"content":"t"},"finish_reason":null}],"n":"%s"}\n\n'
              % (b"x" * i) for i in range(1, 9)]
    plain = PlainTokens()
    assert plain.prefix(b"".join(events)) == (sum(map(len, events)), 8)
    assert len(checked) == 8 and plain._misses == 3 and plain._head == b"\0"
    assert plain.prefix(events[0] * 3) == (len(events[0]) * 3, 3) and len(checked) == 11
    usage = b'data: {"choices":[{"delta":{"content":"t"},"finish_reason":null}],"usage":{}}\n\n'
    assert plain.prefix(events[0] * 2 + usage + events[0]) == (len(events[0]) * 2, 2)
    assert plain._head == b"\0"
    assert PlainTokens().prefix(events[0] * 3) == (len(events[0]) * 3, 3) and len(checked) == 15


def test_a_first_token_with_the_role_does_not_stop_learning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's first token event carries the role too: its template misses the second token,
    whose template then holds for the rest; the misses start over at the hit."""
    checked = _count_full_checks(monkeypatch)

    def event(delta: dict[str, str]) -> bytes:
        return b"data: " + json.dumps({"id": "c", "choices": [{
            "index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]},
            separators=(",", ":")).encode() + b"\n\n"

    plain = PlainTokens()
    reads = [event({"role": "assistant", "content": "Hi"})] + [
        event({"content": f" w{i}"}) for i in range(8)]
    assert [plain.prefix(read) for read in reads] == [(len(read), 1) for read in reads]
    assert len(checked) == 2 and plain._misses == 0


def _count_full_checks(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    checked: list[bytes] = []
    full_check = protocol.sse._plain_text

    def counted(event: bytes) -> object:
        checked.append(event)
        return full_check(event)

    monkeypatch.setattr(protocol.sse, "_plain_text", counted)
    return checked


def test_a_read_of_plain_tokens_goes_on_as_it_came(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast way is taken (the read comes back as the same object) for a read of plain token
    events, with each event's null usage dropped when the client did not ask for usage."""
    token = _event("token", "tok", False, False, True)
    reader, plain = SSEReader(), PlainTokens()
    read = token * 3
    outcome = Outcome(prompt_tokens=2)
    with monkeypatch.context() as patched:  # no event is read one by one
        patched.setattr("gateway.backends.stream.pass_event", None)
        assert pass_chunk(reader, plain, read, _job(), outcome) is read
        assert outcome.completion_tokens == 3 and len(outcome.chunk_times) == 3
        with_null = _event("token", "tok", False, True, True)
        assert pass_chunk(reader, plain, with_null * 2, _job(), outcome) == token * 2


def test_a_read_that_ends_an_event_begun_before_it_is_read_event_by_event() -> None:
    """A read can look like whole plain token events and still be the last line of an event the
    reader holds the start of: the reader decides, not `PlainTokens`."""
    event = _event("two-lines", "tok", False, False, True)
    head, _, rest = event.partition(b"\n")
    fast_reader, slow_reader, plain = SSEReader(), SSEReader(), PlainTokens()
    whole, single = Outcome(prompt_tokens=2), Outcome(prompt_tokens=2)
    for data in (_event("role", "", False, False, True), head + b"\n", rest):
        fast = pass_chunk(fast_reader, plain, data, _job(), whole)
        slow = b"".join([pass_event(e.data, _job(), single) for e in slow_reader.feed(data)])
        assert fast == slow
    assert fast == event and whole.completion_tokens == single.completion_tokens == 1


@pytest.mark.parametrize("chat", [True, False])
def test_a_fairgate_engines_tokens_go_the_fast_way(chat: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The seam with fairgate's own engine: its token events (ResponseWriter, asked for usage
    as the gateway always asks) are the plain tokens `PlainTokens` knows, so a
    change to how the engine writes them that loses the fast way fails here."""
    engine = ResponseWriter("r1", chat, "m", include_usage=True)
    read = b"".join(engine.chunk(text, None) for text in ("Hel", "lo", " wor", "ld"))
    outcome = Outcome(prompt_tokens=2)
    single = Outcome(prompt_tokens=2)
    expected = b"".join([pass_event(e.data, _job(), single) for e in SSEReader().feed(read)])
    with monkeypatch.context() as patched:
        patched.setattr("gateway.backends.stream.pass_event", None)
        assert pass_chunk(SSEReader(), PlainTokens(), read, _job(), outcome) == expected
    assert outcome.completion_tokens == single.completion_tokens == 4
    assert b'"usage"' not in expected  # the client did not ask: each null usage dropped

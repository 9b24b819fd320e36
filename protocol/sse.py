"""Server-sent events: the one writer and the one incremental reader of `text/event-stream`.

The reader follows the WHATWG HTML spec, "interpreting an event stream": line ends CRLF, LF or a
lone CR (mixed freely, a CRLF may be split across reads); `data:` lines joined with LF; one space
after the colon stripped; `:` comment lines ignored; a line without a colon is a field name with
an empty value; a blank line dispatches, and dispatches nothing when no `data` field was seen; one
leading UTF-8 BOM ignored; an incomplete event at the end of the stream discarded. It works on
bytes, so a read may end inside a multi-byte character and payloads are never decoded (the spec
decodes UTF-8 first; line ends and colons are ASCII, so the fields come out the same).

    reader = SSEReader()
    for chunk in chunks:
        for event in reader.feed(chunk):
            handle(event.data)
    reader.close()  # always [] (the spec discards an unterminated event)

The writer emits LF line ends only: `encode_event(data)`, `sse_json(obj)`, `sse_plain(obj)`
and `DONE`.

Which event of an OpenAI stream carries a token is decided here too, once (`read_chunk`,
`is_token_chunk`): the gateway's backends, the load generator and the shadow sender time and
count tokens by it, so their TTFT and ITL are one measure.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from protocol import fastjson

DONE = b"data: [DONE]\n\n"
MESSAGE = b"message"  # the spec's event type when none (or an empty one) is given
_BOM = b"\xef\xbb\xbf"
DONE_DATA = b"[DONE]"


@dataclass(frozen=True, slots=True)
class SSEEvent:
    """One dispatched event. `event` is the spec's type (b"message" unless an `event:` field
    named another); `id` is the stream's last event ID when it was dispatched: like the spec's
    `lastEventId` it carries over to later events until the next `id:` field, and it is None
    only while no `id:` field has been seen."""

    data: bytes
    event: bytes = MESSAGE
    id: bytes | None = None


def encode_event(data: bytes) -> bytes:
    """One event carrying `data`; each line of a multi-line payload gets its own `data:` line
    (any of CRLF, LF, CR separates lines, as the reader splits them)."""
    if b"\n" not in data and b"\r" not in data:
        return b"data: " + data + b"\n\n"
    lines = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    return b"".join([b"data: " + line + b"\n" for line in lines]) + b"\n"


def sse_json(obj: Any) -> bytes:
    """`obj` as one compact JSON event. json.dumps escapes newlines, so no split is needed."""
    payload = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return b"data: " + payload + b"\n\n"


def sse_plain(obj: Any) -> bytes:
    """`sse_json(obj)` for an object of no floats (`fastjson.dumps_plain`): the same bytes, in
    a tenth of the time. An engine's token events and error events are such objects."""
    return b"data: " + fastjson.dumps_plain(obj) + b"\n\n"


class SSEReader:
    """Incremental event-stream parser: `feed` each network read, get the events it completed.

    Normalised bytes only are buffered (every CR turned into LF), so the common case is one
    split on b"\\n\\n" per read and one `startswith` per whole `data: ...` event. `retry` holds
    the last valid `retry:` field (milliseconds), None when none came.
    """

    __slots__ = ("_bom", "_after_cr", "_parts", "_data", "_event", "_id", "retry")

    def __init__(self) -> None:
        self._bom: bytes | None = b""  # the stream's first bytes until a BOM is ruled out
        self._after_cr = False  # the last read ended with CR: an LF opening the next is its pair
        # Bytes not parsed yet (CRs already turned into LFs): the unterminated last line, behind
        # the LF that ended the line before it when that line was applied (so that an LF coming
        # next still reads as the blank line).
        self._parts: list[bytes] = []
        self._data: list[bytes] = []  # the current event's data lines
        self._event = b""
        self._id: bytes | None = None
        self.retry: int | None = None

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """The events that `chunk` completes, in stream order."""
        if self._bom is not None:
            chunk = self._skip_bom(chunk)
        if self._after_cr and chunk:
            self._after_cr = False
            if chunk[:1] == b"\n":
                chunk = chunk[1:]
        if 13 in chunk:  # b"\r"; an int needle is a plain memchr, several times faster
            self._after_cr = chunk.endswith(b"\r")
            chunk = chunk.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if 10 not in chunk:  # b"\n"
            if chunk:
                self._parts.append(chunk)
            return []
        if self._parts:
            self._parts.append(chunk)
            chunk = b"".join(self._parts)
            self._parts = []
        blocks = chunk.split(b"\n\n")  # every block but the last ends with a blank line
        tail = blocks.pop()
        events: list[SSEEvent] = []
        if blocks and (self._data or self._event):  # the first block ends an event begun earlier
            self._fields(blocks[0])
            self._dispatch(events)
            del blocks[0]
        last_id = self._id
        for block in blocks:
            if block.startswith(b"data: ") and 10 not in block:  # one whole data line
                events.append(SSEEvent(block[6:], MESSAGE, last_id))
            else:
                self._fields(block)
                self._dispatch(events)
                last_id = self._id
        if tail:
            cut = tail.rfind(b"\n")
            if cut >= 0:  # whole lines of an unfinished event: apply now, keep only the rest
                self._fields(tail[:cut])
                tail = tail[cut:]
            self._parts.append(tail)
        return events

    def starts_event(self, data: bytes) -> bool:
        """Whether the read `data` begins a new event: nothing is buffered. A stream's first
        read that does not open with a byte of the BOM rules the BOM out."""
        if self._after_cr or self._parts or self._data or self._event:
            return False
        if self._bom == b"" and data[:1] not in (b"", _BOM[:1]):
            self._bom = None
        return self._bom is None

    def close(self) -> list[SSEEvent]:
        """End of stream: always [] (the spec discards an event without its blank line); the
        reader is reset for a new stream, the last event ID and `retry` are kept."""
        self._bom, self._after_cr, self._parts = b"", False, []
        self._data, self._event = [], b""
        return []

    def _skip_bom(self, chunk: bytes) -> bytes:
        assert self._bom is not None
        head = self._bom + chunk
        if len(head) < len(_BOM) and _BOM.startswith(head):
            self._bom = head  # too short to tell yet
            return b""
        self._bom = None
        return head[len(_BOM) :] if head.startswith(_BOM) else head

    def _fields(self, block: bytes) -> None:
        """Apply the field lines of `block` (LF-separated). An empty line here is never a
        dispatch: blank lines were the split points, a leftover one sits between events."""
        for line in block.split(b"\n"):
            if not line or line[:1] == b":":  # empty, or a comment
                continue
            name, _, value = line.partition(b":")
            if value[:1] == b" ":
                value = value[1:]
            if name == b"data":
                self._data.append(value)
            elif name == b"event":
                self._event = value
            elif name == b"id":
                if 0 not in value:
                    self._id = value
            elif name == b"retry" and value.isdigit():  # bytes.isdigit: ASCII digits only
                self.retry = int(value)

    def _dispatch(self, events: list[SSEEvent]) -> None:
        data, event = self._data, self._event
        self._event = b""
        if data:  # no data field: nothing to dispatch
            self._data = []
            events.append(SSEEvent(b"\n".join(data), event or MESSAGE, self._id))


# ---- which chunk of an OpenAI stream is a token ------------------------------------------------
@dataclass(frozen=True, slots=True)
class StreamChunk:
    """One event of an OpenAI completion stream, read: `token` when it carries a generated token
    (`is_token_chunk`), `done` for the [DONE] marker, `body` the JSON object it holds. `body` is
    None for [DONE], for JSON that is not an object, and for a plain token (told apart without
    parsing: nothing in it but the token)."""

    token: bool
    body: dict[str, Any] | None = None
    done: bool = False

    @property
    def usage(self) -> dict[str, Any] | None:
        """The usage counts it carries (the include_usage chunk); None for `usage: null`."""
        usage = self.body.get("usage") if self.body is not None else None
        return usage if isinstance(usage, dict) else None

    @property
    def error(self) -> bool:
        """An error event (`{"error": {...}}`): the stream failed after it started."""
        return self.body is not None and "error" in self.body


PLAIN_TOKEN = StreamChunk(token=True)
DONE_CHUNK = StreamChunk(token=False, done=True)
NOT_AN_OBJECT = StreamChunk(token=False)

# A plain token, told apart by byte search: an open choice whose text or content is a non-empty
# string, and no usage counts or error to read. These are JSON keys: generated text cannot hold
# them unescaped (JSON escapes the quotes inside strings). Both spacings (json.dumps' default and
# compact) are matched; any other spelling takes the parse, which gives the same answer.
_PLAIN_TEXT = re.compile(rb'"(?:text|content)": ?"[^"]')
_OPEN_CHOICE, _OPEN_CHOICE_SPACED = b'"finish_reason":null', b'"finish_reason": null'
_TO_READ = re.compile(rb'"usage": ?\{|"error"')
_TEXT_KEYS = ("content", "reasoning_content", "reasoning")  # a chat delta's generated text


_EVENT_END = b"\n\n"
_QUOTE, _BACKSLASH, _LF, _CR = 34, 92, 10, 13  # int needles: a plain memchr
_NO_TEMPLATE = b"\0"  # no event begins or ends with NUL: it matches nothing
_MISSES = 3


class PlainTokens:
    """Which whole events a read of one OpenAI stream opens with are plain tokens (what
    `read_chunk` calls PLAIN_TOKEN), as `encode_event` writes them: one `data: ` line each, LF
    ends. `prefix(data)` gives (bytes, events) of them; (0, 0) for none.

    An engine writes every token event of a stream alike but for the text, so the first plain
    token is checked in full and kept as a template: the bytes before its text (`"content": "`
    or `"text": "` included) and after it (from the closing quote). A later event that is the
    template around another text, non-empty and holding no quote (escaped or not), no line
    end and no trailing backslash, is the same JSON but for that string, so a plain token too,
    told by a few bounded searches in C instead of a scan of the whole event per condition.
    Anything else is checked in full, and a plain token found that way becomes the template,
    until templates stop paying: in a stream whose token events differ by more than their
    text (a field that varies per event), after the third template in a row that missed,
    each event is checked in full and nothing more is learned.

    The one event the two checks call differently is a token whose text is exactly `error`:
    the full check reads it as a possible error event and parses it, which then passes it on
    unchanged, as the template does. `tests/gateway/test_stream_events.py` holds the rest to
    what `read_chunk` says, raw bytes in a template's text included."""

    __slots__ = ("_head", "_tail", "_misses")

    def __init__(self) -> None:
        self._head = self._tail = _NO_TEMPLATE
        self._misses = 0  # plain tokens in a row the template missed; at _MISSES, no more

    def prefix(self, data: bytes) -> tuple[int, int]:
        end = events = 0
        while (cut := data.find(_EVENT_END, end)) >= 0:
            if self._templated(data, end, cut):
                self._misses = 0
            else:
                event = data[end:cut]
                text = _plain_text(event)
                if text is None:
                    break
                if self._misses < _MISSES:
                    self._learn(event, text)
            if events == 0 and cut + 2 < len(data):  # the events after the first at once,
                run, count = self._run(data, cut + 2)  # where they repeat it
                cut, events = cut + run, events + count
            end = cut + 2
            events += 1
        return end, events

    def _templated(self, data: bytes, end: int, cut: int) -> bool:
        """Whether data[end:cut] is the template around a text that keeps it a plain token."""
        head, tail = self._head, self._tail
        start, stop = end + len(head), cut - len(tail)
        return (start < stop and data.startswith(head, end, cut)
                and data.endswith(tail, end, cut) and data[stop - 1] != _BACKSLASH
                and data.find(_QUOTE, start, stop) < 0 and data.find(_LF, start, stop) < 0
                and data.find(_CR, start, stop) < 0)

    def _run(self, data: bytes, at: int) -> tuple[int, int]:
        """(bytes, events) of the template events from `at` on, all told at once: split at
        each `tail, blank line, head`, every piece but the last is one event's text (the
        blank lines fall only between events: neither the template nor a text holds a line
        end), and the texts together hold no quote or line end, and none ends with a
        backslash."""
        head, tail = self._head, self._tail
        if not data.startswith(head, at):
            return 0, 0
        between = tail + _EVENT_END + head
        rest = data[at + len(head):]
        texts = rest.split(between)
        texts.pop()  # the last event's text and what follows it: one by one
        if not texts or b"" in texts:
            return 0, 0
        joined = b"".join(texts)
        if (_QUOTE in joined or _LF in joined or _CR in joined
                or (_BACKSLASH in joined and b"\\" + between in rest)):
            return 0, 0
        return (len(texts) * (len(head) + len(tail) + 2) + len(joined)), len(texts)

    def _learn(self, event: bytes, text: re.Match[bytes]) -> None:
        """A plain token the template missed becomes the template, unless its text holds an
        escape (the template there stays); the _MISSES-th in a row ends learning for this
        stream."""
        start = text.end() - 1
        close = event.find(_QUOTE, start)
        # The open choice lies wholly before or after the text (no quote in the text), unless
        # it opens with the text's quote (`"text":"finish_reason":null`, not JSON): then
        # another text would leave no open choice.
        if (close <= start or event.find(_BACKSLASH, start, close) >= 0
                or event.startswith(_OPEN_CHOICE, start - 1)
                or event.startswith(_OPEN_CHOICE_SPACED, start - 1)):
            return
        self._misses += 1
        if self._misses == _MISSES:
            self._head = self._tail = _NO_TEMPLATE
        else:
            self._head, self._tail = event[:start], event[close:]


def _plain_text(event: bytes) -> re.Match[bytes] | None:
    """The full check of one event (no blank line): where its text is when it is one `data: `
    line that `read_chunk` calls a plain token; None when it is not."""
    if not (event.startswith(b"data: ") and _LF not in event and _CR not in event
            and (_OPEN_CHOICE in event or _OPEN_CHOICE_SPACED in event)):
        return None
    text = _PLAIN_TEXT.search(event)
    if text is None or _TO_READ.search(event):
        return None
    return text


def read_chunk(data: bytes) -> StreamChunk:
    """What the data of one stream event is (`is_token_chunk` decides `token`). Raises
    ValueError when the data is not JSON (each reader decides what a garbled stream means)."""
    if ((_OPEN_CHOICE in data or _OPEN_CHOICE_SPACED in data) and _PLAIN_TEXT.search(data)
            and not _TO_READ.search(data)):
        return PLAIN_TOKEN
    if data.strip() == DONE_DATA:
        return DONE_CHUNK
    body = fastjson.loads(data)
    if not isinstance(body, dict):
        return NOT_AN_OBJECT
    return StreamChunk(is_token_chunk(body), body)


def is_token_chunk(chunk: dict[str, Any]) -> bool:
    """Whether a streamed chunk (completion or chat) carries a generated token: a choice whose
    text (`text`, or the delta's `content`, `reasoning_content` or `reasoning`) is a string, or
    whose delta holds `tool_calls`; an empty string counts, except in the chat role preamble and
    the bare finish marker. The rule and why:

    - Text, and empty text: a token. vLLM's `bench serve` (`backend_request_func.py`) counts
      every event with non-empty `choices` ("text could be empty here, e.g. for special
      tokens"), and vLLM streams an empty text for a token whose bytes its detokenizer holds
      back (part of a UTF-8 character) or that decodes to nothing. That token was generated, it
      is in `usage.completion_tokens`, and the gap before it is a decode step: skipping it
      would merge two steps into one inter-token gap. fairgate's own engine sends no event for
      such a token (its next event carries the whole character), so there is nothing to count.
    - Tool-call deltas and reasoning text: generated tokens, counted as vLLM's benchmark does.
    - The role-only first chunk of a chat stream (`{"role": "assistant", "content": ""}`): not
      a token. vLLM's benchmark counts it; here it would time TTFT to the headers of a server
      that sends it before generating (OpenAI's), and on fairgate and vLLM, which send it
      with the first token, add a zero gap to ITL and one token too many.
    - The bare finish marker (`finish_reason` set, no text or an empty one, `delta: {}`):
      not a token, only the end of one.
    - The usage chunk (`choices: []`), an error event (`{"error": ...}`) and [DONE] carry no
      choices: not tokens.
    """
    for choice in chunk.get("choices") or ():
        if isinstance(choice, dict) and _carries_token(choice):
            return True
    return False


def _carries_token(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict):
        if delta.get("tool_calls"):
            return True
        texts = [delta.get(key) for key in _TEXT_KEYS]
        opening = "role" in delta
    else:
        texts, opening = [choice.get("text")], False
    if any(isinstance(text, str) and text for text in texts):
        return True
    empty = "" in texts
    return empty and not opening and choice.get("finish_reason") is None

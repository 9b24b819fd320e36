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

The writer emits LF line ends only: `encode_event(data)`, `sse_json(obj)` and `DONE`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]\n\n"
MESSAGE = b"message"  # the spec's event type when none (or an empty one) is given
_BOM = b"\xef\xbb\xbf"


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

"""A shared-memory ring from the gateway to its shadow sender process: one writer, one reader.

The gateway's event loop hands copies to the sender (control/shadow_worker.py) once per loop
turn. Down a pipe, each hand-off is a `write` system call and a wake-up of the other process;
here it is a copy into shared memory and one 8-byte store, and the reader collects what has
arrived on a timer while copies keep coming (`BUSY_POLL_S` after a look that found some, backing
off to `MAX_POLL_S`). Only a reader that has gone idle (nothing for `IDLE_AFTER_S`) is woken, by
one byte down the pipe that is also the lifeline (its end tells the worker that the gateway
stopped or died). This module is the shared memory; the event-loop sides that use it are
control/shadow_worker.py's `RingSender` (the gateway) and `RingReceiver` (the worker).

Layout of the shared file (a memfd, passed to the child as an inherited descriptor):

    bytes 0-7      head: bytes ever written (the writer's; published after the data)
    bytes 64-71    tail: bytes ever read (the reader's)
    bytes 128-135  reader state: 0 busy (polling), 1 idle (wake me), 2 a wake-up is on its way
    4096 ...       the data, `capacity` bytes (a power of two), as parts:
                   u32 size | MORE, then size bytes; a message is its parts up to one
                   without MORE (messages longer than MAX_PART are cut, so any fits)

head and tail only grow, so full and empty never look alike, and each is a single aligned
8-byte store (a memoryview cast to "Q"; struct's standard sizes store byte by byte and could
be read torn). The ordering this relies on, that a store is seen after the stores before it
and a load is never passed by a later store, is x86-64's (TSO); elsewhere `SUPPORTED` is false
and the gateway keeps the pipe. The one thing TSO allows, a store passed by a later load, can
make the writer miss the reader's "idle" while the reader misses the writer's new head; the
reader then finds the data on its idle poll, `IDLE_POLL_S` later, so a rare copy can wait that
long in the hand-off (it is counted in the copy's queue wait, never in its latency).
"""

from __future__ import annotations

import logging
import mmap
import os
import platform
import struct

log = logging.getLogger("fairgate.shadow")

SUPPORTED = hasattr(os, "memfd_create") and platform.machine().lower() in ("x86_64", "amd64")
TRANSPORT_ENV = "FAIRGATE_SHADOW_TRANSPORT"  # "ring" (the default where supported) or "pipe"
RING_BYTES = 1 << 20  # small enough to stay in cache, 2 ms of copies hundreds of times over
MAX_PART = 64 << 10  # a message longer than this is written as several parts
BUSY_POLL_S = 0.0005  # the reader looks again this soon after it found messages,
MAX_POLL_S = 0.008  # and twice as late after each look that found none, up to this
IDLE_AFTER_S = 0.05  # nothing for this long: the reader asks to be woken
IDLE_POLL_S = 0.1  # and still looks this often (the missed wake-up above)
RETRY_S = 0.002  # a full ring: the writer tries again after this
_HEADER_BYTES = 4096
_HEAD, _TAIL, _STATE = 0, 8, 16  # u64 slots: separate cache lines
BUSY, IDLE, WAKING = 0, 1, 2
_PART = struct.Struct("<I")
_MORE = 1 << 31


def wanted() -> bool:
    """Whether the gateway hands copies over through the ring: where it is SUPPORTED, unless
    $FAIRGATE_SHADOW_TRANSPORT says "pipe" (an escape hatch, and the benchmark's baseline)."""
    choice = os.environ.get(TRANSPORT_ENV, "").strip().lower() or "ring"
    if choice not in ("ring", "pipe"):
        log.warning("$%s is %r, not ring or pipe: using %s", TRANSPORT_ENV, choice,
                    "ring" if SUPPORTED else "pipe")
        choice = "ring"
    if choice == "ring" and not SUPPORTED:
        log.info("shadow copies go down a pipe: the shared-memory ring needs Linux on x86-64")
    return choice == "ring" and SUPPORTED


def create(capacity: int = RING_BYTES) -> int:
    """A new zeroed ring's file descriptor (inheritable: pass it to the child)."""
    if capacity & (capacity - 1) or capacity < 2 * _PART.size:
        raise ValueError(f"ring capacity must be a power of two, not {capacity}")
    fd = os.memfd_create("fairgate-shadow-ring", 0)
    os.ftruncate(fd, _HEADER_BYTES + capacity)
    return fd


class _Ring:
    """A ring's file mapped into this process: its header slots and its data."""

    def __init__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        self.capacity = size - _HEADER_BYTES
        if self.capacity <= 0 or self.capacity & (self.capacity - 1):
            raise ValueError(f"not a ring: {size} bytes")
        self._map = mmap.mmap(fd, size)
        self._slots = memoryview(self._map)[:_HEADER_BYTES].cast("Q")
        self._data = memoryview(self._map)[_HEADER_BYTES:]
        self._mask = self.capacity - 1

    @property
    def reader_state(self) -> int:
        """BUSY, IDLE or WAKING: the reader's, as it last said (or a writer since)."""
        return self._slots[_STATE]

    def close(self) -> None:
        self._slots.release()
        self._data.release()
        self._map.close()


class RingWriter(_Ring):
    """The writing end: `write` one part, or False when it does not fit yet."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self._head = self._slots[_HEAD]

    @property
    def free(self) -> int:
        return self.capacity - (self._head - self._slots[_TAIL])

    def write(self, part: bytes | memoryview, more: bool = False) -> bool:
        size = len(part)
        if size >= _MORE or _PART.size + size > self.free:
            return False
        self._put(self._head, _PART.pack(size | (_MORE if more else 0)))
        self._put(self._head + _PART.size, part)
        self._head += _PART.size + size
        self._slots[_HEAD] = self._head  # published: the reader may take it from here
        return True

    def _put(self, pos: int, data: bytes | memoryview) -> None:
        at = pos & self._mask
        first = min(len(data), self.capacity - at)
        self._data[at:at + first] = data[:first]
        if first < len(data):
            self._data[:len(data) - first] = data[first:]

    def wake_wanted(self) -> bool:
        """True once per idle spell of the reader: it asked to be woken, and nobody has yet."""
        if self.reader_state != IDLE:
            return False
        self._slots[_STATE] = WAKING
        return True


class RingReader(_Ring):
    """The reading end: `read` every whole message that has arrived."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd)
        self._tail = self._slots[_TAIL]
        self._partial = bytearray()

    def read(self) -> list[bytes]:
        head = self._slots[_HEAD]
        tail = self._tail
        out: list[bytes] = []
        while tail < head:
            (word,) = _PART.unpack(self._get(tail, _PART.size))
            size = word & ~_MORE
            if tail + _PART.size + size > head:
                raise ValueError("a ring part runs past what was written")
            part = self._get(tail + _PART.size, size)
            tail += _PART.size + size
            if word & _MORE:
                self._partial += part
            elif self._partial:
                self._partial += part
                out.append(bytes(self._partial))
                self._partial.clear()
            else:
                out.append(part)
        self._tail = tail
        self._slots[_TAIL] = tail  # after the copies out: the writer may reuse the space
        return out

    def _get(self, pos: int, size: int) -> bytes:
        at = pos & self._mask
        first = min(size, self.capacity - at)
        if first == size:
            return bytes(self._data[at:at + size])
        return bytes(self._data[at:]) + bytes(self._data[:size - first])

    def set_state(self, state: int) -> None:
        self._slots[_STATE] = state

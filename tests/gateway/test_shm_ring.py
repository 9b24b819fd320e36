"""The shared-memory ring from the gateway to the shadow sender process (control/shm_ring.py):
every batch arrives whole and in order however the ring wraps, fills and is read; a message
longer than a part or than the whole ring still arrives; an idle reader is woken once, and one
whose wake-up was missed still finds the data; a corrupt ring ends the reader."""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

import control.shadow
from control import shm_ring
from control.shadow_worker import RingReceiver, RingSender
from tests.support.waiting import next_loop_turn, wait_for

pytestmark = pytest.mark.skipif(not shm_ring.SUPPORTED,
                                reason="the shared-memory ring needs Linux memfd on x86-64 "
                                       "(the shadow sender uses the pipe elsewhere)")


class _Pipe:
    """The wake-up pipe's write transport: keeps what is written."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def ring_fd() -> Iterator[Any]:
    fds: list[int] = []

    def make(capacity: int = shm_ring.RING_BYTES) -> int:
        fds.append(shm_ring.create(capacity))
        return fds[-1]

    yield make
    for fd in fds:
        os.close(fd)


def test_capacity_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        shm_ring.create(3000)


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=30),
       reads=st.lists(st.integers(min_value=0, max_value=3), min_size=1, max_size=30))
async def test_every_batch_arrives_whole_and_in_order(sizes: list[int],
                                                      reads: list[int]) -> None:
    """A 1 KiB ring and 300-byte parts: messages wrap, span several parts, exceed the ring and
    wait in the sender's backlog while the reader reads at its own pace."""
    fd = shm_ring.create(1024)
    try:
        sender = RingSender(shm_ring.RingWriter(fd), _Pipe(),  # type: ignore[arg-type]
                                     max_part=300)
        reader = shm_ring.RingReader(fd)
        items = [("copy", "s", f"r{i}", {"prompt": "x" * n}) for i, n in enumerate(sizes)]
        got: list[Any] = []
        for turn, item in enumerate(items):  # one batch per loop turn
            sender.put(item)
            await next_loop_turn()
            for _ in range(reads[turn % len(reads)]):
                got.extend(m for batch in map(_loads, reader.read()) for m in batch)
                sender._drain()  # what its retry timer does
        while len(got) < len(items):
            got.extend(m for batch in map(_loads, reader.read()) for m in batch)
            sender._drain()
        assert got == items
        assert sender.waiting == 0 and reader.read() == []
    finally:
        os.close(fd)


def _loads(data: bytes) -> Any:
    return pickle.loads(data)


async def test_an_idle_reader_is_woken_once(ring_fd: Any,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm_ring, "IDLE_AFTER_S", 0.0)
    monkeypatch.setattr(shm_ring, "IDLE_POLL_S", 3600.0)  # only the wake-up can bring it
    fd = ring_fd()
    wake = _Pipe()
    sender = RingSender(shm_ring.RingWriter(fd), wake)  # type: ignore[arg-type]
    got: list[Any] = []
    ended: list[bool] = []
    receiver = RingReceiver(shm_ring.RingReader(fd), got.extend,
                                     lambda: ended.append(True))
    await wait_for(lambda: sender.ring.reader_state == shm_ring.IDLE)
    sender.put(("copy", 1))
    await next_loop_turn()
    sender.put(("copy", 2))
    await next_loop_turn()
    assert bytes(wake.data) == b"\0"  # one wake-up for the idle spell, not one per batch
    assert got == []
    receiver.data_received(bytes(wake.data))  # what the pipe delivers
    assert got == [("copy", 1), ("copy", 2)]
    sender.close()
    receiver.connection_lost(None)
    assert ended == [True] and wake.closed


async def test_a_missed_wake_up_costs_one_idle_poll(ring_fd: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer did not see the reader go idle (a store passed by a later load): the idle
    poll still finds the data."""
    monkeypatch.setattr(shm_ring, "IDLE_AFTER_S", 0.0)
    monkeypatch.setattr(shm_ring, "IDLE_POLL_S", 0.01)
    fd = ring_fd()
    writer = shm_ring.RingWriter(fd)
    got: list[Any] = []
    RingReceiver(shm_ring.RingReader(fd), got.extend, lambda: None)
    await wait_for(lambda: writer.reader_state == shm_ring.IDLE)
    assert writer.write(pickle.dumps([("copy", 7)]))  # and no wake-up byte
    await wait_for(lambda: got == [("copy", 7)], timeout=5)


async def test_a_corrupt_ring_ends_the_reader(ring_fd: Any) -> None:
    fd = ring_fd()
    writer = shm_ring.RingWriter(fd)
    got: list[Any] = []
    ended: list[bool] = []
    receiver = RingReceiver(shm_ring.RingReader(fd), got.extend,
                                     lambda: ended.append(True))
    assert writer.write(b"not a pickle")
    receiver.data_received(b"\0")
    assert got == [] and ended == [True]
    receiver.connection_lost(None)
    assert ended == [True]  # once


async def test_the_gateway_uses_the_ring_and_falls_back_to_the_pipe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender process is started with the ring where it is supported and with the pipe
    alone where not; either way a copy reaches it and its result comes back (here a connection
    refused, counted as a failure), and it exits cleanly with the gateway."""
    from control.shadow_metrics import ShadowMetrics
    from gateway.config import ShadowConfig
    from protocol.measures import SLO

    for transport, supported in (("ring", True), ("pipe", False), ("", True)):
        monkeypatch.setenv(shm_ring.TRANSPORT_ENV, transport)
        shadows = control.shadow.ShadowSet(
            [ShadowConfig(name="cand", url="http://127.0.0.1:9/v1", model="m")],
            ShadowMetrics(CollectorRegistry()))
        await shadows.start()
        worker = shadows.worker
        try:
            assert worker is not None
            assert ("--ring-fd" in worker.args) is supported
            assert isinstance(shadows._out, RingSender) is supported
            mirror = shadows.mirrors["cand"]
            mirror.pending["r1"] = control.shadow.Pair("acme", SLO())
            mirror.outstanding += 1
            shadows._send(("copy", "cand", "r1", {"prompt": "hi", "max_tokens": 1},
                           "completions", "acme", "interactive", time.perf_counter()))
            await wait_for(lambda m=mirror: m.failed == 1, timeout=20)
            assert list(mirror.failures) == [(None, "connect_failed")]
        finally:
            await shadows.close()
        assert worker is not None and worker.poll() == 0


def test_a_transport_that_is_neither_is_named_and_the_default_kept(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(shm_ring.TRANSPORT_ENV, "shm")
    assert shm_ring.wanted() is True
    assert "$FAIRGATE_SHADOW_TRANSPORT is 'shm', not ring or pipe" in caplog.text


async def test_a_ring_that_cannot_be_made_leaves_the_pipe(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from control.shadow_metrics import ShadowMetrics
    from gateway.config import ShadowConfig

    def refused(capacity: int = 0) -> int:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.delenv(shm_ring.TRANSPORT_ENV, raising=False)
    monkeypatch.setattr(shm_ring, "create", refused)
    shadows = control.shadow.ShadowSet(
        [ShadowConfig(name="cand", url="http://127.0.0.1:9/v1", model="m")],
        ShadowMetrics(CollectorRegistry()))
    await shadows.start()
    try:
        assert shadows.worker is not None and "--ring-fd" not in shadows.worker.args
        assert not isinstance(shadows._out, RingSender)
        assert "no shared-memory ring (" in caplog.text
    finally:
        await shadows.close()

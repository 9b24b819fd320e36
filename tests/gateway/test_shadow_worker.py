"""The shadow sender process (control/shadow_worker.py): the copies' HTTP work runs there, its
histograms reach the gateway's /metrics as a Histogram's would, and a dead worker costs live
clients nothing: its copies are counted as dropped and another worker takes over."""

from __future__ import annotations

import itertools
import os
import signal
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram

import control.shadow
from control.shadow_metrics import ShadowHistograms
from control.shadow_worker import FrameReader, FrameSender, _Histogram
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.server import make_app as make_engine_app
from gateway.metrics import ITL_BUCKETS
from tests.gateway.helpers import collect, completion, start_gateway
from tests.support.waiting import next_loop_turn, wait_for

REALTIME = EngineConfig(executor="sim", sim_clock="realtime", max_model_len=512,
                        max_num_batched_tokens=512)


class _Pipe:
    """A write transport that keeps what is written."""

    def __init__(self) -> None:
        self.data = bytearray()
        self.writes = 0
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data
        self.writes += 1

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _frames(data: bytes, cuts: list[int]) -> tuple[list[Any], bool]:
    """`data` read in pieces cut at `cuts`: every item, and whether the end was seen."""
    got: list[Any] = []
    ended: list[bool] = []
    reader = FrameReader(got.extend, lambda: ended.append(True))
    edges = [0, *sorted(c % (len(data) + 1) for c in cuts), len(data)]
    for a, b in itertools.pairwise(edges):
        reader.data_received(data[a:b])
    reader.connection_lost(None)
    return got, ended == [True]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=60), min_size=1, max_size=40),
       st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
async def test_frames_carry_every_item_in_order_however_the_pipe_cuts_them(
        sizes: list[int], cuts: list[int]) -> None:
    pipe = _Pipe()
    sender = FrameSender(pipe)  # type: ignore[arg-type]
    items = [("copy", "s", f"r{i}", {"prompt": "x" * n}) for i, n in enumerate(sizes)]
    half = len(items) // 2
    for item in items[:half]:
        sender.put(item)
    await next_loop_turn()  # the sender's flush has run: one frame for all of them
    sender.put_many(items[half:])
    sender.close()
    assert pipe.closed and pipe.writes == (1 if half == 0 else 2)
    got, ended = _frames(bytes(pipe.data), cuts)
    assert got == items and ended


def test_a_corrupt_frame_ends_the_pipe() -> None:
    got: list[Any] = []
    ended: list[bool] = []
    reader = FrameReader(got.extend, lambda: ended.append(True))
    reader.data_received(b"\x00\x00\x00\x03abc")
    assert got == [] and ended == [True]


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(min_value=0, max_value=3, allow_nan=False), max_size=60),
       st.integers(min_value=1, max_value=4))
def test_worker_histograms_expose_what_a_histogram_would(values: list[float],
                                                         batches: int) -> None:
    """Observed in the worker, added in batches here: the same bucket, count and sum samples
    as prometheus_client's Histogram fed the same values one by one."""
    reference = CollectorRegistry()
    hist = Histogram("fairgate_gateway_shadow_itl_seconds", "x", ["shadow"],
                     buckets=ITL_BUCKETS, registry=reference)
    shadow = ShadowHistograms()
    worker = _Histogram(ITL_BUCKETS)
    step = max(1, len(values) // batches)
    for start in range(0, len(values), step):
        for v in values[start:start + step]:
            hist.labels("s").observe(v)
            worker.observe(v)
        shadow.add(1, "s", *worker.take())
    if not values:
        return
    want = {(s.name, s.labels.get("le")): s.value for m in reference.collect()
            for s in m.samples if not s.name.endswith("_created")}
    got = {(s.name, s.labels.get("le")): s.value for m in shadow.collect() for s in m.samples
           if s.name.startswith("fairgate_gateway_shadow_itl")}
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-9 * max(1.0, abs(value)), key


async def _burst(h: Any, n: int) -> list[int]:
    statuses = []
    for i in range(n):
        resp = await h.post("acme", completion(f"request {i}", max_tokens=4, stream=True))
        [_ async for _ in collect(resp)]
        statuses.append(resp.status)
    return statuses


async def test_a_killed_sender_process_is_replaced_and_live_requests_never_notice(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(control.shadow, "RESTART_S", 3600.0)  # the gap, held open by the test
    live = await aiohttp_server(make_engine_app(AsyncEngine(REALTIME)))
    shadow = await aiohttp_server(make_engine_app(AsyncEngine(REALTIME)))
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": str(live.make_url("/v1"))}],
        "shadow": [{"name": "cand", "url": str(shadow.make_url("/v1"))}]})
    shadows = h.shadows
    mirror = shadows.mirrors["cand"]
    assert await _burst(h, 3) == [200] * 3
    await wait_for(lambda: len(mirror.pairs) == 3, timeout=30)
    first = shadows.worker
    assert first is not None
    os.kill(first.pid, signal.SIGKILL)
    await wait_for(lambda: shadows.worker is None, timeout=10)
    assert shadows._restart is not None  # another one is due
    # while it is gone, live requests succeed; their copies are dropped and counted
    assert await _burst(h, 2) == [200] * 2
    assert mirror.dropped == 2 and mirror.outstanding == 0
    assert h.gateway.metrics.registry.get_sample_value(
        "fairgate_gateway_shadow_dropped_total", {"shadow": "cand", "reason": "sender_died"}) == 2
    shadows._restart.cancel()
    shadows._respawn()  # what the timer does
    await wait_for(lambda: shadows.worker is not None, timeout=10)
    assert shadows.worker is not first
    # the new worker has the target again: copies are paired as before
    assert await _burst(h, 3) == [200] * 3
    await wait_for(lambda: len(mirror.pairs) == 6, timeout=30)
    assert h.gateway.metrics.registry.get_sample_value(
        "fairgate_gateway_shadow_ttft_seconds_count", {"shadow": "cand"}) == len(mirror.pairs)


async def test_the_sender_process_stops_with_the_gateway_and_with_its_last_target(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> None:
    live = await aiohttp_server(make_engine_app(AsyncEngine(REALTIME)))
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": str(live.make_url("/v1"))}],
        "shadow": [{"name": "cand", "url": "http://127.0.0.1:9"}]})
    worker = h.shadows.worker
    assert worker is not None and worker.poll() is None
    resp = await h.client.delete("/admin/shadow/cand",
                                 headers={"Authorization": "Bearer admin-key-0123456789"})
    assert resp.status == 200
    assert worker.poll() is not None and h.shadows.worker is None

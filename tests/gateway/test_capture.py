"""Trace capture: served live requests become a fairgate JSONL trace that replays as it is,
with no prompt text in it."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path
from typing import Any

import pytest

from control.capture import TraceCapture
from engine.config import EngineConfig
from fairgate.cli import main
from gateway.config import CaptureConfig, GatewayConfig
from protocol.openai import parse_request
from tests.gateway.helpers import collect, start_gateway
from tuner.traces import load_trace

ENGINE = EngineConfig(executor="sim", max_model_len=2048, max_num_seqs=8,
                      max_num_batched_tokens=512)
SHARED = "the shared system prompt " * 40  # 1,000 bytes: past the first 512-token block


async def test_a_capture_replays_with_the_same_requests_lengths_and_spacing(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    path = tmp_path / "captured.jsonl"
    h = await start_gateway(aiohttp_client, db_url, tenants={"acme": {}, "globex": {}},
                            engine=ENGINE, gateway={"capture": {"path": str(path)}})
    sent, usages = [], []
    prompts = [("acme", SHARED + "question one", False), ("acme", SHARED + "question two", True),
               ("globex", SHARED + "question one", False), ("acme", "short secret words", True)]
    for i, (tenant, prompt, stream) in enumerate(prompts):
        sent.append(time.perf_counter())
        resp = await h.post(tenant, {"model": "random:tiny", "prompt": prompt,
                                     "max_tokens": 3 + i, "stream": stream,
                                     "stream_options": {"include_usage": True}})
        assert resp.status == 200
        if stream:
            usages.append([e async for e in collect(resp)][-1]["usage"])
        else:
            usages.append((await resp.json())["usage"])
    bad = await h.post("acme", {"model": "random:tiny", "prompt": "x", "max_tokens": -1})
    assert bad.status == 400  # not served: not captured
    await h.capture.flush()
    text = path.read_text()
    assert "secret words" not in text and "shared system prompt" not in text
    trace = load_trace(path)  # the reader the load generator and the tuner replay with
    assert len(trace) == 4
    by_arrival = sorted(trace, key=lambda r: r.arrival)
    assert [r.prompt_tokens for r in by_arrival] == [u["prompt_tokens"] for u in usages]
    assert [r.output_tokens for r in by_arrival] == [u["completion_tokens"] for u in usages]
    assert [r.max_tokens for r in by_arrival] == [3, 4, 5, 6]
    assert [r.tenant for r in by_arrival] == ["acme", "acme", "globex", "acme"]
    gaps = [b - a for a, b in zip(sent, sent[1:], strict=False)]
    captured = [b.arrival - a.arrival for a, b in zip(by_arrival, by_arrival[1:], strict=False)]
    # the arrival spacing is kept: each gap to within 50 ms, the time between the client's stamp
    # and the gateway's on a loaded 2-core machine (it was 27 ms off under a parallel suite)
    assert captured == pytest.approx(gaps, abs=0.05) and all(g > 0 for g in captured)
    one, two, other_tenant, short = (r.prefix_hashes for r in by_arrival)
    assert len(one) == 2 and one[0] == two[0] and one[1] != two[1]  # a shared first block
    assert other_tenant[0] != one[0]  # per tenant, as the prefix caches are
    assert len(short) == 1


async def test_captures_rotate_and_sample(aiohttp_client: Any, db_url: str,
                                          tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    h = await start_gateway(aiohttp_client, db_url, engine=ENGINE, gateway={
        "capture": {"path": str(path), "rotate_mb": 0.0002}})  # ~200 bytes
    for _ in range(3):
        assert (await h.post("acme", {"prompt": "hi", "max_tokens": 2})).status == 200
        await h.capture.flush()
    files = sorted(tmp_path.glob("c*.jsonl"))
    assert len(files) >= 2 and path in files
    assert sum(len(load_trace(f)) for f in files) == 3  # nothing lost across rotations
    with pytest.raises(ValueError, match="gateway.capture.sample"):
        GatewayConfig.from_dict({"capture": {"path": "x", "sample": 2}})


def test_the_tuner_replays_a_capture(tmp_path: Path) -> None:
    trace = tmp_path / "captured.jsonl"
    trace.write_text("# fairgate trace captured from 2026-12-01T00:00:00Z\n" + "".join(
        f'{{"arrival":{0.1 * i},"tenant":"acme","priority":"interactive","prompt_tokens":'
        f'{50 + i},"output_tokens":8,"max_tokens":16,"prefix_hashes":[{i}],'
        f'"block_tokens":512}}\n' for i in range(30)))
    assert main(["tune", "--mode", "sim", "--trace", str(trace), "--slo-ttft-p99", "1",
                 "--slo-itl-p99", "0.1", "--trials", "1", "--robustness", "0", "--storage",
                 f"sqlite:///{tmp_path / 's.db'}", "--out", str(tmp_path / "out")]) == 0
    assert "(30 requests over 2.9 s)" in (tmp_path / "out" / "report.md").read_text()


# ---- GET /admin/capture: a span of the capture as a trace ------------------------------------
ADMIN = {"Authorization": "Bearer admin-key-0123456789"}


def _line(arrival: float, prompt_tokens: int) -> str:
    return (f'{{"arrival":{arrival},"tenant":"acme","priority":"interactive","prompt_tokens":'
            f'{prompt_tokens},"output_tokens":4,"max_tokens":4,"prefix_hashes":[1],'
            '"block_tokens":512}\n')


async def _trace(h: Any, tmp_path: Path, query: str) -> list[Any]:
    resp = await h.client.get(f"/admin/capture?{query}", headers=ADMIN)
    assert resp.status == 200, await resp.text()
    assert resp.content_type == "application/x-ndjson"
    text = await resp.text()
    if not text:
        return []
    out = tmp_path / "window.jsonl"
    out.write_text(text)
    return load_trace(out)


async def test_the_capture_of_a_span_comes_from_the_current_and_the_rotated_files(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    # a rotated file in the older header (its epoch from the UTC stamp: 1000), and the current
    # file as an earlier gateway left it (epoch 2000); prompt_tokens tell the lines apart
    (tmp_path / "c-19700101T001640Z.jsonl").write_text(
        "# fairgate trace captured from 1970-01-01T00:16:40Z; arrivals in seconds since then\n"
        + _line(0.0, 10) + _line(1.0, 11) + _line(2.0, 12))
    path.write_text("# fairgate trace captured from 1970-01-01T00:33:20Z; arrivals in seconds "
                    "since then (epoch 2000.000000)\n" + _line(0.5, 20) + _line(1.5, 21))
    h = await start_gateway(aiohttp_client, db_url, engine=ENGINE,
                            gateway={"capture": {"path": str(path)}})
    served_after = time.time()
    assert (await h.post("acme", {"prompt": "hi", "max_tokens": 2})).status == 200
    # not flushed here: the endpoint writes what is buffered before it reads

    span = await _trace(h, tmp_path, "since=1001&until=2001")
    assert [r.prompt_tokens for r in span] == [11, 12, 20]
    assert [r.arrival for r in span] == pytest.approx([0.0, 1.0, 999.5])  # rebased to 0

    recent = await _trace(h, tmp_path, f"since={served_after - 1:.3f}")
    assert len(recent) == 1 and recent[0].output_tokens == 2  # the request served just now

    last_two = await _trace(h, tmp_path, "limit=2")
    assert [r.prompt_tokens for r in last_two][0] == 21 and len(last_two) == 2
    assert await _trace(h, tmp_path, "since=3000&until=3001") == []  # none: an empty answer
    assert (await h.capture.window(0, 3000, None)).count("\n") == 6  # header + 5


async def _error(h: Any, query: str, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    resp = await h.client.get(f"/admin/capture{query}", headers=ADMIN if headers is None
                              else headers)
    return resp.status, (await resp.json())["error"]


async def test_the_capture_endpoint_wants_the_admin_key_and_good_params(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    h = await start_gateway(aiohttp_client, db_url, engine=ENGINE,
                            gateway={"capture": {"path": str(tmp_path / "c.jsonl")}})
    assert (await _error(h, "", h.auth("acme")))[0] == 401  # a tenant's key is not the admin's
    assert (await _error(h, "", {}))[0] == 401
    for query, param in (("?since=yesterday", "since"), ("?until=nan", "until"),
                         ("?since=-1", "since"), ("?since=10&until=5", "until"),
                         ("?limit=0", "limit"), ("?limit=2.5", "limit")):
        status, error = await _error(h, query)
        assert (status, error["param"]) == (400, param), (query, error)
        assert "\n" not in error["message"]


async def test_without_a_capture_the_endpoint_says_how_to_turn_it_on(
        aiohttp_client: Any, db_url: str) -> None:
    h = await start_gateway(aiohttp_client, db_url, engine=ENGINE)
    status, error = await _error(h, "?since=0")
    assert status == 404 and error["code"] == "no_capture"
    assert "gateway.capture" in error["message"]


# ---- retention and permissions -------------------------------------------------------------
def _capture(path: Path, **bounds: Any) -> TraceCapture:
    return TraceCapture(CaptureConfig(str(path), rotate_mb=0.0001, **bounds))  # ~100 bytes


def _served(capture: TraceCapture, prompt_tokens: int) -> None:
    req = parse_request({"prompt": "hi"}, "completions")
    capture.record(req, "acme", "interactive", capture.started, prompt_tokens, 2, None)


async def test_the_oldest_rotated_files_go_past_max_files(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    capture = _capture(path, max_files=2, max_total_mb=None)
    capture.start()
    try:
        for i in range(6):  # each write finds the file past rotate_mb: 5 rotations
            _served(capture, 100 + i)
            await capture.flush()
    finally:
        await capture.close()
    rotated = capture.rotated()
    assert len(rotated) == 2 and sorted(tmp_path.glob("c*.jsonl")) == sorted([path, *rotated])
    # the two newest rotated files and the current one: the last three requests
    kept = [r.prompt_tokens for f in [*rotated, path] for r in load_trace(f)]
    assert kept == [103, 104, 105]


async def test_the_oldest_rotated_files_go_past_max_total_mb(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    # the operator's own file beside the capture is never the capture's to delete
    (tmp_path / "c-notes.jsonl").write_text("mine\n")
    capture = _capture(path, max_files=None, max_total_mb=0.001)  # ~1,000 bytes in all
    for i in range(8):
        _served(capture, 100 + i)
        await capture.flush()
    rotated = capture.rotated()
    sizes = [f.stat().st_size for f in rotated]
    # the rotated files leave room for the current one to grow to rotate_mb, and no more
    # than that: one more rotated file (each is about as large) would not fit
    room = (0.001 - 0.0001) * (1 << 20)
    assert 2 <= len(rotated) < 7 and sum(sizes) <= room < sum(sizes) + max(sizes)
    kept = [r.prompt_tokens for f in [*rotated, path] for r in load_trace(f)]
    assert kept == list(range(108 - len(kept), 108))  # the newest, in order
    assert (tmp_path / "c-notes.jsonl").read_text() == "mine\n"


async def test_a_gateway_starting_deletes_what_is_past_the_bounds(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    for stamp in ("20261201T000000Z", "20261201T000000Z-2", "20261202T000000Z"):
        (tmp_path / f"c-{stamp}.jsonl").write_text(_line(0.0, 1))
    capture = _capture(path, max_files=1)
    capture.start()
    await capture.close()
    assert [p.name for p in capture.rotated()] == ["c-20261202T000000Z.jsonl"]


async def test_capture_files_are_the_gateways_alone(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    left = tmp_path / "left.jsonl"
    left.write_text("# an earlier gateway's capture\n")
    left.chmod(0o644)
    previous = os.umask(0)  # the widest umask: nothing is taken away from a file's mode
    try:
        for target in (path, left):
            capture = _capture(target)
            for i in range(3):  # the current file and rotated ones
                _served(capture, i)
                await capture.flush()
            for f in [target, *capture.rotated()]:
                assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    finally:
        os.umask(previous)


def test_capture_bounds_are_checked() -> None:
    for bad, message in (({"max_files": -1}, "max_files must be"),
                         ({"max_files": 1.5}, "max_files must be"),
                         ({"max_total_mb": 0}, "max_total_mb must be"),
                         ({"max_total_mb": 10, "rotate_mb": 64}, r"max_total_mb \(10\) must be "
                                                                 r">= rotate_mb \(64\)")):
        with pytest.raises(ValueError, match=message):
            GatewayConfig.from_dict({"capture": {"path": "x", **bad}})
    unbounded = GatewayConfig.from_dict({"capture": {"path": "x", "max_files": None,
                                                     "max_total_mb": None}}).capture
    assert unbounded is not None and (unbounded.max_files, unbounded.max_total_mb) == (None, None)

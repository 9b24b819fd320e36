"""Trace capture: served live requests become a fairgate JSONL trace that replays as it is,
with no prompt text in it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineConfig
from fairgate.cli import main
from gateway.config import GatewayConfig
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
    await h.gateway.capture.flush()
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
    assert captured == pytest.approx(gaps, abs=0.02)  # the arrival spacing is kept
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
        await h.gateway.capture.flush()
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

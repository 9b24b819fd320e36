"""The load generator against the scripted fake server, whose delays are the truth."""

from __future__ import annotations

import json
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from tuner.fake_server import SCRIPT, make_fake_app
from tuner.loadgen import BenchError, Progress, RunOptions, Target, run_workload
from tuner.report import Report, RequestResult
from tuner.traces import TraceRequest

ServerFactory = Callable[[web.Application], Awaitable[TestServer]]


async def _url(aiohttp_server: ServerFactory, app: web.Application) -> str:
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


def _requests(n: int, prompt: int = 40, output: int = 10, gap: float = 0.0) -> list[TraceRequest]:
    return [TraceRequest(i * gap, prompt, output) for i in range(n)]


async def test_ttft_and_itl_match_the_scripted_delays(aiohttp_server: ServerFactory) -> None:
    ttft, itl, n_out = 0.08, 0.02, 8
    url = await _url(aiohttp_server, make_fake_app(ttft=ttft, itl=itl))
    report = await run_workload(
        _requests(6, output=n_out, gap=0.03), url, options=RunOptions(salt=0)
    )
    assert report.failed == 0 and report.total.completed == 6
    for r in report.results:
        assert r.output_tokens == n_out and len(r.itl) == n_out - 1
        # asyncio may wake a timer up to its clock resolution early: allow 2 ms
        assert ttft - 0.002 <= r.ttft < ttft + 0.04  # type: ignore[operator]
        assert r.tpot == pytest.approx(itl, abs=0.004)
        assert r.e2e == pytest.approx(ttft + (n_out - 1) * itl, abs=0.05)
    gaps = [g for r in report.results for g in r.itl]
    assert statistics.median(gaps) == pytest.approx(itl, abs=0.003)
    assert report.total.ttft["median_ms"] == pytest.approx(ttft * 1000, abs=30)


async def test_request_body_and_model_discovery(aiohttp_server: ServerFactory) -> None:
    app = make_fake_app(model="tiny-1")
    url = await _url(aiohttp_server, app)
    reqs = [TraceRequest(0.0, 100, 7, tenant="acme", priority="interactive", api_key="ka")]
    report = await run_workload(reqs, url + "/v1", options=RunOptions(salt=3))
    body = app[SCRIPT].received[0]
    assert body["model"] == "tiny-1" and body["max_tokens"] == 7 and body["stream"] is True
    assert body["ignore_eos"] is True and body["stream_options"] == {"include_usage": True}
    assert (body["priority"], body["user"]) == ("interactive", "acme")
    assert len(body["prompt"]) + 1 == 100  # byte tokenizer: bytes + BOS
    assert report.results[0].prompt_tokens == 100  # the server's usage agrees
    assert report.config["model"] == "tiny-1"


async def test_chat_endpoint_and_counting_without_usage(aiohttp_server: ServerFactory) -> None:
    app = make_fake_app(itl=0.001, tokens_per_chunk=3, send_usage=False)
    url = await _url(aiohttp_server, app)
    target = Target(url, endpoint="chat", model="m")
    report = await run_workload(_requests(2, output=9), target)
    assert app[SCRIPT].received[0]["messages"][0]["role"] == "user"
    # 9 tokens in chunks of 3, no usage chunk: counted from the content chunks
    assert [r.output_tokens for r in report.results] == [3, 3]
    assert all(len(r.itl) == 2 for r in report.results)
    app2 = make_fake_app(tokens_per_chunk=3)
    report2 = await run_workload(
        _requests(1, output=9), Target(await _url(aiohttp_server, app2), endpoint="chat")
    )
    assert report2.results[0].output_tokens == 9  # usage wins when it is there


async def test_statuses_are_counted_with_messages(aiohttp_server: ServerFactory) -> None:
    url = await _url(aiohttp_server, make_fake_app(statuses=[200, 429, 401, 200]))
    report = await run_workload(_requests(8), url)
    assert report.total.completed == 4
    assert report.total.failed == {"HTTP 429": 2, "HTTP 401": 2}
    assert report.errors["HTTP 429"] == "scripted status 429"
    text = report.format()
    assert "HTTP 429:" in text and "rate limited" in text and "unauthorized" in text


async def test_api_keys_per_tenant(aiohttp_server: ServerFactory) -> None:
    url = await _url(aiohttp_server, make_fake_app(api_keys=["good"]))
    reqs = [
        TraceRequest(0.0, 10, 2, tenant="a"),
        TraceRequest(0.0, 10, 2, tenant="b", api_key="bad"),
    ]
    report = await run_workload(reqs, Target(url, api_key="good"))
    assert [r.status for r in report.results] == ["ok", "HTTP 401"]
    assert set(report.tenants) == {"a", "b"}
    assert "Per tenant" in report.format()


async def test_concurrency_cap_is_respected(aiohttp_server: ServerFactory) -> None:
    app = make_fake_app(ttft=0.02, itl=0.005)
    url = await _url(aiohttp_server, app)
    seen: list[Progress] = []
    report = await run_workload(
        _requests(30, output=4), url, options=RunOptions(max_concurrency=4), on_progress=seen.append
    )
    assert report.total.completed == 30
    assert app[SCRIPT].max_in_flight == 4
    assert seen[-1].done == seen[-1].total == 30


async def test_unreachable_url_is_one_clear_error() -> None:
    with pytest.raises(BenchError, match=r"cannot reach http://127\.0\.0\.1:9"):
        await run_workload(_requests(1), "http://127.0.0.1:9")
    report = await run_workload(_requests(2), Target("http://127.0.0.1:9", model="m"))
    assert report.total.failed == {"connection error": 2}
    assert "is the server running" in report.format()


async def _garbage(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b'data: {"choices":[{"text":"a","finish_reason":null}]}\n\n')
    await resp.write(b"data: {this is not json}\n\n")
    return resp


async def _stream_error(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b'data: {"error": {"message": "engine died"}}\n\n')
    return resp


@pytest.mark.parametrize(
    ("handler", "message"), [(_garbage, "Expecting"), (_stream_error, "engine died")]
)
async def test_broken_streams_are_counted(
    aiohttp_server: ServerFactory, handler: Any, message: str
) -> None:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    report = await run_workload(_requests(2), Target(await _url(aiohttp_server, app), model="m"))
    assert report.total.failed == {"stream error": 2}
    assert message in report.errors["stream error"]


async def test_report_json_csv_and_goodput(aiohttp_server: ServerFactory, tmp_path: Path) -> None:
    # The truth is 10x the ITL SLO: the fake server catches up on a fixed schedule after a
    # stall, so under load two chunks can share a read and halve the measured TPOT.
    url = await _url(aiohttp_server, make_fake_app(ttft=0.05, itl=0.05))
    # a TPOT SLO below the truth: no goodput; every gap within the ITL SLO
    options = RunOptions(slo_ttft=0.5, slo_tpot=0.005, slo_itl=1.0)
    report: Report = await run_workload(_requests(3, output=3), url, options=options)
    assert report.total.goodput == 0.0
    assert report.total.itl_attainment == {"gaps": 6, "met": 6, "fraction": 1.0}
    loose = Report(report.results, report.duration, slo_ttft=0.5, slo_tpot=0.1)
    assert loose.total.goodput == pytest.approx(3 / report.duration)
    assert loose.total.itl_attainment is None  # no ITL target
    report.write_json(tmp_path / "r.json")
    report.write_csv(tmp_path / "r.csv")
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["completed"] == 3 and len(data["requests"]) == 3
    assert data["slo"] == {"ttft_s": 0.5, "tpot_s": 0.005, "itl_s": 1.0}
    assert data["itl_attainment"] == {"gaps": 6, "met": 6, "fraction": 1.0}
    assert len(data["requests"][0]["itl_s"]) == 2
    rows = (tmp_path / "r.csv").read_text().splitlines()
    assert rows[0].startswith("index,tenant,priority") and len(rows) == 4


def _result(i: int, tenant: str, ttft: float | None, itl: list[float],
            status: str = "ok") -> RequestResult:
    e2e = None if ttft is None else ttft + sum(itl)
    return RequestResult(i, tenant, None, 0.0, status=status, output_tokens=len(itl) + 1,
                         ttft=ttft, e2e=e2e, itl=itl)


# TTFT 0.5 s, TPOT 50 ms, ITL 50 ms
HAND_MADE = [
    _result(0, "acme", 0.1, [0.02, 0.02, 0.2]),  # TPOT 80 ms misses; 2 of 3 gaps within ITL
    _result(1, "acme", 0.1, [0.01, 0.01]),  # meets both: the one good request; 2 of 2 gaps
    _result(2, "beta", 0.6, [0.01]),  # misses TTFT; its 1 gap is within ITL
    _result(3, "beta", None, [], status="HTTP 429"),  # no gap: one miss for its unfinished answer
]


def test_goodput_is_ttft_and_tpot_per_request_itl_attainment_every_gap() -> None:
    report = Report(HAND_MADE, duration=2.0, slo_ttft=0.5, slo_tpot=0.05, slo_itl=0.05)
    assert report.total.goodput == pytest.approx(1 / 2.0)  # request 1 alone
    assert report.total.itl_attainment == {"gaps": 7, "met": 5, "fraction": pytest.approx(5 / 7)}
    assert report.tenants["acme"].itl_attainment == {"gaps": 5, "met": 4, "fraction": 0.8}
    assert report.tenants["beta"].itl_attainment == {"gaps": 2, "met": 1, "fraction": 0.5}
    data = report.to_json()
    assert data["slo"] == {"ttft_s": 0.5, "tpot_s": 0.05, "itl_s": 0.05}
    assert data["goodput"] == pytest.approx(0.5)
    assert data["itl_attainment"] == {"gaps": 7, "met": 5, "fraction": pytest.approx(5 / 7)}
    assert data["tenants"]["acme"]["itl_attainment"]["met"] == 4
    text = report.format()
    assert "Request goodput (req/s) [TTFT<=500ms TPOT<=50ms]: 0.50" in text
    assert "ITL attainment [ITL<=50ms]:              71.43% (5 of 7 gaps)" in text


def test_itl_target_leaves_goodput_alone() -> None:
    """--slo-itl alone gives ITL attainment and no goodput; the TPOT that request 0 misses is
    goodput's; a TTFT or TPOT target alone gives goodput and no ITL attainment."""
    itl_only = Report(HAND_MADE, duration=2.0, slo_itl=0.05)
    assert itl_only.total.goodput is None and itl_only.total.itl_attainment is not None
    assert "Request goodput" not in itl_only.format() and "ITL attainment" in itl_only.format()
    tpot_only = Report(HAND_MADE, duration=2.0, slo_tpot=0.05)
    assert tpot_only.total.goodput == pytest.approx(2 / 2.0)  # requests 1 and 2
    assert tpot_only.total.itl_attainment is None and "ITL attainment" not in tpot_only.format()
    loose_tpot = Report(HAND_MADE, duration=2.0, slo_tpot=0.1, slo_itl=0.001)
    assert loose_tpot.total.goodput == pytest.approx(3 / 2.0)  # strict ITL costs no goodput
    assert loose_tpot.total.itl_attainment == {"gaps": 7, "met": 0, "fraction": 0.0}

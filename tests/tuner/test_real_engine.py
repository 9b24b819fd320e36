"""The load generator against a real `fairgate engine` (random:tiny on CPU, byte tokenizer)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from tests.support.processes import fairgate_engine
from tuner.loadgen import RunOptions, Target, run_workload
from tuner.traces import TraceRequest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("engine.server") is None,
    reason="engine.server is not written yet (issue: engine HTTP server); nothing to bench",
)


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    with fairgate_engine(timeout=120) as url:  # the default engine: torch on the CPU
        yield url


@pytest.mark.slow
async def test_bench_against_the_real_engine(engine_url: str) -> None:
    reqs = [TraceRequest(i * 0.05, 24, 6) for i in range(6)]
    report = await run_workload(reqs, engine_url, options=RunOptions(salt=0, request_timeout=120))
    assert report.total.failed == {}, report.errors
    for r in report.results:
        assert r.output_tokens == 6  # ignore_eos + max_tokens force the length
        assert r.prompt_tokens == 24  # byte tokenizer: 23 bytes + BOS
        assert r.ttft is not None and r.ttft > 0 and len(r.itl) >= 1
        assert r.e2e is not None and r.e2e >= r.ttft


@pytest.mark.slow
async def test_chat_against_the_real_engine(engine_url: str) -> None:
    report = await run_workload([TraceRequest(0.0, 16, 4)], Target(engine_url, endpoint="chat"))
    assert report.total.completed == 1, report.errors
    assert report.results[0].output_tokens == 4

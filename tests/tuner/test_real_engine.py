"""The load generator against a real `fairgate engine` (random:tiny on CPU, byte tokenizer)."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tuner.loadgen import RunOptions, Target, run_workload
from tuner.traces import TraceRequest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("engine.server") is None,
    reason="engine.server is not written yet (issue: engine HTTP server); nothing to bench",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "fairgate", "engine", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            if proc.poll() is not None:
                err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
                pytest.fail(f"`fairgate engine` exited with {proc.returncode}: {err[-2000:]}")
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail("`fairgate engine` did not answer /v1/models within 120 s")
                time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


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

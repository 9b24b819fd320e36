"""`fairgate bench` end to end: the command against a fake server in another process."""

from __future__ import annotations

import io
import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from fairgate.cli import main
from tuner.bench_cli import ProgressBar
from tuner.loadgen import Progress
from tuner.traces import load_trace

StartServer = Callable[..., str]  # the fake_server_process fixture (conftest.py)

SMALL = ["--scale-tokens", "0.02", "--num-requests", "6", "--rate", "100"]


def test_bench_prints_report_and_writes_files(
    fake_server_process: StartServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = fake_server_process("--ttft", "0.01", "--itl", "0.002")
    out, rows, trace = tmp_path / "r.json", tmp_path / "r.csv", tmp_path / "plan.jsonl"
    rc = main(
        [
            "bench",
            "--url",
            url,
            "--workload",
            "fixed",
            *SMALL,
            "--slo-ttft",
            "1",
            "--slo-tpot",
            "0.5",
            "--slo-itl",
            "0.5",
            "--json",
            str(out),
            "--csv",
            str(rows),
            "--save-trace",
            str(trace),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0
    assert "Successful requests:                     6" in text
    assert "Request goodput (req/s) [TTFT<=1000ms TPOT<=500ms]:" in text
    assert re.search(r"ITL attainment \[ITL<=500ms\]: +100\.00% \(12 of 12 gaps\)", text)
    assert "Median TTFT (ms)" in text and "P99 ITL (ms)" in text
    data = json.loads(out.read_text())
    assert data["completed"] == 6 and data["output_tokens"] == 6 * 3  # 128 * 0.02 ~ 3
    assert data["slo"] == {"ttft_s": 1.0, "tpot_s": 0.5, "itl_s": 0.5}
    assert data["goodput"] == pytest.approx(data["request_throughput"])  # every one met both
    assert data["itl_attainment"] == {"gaps": 12, "met": 12, "fraction": 1.0}
    assert len(rows.read_text().splitlines()) == 7
    assert len(load_trace(trace)) == 6


def test_bench_workload_file_per_tenant_and_bad_keys(
    fake_server_process: StartServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = fake_server_process("--api-key", "ka", "--api-key", "kb")
    mix = tmp_path / "mix.yaml"
    mix.write_text(
        "rate: 50\nduration: 0.5\ntenants:\n"
        "  - {tenant: alpha, api_key: ka, priority: interactive, workload: fixed}\n"
        "  - {tenant: beta, workload: uniform}\n"
    )
    args = ["--workload-file", str(mix), "--scale-tokens", "0.01", "--endpoint", "chat"]
    rc = main(["bench", "--url", url, "--api-key", "kb", *args])
    text = capsys.readouterr().out
    assert rc == 0 and "Per tenant" in text and "alpha" in text and "beta" in text
    assert "Failed requests:                         0" in text
    # beta falls back to --api-key: a wrong one fails beta's requests, alpha keeps its own key
    rc = main(["bench", "--url", url, "--api-key", "wrong", *args])
    text = capsys.readouterr().out
    assert rc == 0 and re.search(r"HTTP 401:\s+\d+ ", text)
    # no key of the run is accepted: GET /v1/models says so before anything is sent
    rc = main(["bench", "--url", url, "--api-key", "wrong", "--workload", "fixed", *SMALL])
    captured = capsys.readouterr()
    assert rc == 2 and captured.out == ""
    assert "/v1/models answered 401 (invalid API key); it refused every API key" in captured.err
    # with --model nothing is asked first, and every request fails
    rc = main(["bench", "--url", url, "--api-key", "wrong", "--model", "fake-model",
               "--workload", "fixed", *SMALL])
    captured = capsys.readouterr()
    assert rc == 1  # nothing succeeded
    assert re.search(r"HTTP 401:\s+6 ", captured.out)
    assert "every request failed (HTTP 401: invalid API key)" in captured.err


def test_bench_counts_429(
    fake_server_process: StartServer, capsys: pytest.CaptureFixture[str]
) -> None:
    url = fake_server_process("--status", "200,429")
    rc = main(["bench", "--url", url, "--workload", "fixed", *SMALL])
    out = capsys.readouterr().out
    assert rc == 0 and re.search(r"HTTP 429:\s+3 ", out)
    assert "rate limited" in out


def test_bench_user_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--url", "http://127.0.0.1:9", "--workload", "bogus"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown workload 'bogus'" in err and "mooncake" in err
    assert "Traceback" not in err
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"arrival": 0, "prompt_tokens": 5, "output_tokens": 2}\nnot json\n')
    rc = main(["bench", "--url", "http://127.0.0.1:9", "--trace", str(bad)])
    err = capsys.readouterr().err
    assert rc == 2 and f"{bad}:2: not valid JSON" in err
    rc = main(["bench", "--url", "http://127.0.0.1:9", "--workload", "fixed", *SMALL])
    err = capsys.readouterr().err
    assert rc == 2 and "cannot reach http://127.0.0.1:9" in err and "Traceback" not in err
    rc = main(["bench", "--url", "127.0.0.1:9", "--workload", "fixed", *SMALL])
    assert rc == 2 and "must start with http://" in capsys.readouterr().err


def test_progress_bar_draws_one_line() -> None:
    stream = io.StringIO()
    bar = ProgressBar(stream, width=10)
    bar(Progress(done=5, total=10, failed=1, elapsed=2.0))
    bar.close()
    assert stream.getvalue() == "\r[#####-----] 5/10, 1 failed     2.0 s\n"


def test_bench_slo_itl_help_says_its_meaning_changed(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--slo-tpot S each request's TPOT" in text
    assert "before, this flag bounded TPOT: use --slo-tpot for that" in text

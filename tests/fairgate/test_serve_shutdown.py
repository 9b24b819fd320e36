"""`fairgate serve` starts and stops cleanly: the "gateway on" banner only once it listens (a
port in use is one error line and no banner), and a SIGTERM after traffic exits 0 with the
usage written and none of nanobind's "leaked instance" lines (triton's objects, kept from the
collector by the startup heap freeze, were never freed at exit)."""

from __future__ import annotations

import json
import re
import signal
import socket
import sqlite3
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.processes import free_port, read_until, spawn_fairgate, wait_or_kill

BANNER = b"fairgate gateway on"


def write_config(folder: Path, port: int, gateway: dict[str, Any]) -> Path:
    path = folder / "fairgate.yaml"
    path.write_text(json.dumps({"database": f"sqlite:///{folder / 'fg.db'}",
                                "gateway": {"port": port, "metrics_port": None, **gateway}}))
    return path


def complete(url: str, key: str) -> dict[str, Any]:
    body = json.dumps({"model": "random:tiny", "prompt": "hello", "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return dict(json.loads(answer.read()))


def usage_rows(database: Path) -> int:
    with sqlite3.connect(database) as db:
        return int(db.execute("SELECT count(*) FROM fg_usage").fetchone()[0])


def test_sigterm_after_a_request_exits_0_with_usage_written_and_no_leak_lines(
        tmp_path: Path) -> None:
    port = free_port()
    proc = spawn_fairgate("serve", "-c", str(write_config(tmp_path, port, {})), cwd=tmp_path)
    try:
        started = read_until(proc, BANNER, 120).decode()
        key = re.search(r"fg-[A-Za-z0-9_-]+", started)  # the demo tenant's, printed before
        assert key is not None, started
        answer = complete(f"http://127.0.0.1:{port}", key.group())
        assert answer["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0].decode()
    assert proc.returncode == 0, rest
    assert "leaked" not in rest and "nanobind" not in rest, rest
    assert usage_rows(tmp_path / "fg.db") == 1  # the ledger flushed before the exit


def test_a_port_in_use_is_one_error_line_and_no_banner(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        # A remote backend nothing listens on: no engine to build, only the bind can fail.
        config = write_config(tmp_path, port, {"demo_tenant": False,
                                               "backends": [{"url": "http://127.0.0.1:9"}]})
        proc = spawn_fairgate("serve", "-c", str(config), cwd=tmp_path)
        output = proc.communicate(timeout=120)[0].decode()
        wait_or_kill(proc)
    assert proc.returncode == 2, output
    [line] = output.strip().splitlines()
    assert line.startswith(
        f"fairgate serve: error: cannot listen on 127.0.0.1:{port}: address already in use"), line

"""`fairgate serve` takes its admin key from $FAIRGATE_ADMIN_KEY over fairgate.yaml's (how the
Kubernetes base and compose give it), and refuses a short one at start with one line."""

from __future__ import annotations

import json
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import ADMIN_KEY_ENV
from tests.support.processes import free_port, spawn_fairgate, wait_for_output
from tests.support.waiting import poll_until

FILE_KEY = "admin-key-from-the-file"
ENV_KEY = "admin-key-from-the-environment"


def write_config(folder: Path, port: int) -> Path:
    path = folder / "fairgate.yaml"
    path.write_text(json.dumps({"database": f"sqlite:///{folder / 'fg.db'}", "gateway": {
        "port": port, "admin_key": FILE_KEY, "demo_tenant": False, "metrics_port": None,
        "backends": [{"url": "http://127.0.0.1:9"}]}}))  # nothing listens: no engine needed
    return path


def serve(config: Path, admin_key: str) -> subprocess.Popen[bytes]:
    return spawn_fairgate("serve", "-c", str(config), env={ADMIN_KEY_ENV: admin_key})


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[str, bytes]]:
    port = free_port()
    proc = serve(write_config(tmp_path, port), ENV_KEY)
    try:
        yield f"http://127.0.0.1:{port}", wait_for_output(proc, b"fairgate gateway on", 120)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def admin_status(url: str, key: str) -> int:
    request = urllib.request.Request(f"{url}/admin/tenants",
                                     headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as err:
        return err.code


def test_serve_takes_the_admin_key_from_the_environment(gateway: tuple[str, bytes]) -> None:
    url, startup = gateway
    assert f"admin key: ${ADMIN_KEY_ENV}".encode() in startup
    assert ENV_KEY.encode() not in startup
    assert poll_until(lambda: admin_status(url, ENV_KEY) == 200, 60, "the admin API answers")
    assert admin_status(url, FILE_KEY) == 401  # the file's key is overridden


def test_serve_refuses_a_short_admin_key_in_the_environment(tmp_path: Path) -> None:
    proc = serve(write_config(tmp_path, free_port()), "short")
    output = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 2
    assert output.strip().splitlines() == [
        f"fairgate serve: error: {ADMIN_KEY_ENV} must be a string of at least 16 characters"]

"""`fairgate bench` against a real gateway (simulated engine) that wants API keys: asked its
models without a key, the gateway answers 401, and bench stops with one line saying so, exit 2,
instead of sending every request with a guessed model. A workload file that names its model
needs no /v1/models, and says it used that; a mix whose tenants bring their own keys asks with
theirs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from fairgate.cli import main
from tests.gateway.helpers import Harness, start_gateway

SMALL = ["--scale-tokens", "0.02", "--num-requests", "4", "--rate", "100"]


@pytest.fixture
async def gateway(aiohttp_client: Any, tmp_path: Path) -> Harness:
    return await start_gateway(aiohttp_client, f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}")


async def bench(capsys: pytest.CaptureFixture[str], h: Harness, *argv: str
                ) -> tuple[int, str, str]:
    # In a thread: the command runs its own event loop while this one serves the gateway.
    url = str(h.client.make_url("")).rstrip("/")
    code = await asyncio.to_thread(main, ["bench", "--url", url, *argv])
    out, err = capsys.readouterr()
    return code, out, err


async def served_model(h: Harness) -> str:
    answer = await h.client.get("/v1/models", headers=h.auth("acme"))
    return str((await answer.json())["data"][0]["id"])


async def test_no_key_is_one_line_naming_the_401_and_exit_2(
        gateway: Harness, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = await bench(capsys, gateway, "--workload", "fixed", *SMALL)
    assert code == 2 and out == ""
    [line] = [e for e in err.splitlines() if "error" in e]
    assert line.startswith("fairgate bench: error: GET http://") and "/v1/models answered 401" in line
    assert line.endswith("it wants an API key: give --api-key KEY"), line
    code, _, err = await bench(capsys, gateway, "--api-key", "fg-wrong", "--workload", "fixed",
                               *SMALL)
    assert code == 2 and "answered 401" in err and "it refused every API key given" in err


async def test_with_a_key_it_sends_the_served_model(
        gateway: Harness, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = tmp_path / "run.json"
    code, out, _ = await bench(capsys, gateway, "--api-key", gateway.keys["acme"], "--workload",
                               "fixed", *SMALL, "--json", str(report))
    assert code == 0 and "Successful requests:                     4" in out
    assert json.loads(report.read_text())["config"]["model"] == await served_model(gateway)


async def test_a_workload_file_names_its_model_or_lends_its_tenants_key(
        gateway: Harness, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model, key = await served_model(gateway), gateway.keys["acme"]
    named = tmp_path / "named.yaml"
    named.write_text(f"model: {model}\ntenants:\n  - {{tenant: acme, api_key: {key}}}\n")
    code, out, err = await bench(capsys, gateway, "--workload-file", str(named), *SMALL)
    assert code == 0 and "Successful requests:                     4" in out
    assert f"fairgate bench: model {model!r}, named by {named}" in err
    unnamed = tmp_path / "unnamed.yaml"  # no model, no --api-key: asked with acme's key
    unnamed.write_text(f"tenants:\n  - {{tenant: acme, api_key: {key}}}\n")
    code, out, err = await bench(capsys, gateway, "--workload-file", str(unnamed), *SMALL)
    assert code == 0 and "Successful requests:                     4" in out
    assert "named by" not in err

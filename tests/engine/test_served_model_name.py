"""vLLM's names on the engine: `served_model_name` is the model's id in /v1/models, responses and
metrics, on `fairgate engine` and through the gateway (`fairgate serve`, embedded and remote
engines), with the model itself accepted as an alias; vLLM's keys for fairgate's knobs
(gpu_memory_utilization, ...) in fairgate.yaml."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client import generate_latest

from engine import EngineConfig
from engine.async_engine import AsyncEngine
from engine.config import canonical_knobs
from engine.server import METRICS_KEY, make_app
from engine.vllm_flags import KEY_ALIASES
from fairgate.config import FairgateConfig
from fairgate.engine_cli import build_config
from tests.gateway.helpers import create_tenants, start_gateway
from tests.support.engines import sim_config
from tests.support.processes import free_port, read_until, spawn_fairgate
from tests.support.waiting import poll_until, wait_for

NAMES = ["my-model", "my-model-v2"]
# vLLM's key -> fairgate's knob, written here from vLLM's EngineArgs (not from the table)
# (and two values for it)
VLLM_KEYS = {"gpu_memory_utilization": ("memory_fraction", 0.7, 0.5),
             "swap_space": ("swap_space_gb", 3.0, 2.0),
             "num_gpu_blocks_override": ("num_kv_blocks", 400, 300)}


# ---- the setting ----------------------------------------------------------------------------
@pytest.mark.parametrize(("value", "names"), [
    ("my-model", ("my-model",)), (NAMES, tuple(NAMES)), (None, ("random:tiny",))])
def test_served_names_one_or_a_list(value: Any, names: tuple[str, ...]) -> None:
    config = EngineConfig.from_dict({"served_model_name": value})
    assert config.served_model_names == names
    assert config.accepted_model_names == tuple(dict.fromkeys([*names, "random:tiny"]))
    assert EngineConfig.from_dict(config.to_dict()) == config  # as /admin/config and YAML write it


@pytest.mark.parametrize("bad", ["", [], [""], [" padded"], 3, [3], {"a": 1}])
def test_a_bad_served_name_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="served_model_name must be a name or a list of names"):
        EngineConfig(served_model_name=bad)


@pytest.mark.parametrize("alias", sorted({*VLLM_KEYS, *KEY_ALIASES}))
def test_vllms_keys_in_fairgate_yaml(tmp_path: Path, alias: str) -> None:
    assert KEY_ALIASES.get(alias) == VLLM_KEYS[alias][0], "the table and vLLM's names disagree"
    knob, value, other = VLLM_KEYS[alias]
    path = tmp_path / "fairgate.yaml"
    path.write_text(f"engine:\n  {alias}: {value}\n")
    assert getattr(FairgateConfig.load(path).engine, knob) == value  # fairgate serve
    assert getattr(build_config(str(path), []), knob) == value  # fairgate engine -c
    # the command line's knob name over the file's vLLM name: not "both given"
    assert getattr(build_config(str(path), [f"{knob}={other}"]), knob) == other
    assert getattr(build_config(None, [f"{alias}={value}"]), knob) == value  # --set
    assert getattr(EngineConfig().replace(**{alias: value}), knob) == value  # /admin/reconfigure
    with pytest.raises(ValueError, match=f"{alias} is vLLM's name for {knob}; give one"):
        canonical_knobs({alias: value, knob: value})
    path.write_text(f"engine:\n  {alias}: {value}\n  {knob}: {value}\n")
    with pytest.raises(ValueError, match=f"{alias} is vLLM's name for {knob}"):
        FairgateConfig.load(path)


# ---- the engine server ----------------------------------------------------------------------
Client = TestClient[web.Request, web.Application]


def served(**changes: Any) -> EngineConfig:
    return sim_config(served_model_name=NAMES, **changes)


async def complete(client: Any, model: str | None, headers: dict[str, str] | None = None,
                   stream: bool = False) -> Any:
    body: dict[str, Any] = {"prompt": "hi", "max_tokens": 2, "stream": stream}
    if model is not None:
        body["model"] = model
    return await client.post("/v1/completions", json=body, headers=headers or {})


async def test_the_engine_serves_its_names_and_the_model_as_an_alias(
        aiohttp_client: Any) -> None:
    client = await aiohttp_client(make_app(AsyncEngine(served(metrics_compat="vllm"))))
    cards = (await (await client.get("/v1/models")).json())["data"]
    assert [c["id"] for c in cards] == NAMES
    assert {c["root"] for c in cards} == {"random:tiny"}
    for model in [*NAMES, "random:tiny", None]:
        answer = await complete(client, model)
        assert answer.status == 200, await answer.text()
        assert (await answer.json())["model"] == "my-model"  # the first name, as vLLM answers
    streamed = await (await complete(client, "random:tiny", stream=True)).text()
    assert '"model":"my-model"' in streamed.replace(" ", "")
    missing = await complete(client, "other")
    assert missing.status == 404
    assert (await missing.json())["error"]["code"] == "model_not_found"
    exported = generate_latest(client.app[METRICS_KEY].registry).decode()
    assert 'vllm:num_requests_running{model_name="my-model"}' in exported
    assert 'model_name="random:tiny"' not in exported
    refused = await client.post("/admin/reconfigure", json={"served_model_name": "renamed"})
    assert refused.status == 400 and "served_model_name" in (await refused.text())


# ---- through the gateway --------------------------------------------------------------------
async def gateway_names(h: Any) -> list[str]:
    answer = await h.client.get("/v1/models", headers=h.auth("acme"))
    return [card["id"] for card in (await answer.json())["data"]]


async def check_gateway_serves(h: Any) -> None:
    assert await gateway_names(h) == ["my-model"]
    for model in [*NAMES, "random:tiny"]:
        answer = await h.post("acme", {"model": model, "prompt": "hi", "max_tokens": 2})
        assert answer.status == 200, await answer.text()
        assert (await answer.json())["model"] == "my-model"
    missing = await h.post("acme", {"model": "other", "prompt": "hi", "max_tokens": 2})
    assert missing.status == 404 and "my-model" in (await missing.json())["error"]["message"]


async def test_the_gateway_serves_an_embedded_engines_names(aiohttp_client: Any,
                                                            tmp_path: Path) -> None:
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    h = await start_gateway(aiohttp_client, db_url, engine=served(max_model_len=512))
    await check_gateway_serves(h)


async def test_the_gateway_learns_a_remote_engines_names(aiohttp_client: Any,
                                                         aiohttp_server: Any,
                                                         tmp_path: Path) -> None:
    engine = await aiohttp_server(make_app(AsyncEngine(served())))
    db_url = f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": str(engine.make_url("/"))}]})
    [backend] = h.gateway.pool.backends
    await wait_for(lambda: backend.healthy and backend.model_name == "my-model")
    assert set(backend.model_aliases) == {"my-model-v2", "random:tiny"}
    await check_gateway_serves(h)  # the path alias resolved to the id, which the engine takes


# ---- the real commands ----------------------------------------------------------------------
def http_json(url: str, body: dict[str, Any] | None = None,
              key: str | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def check_served_over_http(base: str, key: str | None = None) -> None:
    status, models = http_json(f"{base}/v1/models", key=key)
    assert status == 200 and models["data"][0]["id"] == "my-model"
    for model in ("my-model", "random:tiny"):
        status, answer = http_json(f"{base}/v1/completions",
                                   {"model": model, "prompt": "hi", "max_tokens": 2}, key)
        assert status == 200 and answer["model"] == "my-model", answer


def test_fairgate_engine_with_vllms_command_line() -> None:
    port = free_port()
    proc = spawn_fairgate("engine", "random:tiny", "--served-model-name", *NAMES,
                          "--port", str(port), "--max-num-seqs", "8",
                          "--max-num-batched-tokens", "512", "--max-model-len", "512",
                          "--num-gpu-blocks-override", "64", "--no-enable-prefix-caching",
                          "--set", "executor=sim", "--set", "sim_model=tiny")
    printed = b""
    try:
        printed = read_until(proc, b"serving ", timeout=120)
        assert b"serving random:tiny as my-model, my-model-v2 on " in printed
        check_served_over_http(f"http://127.0.0.1:{port}")
        status, config = http_json(f"http://127.0.0.1:{port}/admin/config")
        assert status == 200
        assert {k: config["config"][k] for k in ("max_num_seqs", "max_num_batched_tokens",
                                                 "max_model_len", "num_kv_blocks",
                                                 "enable_prefix_caching",
                                                 "served_model_name")} == {
            "max_num_seqs": 8, "max_num_batched_tokens": 512, "max_model_len": 512,
            "num_kv_blocks": 64, "enable_prefix_caching": False, "served_model_name": NAMES}
    finally:
        proc.send_signal(signal.SIGINT)
        output = (printed + proc.communicate(timeout=30)[0]).decode()
    assert proc.returncode in (0, 130), output


def test_fairgate_serve_with_a_served_model_name_in_fairgate_yaml(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 'fg.db'}"
    keys = asyncio.run(create_tenants(db, {"acme": {}}))
    port = free_port()
    config = tmp_path / "fairgate.yaml"
    config.write_text(json.dumps({
        "database": db,
        "engine": {"executor": "sim", "max_model_len": 512, "served_model_name": "my-model",
                   "gpu_memory_utilization": 0.8},
        "gateway": {"port": port, "metrics_port": None, "demo_tenant": False,
                    "admin_key": "admin-key-0123456789"}}))
    proc = spawn_fairgate("serve", "-c", str(config))
    try:
        read_until(proc, b"fairgate gateway on", timeout=120)
        base = f"http://127.0.0.1:{port}"
        poll_until(lambda: http_json(f"{base}/v1/models", key=keys["acme"])[0] == 200, 60,
                   "the gateway answers /v1/models")
        check_served_over_http(base, keys["acme"])
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)


def test_a_served_name_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="lists a name twice"):
        EngineConfig(served_model_name=["acme/tiny", "acme/tiny"])

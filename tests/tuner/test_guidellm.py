"""guidellm (the vLLM project's benchmark tool) against a real `fairgate engine` and a gateway,
offline, with a local tokenizer.

guidellm's backend check (`OpenAIHTTPBackend`, what `guidellm run` does first, in
`guidellm.benchmark.entrypoints.resolve_backend`): `validate()` sends `GET {target}/health` with
`Authorization: Bearer <api_key>` when a key is set, and only needs a 2xx; then, with no model
given, `default_model()` sends `GET {target}/v1/models` with the same header and takes
`data[0]["id"]`. A tiny `guidellm run` (2 synchronous streaming chat completions of synthetic
text) then checks the whole path, its tokenizer loaded from a local folder with the hub off.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

pytest.importorskip(
    "guidellm", reason="guidellm is not installed (pip install guidellm) - the guidellm "
    "compatibility tests need it")

from guidellm.backends import Backend  # noqa: E402
from guidellm.schemas.backends import OpenAIHTTPBackendArgs  # noqa: E402

from gateway.app import make_app  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from tests.gateway.helpers import SIM_ENGINE, ServerThread, create_tenants  # noqa: E402
from tests.support.processes import fairgate_engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def engine_url() -> Iterator[str]:
    """A real `fairgate engine` (simulated executor) in its own process."""
    with fairgate_engine("executor=sim", "sim_model=tiny", "num_kv_blocks=256") as url:
        yield url


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(url, tenant key) of a gateway served from a thread (like tests/gateway's
    `served_gateway`), with its own simulated engine."""
    db_url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('guidellm-gw') / 'served.db'}"
    keys = asyncio.run(create_tenants(db_url, {"acme": {}}))
    app = make_app(GatewayConfig(demo_tenant=False, max_body_bytes=4096), engine=SIM_ENGINE,
                   database=db_url)
    with ServerThread(app) as server:
        yield server.url, keys["acme"]


@pytest.fixture(params=["engine", "gateway"])
def server(request: pytest.FixtureRequest) -> tuple[str, str | None]:
    """(target, api key or None): the engine (no auth) or the gateway (a tenant's key)."""
    if request.param == "engine":
        return request.getfixturevalue("engine_url"), None
    url, key = request.getfixturevalue("gateway")
    return url, key


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local Hugging Face tokenizer folder (byte-level, no merges: every text round-trips)
    that `AutoTokenizer.from_pretrained(folder)` loads with the hub off."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("guidellm-tokenizer")
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "model_max_length": 100000}))
    return folder


def served_model(target: str, key: str | None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    request = urllib.request.Request(f"{target}/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as resp:
        return str(json.load(resp)["data"][0]["id"])


async def backend_check(target: str, key: str | None) -> str:
    """guidellm's own check, step by step as `resolve_backend` runs it: start up, validate
    (GET /health), resolve the default model (GET /v1/models), shut down."""
    backend: Any = Backend.create(
        OpenAIHTTPBackendArgs(target=target, api_key=SecretStr(key) if key else None))
    await backend.process_startup()
    try:
        await backend.validate()
        assert await backend.available_models()
        return str(await backend.default_model())
    finally:
        await backend.process_shutdown()


def test_backend_check_passes(server: tuple[str, str | None]) -> None:
    target, key = server
    model = served_model(target, key)
    assert asyncio.run(backend_check(target, key)) == model
    # guidellm strips a trailing /v1 from the target, as users often pass it
    assert asyncio.run(backend_check(f"{target}/v1", key)) == model


def test_backend_check_without_key_fails_at_the_gateway(gateway: tuple[str, str]) -> None:
    import httpx

    with pytest.raises((RuntimeError, httpx.HTTPStatusError)) as info:
        asyncio.run(backend_check(gateway[0], None))
    error = info.value.__cause__ if isinstance(info.value, RuntimeError) else info.value
    assert isinstance(error, httpx.HTTPStatusError) and error.response.status_code == 401


def test_tiny_guidellm_run_offline(server: tuple[str, str | None], tokenizer_dir: Path,
                                   tmp_path: Path) -> None:
    target, key = server
    backend = f"kind=openai_http,target={target}" + (f",api_key={key}" if key else "")
    out = tmp_path / "benchmarks.json"
    env = {**os.environ, **OFFLINE, "HF_HOME": str(tmp_path / "hf-home")}
    proc = subprocess.run(
        [sys.executable, "-m", "guidellm", "run", "--backend", backend,
         "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=2",
         "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=4",
         "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
         "--output", f"kind=json,path={out}", "--disable-console-interactive"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    log = proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.returncode == 0, log
    assert "backend validated with model" in proc.stdout, log
    (benchmark,) = json.loads(out.read_text())["benchmarks"]
    state = benchmark["scheduler_state"]
    assert (state["successful_requests"], state["errored_requests"]) == (2, 0), log
    successful = benchmark["requests"]["successful"]
    assert len(successful) == 2
    for stats in successful:
        assert stats["output"], stats  # streamed text came back
        body = json.loads(stats["request_args"])["body"]
        assert body["model"] == served_model(target, key)

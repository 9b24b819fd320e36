"""guidellm (the vLLM project's benchmark tool) against a real `fairgate engine` and a gateway,
offline, with a local tokenizer.

guidellm's backend check (`OpenAIHTTPBackend`, what `guidellm run` does first, in
`guidellm.benchmark.entrypoints.resolve_backend`): `validate()` sends `GET {target}/health` with
`Authorization: Bearer <api_key>` when a key is set, and only needs a 2xx; then, with no model
given, `default_model()` sends `GET {target}/v1/models` with the same header and takes
`data[0]["id"]`. A tiny `guidellm run` (2 synchronous streaming chat completions of synthetic
text) then checks the whole path, its tokenizer loaded from a local folder with the hub off.
Last, `guidellm run` with no model or tokenizer flag against a real `fairgate serve` (a tiny
Llama checkpoint on the torch executor): the id in /v1/models is all it needs.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
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
from tests.engine.ckpt import build_checkpoint  # noqa: E402
from tests.gateway.helpers import SIM_ENGINE, ServerThread, create_tenants  # noqa: E402
from tests.support.processes import fairgate_engine, fairgate_process, free_port  # noqa: E402
from tests.support.waiting import poll_until  # noqa: E402

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


def save_byte_level_tokenizer(folder: Path) -> int:
    """A Hugging Face tokenizer in `folder` (byte-level, no merges: every text round-trips)
    that `AutoTokenizer.from_pretrained(folder)` loads with the hub off: its vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "model_max_length": 100000}))
    return len(vocab)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("guidellm-tokenizer")
    save_byte_level_tokenizer(folder)
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


# ---- `guidellm run` with no model or tokenizer flag, against `fairgate serve` ------------------
# With no --tokenizer, guidellm's `resolve_tokenizer` takes the model id /v1/models answers, and
# its synthetic data loads `AutoTokenizer.from_pretrained(model id)`. Two ids a user has resolve
# offline: a Hugging Face name served with `served_model_name`, the checkpoint where
# `huggingface-cli download` leaves it (the hub cache, found by HF_HOME); and, with no name
# served, the checkpoint folder's path.

HF_NAME = "fairgate-test/tiny-llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"  # refs/main: the snapshot of the name
GUIDELLM = (shutil.which("guidellm", path=str(Path(sys.executable).parent))
            or shutil.which("guidellm"))


@dataclass(frozen=True)
class Served:
    """How `fairgate serve` serves the checkpoint and where guidellm looks for its tokenizer."""

    served_model_name: str | None  # engine.served_model_name (None: the model path is the id)
    model_id: str  # the id in /v1/models, which guidellm loads its tokenizer by
    hf_home: Path  # guidellm's HF_HOME


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(HF_HOME, snapshot folder): a tiny Llama and its byte-level tokenizer, laid out as
    `huggingface-cli download fairgate-test/tiny-llama` leaves them in the hub cache."""
    hf_home = tmp_path_factory.mktemp("guidellm-hf-home")
    repo = hf_home / "hub" / f"models--{HF_NAME.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    vocab_size = 257  # the byte-level tokenizer's 256 bytes and its end-of-text token
    build_checkpoint(snapshot, vocab_size=vocab_size, bos_token_id=None,
                     eos_token_id=vocab_size - 1, pad_token_id=None)
    assert save_byte_level_tokenizer(snapshot) == vocab_size  # over build_checkpoint's own
    return hf_home, snapshot


@pytest.fixture(params=["hugging-face-name", "checkpoint-path"])
def served(request: pytest.FixtureRequest, hub_cache: tuple[Path, Path],
           tmp_path: Path) -> Served:
    hf_home, snapshot = hub_cache
    if request.param == "hugging-face-name":
        return Served(HF_NAME, HF_NAME, hf_home)
    empty_home = tmp_path / "empty-hf-home"  # the path alone must find the tokenizer
    empty_home.mkdir()
    return Served(None, str(snapshot), empty_home)


@pytest.fixture
def fairgate_serve(served: Served, hub_cache: tuple[Path, Path],
                   tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(url, tenant key) of a real `fairgate serve` process, its embedded engine running the
    checkpoint on the torch executor under `served`'s name."""
    db = f"sqlite:///{tmp_path / 'fairgate.db'}"
    key = asyncio.run(create_tenants(db, {"acme": {}}))["acme"]
    engine: dict[str, Any] = {"model": str(hub_cache[1]), "max_model_len": 512,
                              "num_kv_blocks": 256}
    if served.served_model_name is not None:
        engine["served_model_name"] = served.served_model_name
    port = free_port()
    config = tmp_path / "fairgate.yaml"
    config.write_text(json.dumps({
        "database": db, "engine": engine,
        "gateway": {"port": port, "metrics_port": None, "demo_tenant": False,
                    "admin_key": "admin-key-0123456789"}}))
    with fairgate_process("serve", "-c", str(config), ready=b"fairgate gateway on",
                          timeout=120, sig=signal.SIGTERM):
        url = f"http://127.0.0.1:{port}"
        poll_until(lambda: served_model(url, key), 60, "the gateway answers /v1/models")
        yield url, key


@pytest.mark.skipif(GUIDELLM is None, reason="no guidellm executable in this virtual "
                    "environment or on PATH (pip install guidellm)")
def test_guidellm_run_against_fairgate_serve_needs_no_model_flags(
        served: Served, fairgate_serve: tuple[str, str], tmp_path: Path) -> None:
    url, key = fairgate_serve
    assert served_model(url, key) == served.model_id
    env = {**os.environ, **OFFLINE, "HF_HOME": str(served.hf_home),
           "COLUMNS": "1000"}  # rich would fold a long model id over lines
    for attempt in (1, 2):
        proc = subprocess.run(
            [str(GUIDELLM), "run", "--backend", f"kind=openai_http,target={url},api_key={key}",
             "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4",
             "--data", "kind=synthetic_text,prompt_tokens=64,output_tokens=16"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        log = proc.stdout[-4000:] + proc.stderr[-4000:]
        assert proc.returncode == 0, log
        assert f"using model '{served.model_id}' as tokenizer" in proc.stdout, log
        report = json.loads((tmp_path / "benchmarks.json").read_text())
        (benchmark,) = report["benchmarks"]
        state = benchmark["scheduler_state"]
        # guidellm's own race, seen under a loaded suite: it finalizes the benchmark with the
        # last request still counted as processing (no error, no incomplete request; the server
        # answered it). That run says nothing about the server: run once more, same checks.
        if attempt == 1 and state["processing_requests"] and not state["errored_requests"]:
            continue
        break
    given = report["config"]["spec"]  # the run's arguments: no model, no tokenizer
    assert (given["backend"]["model"], given["tokenizer"]["model"]) == ("", None), given
    errors = [r["info"]["error"] for r in benchmark["requests"]["errored"] or []]
    assert (state["successful_requests"], state["errored_requests"]) == (4, 0), (errors, log)
    successful = benchmark["requests"]["successful"]
    assert len(successful) == 4
    for stats in successful:
        assert json.loads(stats["request_args"])["body"]["model"] == served.model_id
        # the usage fairgate streamed back: the prompt as the server's tokenizer counts it
        # (the 64 synthetic tokens and the chat template's), and every token asked for
        assert stats["prompt_tokens"] >= 64 and stats["output_tokens"] == 16, stats

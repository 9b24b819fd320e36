"""The prompt tokenized once: a gateway holding a `kind: fairgate` backend's own tokenizer
(`backends[].tokenizer`, the engine's model folder) sends the prompt as that engine's token ids
(the `prompt_token_ids` extension), and the engine runs them without tokenizing again. The
seam: what the gateway sends is what the engine would have rendered itself, for a completion
and for a chat through the model's chat template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from engine import EngineConfig
from engine.async_engine import AsyncEngine
from engine.server import make_app as make_engine_app
from protocol.openai import PROMPT_IDS, parse_request, prompt_token_ids
from tests.engine.ckpt import build_checkpoint
from tests.gateway.helpers import start_gateway

TEMPLATE = "{% for m in messages %}w{{ loop.index + 10 }} {{ m['content'] }} {% endfor %}w9"
CHAT = [{"role": "system", "content": "w4 w5"}, {"role": "user", "content": "w6 w7 w8"}]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_checkpoint(tmp_path_factory.mktemp("tiny-llama"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


class Engine:
    """A real engine app over the tiny checkpoint that records each body it was sent and
    counts its own tokenizer's encode calls."""

    def __init__(self, folder: Path) -> None:
        self.engine = AsyncEngine(EngineConfig(model=str(folder), executor="torch",
                                               max_num_seqs=4, max_num_batched_tokens=128,
                                               max_model_len=128))
        self.bodies: list[dict[str, Any]] = []
        self.encodes = 0
        tokenizer = self.engine.tokenizer
        encode = tokenizer.encode

        def counted(text: str, add_special_tokens: bool = True) -> list[int]:
            self.encodes += 1
            return encode(text, add_special_tokens)

        tokenizer.encode = counted  # type: ignore[method-assign]

        @web.middleware
        async def record(request: web.Request, handler: Any) -> web.StreamResponse:
            if request.method == "POST" and request.path.startswith("/v1/"):
                self.bodies.append(json.loads(await request.read()))
            return await handler(request)

        self.app = make_engine_app(self.engine)
        self.app.middlewares.insert(0, record)

    def own_rendering(self, body: dict[str, Any], endpoint: str) -> list[int]:
        """What the engine renders for `body` without the extension (its own tokenizer)."""
        req = parse_request({k: v for k, v in body.items() if k != PROMPT_IDS}, endpoint)
        return prompt_token_ids(req, self.engine.tokenizer)


async def gateway_over(aiohttp_client: Any, aiohttp_server: Any, db_url: str,
                       engine: Engine, **backend: Any) -> Any:
    server = await aiohttp_server(engine.app)
    return await start_gateway(aiohttp_client, db_url, gateway={
        "backends": [{"url": str(server.make_url("/v1")), **backend}]})


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
async def test_the_engine_runs_the_gateways_ids_as_it_would_have_rendered_them(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str, model_folder: Path,
        endpoint: str) -> None:
    engine = Engine(model_folder)
    h = await gateway_over(aiohttp_client, aiohttp_server, db_url, engine,
                           tokenizer=str(model_folder))
    if endpoint == "chat":
        resp = await h.post("acme", {"messages": CHAT, "max_tokens": 3},
                            path="/v1/chat/completions")
    else:
        resp = await h.post("acme", {"prompt": "w4 w5 w6 w7 w8 w9", "max_tokens": 3})
    assert resp.status == 200, await resp.text()
    usage = (await resp.json())["usage"]
    sent = engine.bodies[-1]
    engine.encodes = 0
    own = engine.own_rendering(sent, endpoint)
    assert engine.encodes == 1  # own_rendering tokenized; the request itself did not
    assert sent[PROMPT_IDS] == own and usage["prompt_tokens"] == len(own)
    if endpoint == "chat":  # rendered through the checkpoint's template, not the plain one
        assert own == [11, 4, 5, 12, 6, 7, 8, 9]


async def test_without_the_backends_tokenizer_the_prompt_goes_as_text(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str, model_folder: Path) -> None:
    """gateway.tokenizer counts prompts, but it may be another model's than an engine's: no ids."""
    engine = Engine(model_folder)
    server = await aiohttp_server(engine.app)
    h = await start_gateway(aiohttp_client, db_url, gateway={
        "tokenizer": str(model_folder / "tokenizer.json"),
        "backends": [{"url": str(server.make_url("/v1"))}]})
    resp = await h.post("acme", {"prompt": "w4 w5 w6", "max_tokens": 2})
    assert resp.status == 200, await resp.text()
    assert PROMPT_IDS not in engine.bodies[-1] and engine.encodes == 1
    assert (await resp.json())["usage"]["prompt_tokens"] == 3  # w4 w5 w6


async def test_a_clients_prompt_token_ids_are_not_passed_on(
        aiohttp_client: Any, aiohttp_server: Any, db_url: str, model_folder: Path) -> None:
    """The extension is the gateway's to send: a client's ids neither replace its messages
    nor reach the engine."""
    engine = Engine(model_folder)
    h = await gateway_over(aiohttp_client, aiohttp_server, db_url, engine)
    resp = await h.post("acme", {"messages": CHAT, "max_tokens": 2, PROMPT_IDS: [5] * 40},
                        path="/v1/chat/completions")
    assert resp.status == 200, await resp.text()
    sent = engine.bodies[-1]
    assert PROMPT_IDS not in sent
    own = engine.own_rendering(sent, "chat")
    assert (await resp.json())["usage"]["prompt_tokens"] == len(own) != 40


async def test_the_engine_takes_the_extension_and_checks_it(
        aiohttp_client: Any, model_folder: Path) -> None:
    engine = Engine(model_folder)
    client = await aiohttp_client(engine.app)
    body = {"messages": CHAT, "max_tokens": 2, PROMPT_IDS: [1, 7, 7, 7]}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["usage"]["prompt_tokens"] == 4 and engine.encodes == 0
    bad = await client.post("/v1/completions", json={"prompt": "w4", PROMPT_IDS: [1, -2]})
    error = (await bad.json())["error"]
    assert bad.status == 400 and error["param"] == PROMPT_IDS, error
    assert "prompt_token_ids[1] is -2" in error["message"]


def test_a_backend_tokenizer_that_is_not_there_names_the_key(tmp_path: Path) -> None:
    from gateway.backends.remote import RemoteBackend
    from gateway.config import BackendConfig

    config = BackendConfig(url="http://127.0.0.1:9", tokenizer=str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match=r"^gateway.backends\[\].tokenizer '.*nothing': .*"
                                         r"tokenizer.json: file not found"):
        RemoteBackend(config, default_max_model_len=128)


def test_replicas_of_one_model_share_its_tokenizer(model_folder: Path) -> None:
    """A prompt counted at admission with the pool's primary is not rendered again for the
    replica it is sent to: one tokenizer object per path."""
    from gateway.backends.remote import RemoteBackend
    from gateway.config import BackendConfig

    a, b = (RemoteBackend(BackendConfig(url=f"http://127.0.0.1:{port}",
                                        tokenizer=str(model_folder)), default_max_model_len=128)
            for port in (9, 10))
    assert a.tokenizer is b.tokenizer and a.engines_tokenizer
    req = parse_request({"messages": CHAT}, "chat")
    counted = a.count_prompt(req)
    assert b.prompt_ids(req) is req.token_ids and counted == len(req.token_ids)

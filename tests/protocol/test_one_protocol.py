"""One table of request bodies through every surface: the engine server, the gateway with the
embedded engine, the gateway with a remote engine. Each must answer the same status and, when
it runs the request, hand its engine the same prompt token ids and the same SamplingParams."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine import EngineConfig, SamplingParams
from engine.async_engine import AsyncEngine
from engine.server import make_app as make_engine_app
from gateway.backends import EmbeddedBackend
from tests.gateway.helpers import start_gateway

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n"
            "{% endfor %}[assistant] ")
ENGINE = EngineConfig(executor="sim", max_model_len=512, max_num_seqs=8,
                      max_num_batched_tokens=512)
USER = [{"role": "user", "content": "hello"}]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass
class Recorder:
    """Wraps an AsyncEngine's generate: what each surface asked its engine to run."""

    engine: AsyncEngine
    calls: list[tuple[list[int], SamplingParams]] = field(default_factory=list)

    def __post_init__(self) -> None:
        generate = self.engine.generate

        def recording(request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      **kwargs: Any) -> Any:
            self.calls.append((list(prompt_token_ids), params))
            return generate(request_id, prompt_token_ids, params, **kwargs)

        self.engine.generate = recording  # type: ignore[method-assign]


def engine_with_template() -> Recorder:
    engine = AsyncEngine(ENGINE)
    engine.tokenizer.chat_template = TEMPLATE  # type: ignore[attr-defined]
    return Recorder(engine)


CASES: list[tuple[str, str, dict[str, Any] | bytes, int]] = [
    ("completion defaults", COMPLETIONS, {"prompt": "hi"}, 200),
    ("chat defaults through the template", CHAT, {"messages": USER}, 200),
    ("chat, max_completion_tokens", CHAT, {"messages": USER, "max_completion_tokens": 5}, 200),
    ("sampling values", COMPLETIONS, {"prompt": "hi", "temperature": 0.5, "top_p": 0.9,
                                      "top_k": 5, "seed": 7, "max_tokens": 4}, 200),
    ("top_k -1 is off", COMPLETIONS, {"prompt": "hi", "top_k": -1}, 200),
    ("stop strings and ids", COMPLETIONS, {"prompt": "hi", "stop": ["x", "yz"],
                                           "stop_token_ids": [5, 9], "max_tokens": 3}, 200),
    ("single stop string", CHAT, {"messages": USER, "stop": "zz", "max_tokens": 3}, 200),
    ("token-id prompt", COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 2}, 200),
    ("assistant content null", CHAT, {"messages": [*USER, {"role": "assistant",
                                                           "content": None}, *USER]}, 200),
    ("text parts", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}, 200),
    ("model named", COMPLETIONS, {"model": "random:tiny", "prompt": "hi"}, 200),
    ("stop_token_ids not a list", COMPLETIONS, {"prompt": "hi", "stop_token_ids": "x"}, 400),
    ("stop_token_ids negative", COMPLETIONS, {"prompt": "hi", "stop_token_ids": [-1]}, 400),
    ("user content null", CHAT, {"messages": [{"role": "user", "content": None}]}, 400),
    ("response_format json", CHAT, {"messages": USER,
                                    "response_format": {"type": "json_object"}}, 400),
    ("tools", CHAT, {"messages": USER, "tools": [{"type": "function",
                                                  "function": {"name": "f"}}]}, 400),
    ("n=2", COMPLETIONS, {"prompt": "hi", "n": 2}, 400),
    ("logprobs", COMPLETIONS, {"prompt": "hi", "logprobs": 2}, 400),
    ("temperature out of range", COMPLETIONS, {"prompt": "hi", "temperature": 900}, 400),
    ("min_tokens over max_tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": 2,
                                                 "min_tokens": 3}, 400),
    ("too long", COMPLETIONS, {"prompt": "hi", "max_tokens": 600}, 400),
    ("lone surrogate in a prompt", COMPLETIONS, b'{"prompt": "a\\ud800b"}', 400),
    ("lone surrogate in chat", CHAT,
     b'{"messages": [{"role": "user", "content": "a\\udfffb"}]}', 400),
    ("surrogate pair is fine", COMPLETIONS, b'{"prompt": "a\\ud83d\\ude00b"}', 200),
    ("unknown model", COMPLETIONS, {"model": "gpt-9", "prompt": "hi"}, 404),
    ("token-id prompt with a negative id", COMPLETIONS, {"prompt": [1, -3]}, 400),
    ("token-id prompt of booleans", COMPLETIONS, {"prompt": [True, False]}, 400),
    ("token-id prompt of integral floats", COMPLETIONS, {"prompt": [1.0, 2.0],
                                                         "max_tokens": 2}, 200),
    ("integral floats are integers", COMPLETIONS, {"prompt": "hi", "max_tokens": 3.0,
                                                   "top_k": 5.0}, 200),
    ("top_k past its bound", COMPLETIONS, {"prompt": "hi", "top_k": 10**18}, 400),
    ("min_tokens past its bound", COMPLETIONS, {"prompt": "hi", "min_tokens": 2**31}, 400),
    ("max_tokens past any context", COMPLETIONS, {"prompt": "hi", "max_tokens": 2**31}, 400),
    ("seed past int64", COMPLETIONS, {"prompt": "hi", "seed": 2**63}, 400),
    ("a bad max_tokens beside max_completion_tokens", CHAT,
     {"messages": USER, "max_completion_tokens": 3, "max_tokens": "x"}, 400),
]


@dataclass
class Surface:
    name: str
    post: Any  # (path, data) -> response
    recorder: Recorder


@pytest.fixture
def db_url(tmp_path: Any) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"


@pytest.fixture
async def surfaces(aiohttp_client: Any, aiohttp_server: Any, db_url: str) -> list[Surface]:
    direct = engine_with_template()
    engine_client = await aiohttp_client(make_engine_app(direct.engine))
    embedded = engine_with_template()
    gw_embedded = await start_gateway(aiohttp_client, db_url,
                                      backends=[EmbeddedBackend(embedded.engine)])
    remote = engine_with_template()
    server = await aiohttp_server(make_engine_app(remote.engine))
    gw_remote = await start_gateway(
        aiohttp_client, db_url.replace(".db", "-remote.db"),
        gateway={"backends": [{"url": str(server.make_url(""))}]})

    def poster(client: Any, headers: dict[str, str]) -> Any:
        async def post(path: str, data: bytes) -> Any:
            return await client.post(path, data=data, headers=headers)
        return post

    return [Surface("engine server", poster(engine_client, {}), direct),
            Surface("gateway, embedded", poster(gw_embedded.client, gw_embedded.auth("acme")),
                    embedded),
            Surface("gateway, remote", poster(gw_remote.client, gw_remote.auth("acme")), remote)]


async def test_every_surface_reads_a_body_the_same(surfaces: list[Surface]) -> None:
    for name, path, body, status in CASES:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        seen = []
        for surface in surfaces:
            before = len(surface.recorder.calls)
            resp = await surface.post(path, data)
            text = await resp.text()
            assert resp.status == status, f"{name} via {surface.name}: {text}"
            answer = json.loads(text)
            if status != 200:
                assert set(answer["error"]) == {"message", "type", "param", "code"}
                seen.append((answer["error"]["code"], answer["error"]["param"]))
                assert len(surface.recorder.calls) == before, f"{name} ran via {surface.name}"
                continue
            assert len(surface.recorder.calls) == before + 1, f"{name} via {surface.name}"
            seen.append(surface.recorder.calls[-1])
        assert all(s == seen[0] for s in seen), f"{name}: {list(zip(surfaces, seen, strict=True))}"


async def test_defaults_and_template_are_openais(surfaces: list[Surface]) -> None:
    """What the shared answers are, not only that they agree: OpenAI's and vLLM's defaults,
    the model's chat template."""
    for surface in surfaces:
        await surface.post(COMPLETIONS, json.dumps({"prompt": "hi"}).encode())
        prompt, params = surface.recorder.calls[-1]
        assert params.max_tokens == 16 and params.temperature == 1.0 and params.top_p == 1.0
        await surface.post(CHAT, json.dumps({"messages": USER}).encode())
        prompt, params = surface.recorder.calls[-1]
        assert bytes(prompt).decode() == "[user] hello\n[assistant] ", surface.name
        assert params.max_tokens == ENGINE.max_model_len - len(prompt)
        assert params.temperature == 1.0

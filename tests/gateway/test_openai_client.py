"""The official `openai` client against a real `fairgate serve` process, with the demo key it
prints at first start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.processes import fairgate_process, free_port


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[str, str]]:
    port = free_port()
    config = tmp_path / "fairgate.yaml"
    config.write_text(f"database: sqlite:///{tmp_path / 'fg.db'}\n"
                      "engine:\n  executor: sim\n  max_model_len: 1024\n"
                      f"gateway:\n  port: {port}\n  metrics_port: 0\n")
    # the metrics line comes once every listener is open; the demo key was printed before it
    with fairgate_process("serve", "-c", str(config), ready=b"metrics on http://",
                          timeout=120) as (_, printed):
        yield f"http://127.0.0.1:{port}/v1", _demo_key(printed)


def _demo_key(printed: bytes) -> str:
    keys = [line.strip() for line in printed.decode().splitlines()
            if line.strip().startswith("fg-")]
    assert len(keys) == 1, f"fairgate serve printed no demo key: {printed[-2000:]!r}"
    return keys[0]


def test_openai_client_chat_and_completions(serve: tuple[str, str]) -> None:
    base_url, key = serve
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    assert [m.id for m in client.models.list()] == ["random:tiny"]
    done = client.completions.create(model="random:tiny", prompt="hello", max_tokens=5)
    assert done.usage is not None and done.usage.completion_tokens == 5
    assert done.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="random:tiny", max_tokens=4,
                                          messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.role == "assistant" and chat.usage is not None
    chunks = list(client.completions.create(model="random:tiny", prompt="hi", max_tokens=6,
                                            stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"
    stream = client.chat.completions.create(
        model="random:tiny", max_tokens=6, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hi"}])
    events = list(stream)
    assert events[-1].usage is not None and events[-1].usage.completion_tokens == 6
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="fg-wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="random:tiny", prompt="x", max_tokens=5000)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=5)

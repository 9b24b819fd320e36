"""The official `openai` client against a real `fairgate serve` process, with the demo key it
prints at first start."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.gateway.helpers import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[tuple[str, str]]:
    port = free_port()
    config = tmp_path / "fairgate.yaml"
    config.write_text(f"database: sqlite:///{tmp_path / 'fg.db'}\n"
                      "engine:\n  executor: sim\n  max_model_len: 1024\n"
                      f"gateway:\n  port: {port}\n  metrics_port: 0\n")
    proc = subprocess.Popen([sys.executable, "-m", "fairgate", "serve", "-c", str(config)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        key = _demo_key(proc)
        _wait_healthy(f"http://127.0.0.1:{port}/healthz", proc)
        yield f"http://127.0.0.1:{port}/v1", key
    finally:
        proc.terminate()
        proc.wait(20)


def _demo_key(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.strip().startswith("fg-"):
            return line.strip()
    raise AssertionError(f"fairgate serve printed no demo key (exit {proc.poll()})")


def _wait_healthy(url: str, proc: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            assert proc.poll() is None, "fairgate serve exited"
            time.sleep(0.1)
    raise AssertionError("fairgate serve did not become healthy")


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

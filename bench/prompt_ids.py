"""The prompt tokenized once: what a `kind: fairgate` backend's prompts as token ids save.

A real `fairgate engine` (a tiny random Llama on the CPU, with a byte-level BPE tokenizer of
16,000 tokens trained here on Python's own library, and a chat template) behind two `fairgate
serve` gateways that both count prompts with that tokenizer:

- text: `gateway.tokenizer` (counting only): the chat goes as messages, the engine renders
  and tokenizes it again;
- ids: the backend's own `tokenizer` (issue 28): the chat goes as `prompt_token_ids`, the
  engine runs them as given.

The same chat requests (a 4,000-character user message, max_tokens 1, non-streaming) go through
each gateway in interleaved rounds; the engine's and each gateway's CPU per request (utime +
stime from /proc) are compared within the run.

    .venv/bin/python bench/prompt_ids.py [--requests 300] [--concurrency 8] [--rounds 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from bench.common import (  # noqa: E402
    PYTHON,
    ROOT,
    free_port,
    machine,
    rotated,
    start_gateway,
    stop,
    wait_healthy,
)
from bench.gateway_cpu import cpu_seconds, median  # noqa: E402

VOCAB = 16_000
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|start|>{{ m['role'] }}\n{{ m['content'] }}"
            "<|end|>\n{% endfor %}<|start|>assistant\n")


def build_model(folder: Path) -> None:
    """A byte-level BPE trained on the standard library's sources and a random tiny Llama."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, LlamaConfig

    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:200]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[
        "<s>", "</s>", "<|start|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train([str(p) for p in sources], trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "chat_template": TEMPLATE}))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, bos_token_id=0, eos_token_id=1)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)


def chat_body(model: str) -> bytes:
    """A chat whose user message is 4,000 characters of English-like text."""
    sentence = ("the engine schedules every request within its token budget and returns the "
                "blocks of a finished sequence to the pool before the next step begins ")
    text = (sentence * (4000 // len(sentence) + 1))[:4000]
    return json.dumps({"model": model, "max_tokens": 1, "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": text}]}).encode()


async def drive(url: str, key: str, body: bytes, requests: int, concurrency: int) -> None:
    from gateway.upstream import UpstreamPool

    pool = UpstreamPool(url, {"Authorization": f"Bearer {key}"})
    left = [requests]

    async def worker() -> None:
        while left[0] > 0:
            left[0] -= 1
            resp = await pool.request("POST", "/v1/chat/completions", body, timeout=60)
            try:
                data = await resp.read()
            finally:
                resp.close()
            if resp.status != 200:
                raise SystemExit(f"{url}: HTTP {resp.status}: {data[:300]!r}")

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        pool.close()


async def run(args: argparse.Namespace, engine: subprocess.Popen[Any],
              gateways: dict[str, tuple[subprocess.Popen[Any], str, str]], model: str) -> None:
    body = chat_body(model)
    for _, url, key in gateways.values():
        await drive(url, key, body, 50, args.concurrency)  # warm: connections, caches
    cpu: dict[str, dict[str, list[float]]] = {g: {"engine": [], "gateway": []} for g in gateways}
    for round_ in range(args.rounds):
        for label in rotated(list(gateways), round_):
            proc, url, key = gateways[label]
            engine_before, gateway_before = cpu_seconds(engine.pid), cpu_seconds(proc.pid)
            await drive(url, key, body, args.requests, args.concurrency)
            cpu[label]["engine"].append((cpu_seconds(engine.pid) - engine_before)
                                        / args.requests * 1e6)
            cpu[label]["gateway"].append((cpu_seconds(proc.pid) - gateway_before)
                                         / args.requests * 1e6)
    print(f"\n== {args.requests} chat requests (4,000-character message, max_tokens 1) x "
          f"{args.rounds} rounds, {args.concurrency} connections; median of the rounds ==")
    for label, parts in cpu.items():
        print(f"{label:<34} engine {median(parts['engine']):6.0f} µs   gateway "
              f"{median(parts['gateway']):6.0f} µs CPU per request   (rounds: engine "
              f"{', '.join(f'{us:.0f}' for us in parts['engine'])}; gateway "
              f"{', '.join(f'{us:.0f}' for us in parts['gateway'])})")
    for part in ("engine", "gateway"):
        text, ids = (median(cpu[label][part]) for label in gateways)
        print(f"{part} CPU per request, ids / text: {ids / text:.3f} ({ids - text:+.0f} µs)")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="per round and gateway")
    parser.add_argument("--concurrency", type=int, default=8, help="keep-alive connections")
    parser.add_argument("--rounds", type=int, default=4,
                        help="each gateway measured this many times, interleaved (median)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tiny-bpe-llama"
        folder.mkdir()
        build_model(folder)
        port = free_port()
        engine = subprocess.Popen([PYTHON, "-m", "fairgate", "engine", str(folder), "--port",
                                   str(port), "--max-model-len", "4096", "--log-level",
                                   "warning"], cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
        gateways: dict[str, tuple[subprocess.Popen[Any], str, str]] = {}
        try:
            engine_url = f"http://127.0.0.1:{port}"
            wait_healthy(engine_url, engine)
            backend = {"url": engine_url, "max_model_len": 4096}
            for label, gateway in (
                    ("text (gateway.tokenizer counts)",
                     {"tokenizer": str(folder / "tokenizer.json"), "backends": [backend]}),
                    ("ids (backends[].tokenizer)",
                     {"backends": [{**backend, "tokenizer": str(folder)}]})):
                proc, url, keys = start_gateway({"gateway": gateway}, Path(tmp))
                gateways[label] = (proc, url, keys["demo"])
            print(f"engine {engine_url} (tiny Llama, torch on the CPU, a {VOCAB}-token BPE); "
                  f"two gateways in front of it; load generator: this process; {machine()}")
            import uvloop

            uvloop.run(run(args, engine, gateways, str(folder)))
        finally:
            for proc, _, _ in gateways.values():
                stop(proc)
            stop(engine)
    return 0


if __name__ == "__main__":
    sys.exit(main())

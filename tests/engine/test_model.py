"""The model against transformers' forward: logits of a mixed batch, RoPE tables, int8 KV."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import EngineConfig, Request, SamplingParams
from engine.model import ModelConfig, rope_inv_freq
from engine.runner import TorchExecutor
from engine.scheduler import ScheduledRequest
from tests.engine.ckpt import LLAMA3_ROPE, build_checkpoint, hf_config, load_hf

PROMPTS = [[1, 5, 9, 77, 100, 3], list(range(4, 41)), [1, 200, 17]]
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("qwen2"), "qwen2")


def make_executor(folder: Path, **knobs) -> TorchExecutor:
    config = EngineConfig(model=str(folder), executor="torch", num_kv_blocks=32,
                          block_size=BLOCK_SIZE, max_model_len=256, **knobs)
    executor = TorchExecutor(config)
    executor.allocate_kv_cache(config, executor.plan_kv_capacity(config))
    return executor


def scheduled(prompts: list[list[int]], chunks: list[tuple[int, int]]) -> list[ScheduledRequest]:
    """Requests with disjoint block tables, each computing tokens [start, start + n)."""
    out, next_block = [], 0
    for i, (prompt, (start, n)) in enumerate(zip(prompts, chunks, strict=True)):
        request = Request(f"r{i}", prompt, SamplingParams())
        num_blocks = -(-len(prompt) // BLOCK_SIZE)
        request.block_ids = list(range(next_block + num_blocks - 1, next_block - 1, -1))  # shuffled
        next_block += num_blocks
        out.append(ScheduledRequest(request, start, n, samples=start + n == len(prompt)))
    return out


def all_logits(executor: TorchExecutor, batch: list[ScheduledRequest]) -> torch.Tensor:
    return executor.forward(executor.prepare(batch), all_tokens=True)


def hf_logits(folder: Path, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return load_hf(folder)(torch.tensor([prompt])).logits[0].float()


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_prefill_logits_match_transformers(request, name):
    folder = request.getfixturevalue(name)
    executor = make_executor(folder)
    logits = all_logits(executor, scheduled(PROMPTS, [(0, len(p)) for p in PROMPTS]))
    expected = torch.cat([hf_logits(folder, p) for p in PROMPTS])
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)


def test_chunks_and_decodes_in_one_batch_read_the_cache(llama):
    """Step 1 prefills a prefix of every prompt; step 2 mixes a decode, a middle chunk and a
    final chunk in one batch, attending to step 1's cached keys through the block tables."""
    executor = make_executor(llama)
    first = [(0, len(PROMPTS[0]) - 1), (0, 20), (0, 1)]
    second = [(len(PROMPTS[0]) - 1, 1), (20, 17), (1, 2)]
    all_logits(executor, scheduled(PROMPTS, first))
    logits = all_logits(executor, scheduled(PROMPTS, second))
    expected = torch.cat([hf_logits(llama, p)[s:s + n] for p, (s, n) in zip(PROMPTS, second,
                                                                             strict=True)])
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)


def test_decode_only_batch_matches_transformers(llama):
    executor = make_executor(llama)
    all_logits(executor, scheduled(PROMPTS, [(0, len(p) - 1) for p in PROMPTS]))
    batch = executor.prepare(scheduled(PROMPTS, [(len(p) - 1, 1) for p in PROMPTS]))
    assert batch.meta.decode_only
    logits = executor.forward(batch)
    expected = torch.stack([hf_logits(llama, p)[-1] for p in PROMPTS])
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=1e-4)


def test_int8_kv_cache_logits_stay_close(llama):
    executor = make_executor(llama, kv_cache_dtype="int8")
    assert executor.kv_cache is not None and executor.kv_cache.data.dtype == torch.int8
    all_logits(executor, scheduled(PROMPTS, [(0, len(p) - 1) for p in PROMPTS]))
    logits = executor.forward(executor.prepare(scheduled(PROMPTS, [(len(p) - 1, 1)
                                                                   for p in PROMPTS])))
    expected = torch.stack([hf_logits(llama, p)[-1] for p in PROMPTS])
    assert (logits - expected).abs().max() < 0.05 * expected.abs().max()
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("rope", [None, LLAMA3_ROPE, {"rope_type": "linear", "factor": 2.0}])
def test_rope_frequencies_match_transformers(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_config("llama", rope_scaling=rope, rope_theta=500000.0)
    ours = rope_inv_freq(ModelConfig.from_hf(hf.to_dict()))
    if rope is None:
        dim = hf.head_dim
        expected = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf, "cpu")
    torch.testing.assert_close(ours, expected.float(), rtol=1e-5, atol=1e-9)

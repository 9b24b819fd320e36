"""Loading: HF folders (sharded, tied, bad ones), random presets, tokenizers, KV sizing."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import EngineConfig
from engine.loader import load_model
from engine.runner import TorchExecutor
from engine.tokenizer import ByteTokenizer, HFTokenizer
from kernels import get_ops
from tests.engine.ckpt import build_checkpoint

CPU = torch.device("cpu")
OPS = get_ops("torch")


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def broken(llama: Path, tmp_path: Path) -> Path:
    """A private copy of the llama checkpoint to damage."""
    return Path(shutil.copytree(llama, tmp_path / "ckpt"))


def load(folder: Path):
    return load_model(str(folder), OPS, CPU, torch.float32)


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_sharded_checkpoint_loads_the_same_weights(llama, tmp_path):
    sharded = build_checkpoint(tmp_path / "sharded", "llama", max_shard_size="60KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    one, many = load(llama).model.state_dict(), load(sharded).model.state_dict()
    assert all(torch.equal(one[name], many[name]) for name in one)


def test_tied_embeddings_share_one_tensor(tmp_path):
    folder = build_checkpoint(tmp_path / "tied", "qwen2", tie_word_embeddings=True)
    model = load(folder).model
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.layers[0].self_attn.qkv_proj.bias is not None  # Qwen2: q/k/v bias


def test_tokenizer_and_eos_ids(llama):
    loaded = load(llama)
    tokenizer = loaded.tokenizer
    assert isinstance(tokenizer, HFTokenizer)
    assert tokenizer.encode("w5 w9 w77") == [5, 9, 77]
    assert tokenizer.decode([5, 9]) == "w5 w9"
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == (2,)
    assert tokenizer.chat_template == "{{ x }}" and tokenizer.vocab_size == 256
    assert loaded.eos_token_ids == (2,)  # no eos in config/generation_config: the tokenizer's


def test_generation_config_eos_ids_win(broken):
    (broken / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load(broken).eos_token_ids == (2, 7)


@pytest.mark.parametrize(("changes", "message"), [
    ({"architectures": ["GPT2LMHeadModel"]}, "architecture 'GPT2LMHeadModel' is not supported"),
    ({"architectures": None, "model_type": "gpt2"}, "no 'architectures' entry"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
])
def test_unsupported_config_names_the_file(broken, changes, message):
    edit_config(broken, **changes)
    with pytest.raises(ValueError, match=message) as error:
        load(broken)
    assert "config.json" in str(error.value)


def test_missing_weight_names_the_tensor(broken):
    path = broken / "model.safetensors"
    tensors = load_file(path)
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weights.*model.layers.1.self_attn"):
        load(broken)


def test_shape_mismatch_names_file_and_tensor(broken):
    edit_config(broken, intermediate_size=96)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor 'model.layers.0.mlp.\w+_proj"
                       r".weight' has shape"):
        load(broken)


def test_unexpected_tensor_and_no_weights(broken):
    path = broken / "model.safetensors"
    tensors = load_file(path)
    tensors["model.layers.9.mlp.up_proj.weight"] = torch.zeros(128, 64)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.safetensors: tensor 'model.layers.9.mlp.up_proj"):
        load(broken)
    path.unlink()
    with pytest.raises(ValueError, match=r"no \*.safetensors"):
        load(broken)


def test_missing_folder_or_config(tmp_path):
    with pytest.raises(ValueError, match="neither a checkpoint folder nor random:<preset>"):
        load(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json: file not found"):
        load(tmp_path)


def test_random_preset_is_deterministic_with_byte_tokenizer():
    a, b = load_model("random:tiny", OPS, CPU, torch.float32, seed=3), load_model(
        "random:tiny", OPS, CPU, torch.float32, seed=3)
    assert isinstance(a.tokenizer, ByteTokenizer) and a.tokenizer.vocab_size == 512
    assert a.eos_token_ids == (257,)
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(),
                                                 strict=True))
    c = load_model("random:tiny", OPS, CPU, torch.float32, seed=4)
    assert not torch.equal(a.model.lm_head.weight, c.model.lm_head.weight)
    with pytest.raises(ValueError, match="unknown model preset"):
        load_model("random:nope", OPS, CPU, torch.float32)


def test_kv_sizing_from_memory(caplog):
    config = EngineConfig(model="random:tiny", device_memory_gb=0.5, max_num_batched_tokens=256,
                          max_model_len=1024, swap_space_gb=0.25)
    executor = TorchExecutor(config)
    with caplog.at_level(logging.INFO, logger="fairgate.engine"):
        capacity = executor.plan_kv_capacity(config)
    per_block = 2 * 4 * 16 * 2 * 64 * 4  # K and V, layers, block, kv heads, head_dim, fp32
    assert capacity.bytes_per_block == per_block
    budget = 0.5 * 2**30 * 0.9 - executor.weight_bytes() - executor.activation_peak_bytes(config)
    assert capacity.num_blocks == int(budget // per_block)
    assert capacity.num_host_blocks == int(0.25 * 2**30) // per_block
    assert "tokens" in caplog.text and "maximum concurrency at max_model_len 1024" in caplog.text
    executor.allocate_kv_cache(config, capacity)
    assert executor.kv_cache is not None and executor.kv_cache.data.shape[2] == capacity.num_blocks


def test_int8_kv_blocks_are_smaller():
    # executors get the engine's config, max_model_len resolved (LLMEngine.config)
    fp16 = EngineConfig(model="random:tiny", dtype="float16", num_kv_blocks=128, max_model_len=2048)
    executor = TorchExecutor(EngineConfig(model="random:tiny", num_kv_blocks=128,
                                          max_model_len=2048))
    fp32_bytes = executor.bytes_per_block(executor.config)
    int8_bytes = executor.bytes_per_block(executor.config.replace(kv_cache_dtype="int8"))
    assert int8_bytes / fp32_bytes == pytest.approx((64 + 4) / (4 * 64))  # ~ a quarter
    half = TorchExecutor(fp16)
    assert half.bytes_per_block(fp16.replace(kv_cache_dtype="int8")) / half.bytes_per_block(
        fp16) == pytest.approx((64 + 4) / (2 * 64))  # ~ a half
    assert executor.plan_kv_capacity(executor.config).num_blocks == 128  # the override wins


def test_too_little_memory_names_the_knob():
    config = EngineConfig(model="random:tiny", device_memory_gb=0.01, max_model_len=1024)
    with pytest.raises(ValueError, match="not enough memory for the KV cache.*device_memory_gb"):
        TorchExecutor(config).plan_kv_capacity(config)

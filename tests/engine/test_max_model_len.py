"""max_model_len like vLLM: unset means the model's own context length; larger is an error."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.presets import model_preset
from engine.request import FinishReason
from gateway.app import DEFAULT_REMOTE_MAX_MODEL_LEN, _pool
from gateway.config import BackendConfig, GatewayConfig
from tests.engine.ckpt import build_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose config.json says max_position_embeddings: 1024."""
    return build_checkpoint(tmp_path_factory.mktemp("ctx1024"), max_position_embeddings=1024)


def run(engine: LLMEngine, prompt_len: int, max_tokens: int) -> FinishReason | None:
    request = engine.add_request("r", [5] * prompt_len,
                                 SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert request.num_tokens == prompt_len + max_tokens
    return request.finish_reason


def test_checkpoint_runs_at_its_own_context_length(checkpoint: Path) -> None:
    config = EngineConfig(model=str(checkpoint), device="cpu", num_kv_blocks=64)  # 1024 tokens
    assert config.max_model_len is None
    engine = LLMEngine(config)
    assert engine.config.max_model_len == 1024 and config.max_model_len is None  # a new config
    assert run(engine, 1000, 24) == FinishReason.LENGTH  # the whole context
    with pytest.raises(ValueError, match=r"exceeds max_model_len \(1024\)"):
        engine.add_request("long", [5] * 1001, SamplingParams(max_tokens=24))


def test_explicit_max_model_len_over_the_context_fails(checkpoint: Path) -> None:
    message = ("max_model_len (4096) is larger than the model's context length (1024, "
               "max_position_embeddings in config.json); lower max_model_len")
    with pytest.raises(ValueError, match=re.escape(message)):
        LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", max_model_len=4096,
                               num_kv_blocks=512))


def test_explicit_max_model_len_within_the_context_is_kept(checkpoint: Path) -> None:
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", max_model_len=256,
                                    num_kv_blocks=16))
    assert engine.config.max_model_len == 256


def test_random_preset_resolves_to_the_preset_context() -> None:
    engine = LLMEngine(EngineConfig(model="random:tiny", device="cpu", num_kv_blocks=256))
    assert engine.config.max_model_len == model_preset("tiny").max_position == 4096
    preset = re.escape("context length (4096, the random:tiny preset)")
    with pytest.raises(ValueError, match=preset):
        LLMEngine(EngineConfig(model="random:tiny", device="cpu", max_model_len=8192,
                               num_kv_blocks=512))


@pytest.mark.parametrize(("sim_model", "context"), [("tiny", 4096), ("llama-3-8b", 131072)])
def test_sim_executor_resolves_to_its_sim_model(sim_model: str, context: int) -> None:
    engine = LLMEngine(EngineConfig(executor="sim", sim_model=sim_model))
    assert engine.config.max_model_len == context == model_preset(sim_model).max_position
    with pytest.raises(ValueError, match=re.escape(f"({context}, sim_model {sim_model})")):
        LLMEngine(EngineConfig(executor="sim", sim_model=sim_model, max_model_len=context + 1))


def test_reconfigure_resolves_again() -> None:
    engine = LLMEngine(EngineConfig(executor="sim", sim_model="tiny", max_model_len=512))
    engine.reconfigure(engine.config.replace(max_model_len=None))
    assert engine.config.max_model_len == 4096
    with pytest.raises(ValueError, match="larger than the model's context length"):
        engine.reconfigure(engine.config.replace(max_model_len=5000))
    assert engine.config.max_model_len == 4096  # the failed one changed nothing


def test_kv_blocks_too_few_for_the_context_fail_clearly() -> None:
    with pytest.raises(ValueError) as info:
        LLMEngine(EngineConfig(executor="sim", sim_model="tiny", num_kv_blocks=16))
    message = str(info.value)
    assert "holds 256 tokens, fewer than max_model_len (4096)" in message
    assert "raise num_kv_blocks or lower max_model_len" in message
    assert "unset, so it is the model's context length: 4096, sim_model tiny" in message


def test_kv_memory_too_small_for_the_context_fails_clearly(checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"has room for 0 KV blocks \(0 tokens\).*max_model_len "
                                         r"\(131072\).*lower max_model_len"):
        LLMEngine(EngineConfig(executor="sim", sim_hardware="cpu"))  # 16 GiB of 8B weights
    with pytest.raises(ValueError, match=r"not enough memory for the KV cache.*tokens\), fewer "
                                         r"than max_model_len=1024.*max_model_len"):
        LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", device_memory_gb=0.002))


def test_checks_on_max_model_len_apply_once_it_is_known() -> None:
    config = EngineConfig(executor="sim", sim_model="tiny", max_waiting_tokens=100)  # unset: ok
    with pytest.raises(ValueError, match=r"max_waiting_tokens \(100\) must be >= max_model_len "
                                         r"\(4096\)"):
        LLMEngine(config)
    with pytest.raises(ValueError, match="max_model_len must be a positive integer"):
        EngineConfig(max_model_len=0)


def test_remote_backends_default_without_an_engine_max_model_len() -> None:
    backend = BackendConfig(url="http://127.0.0.1:9")
    remote = GatewayConfig(backends=(backend,))
    assert [b.max_model_len for b in _pool(remote, EngineConfig(), None, lambda: None).backends] == [
        DEFAULT_REMOTE_MAX_MODEL_LEN]
    set_ = EngineConfig(max_model_len=8192)
    assert [b.max_model_len for b in _pool(remote, set_, None, lambda: None).backends] == [8192]

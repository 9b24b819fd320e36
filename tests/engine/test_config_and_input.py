"""Bad configuration and bad requests fail with clear messages and change nothing."""

from __future__ import annotations

import math

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams


@pytest.mark.parametrize(("knobs", "message"), [
    (dict(max_num_batched_tokens=512, max_num_seqs=1024), "max_num_batched_tokens (512) must be >= max_num_seqs (1024)"),
    (dict(policy="lifo"), "policy must be one of fcfs | priority | sjf | prefix | fair"),
    (dict(preemption="kill"), "preemption must be one of"),
    (dict(block_size=12), "block_size must be a power of two"),
    (dict(memory_fraction=1.5), "memory_fraction must be in (0, 1]"),
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
    (dict(num_kv_blocks=4, block_size=16, max_model_len=2048), "raise num_kv_blocks or lower max_model_len"),
    (dict(preemption="swap", swap_space_gb=0), "needs swap_space_gb > 0"),
    (dict(long_prefill_token_threshold=10_000, max_num_batched_tokens=2048), "long_prefill_token_threshold"),
    (dict(executor="cuda"), "executor must be one of torch | sim"),
])
def test_bad_config_names_the_knob(knobs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=None) as info:
        EngineConfig(**knobs)
    assert message in str(info.value)


@pytest.mark.parametrize(("knob", "value"), [
    ("sjf_aging_tokens_per_s", math.inf), ("sjf_aging_tokens_per_s", math.nan),
    ("swap_space_gb", math.nan), ("swap_space_gb", math.inf), ("device_memory_gb", math.inf),
    ("device_memory_gb", math.nan), ("enable_prefix_caching", "false"), ("seed", "abc"),
    ("seed", 1.5), ("long_prefill_token_threshold", True), ("swap_space_gb", True),
])
def test_config_refuses_non_finite_and_wrongly_typed_knobs(knob: str, value: object) -> None:
    with pytest.raises(ValueError, match=knob):
        EngineConfig(**{knob: value})  # type: ignore[arg-type]


def test_unknown_knob_from_yaml_is_named() -> None:
    with pytest.raises(ValueError, match="unknown engine setting.*max_batch"):
        EngineConfig.from_dict({"max_batch": 3})
    config = EngineConfig.from_dict({"max_num_seqs": 8})
    assert config.replace(max_num_seqs=4).max_num_seqs == 4


@pytest.mark.parametrize(("knobs", "message"), [
    (dict(max_tokens=0), "max_tokens must be a positive integer, got 0"),
    (dict(temperature=-1.0), "temperature must be in"),
    (dict(top_p=0.0), "top_p must be in (0.0, 1.0]"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens (5) must be <= max_tokens (2)"),
    (dict(max_tokens=True), "max_tokens must be a positive integer, got True"),
])
def test_bad_sampling_params(knobs: dict, message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**knobs)
    assert message in str(info.value)


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**70])
def test_seed_outside_int64_is_refused(seed: int) -> None:
    # the torch sampler packs seeds into an int64 tensor: one such seed failed the whole batch
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(executor="sim", sim_model="tiny", max_model_len=256,
                                  max_num_batched_tokens=256, max_num_seqs=8, num_kv_blocks=64))


@pytest.mark.parametrize(("args", "message"), [
    (dict(prompt_token_ids=[]), "the prompt is empty"),
    (dict(prompt_token_ids=[1] * 300), "exceeds max_model_len (256)"),
    (dict(prompt_token_ids=[1] * 250, params=SamplingParams(max_tokens=10)), "plus max_tokens (10)"),
    (dict(prompt_token_ids=[1], priority="urgent"), "unknown priority 'urgent'"),
    (dict(prompt_token_ids=[1, 99999]), "prompt token ids must be integers in [0, 512)"),
    (dict(prompt_token_ids=[1], request_id="dup"), "duplicate request id 'dup'"),
    (dict(prompt_token_ids=[1], tenant=["acme"]), "tenant"),  # unhashable
])
def test_bad_requests_leave_the_engine_unchanged(args: dict, message: str) -> None:
    eng = engine()
    eng.add_request("dup", [1, 2, 3], SamplingParams(max_tokens=2))
    before = eng.stats()
    kwargs = dict(request_id="new", params=SamplingParams(max_tokens=2))
    kwargs.update(args)
    with pytest.raises(ValueError) as info:
        eng.add_request(**kwargs)
    assert message in str(info.value)
    assert eng.stats() == before
    assert list(eng.scheduler.requests) == ["dup"]


def test_abort_unknown_id_is_a_noop_and_abort_frees_blocks() -> None:
    eng = engine()
    assert eng.abort("nope") is False
    eng.add_request("a", [1] * 40, SamplingParams(max_tokens=50))
    eng.step()
    assert eng.stats()["free_blocks"] < 64
    assert eng.abort("a") is True
    assert eng.stats()["free_blocks"] == 64 and not eng.has_unfinished()
    eng.add_request("a", [1] * 40, SamplingParams(max_tokens=2))  # the id is free again


def test_stop_token_ids_and_min_tokens() -> None:
    eng = engine()
    tokens = []
    eng.add_request("probe", [1, 2], SamplingParams(max_tokens=6))
    while eng.has_unfinished():
        if (token := eng.step().sampled.get("probe")) is not None:
            tokens.append(token)
    # the sim's tokens are a function of (request id, position): the same id replays them
    eng.add_request("probe", [1, 2], SamplingParams(max_tokens=6, stop_token_ids=(tokens[1],)))
    finished = {}
    while eng.has_unfinished():
        finished.update(eng.step().finished)
    assert finished == {"probe": "stop"}
    eng.add_request("probe", [1, 2], SamplingParams(max_tokens=6, stop_token_ids=(tokens[1],),
                                                      min_tokens=3))
    outputs: list[int] = []
    while eng.has_unfinished():
        if (token := eng.step().sampled.get("probe")) is not None:
            outputs.append(token)
    assert len(outputs) >= 3
    assert eng.scheduler.kv.num_free_blocks == 64


def test_waiting_token_bound_must_hold_one_full_request() -> None:
    with pytest.raises(ValueError, match=r"max_waiting_tokens \(100\) must be >= max_model_len"):
        EngineConfig(max_waiting_tokens=100, max_model_len=2048)

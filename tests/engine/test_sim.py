"""The simulated executor's cost model and clocks."""

from __future__ import annotations

import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.clock import VirtualClock
from engine.presets import model_preset
from engine.request import Request
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.sim import HARDWARE_PRESETS, CostModel, OutOfMemory


def plan_of(*shapes: tuple[int, int]) -> SchedulerOutput:
    plan = SchedulerOutput()
    for i, (start, num_tokens) in enumerate(shapes):
        request = Request(f"r{i}", [1] * (start + num_tokens), SamplingParams())
        plan.requests.append(ScheduledRequest(request, start, num_tokens))
        plan.num_batched_tokens += num_tokens
    return plan


def cost(hardware: str = "h100", model: str = "llama-3-8b") -> CostModel:
    return CostModel(model_preset(model), HARDWARE_PRESETS[hardware], kv_dtype_bytes=2.0)


def test_small_decode_batches_are_bound_by_reading_the_weights() -> None:
    model = cost()
    one = model.step_time(plan_of((100, 1)))
    eight = model.step_time(plan_of(*[(100, 1)] * 8))
    weights_s = 16.06e9 / (3.35e12 * 0.8)
    assert one == pytest.approx(0.002 + weights_s, rel=0.02)
    assert eight < one * 1.05  # eight decodes cost barely more than one


def test_large_prefills_are_bound_by_compute_and_context_adds_attention() -> None:
    model = cost()
    prefill = model.step_time(plan_of((0, 8192)))
    flops_s = 2 * 8.03e9 * 8192 / (989e12 * 0.5)
    assert prefill > flops_s
    short = model.step_time(plan_of(*[(100, 1)] * 64))
    long = model.step_time(plan_of(*[(32000, 1)] * 64))
    assert long > short * 1.5  # reading 64 x 32k tokens of KV dominates


def test_faster_hardware_is_faster() -> None:
    plan = plan_of(*[(2000, 1)] * 32)
    assert cost("h200").step_time(plan) < cost("h100").step_time(plan) < cost("a100").step_time(plan)


def test_kv_capacity_is_the_budget_less_weights_activation_peak_and_reserve() -> None:
    config = EngineConfig(executor="sim", sim_model="llama-3-8b", sim_hardware="h100",
                          max_model_len=8192)
    model = cost()
    capacity = model.kv_capacity(config)
    shape, hw = model_preset("llama-3-8b"), HARDWARE_PRESETS["h100"]
    block = shape.kv_bytes_per_token(2.0) * 16
    plan = model.memory_plan(config)
    assert plan.weights == shape.num_params * 2
    assert plan.budget == pytest.approx(hw.memory_gb * 2**30 * 0.9)
    used = plan.weights + plan.activation_peak + plan.non_torch
    assert capacity.num_blocks * block <= plan.budget - used < (capacity.num_blocks + 1) * block
    # the activation peak is real and grows with the token budget: fewer blocks are left
    assert 0.2 * 2**30 < plan.activation_peak < 1 * 2**30
    bigger = model.kv_capacity(config.replace(max_num_batched_tokens=16384))
    assert bigger.num_blocks < capacity.num_blocks
    seventy = CostModel(model_preset("llama-3-70b"), HARDWARE_PRESETS["h100"], 2.0)
    with pytest.raises(OutOfMemory, match="memory_fraction"):
        seventy.kv_capacity(config.replace(sim_model="llama-3-70b"))


L4 = EngineConfig(executor="sim", sim_model="llama-3-8b", sim_hardware="l4", max_model_len=8192)


def test_on_a_24_gb_card_every_memory_knob_decides_whether_llama_8b_starts() -> None:
    model = cost("l4")
    fits = model.kv_capacity(L4)
    assert fits.num_blocks * 16 >= 8192
    # the model's whole 128k context does not fit beside 15 GiB of weights
    with pytest.raises(OutOfMemory, match="max_model_len"):
        model.kv_capacity(L4.replace(max_model_len=131072))
    # a low memory_fraction leaves no KV room at all
    with pytest.raises(OutOfMemory, match="raise memory_fraction"):
        model.kv_capacity(L4.replace(memory_fraction=0.7))
    # a huge token budget's activation peak eats the KV cache
    with pytest.raises(OutOfMemory, match="max_num_batched_tokens"):
        model.kv_capacity(L4.replace(max_num_batched_tokens=65536))
    # a high memory_fraction starts the KV cache but leaves no room for many graphs
    model.kv_capacity(L4.replace(memory_fraction=0.97, max_num_seqs=64))
    with pytest.raises(OutOfMemory, match="CUDA graphs.*lower memory_fraction or max_num_seqs"):
        model.kv_capacity(L4.replace(memory_fraction=0.97, max_num_seqs=512))


def test_an_engine_that_runs_out_of_simulated_memory_fails_at_start() -> None:
    with pytest.raises(OutOfMemory, match="out of memory"):
        LLMEngine(L4.replace(memory_fraction=0.99))
    assert LLMEngine(L4).capacity.num_blocks > 0


def test_virtual_clock_advances_by_modelled_step_times() -> None:
    engine = LLMEngine(EngineConfig(executor="sim", max_model_len=4096, max_num_seqs=8))
    assert isinstance(engine.clock, VirtualClock)
    engine.add_request("a", [1] * 100, SamplingParams(max_tokens=10))
    total = 0.0
    started = time.perf_counter()
    while engine.has_unfinished():
        total += engine.step().step_time
    assert engine.clock.now() == pytest.approx(total)
    assert time.perf_counter() - started < total  # faster than the modelled GPU
    assert 0.05 < total < 0.2  # ten steps of ~8 ms each


def test_realtime_clock_sleeps_the_modelled_time() -> None:
    engine = LLMEngine(EngineConfig(executor="sim", sim_clock="realtime", max_model_len=4096,
                                    max_num_seqs=8))
    engine.add_request("a", [1] * 100, SamplingParams(max_tokens=10))
    modelled = 0.0
    started = time.perf_counter()
    while engine.has_unfinished():
        modelled += engine.step().step_time
    elapsed = time.perf_counter() - started
    assert elapsed >= modelled * 0.95


def test_sim_tokens_are_printable_and_never_eos() -> None:
    engine = LLMEngine(EngineConfig(executor="sim", sim_model="tiny", max_model_len=512))
    engine.add_request("a", [1, 2], SamplingParams(max_tokens=200))
    tokens: list[int] = []
    while engine.has_unfinished():
        if (token := engine.step().sampled.get("a")) is not None:
            tokens.append(token)
    assert len(tokens) == 200
    text = engine.tokenizer.decode(tokens)
    assert text.replace(" ", "").isalpha() and text.islower()

"""The simulated executor's cost model and clocks."""

from __future__ import annotations

import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.clock import VirtualClock
from engine.presets import model_preset
from engine.request import Request
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.sim import HARDWARE_PRESETS, CostModel


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


def test_kv_capacity_from_memory_and_too_little_memory_names_the_knob() -> None:
    config = EngineConfig(executor="sim", sim_model="llama-3-8b", sim_hardware="h100",
                          max_model_len=8192)
    capacity = cost().kv_capacity(config)
    kv_bytes = model_preset("llama-3-8b").kv_bytes_per_token(2.0) * 16
    expected = int((80 * 2**30 * 0.9 - model_preset("llama-3-8b").num_params * 2) // kv_bytes)
    assert capacity.num_blocks == expected
    seventy = CostModel(model_preset("llama-3-70b"), HARDWARE_PRESETS["h100"], 2.0)
    with pytest.raises(ValueError, match="memory_fraction"):
        seventy.kv_capacity(config.replace(sim_model="llama-3-70b"))


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
        tokens += engine.step().outputs.get("a", [])
    assert len(tokens) == 200
    text = engine.tokenizer.decode(tokens)
    assert text.replace(" ", "").isalpha() and text.islower()

"""One fair-share cost (protocol.fairness): the engine's `fair` policy and the gateway's
FairQueue charge the same for the same tokens; the far-ahead distance is its own knob."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.policies import FairShareQueue, step_cost
from engine.request import Request
from gateway.fairqueue import FairQueue, QueuedRequest
from protocol.fairness import VTC_COST, VTCCost

# (prompt tokens, output tokens, tenant weight); prompts over the 64-token budget are chunked
CASES = [(1, 1, 1.0), (10, 1, 1.0), (10, 5, 1.0), (64, 3, 2.0), (65, 2, 1.0), (200, 17, 0.5),
         (130, 40, 3.0)]


def engine_charge(prompt: int, output: int, weight: float) -> float:
    engine = LLMEngine(EngineConfig(executor="sim", sim_model="tiny", policy="fair",
                                    max_num_batched_tokens=64, max_num_seqs=8,
                                    max_model_len=1024, num_kv_blocks=128))
    engine.add_request("r", [7] * prompt, SamplingParams(max_tokens=output, ignore_eos=True),
                       tenant="t", tenant_weight=weight)
    while engine.has_unfinished():
        engine.step()
    queue = engine.scheduler.waiting
    assert isinstance(queue, FairShareQueue) and engine.scheduler.num_preemptions == 0
    return queue.counters["t"]


def gateway_charge(prompt: int, output: int, weight: float) -> float:
    queue = FairQueue()
    queue.push(QueuedRequest("t", prompt, 256, weight=weight))  # estimated output: 256
    item = queue.pop()
    assert item is not None
    queue.finish(item, prompt, output)  # settled to the actual tokens
    return queue.tenants["t"].counter


@pytest.mark.parametrize(("prompt", "output", "weight"), CASES)
def test_engine_and_gateway_charge_the_same_cost(prompt: int, output: int, weight: float) -> None:
    expected = VTC_COST.cost(prompt, output) / weight
    assert engine_charge(prompt, output, weight) == pytest.approx(expected)
    assert gateway_charge(prompt, output, weight) == pytest.approx(expected)


def test_decode_is_dearer_than_prefill() -> None:
    assert VTCCost(input_weight=1.0, output_weight=2.0) == VTC_COST
    assert VTC_COST.cost(3, 4) == 11.0
    with pytest.raises(ValueError, match="output_weight"):
        VTCCost(output_weight=0.0)


def test_recompute_after_preemption_is_charged_as_input() -> None:
    request = Request("r", [7] * 10, SamplingParams(max_tokens=8))
    for token in (1, 2, 3):
        request.append_output(token, 0.0)
    request.num_computed_tokens = 13  # preempted by recompute (reset to 0), then all 13 rerun
    assert step_cost(request, 13) == VTC_COST.cost(13, 1)
    request.num_computed_tokens = 8  # a first chunk of the rerun samples nothing
    assert step_cost(request, 8) == VTC_COST.cost(8, 0)


def fair_queue(**knobs: int) -> FairShareQueue:
    config = EngineConfig(executor="sim", sim_model="tiny", policy="fair", max_model_len=1024,
                          **knobs)  # type: ignore[arg-type]
    queue = FairShareQueue(config)
    for i, tenant in enumerate("ab"):
        queue.add(Request(f"{tenant}0", [7] * 10, SamplingParams(), tenant=tenant, seq=i))
    queue.counters.update(a=1000.0, b=0.0)
    return queue


def test_token_budget_does_not_move_the_far_ahead_distance() -> None:
    far = {budget: fair_queue(max_num_batched_tokens=budget).far_ahead_tenants({"a", "b"})
           for budget in (256, 512, 4096)}
    assert far == dict.fromkeys((256, 512, 4096), frozenset())  # 1000 < fair_far_ahead_tokens


def test_fair_far_ahead_tokens_moves_it() -> None:
    assert fair_queue(fair_far_ahead_tokens=999).far_ahead_tenants({"a", "b"}) == {"a"}
    assert fair_queue(fair_far_ahead_tokens=1000).far_ahead_tenants({"a", "b"}) == frozenset()


@pytest.mark.parametrize("value", [0, -5, 1.5, True, "64", None])
def test_fair_far_ahead_tokens_must_be_a_positive_int(value: object) -> None:
    with pytest.raises(ValueError, match="fair_far_ahead_tokens must be a positive integer"):
        EngineConfig(fair_far_ahead_tokens=value)  # type: ignore[arg-type]

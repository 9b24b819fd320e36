"""Review of the engine core: scheduler admission under priorities, fair-share counters, input
and config validation."""

from __future__ import annotations

import math

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams


def make_engine(**knobs: object) -> LLMEngine:
    defaults: dict[str, object] = dict(executor="sim", max_num_batched_tokens=64, max_num_seqs=2,
                                       max_model_len=1024, num_kv_blocks=256)
    defaults.update(knobs)
    return LLMEngine(EngineConfig(**defaults))  # type: ignore[arg-type]


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_interactive_request_is_not_held_back_by_preempted_batch_work(preemption: str) -> None:
    # b1, preempted for i1, waits (or is swapped) ahead of i2; b0 still holds a seat, so i2
    # must preempt it rather than wait behind b1 for a seat b1 can never take.
    engine = make_engine(preemption=preemption)
    for rid in ("b0", "b1"):
        engine.add_request(rid, [1, 2], SamplingParams(max_tokens=100), priority="batch")
    engine.step()
    engine.add_request("i1", [3, 4], SamplingParams(max_tokens=50))
    assert engine.step().preempted == ["b1"]
    engine.add_request("i2", [3, 5], SamplingParams(max_tokens=50))
    out = engine.step()
    assert out.preempted == ["b0"]
    assert set(out.scheduled) == {"i1", "i2"}
    engine.scheduler.check_invariants()
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]


def test_swapped_interactive_work_still_goes_before_new_interactive_work() -> None:
    # 8 blocks: the interactive requests outgrow them and one is swapped; a new interactive
    # request must not overtake it (only work that outranks swapped work may pass it).
    engine = make_engine(num_kv_blocks=8, block_size=16, max_model_len=128, max_num_seqs=8,
                         max_num_batched_tokens=256, preemption="swap",
                         enable_prefix_caching=False)
    for i in range(4):
        engine.add_request(f"r{i}", [i + 1] * 30, SamplingParams(max_tokens=40))
    while not engine.scheduler.swapped:
        engine.step()
    engine.add_request("late", [9] * 30, SamplingParams(max_tokens=4))
    while "late" not in engine.step().scheduled:
        pass
    assert not engine.scheduler.swapped  # in only once everything swapped came back
    while engine.has_unfinished():
        engine.step()
        engine.scheduler.check_invariants()


def test_fair_tenant_returning_after_an_idle_gap_is_not_starved() -> None:
    # A is served alone, then B is served alone: B's counter must not restart at zero
    # below A's, or A, back again, waits until B has been served as much as A ever was.
    engine = make_engine(policy="fair", max_num_seqs=1, max_num_batched_tokens=1024)
    engine.add_request("a0", [1] * 500, SamplingParams(max_tokens=1), tenant="A")
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b0", [2] * 10, SamplingParams(max_tokens=5), tenant="B")
    engine.step()
    for i in range(1, 6):
        engine.add_request(f"b{i}", [2] * 10, SamplingParams(max_tokens=5), tenant="B")
    engine.add_request("a1", [1] * 10, SamplingParams(max_tokens=5), tenant="A")
    order: list[str] = []
    while engine.has_unfinished():
        order += [r for r in engine.step().scheduled if r not in order]
    assert order.index("a1") <= 2, order


def test_fair_new_tenant_starts_at_the_minimum_of_active_tenants() -> None:
    engine = make_engine(policy="fair", max_num_seqs=4, max_num_batched_tokens=1024)
    engine.add_request("a0", [1] * 100, SamplingParams(max_tokens=50), tenant="A")
    engine.add_request("b0", [2] * 300, SamplingParams(max_tokens=50), tenant="B")
    engine.step()
    counters = engine.scheduler.waiting.counters  # type: ignore[attr-defined]
    engine.add_request("c0", [3] * 10, SamplingParams(max_tokens=5), tenant="C")
    assert counters["C"] == min(counters["A"], counters["B"]) > 0


def test_unhashable_tenant_is_a_value_error_and_leaves_the_engine_unchanged() -> None:
    engine = make_engine()
    with pytest.raises(ValueError, match="tenant"):
        engine.add_request("x", [1, 2], tenant=["acme"])  # type: ignore[arg-type]
    assert not engine.has_unfinished()
    engine.scheduler.check_invariants()
    engine.add_request("x", [1, 2], SamplingParams(max_tokens=2))
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**70])
def test_seed_outside_int64_is_refused(seed: int) -> None:
    # the torch sampler packs seeds into an int64 tensor: one such seed failed the whole batch
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1


@pytest.mark.parametrize(("knob", "value"), [
    ("sjf_aging_tokens_per_s", math.inf), ("sjf_aging_tokens_per_s", math.nan),
    ("swap_space_gb", math.nan), ("swap_space_gb", math.inf), ("device_memory_gb", math.inf),
    ("device_memory_gb", math.nan), ("enable_prefix_caching", "false"), ("seed", "abc"),
    ("seed", 1.5), ("long_prefill_token_threshold", True), ("swap_space_gb", True),
])
def test_config_refuses_non_finite_and_wrongly_typed_knobs(knob: str, value: object) -> None:
    with pytest.raises(ValueError, match=knob):
        EngineConfig(**{knob: value})  # type: ignore[arg-type]



def test_swapped_interactive_work_comes_back_before_swapped_batch_work() -> None:
    engine = make_engine(num_kv_blocks=8, block_size=16, max_model_len=128, max_num_seqs=8,
                         max_num_batched_tokens=256, preemption="swap", swap_space_gb=0.5,
                         enable_prefix_caching=False)
    for rid in ("i0", "b0", "i1", "b1", "i2"):
        engine.add_request(rid, [1] * 30, SamplingParams(max_tokens=60),
                           priority="batch" if rid[0] == "b" else "interactive")
    swapped_in_batch = 0
    while engine.has_unfinished():
        before = set(engine.scheduler.swapped)
        out = engine.step()
        back = before & set(out.scheduled)
        if any(rid.startswith("b") for rid in back):
            swapped_in_batch += 1
            assert not any(r.priority == "interactive" for r in engine.scheduler.swapped.values())
        engine.scheduler.check_invariants()
    assert swapped_in_batch

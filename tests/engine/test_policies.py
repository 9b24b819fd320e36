"""Waiting-queue orders."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import POLICIES
from engine.policies import FairShareQueue


def engine_with(policy: str, **knobs: object) -> LLMEngine:
    settings: dict[str, object] = dict(executor="sim", sim_model="tiny", policy=policy,
                                       max_num_seqs=1, max_num_batched_tokens=4096,
                                       max_model_len=4096, num_kv_blocks=1024)
    settings.update(knobs)
    return LLMEngine(EngineConfig(**settings))  # type: ignore[arg-type]


def admission_order(engine: LLMEngine) -> list[str]:
    order: list[str] = []
    while engine.has_unfinished():
        for rid in engine.step().scheduled:
            if rid not in order:
                order.append(rid)
    return order


def add(engine: LLMEngine, rid: str, prompt_len: int = 4, max_tokens: int = 2,
        priority: str = "interactive", tenant: str = "", at: float = 0.0) -> None:
    engine.add_request(rid, [7] * prompt_len, SamplingParams(max_tokens=max_tokens),
                       priority=priority, tenant=tenant, arrival_time=at)


def test_fcfs_admits_in_arrival_order() -> None:
    engine = engine_with("fcfs")
    add(engine, "second", at=2.0)
    add(engine, "first", at=1.0)
    add(engine, "third", at=3.0, prompt_len=1)
    assert admission_order(engine) == ["first", "second", "third"]


def test_priority_runs_interactive_before_batch_then_arrival() -> None:
    engine = engine_with("priority")
    add(engine, "b1", priority="batch", at=0.0)
    add(engine, "i1", at=1.0)
    add(engine, "b2", priority="batch", at=2.0)
    add(engine, "i2", at=3.0)
    assert admission_order(engine) == ["i1", "i2", "b1", "b2"]


def test_sjf_prefers_short_jobs() -> None:
    engine = engine_with("sjf", sjf_aging_tokens_per_s=0.0)
    add(engine, "long", prompt_len=500, max_tokens=100, at=0.0)
    add(engine, "short", prompt_len=10, max_tokens=5, at=1.0)
    add(engine, "mid", prompt_len=100, max_tokens=20, at=2.0)
    assert admission_order(engine) == ["short", "mid", "long"]


def test_sjf_aging_lets_a_long_waiting_job_go_first() -> None:
    engine = engine_with("sjf", sjf_aging_tokens_per_s=100.0)
    add(engine, "long", prompt_len=500, max_tokens=100, at=0.0)  # work 600, waited 10 s
    add(engine, "short", prompt_len=10, max_tokens=5, at=10.0)  # work 15, just arrived
    assert admission_order(engine) == ["long", "short"]


def test_prefix_policy_prefers_the_longest_cached_prefix() -> None:
    engine = engine_with("prefix", block_size=16)
    shared = list(range(1, 257))
    engine.add_request("warm", shared + [1], SamplingParams(max_tokens=1), arrival_time=0.0)
    admission_order(engine)
    engine.add_request("cold", list(range(200, 456)), SamplingParams(max_tokens=1), arrival_time=1.0)
    engine.add_request("hit", shared + [2, 3], SamplingParams(max_tokens=1), arrival_time=2.0)
    assert admission_order(engine) == ["hit", "cold"]


def test_fair_share_interleaves_tenants_by_weight() -> None:
    engine = engine_with("fair", max_num_seqs=1)
    engine.set_tenant_weights({"a": 1.0, "b": 3.0})
    for i in range(12):
        add(engine, f"a{i}", prompt_len=10, max_tokens=1, tenant="a", at=i * 0.01)
        add(engine, f"b{i}", prompt_len=10, max_tokens=1, tenant="b", at=i * 0.01 + 0.001)
    order = admission_order(engine)[:16]
    served_b = sum(1 for rid in order if rid.startswith("b"))
    assert 11 <= served_b <= 13  # ~3:1 while both are backlogged


def test_fair_share_new_tenant_starts_at_the_current_minimum() -> None:
    engine = engine_with("fair", max_num_seqs=1)
    for i in range(30):
        add(engine, f"a{i}", prompt_len=10, max_tokens=1, tenant="a", at=float(i))
    for _ in range(20):
        engine.step()
    # b arrives late: with counters starting at zero it would monopolise the engine
    for i in range(10):
        add(engine, f"b{i}", prompt_len=10, max_tokens=1, tenant="b", at=100.0 + i)
    order = admission_order(engine)[:10]
    assert 4 <= sum(1 for rid in order if rid.startswith("b")) <= 6


def test_fair_share_tenant_back_after_an_idle_gap_is_not_starved() -> None:
    # A is served alone, then B is served alone: B's counter must not restart at zero
    # below A's, or A, back again, waits until B has been served as much as A ever was.
    engine = engine_with("fair", max_num_batched_tokens=1024)
    engine.add_request("a0", [1] * 500, SamplingParams(max_tokens=1), tenant="A")
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b0", [2] * 10, SamplingParams(max_tokens=5), tenant="B")
    engine.step()
    for i in range(1, 6):
        engine.add_request(f"b{i}", [2] * 10, SamplingParams(max_tokens=5), tenant="B")
    engine.add_request("a1", [1] * 10, SamplingParams(max_tokens=5), tenant="A")
    order = admission_order(engine)
    assert order.index("a1") <= 2, order


def test_fair_share_new_tenant_counter_is_the_minimum_of_the_active_ones() -> None:
    engine = engine_with("fair", max_num_seqs=4, max_num_batched_tokens=1024)
    engine.add_request("a0", [1] * 100, SamplingParams(max_tokens=50), tenant="A")
    engine.add_request("b0", [2] * 300, SamplingParams(max_tokens=50), tenant="B")
    engine.step()
    counters = engine.scheduler.waiting.counters  # type: ignore[attr-defined]
    engine.add_request("c0", [3] * 10, SamplingParams(max_tokens=5), tenant="C")
    assert counters["C"] == min(counters["A"], counters["B"]) > 0


def first_step_prefills(engine: LLMEngine) -> set[str]:
    return set(engine.step().scheduled)


def set_counters(engine: LLMEngine, **counters: float) -> None:
    queue = engine.scheduler.waiting
    assert isinstance(queue, FairShareQueue)
    queue.counters.update(counters)


def test_fair_share_tenant_far_ahead_waits_for_the_next_step() -> None:
    engine = engine_with("fair", max_num_seqs=8, max_num_batched_tokens=64,
                         fair_far_ahead_tokens=64)
    add(engine, "a0", prompt_len=10, max_tokens=4, tenant="a")
    add(engine, "b0", prompt_len=10, max_tokens=4, tenant="b")
    set_counters(engine, a=500.0, b=0.0)  # a leads by more than fair_far_ahead_tokens (64)
    # both fit the budget, but a's prefill would lengthen the step that gives b its first token
    assert first_step_prefills(engine) == {"b0"}
    assert first_step_prefills(engine) == {"a0", "b0"}  # a's turn: b decodes beside it


@pytest.mark.parametrize(("prompt_len", "admitted"), [(40, 1), (8, 4)])
def test_fair_share_far_ahead_tenant_adds_few_prefills_per_step(prompt_len: int,
                                                                 admitted: int) -> None:
    engine = engine_with("fair", max_num_seqs=16, max_num_batched_tokens=256,  # cap: 32 tokens
                         fair_far_ahead_tokens=256)
    add(engine, "b0", prompt_len=10, max_tokens=50, tenant="b")
    engine.step()  # b is active (decoding) with nothing waiting
    for i in range(5):
        add(engine, f"a{i}", prompt_len=prompt_len, max_tokens=2, tenant="a")
    set_counters(engine, a=1000.0, b=0.0)
    # the first prefill opens the step whatever its size; more only within the cap
    assert first_step_prefills(engine) - {"b0"} == {f"a{i}" for i in range(admitted)}


def test_fair_share_lone_tenant_is_never_limited() -> None:
    engine = engine_with("fair", max_num_seqs=16, max_num_batched_tokens=256,
                         fair_far_ahead_tokens=256)
    for i in range(4):
        add(engine, f"a{i}", prompt_len=40, max_tokens=2, tenant="a")
    set_counters(engine, a=1000.0)
    assert first_step_prefills(engine) == {"a0", "a1", "a2", "a3"}


def test_fair_share_tenants_close_to_each_other_share_steps() -> None:
    engine = engine_with("fair", max_num_seqs=8, max_num_batched_tokens=64,
                         fair_far_ahead_tokens=64)
    add(engine, "a0", prompt_len=10, max_tokens=4, tenant="a")
    add(engine, "b0", prompt_len=10, max_tokens=4, tenant="b")
    set_counters(engine, a=30.0, b=0.0)  # within fair_far_ahead_tokens
    assert first_step_prefills(engine) == {"a0", "b0"}


def test_every_policy_serves_everything() -> None:
    for policy in POLICIES:
        engine = engine_with(policy, max_num_seqs=2)
        for i in range(6):
            add(engine, f"r{i}", prompt_len=5 + i, max_tokens=3, tenant=f"t{i % 2}",
                priority="batch" if i % 3 else "interactive", at=float(i))
        assert sorted(admission_order(engine)) == [f"r{i}" for i in range(6)]

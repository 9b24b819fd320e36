"""Scheduler behaviour on the simulated executor: budgets, chunking, preemption, prefix cache."""

from __future__ import annotations

import pytest

from engine import EngineConfig, LLMEngine, RequestStatus, SamplingParams


def make_engine(**knobs: object) -> LLMEngine:
    defaults: dict[str, object] = dict(executor="sim", max_num_batched_tokens=4096,
                                       max_num_seqs=256, max_model_len=32768, num_kv_blocks=4096)
    defaults.update(knobs)
    return LLMEngine(EngineConfig(**defaults))  # type: ignore[arg-type]


def start_decodes(engine: LLMEngine, count: int, max_tokens: int = 1000) -> list[str]:
    ids = [f"d{i}" for i in range(count)]
    for rid in ids:
        engine.add_request(rid, [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens))
    engine.step()  # all short prompts prefill in one step
    assert all(engine.get_request(r).num_output_tokens == 1 for r in ids)
    return ids


@pytest.mark.parametrize(("budget", "decodes", "chunk"), [(4096, 128, 3968), (2048, 48, 2000)])
def test_long_prompt_is_chunked_around_running_decodes(budget: int, decodes: int, chunk: int) -> None:
    engine = make_engine(max_num_batched_tokens=budget)
    ids = start_decodes(engine, decodes)
    engine.add_request("long", list(range(1, 20001)), SamplingParams(max_tokens=4))
    chunks = []
    for _ in range(100):
        out = engine.step()
        assert all(out.scheduled[r] == 1 and r in out.sampled for r in ids)
        assert out.num_batched_tokens <= budget
        chunks.append(out.scheduled["long"])
        if "long" in out.sampled:
            break
    full, last = divmod(20000, chunk)
    expected = [chunk] * full + ([last] if last else [])
    assert chunks == expected
    assert len(chunks) == len(expected)  # the first token comes out of the last chunk's step


def test_long_prefill_token_threshold_caps_each_chunk() -> None:
    engine = make_engine(long_prefill_token_threshold=1000)
    engine.add_request("a", list(range(1, 2501)), SamplingParams(max_tokens=2))
    assert [engine.step().scheduled["a"] for _ in range(3)] == [1000, 1000, 500]


def test_max_num_partial_prefills_limits_concurrent_chunked_prompts() -> None:
    def first_step(max_partial: int) -> dict[str, int]:
        engine = make_engine(max_num_batched_tokens=1024, long_prefill_token_threshold=500,
                             max_num_partial_prefills=max_partial)
        engine.add_request("a", [5] * 3000, SamplingParams(max_tokens=2))
        engine.add_request("b", [6] * 3000, SamplingParams(max_tokens=2))
        engine.add_request("c", [7] * 10, SamplingParams(max_tokens=2))
        return engine.step().scheduled

    # one partial prefill allowed: b waits, c (which finishes its prompt) goes past it
    assert first_step(1) == {"a": 500, "c": 10}
    assert first_step(2) == {"a": 500, "b": 500, "c": 10}


def test_max_num_seqs_bounds_running_requests() -> None:
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(10):
        engine.add_request(f"r{i}", [1, 2], SamplingParams(max_tokens=3))
    out = engine.step()
    assert len(out.scheduled) == 4
    assert engine.stats()["waiting"] == 6


def test_interactive_request_preempts_batch_work_holding_every_seat() -> None:
    engine = make_engine(max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(4):
        engine.add_request(f"b{i}", [1, 2], SamplingParams(max_tokens=50), priority="batch")
    engine.step()
    engine.add_request("i", [3, 4], SamplingParams(max_tokens=3), priority="interactive")
    out = engine.step()
    assert out.preempted == ["b3"]  # latest batch arrival
    assert "i" in out.scheduled
    assert engine.get_request("b3").status is RequestStatus.WAITING


@pytest.mark.parametrize("policy", ["fcfs", "sjf", "prefix", "priority", "fair"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_batch_work_admitted_in_the_step_an_interactive_request_takes_its_seat_never_ran(
        policy: str, preemption: str) -> None:
    """Where a policy orders batch work before an interactive request arriving with it, the
    interactive one takes the seat in the same step: the batch request goes back to waiting
    as if never admitted (no preemption, no swap, no first scheduling, no prefix lookup)."""
    engine = make_engine(max_num_seqs=1, policy=policy, preemption=preemption,
                         enable_prefix_caching=True)
    engine.add_request("b", [5] * 40, SamplingParams(max_tokens=3), priority="batch")
    engine.add_request("i", [6] * 40, SamplingParams(max_tokens=3), priority="interactive")
    kv = engine.scheduler.kv
    out = engine.step()
    assert list(out.scheduled) == ["i"] and out.preempted == []
    assert engine.scheduler.num_preemptions == 0 and kv.prefix_cache_queries == 40
    batch = engine.get_request("b")
    assert batch.status is RequestStatus.WAITING and batch.first_scheduled_time is None
    assert batch.block_ids == [] and batch.num_computed_tokens == 0
    while "b" not in engine.step().scheduled:
        pass
    assert batch.first_scheduled_time is not None and kv.prefix_cache_queries == 80


def test_batch_request_does_not_preempt_batch_work() -> None:
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(2):
        engine.add_request(f"b{i}", [1, 2], SamplingParams(max_tokens=50), priority="batch")
    engine.step()
    engine.add_request("b9", [3, 4], SamplingParams(max_tokens=3), priority="batch")
    out = engine.step()
    assert out.preempted == [] and "b9" not in out.scheduled


def test_out_of_blocks_preempts_batch_before_interactive_then_latest() -> None:
    # 8 blocks of 16 tokens; four requests of 17+ tokens need 2 blocks each, growing to 3
    engine = make_engine(num_kv_blocks=8, block_size=16, max_model_len=128,
                         max_num_batched_tokens=256)
    engine.add_request("i0", [1] * 30, SamplingParams(max_tokens=40), priority="interactive")
    engine.add_request("b0", [2] * 30, SamplingParams(max_tokens=40), priority="batch")
    engine.add_request("i1", [3] * 30, SamplingParams(max_tokens=40), priority="interactive")
    engine.add_request("b1", [4] * 30, SamplingParams(max_tokens=40), priority="batch")
    preempted: list[str] = []
    while engine.has_unfinished():
        preempted += engine.step().preempted
        engine.scheduler.check_invariants()
    assert preempted[:2] == ["b1", "b0"]
    assert engine.stats()["free_blocks"] == 8


def test_prefix_cache_reuses_blocks_within_a_tenant_only() -> None:
    engine = make_engine(block_size=16)
    prefix = list(range(1, 1001))
    engine.add_request("a", prefix + [7, 8], SamplingParams(max_tokens=2), tenant="acme")
    while engine.has_unfinished():
        engine.step()
    engine.add_request("b", prefix + [9, 9, 9], SamplingParams(max_tokens=2), tenant="acme")
    out = engine.step()
    assert out.scheduled["b"] == 1003 - 992  # 62 full blocks of the shared prefix reused
    stats = engine.stats()
    assert stats["prefix_cache_hits"] == 992
    engine.add_request("c", prefix + [9, 9, 9], SamplingParams(max_tokens=2), tenant="other")
    out = engine.step()
    assert out.scheduled["c"] == 1003
    assert engine.stats()["prefix_cache_hits"] == 992


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    engine = make_engine(block_size=16)
    prompt = list(range(1, 65))  # exactly 4 blocks
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1))
        while engine.has_unfinished():
            out = engine.step()
    assert out.finished == {"b": "length"}
    assert engine.stats()["prefix_cache_hits"] == 48


def test_swap_preserves_computed_tokens() -> None:
    engine = make_engine(num_kv_blocks=8, block_size=16, max_model_len=128, preemption="swap",
                         swap_space_gb=0.5, max_num_batched_tokens=256, enable_prefix_caching=False)
    for i in range(4):
        engine.add_request(f"r{i}", [i + 1] * 30, SamplingParams(max_tokens=40))
    swapped_seen = set()
    computed_at_swap: dict[str, int] = {}
    total_prefill = 0
    while engine.has_unfinished():
        out = engine.step()
        for rid in out.preempted:
            request = engine.get_request(rid)
            assert request.status is RequestStatus.SWAPPED
            swapped_seen.add(rid)
            computed_at_swap[rid] = request.num_computed_tokens
        for rid, n in out.scheduled.items():
            if rid in computed_at_swap:
                # resumed with its tokens intact: a decode, not a re-prefill
                assert n == 1
                assert engine.get_request(rid).num_computed_tokens >= computed_at_swap.pop(rid)
            total_prefill += n
        engine.scheduler.check_invariants()
    assert swapped_seen
    assert engine.stats()["free_blocks"] == 8
    # no recompute: every token went through the model exactly once
    assert total_prefill == 4 * 30 + 4 * 39


def test_recompute_preemption_reproduces_the_same_tokens() -> None:
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        engine = make_engine(num_kv_blocks=num_blocks, block_size=16, max_model_len=128,
                             max_num_batched_tokens=256, enable_prefix_caching=False)
        for i in range(4):
            engine.add_request(f"r{i}", [i + 1] * 30, SamplingParams(max_tokens=40))
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
        while engine.has_unfinished():
            for rid, token in engine.step().sampled.items():
                tokens[rid].append(token)
        return tokens, engine.stats()["num_preemptions"]

    roomy, none = run(64)
    tight, some = run(8)
    assert none == 0 and some > 0
    assert tight == roomy


def test_interactive_request_does_not_preempt_batch_work_that_cannot_make_room() -> None:
    # 8 blocks; an interactive request already holds 6, a batch request 2. A new interactive
    # request needing 3 blocks cannot fit even if the batch request goes: leave it running.
    engine = make_engine(num_kv_blocks=8, block_size=16, max_model_len=128,
                         max_num_batched_tokens=256, enable_prefix_caching=False)
    engine.add_request("i0", [1] * 90, SamplingParams(max_tokens=2), priority="interactive")
    engine.add_request("b0", [2] * 20, SamplingParams(max_tokens=30), priority="batch")
    engine.step()
    engine.add_request("i1", [3] * 40, SamplingParams(max_tokens=2), priority="interactive")
    out = engine.step()
    assert out.preempted == [] and "i1" not in out.scheduled
    assert "b0" in out.scheduled


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_interactive_request_is_not_held_back_by_preempted_batch_work(preemption: str) -> None:
    # b1, preempted for i1, waits (or is swapped) ahead of i2; b0 still holds a seat, so i2
    # must preempt it rather than wait behind b1 for a seat b1 can never take.
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=1024,
                         num_kv_blocks=256, preemption=preemption)
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


def test_fair_share_weights_survive_reconfigure() -> None:
    engine = make_engine(policy="fair")
    engine.set_tenant_weights({"a": 3.0})
    engine.reconfigure(engine.config.replace(max_num_seqs=16))
    assert engine.scheduler.waiting.weights == {"a": 3.0}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"numbers in \[1e-06, 1e\+06\]"):
        engine.set_tenant_weights({"b": float("inf")})

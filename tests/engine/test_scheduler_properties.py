"""Property tests: random configs and random add/step/abort sequences keep every invariant."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.config import POLICIES


@st.composite
def configs(draw: st.DrawFn) -> EngineConfig:
    block_size = draw(st.sampled_from([4, 8, 16]))
    max_model_len = draw(st.sampled_from([64, 128]))
    min_blocks = -(-max_model_len // block_size)
    max_num_seqs = draw(st.integers(1, 8))
    return EngineConfig(
        executor="sim", sim_model="tiny", block_size=block_size, max_model_len=max_model_len,
        num_kv_blocks=draw(st.integers(min_blocks, min_blocks * 2)),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max(max_num_seqs, 8), 96)),
        policy=draw(st.sampled_from(POLICIES)),
        preemption=draw(st.sampled_from(["recompute", "swap"])),
        swap_space_gb=draw(st.sampled_from([1e-5, 1.0])),  # tiny swap space forces the fallback
        enable_prefix_caching=draw(st.booleans()),
        long_prefill_token_threshold=draw(st.sampled_from([0, 8])),
        max_num_partial_prefills=draw(st.integers(1, 3)),
    )


add_op = st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 48),
                   st.sampled_from(["t1", "t2", "t3"]), st.sampled_from(["interactive", "batch"]),
                   st.integers(0, 2))
operations = st.lists(st.one_of(add_op, st.tuples(st.just("step")),
                                st.tuples(st.just("abort"), st.integers(0, 30))),
                      min_size=1, max_size=60)


def checked_step(engine: LLMEngine) -> dict[str, int]:
    config = engine.config
    out = engine.step()
    assert out.num_batched_tokens == sum(out.scheduled.values())
    assert out.num_batched_tokens <= config.max_num_batched_tokens
    assert len(out.scheduled) <= config.max_num_seqs
    assert all(n > 0 for n in out.scheduled.values())
    engine.scheduler.check_invariants()
    return out.sampled


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), ops=operations)
def test_random_workloads_keep_invariants_and_finish(config: EngineConfig, ops: list) -> None:
    engine = LLMEngine(config)
    expected: dict[str, int] = {}
    produced: dict[str, int] = {}
    added = 0
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, tenant, priority, prefix = op
            max_tokens = min(max_tokens, config.max_model_len - prompt_len)
            if max_tokens < 1:
                continue
            rid = f"r{added}"
            added += 1
            # shared prefixes make prefix-cache hits likely
            prompt = [prefix + 1] * (prompt_len // 2) + [(i % 50) + 1 for i in range(prompt_len - prompt_len // 2)]
            engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens), tenant=tenant,
                               priority=priority)
            expected[rid] = max_tokens
        elif op[0] == "step":
            for rid in checked_step(engine):
                produced[rid] = produced.get(rid, 0) + 1
        else:
            rid = f"r{op[1]}"
            if engine.abort(rid):
                expected.pop(rid)
    for _ in range(20_000):
        if not engine.has_unfinished():
            break
        for rid in checked_step(engine):
            produced[rid] = produced.get(rid, 0) + 1
    assert not engine.has_unfinished(), f"starved: {engine.stats()}"
    # nothing leaked: every device block free, every host block free
    assert engine.stats()["free_blocks"] == engine.stats()["num_blocks"]
    kv = engine.scheduler.kv
    assert len(kv.free_host_blocks) == kv.num_host_blocks
    # preempted or not, every request produced exactly its max_tokens (the sim never stops early)
    for rid, want in expected.items():
        assert produced.get(rid, 0) == want, rid

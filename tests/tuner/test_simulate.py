"""Sim mode: the discrete-event replay of a workload on the simulated executor's virtual clock."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.presets import model_preset
from engine.request import Request, SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.sim import HARDWARE_PRESETS, CostModel
from protocol.measures import RequestTiming
from protocol.stats import percentile
from tuner import bench_cli
from tuner.simulate import PromptBuilder, SimResult, sample_workload, simulate
from tuner.traces import TraceRequest, write_fairgate_trace

SIM = EngineConfig(executor="sim", sim_model="llama-3-8b", sim_hardware="h100",
                   max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=32)


def step_time(*shapes: tuple[int, int]) -> float:
    """The cost model's time for one step computing `num_tokens` from `start`, per request."""
    plan = SchedulerOutput()
    for i, (start, num_tokens) in enumerate(shapes):
        request = Request(f"r{i}", [1] * (start + num_tokens), SamplingParams())
        plan.requests.append(ScheduledRequest(request, start, num_tokens))
        plan.num_batched_tokens += num_tokens
    model = CostModel(model_preset("llama-3-8b"), HARDWARE_PRESETS["h100"], kv_dtype_bytes=2.0)
    return model.step_time(plan)


def poisson(n: int, rate: float, prompt: int = 200, output: int = 20) -> list[TraceRequest]:
    """Deterministic, evenly spread arrivals (a fixed rate) of equal-sized requests."""
    return [TraceRequest(i / rate, prompt, output) for i in range(n)]


def ttft_p99(result: SimResult) -> float:
    return percentile((t.ttft for t in result.timings if t.ttft is not None), 99)


def test_a_lone_request_is_timed_by_the_cost_model_step_by_step() -> None:
    result = simulate(SIM, [TraceRequest(0.0, 500, 8)])
    (timing,) = result.timings
    assert timing.ok and timing.start == 0.0
    assert timing.ttft == pytest.approx(step_time((0, 500)))
    assert len(timing.token_times) == timing.num_output_tokens == 8
    gaps = list(timing.itls)
    # each decode computes the token sampled last step: context 500 + k
    assert gaps == pytest.approx([step_time((500 + k, 1)) for k in range(7)])
    assert all(gap > 0 for gap in gaps)
    assert timing.end == timing.token_times[-1] == pytest.approx(result.elapsed_s)
    assert result.steps == 8 and result.stopped is None and result.preemptions == 0


def test_arrivals_are_respected_and_idle_gaps_jump() -> None:
    alone = simulate(SIM, [TraceRequest(0.0, 300, 4)]).timings[0]
    started = time.perf_counter()
    result = simulate(SIM, [TraceRequest(5.0, 300, 4), TraceRequest(1005.0, 300, 4)])
    assert time.perf_counter() - started < 1.0  # the 1000 s gap is one clock jump
    first, second = result.timings
    assert (first.start, second.start) == (5.0, 1005.0)
    assert first.token_times[0] > 5.0 and second.token_times[0] > 1005.0
    assert first.ttft == pytest.approx(alone.ttft) == pytest.approx(second.ttft)
    assert result.elapsed_s == pytest.approx(second.end - 5.0)
    assert result.elapsed_s > 1000 and result.steps == 8
    # timings come back in workload order, whatever order the arrivals are listed in
    late, early = simulate(SIM, [TraceRequest(1005.0, 300, 4), TraceRequest(5.0, 300, 4)]).timings
    assert (late, early) == (second, first)


def test_a_busy_engine_adds_arrivals_between_steps_with_their_own_start() -> None:
    # the second request arrives while the first one's prefill step runs
    prefill = step_time((0, 2000))
    result = simulate(SIM, [TraceRequest(0.0, 2000, 4), TraceRequest(prefill / 2, 100, 4)])
    late = result.timings[1]
    assert late.start == pytest.approx(prefill / 2)  # its arrival, not when it was added
    assert late.token_times[0] > prefill  # it joined the step after the prefill


def test_requests_too_long_for_max_model_len_are_refused_as_misses() -> None:
    config = SIM.replace(max_model_len=1024)
    result = simulate(config, [TraceRequest(0.0, 1000, 100), TraceRequest(0.1, 500, 10),
                               TraceRequest(0.2, 10, 10, priority="no-such-class")])
    refused, served, unknown = result.timings
    assert not refused.ok and refused.token_times == () and refused.start == 0.0
    assert not unknown.ok and unknown.ttft is None
    assert served.ok and len(served.token_times) == 10


def test_more_load_raises_p99_ttft() -> None:
    light = simulate(SIM, poisson(150, rate=5.0))
    heavy = simulate(SIM, poisson(150, rate=400.0))
    assert all(t.ok for t in light.timings + heavy.timings)
    assert ttft_p99(heavy) > 2 * ttft_p99(light)
    assert heavy.elapsed_s < light.elapsed_s


def test_a_shared_prefix_is_served_from_the_prefix_cache() -> None:
    shared = [TraceRequest(float(i), 1024 + 64, 2, prefix_hashes=(7, 8), block_tokens=512)
              for i in range(2)]
    cold, warm = simulate(SIM, shared).timings
    assert warm.ttft is not None and cold.ttft is not None
    assert warm.ttft < cold.ttft / 2  # only the 64 unique tokens are prefilled
    distinct = [TraceRequest(float(i), 1024 + 64, 2) for i in range(2)]
    first, second = simulate(SIM, distinct).timings
    assert second.ttft == pytest.approx(first.ttft)


def test_stop_cuts_the_run_short_and_aborts_the_rest() -> None:
    seen: list[int] = []

    def stop(finished: list[RequestTiming]) -> str | None:
        seen.append(len(finished))
        return "enough" if len(finished) >= 20 else None

    requests = poisson(200, rate=100.0)
    result = simulate(SIM, requests, stop=stop, check_every=10)
    assert result.stopped == "enough"
    assert seen and seen[-1] >= 20 and all(n >= 10 * (i + 1) for i, n in enumerate(seen))
    assert len(result.timings) == len(requests)
    served = [t for t in result.timings if t.ok]
    assert len(served) == seen[-1] < len(requests)
    cut = [t for t in result.timings if not t.ok]
    assert cut and all(t.token_times == () and t.num_output_tokens == 0 for t in cut)
    full = simulate(SIM, requests)
    assert full.stopped is None and result.steps < full.steps


def test_the_same_input_gives_identical_timings() -> None:
    requests = [TraceRequest(i * 0.01, 100 + 37 * (i % 5), 5 + i % 7, tenant=f"t{i % 2}",
                             prefix_hashes=(i % 3,), block_tokens=64) for i in range(60)]
    first, second = simulate(SIM, requests), simulate(SIM, requests)
    assert first.timings == second.timings
    assert (first.steps, first.elapsed_s) == (second.steps, second.elapsed_s)


@pytest.mark.parametrize("changes", [{"executor": "torch"}, {"sim_clock": "realtime"}])
def test_only_a_virtual_clock_sim_config_is_accepted(changes: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="sim_clock='virtual'"):
        simulate(SIM.replace(**changes), [TraceRequest(0.0, 10, 1)])


def test_a_config_that_cannot_start_raises_the_engines_message() -> None:
    too_big = SIM.replace(sim_model="llama-3-70b")  # 140 GB of weights on an 80 GB device
    with pytest.raises(ValueError, match="memory_fraction"):
        simulate(too_big, [TraceRequest(0.0, 10, 1)])


def test_prompt_ids_share_exactly_the_hashed_blocks() -> None:
    builder = PromptBuilder(vocab_size=300)
    a = builder.build(0, TraceRequest(0.0, 100, 1, prefix_hashes=(5, 6), block_tokens=40))
    b = builder.build(1, TraceRequest(0.0, 90, 1, prefix_hashes=(5, 9), block_tokens=40))
    c = builder.build(300, TraceRequest(0.0, 100, 1))
    assert (len(a), len(b), len(c)) == (100, 90, 100)
    assert a[:40] == b[:40] and a[40:80] != b[40:80]
    assert c[:40] != builder.build(0, TraceRequest(0.0, 100, 1))[:40]
    assert all(0 <= t < 300 for t in a + b + c)


def bench_plan(*argv: str) -> list[TraceRequest]:
    parser = argparse.ArgumentParser()
    bench_cli.register(parser)
    return bench_cli.plan_requests(parser.parse_args(["--url", "http://x", *argv]))


def test_sample_workload_plans_what_fairgate_bench_would_send(tmp_path: Path) -> None:
    named = sample_workload("longtail", rate=20.0, duration=5.0, seed=3)
    assert named and named == bench_plan("--workload", "longtail", "--rate", "20",
                                         "--duration", "5", "--seed", "3")
    trace = tmp_path / "trace.jsonl"
    write_fairgate_trace(trace, [TraceRequest(i * 0.5, 10 + i, 3) for i in range(10)])
    replayed = sample_workload(trace, rate=4.0, duration=1.0)
    assert replayed == bench_plan("--trace", str(trace), "--rate", "4", "--duration", "1")
    assert [r.prompt_tokens for r in replayed] == [10, 11, 12, 13]


workloads = st.lists(
    st.tuples(st.floats(0, 2, allow_nan=False), st.integers(1, 600), st.integers(1, 40),
              st.sampled_from([(), (1,), (1, 2), (3,)])),
    min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads, st.sampled_from([4, 16]), st.sampled_from([64, 512]))
def test_every_request_gets_one_ordered_timing(
        shapes: list[tuple[float, int, int, tuple[int, ...]]], max_num_seqs: int,
        num_kv_blocks: int) -> None:
    # small KV pools make preemption happen; max_model_len 640 refuses the longest requests
    config = SIM.replace(max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                         max_model_len=640, num_kv_blocks=num_kv_blocks)
    requests = [TraceRequest(arrival, prompt, output, prefix_hashes=hashes, block_tokens=128)
                for arrival, prompt, output, hashes in shapes]
    result = simulate(config, requests)
    assert len(result.timings) == len(requests)
    for request, timing in zip(requests, result.timings, strict=True):
        assert timing.start == request.arrival
        assert timing.ok == (request.prompt_tokens + request.output_tokens <= 640)
        if timing.ok:
            times = [timing.start, *timing.token_times, timing.end]
            assert len(timing.token_times) == timing.num_output_tokens == request.output_tokens
            assert times == sorted(times) and timing.start < timing.token_times[0]
        else:
            assert timing.token_times == ()


def test_a_run_past_its_cpu_budget_is_stopped_with_the_reason() -> None:
    result = simulate(SIM, poisson(3000, rate=40.0), max_cpu_s=0.0)
    assert result.stopped is not None and "s of CPU time" in result.stopped
    assert 0 < sum(t.ok for t in result.timings) < 3000  # cut off, the rest failed
    assert len(result.timings) == 3000


def test_a_stopped_process_does_not_fail_its_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget is CPU time: wall-clock time that passes while the process is not running
    (stopped, or waiting for a busy machine's cores) does not count. Here the wall clock
    jumps an hour at every reading."""
    import tuner.simulate

    jumps = iter(range(0, 10**9, 3600))
    monkeypatch.setattr(tuner.simulate.time, "perf_counter", lambda: float(next(jumps)))
    result = simulate(SIM, poisson(300, rate=40.0), max_cpu_s=300.0)
    assert result.stopped is None and all(t.ok for t in result.timings)

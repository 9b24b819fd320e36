"""AsyncEngine: streams, aborts, admission, stop strings, reconfiguration, shutdown, errors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine, EngineOverloaded, EngineStopped, RequestOutput
from tests.support.engines import realtime_config, sim_config
from tests.support.waiting import wait_for


@pytest.fixture
async def engine() -> AsyncIterator[AsyncEngine]:
    eng = AsyncEngine(sim_config())
    await eng.start()
    yield eng
    await eng.shutdown()


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int] | None = None,
                  **params: Any) -> list[RequestOutput]:
    return [out async for out in engine.generate(request_id, [1, 2, 3] if prompt is None else prompt,
                                                 SamplingParams(**params))]


def assert_all_blocks_free(engine: AsyncEngine) -> None:
    load = engine.load()
    assert (load["running"], load["waiting"], load["swapped"]) == (0, 0, 0)
    assert load["free_blocks"] == load["num_blocks"] and load["kv_usage"] == 0.0


async def test_generate_streams_tokens_text_and_metrics(engine: AsyncEngine) -> None:
    outs = await collect(engine, "a", max_tokens=8)
    assert [o.finished for o in outs] == [False] * 7 + [True]
    assert outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 8
    token_ids = [t for o in outs for t in o.new_token_ids]
    assert "".join(o.text for o in outs) == engine.tokenizer.decode(token_ids)
    last = outs[-1]
    assert last.num_prompt_tokens == 3 and last.ttft is not None and last.ttft > 0
    assert last.queue_time is not None and last.first_token_time is not None
    assert engine.model_name == "random:tiny" and engine.config.max_num_seqs == 16


async def test_concurrent_streams_are_independent(engine: AsyncEngine) -> None:
    results = await asyncio.gather(*(collect(engine, f"r{i}", max_tokens=5 + i)
                                     for i in range(20)))
    assert [r[-1].num_output_tokens for r in results] == [5 + i for i in range(20)]
    assert_all_blocks_free(engine)


async def test_stop_string_ends_the_request_and_is_not_returned(engine: AsyncEngine) -> None:
    full = "".join(o.text for o in await collect(engine, "x", max_tokens=30))
    stop = full[10:12]
    outs = await collect(engine, "x", max_tokens=30, stop=[stop])
    text = "".join(o.text for o in outs)
    assert text == full[:full.find(stop)]
    assert outs[-1].finish_reason == "stop" and outs[-1].num_output_tokens < 30
    assert_all_blocks_free(engine)


async def test_abort_from_another_coroutine_ends_the_stream() -> None:
    engine = AsyncEngine(realtime_config())
    seen: list[RequestOutput] = []

    async def consume() -> None:
        async for out in engine.generate("long", [1, 2], SamplingParams(max_tokens=200)):
            seen.append(out)
            if len(seen) == 3:
                await engine.abort("long")

    await engine.start()
    try:
        await asyncio.wait_for(consume(), 10)
        assert seen[-1].finished and seen[-1].finish_reason == "abort"
        assert seen[-1].num_output_tokens < 200
        assert_all_blocks_free(engine)
    finally:
        await engine.shutdown()


async def test_leaving_the_iterator_early_aborts_the_request() -> None:
    # real-time steps: on the virtual clock 200 tokens can all be out before the abort lands
    engine = AsyncEngine(realtime_config())
    await engine.start()
    try:
        stream = engine.generate("gone", [1, 2], SamplingParams(max_tokens=1000))
        async for _ in stream:
            break
        await stream.aclose()
        await wait_for(lambda: engine.load()["running"] == 0)
        assert_all_blocks_free(engine)
        records, _ = engine.stats.recent(engine.now(), 1e9)
        assert [r.finish_reason for r in records] == ["abort"]
    finally:
        await engine.shutdown()


async def test_bad_input_raises_value_error_before_any_output(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="max_model_len"):
        await collect(engine, "long", prompt=[1] * 200, max_tokens=100)
    with pytest.raises(ValueError, match="prompt token ids"):
        await collect(engine, "vocab", prompt=[10**6])
    with pytest.raises(ValueError, match="empty"):
        await collect(engine, "empty", prompt=[])
    assert (await collect(engine, "fine", max_tokens=2))[-1].finish_reason == "length"


async def test_duplicate_live_request_id_is_refused(engine: AsyncEngine) -> None:
    first = engine.generate("same", [1], SamplingParams(max_tokens=50))
    await anext(first)
    with pytest.raises(ValueError, match="duplicate"):
        await collect(engine, "same")
    await first.aclose()


async def test_reused_request_id_does_not_receive_the_abandoned_streams_outputs() -> None:
    # A client leaves "x" and a new "x" starts at once: the old request's abort (and any of
    # its outputs still on the way) must not land in the new stream.
    engine = AsyncEngine(realtime_config())
    await engine.start()
    try:
        old = engine.generate("x", [1, 2, 3], SamplingParams(max_tokens=500))
        await anext(old)
        await old.aclose()
        outs = [o async for o in engine.generate("x", [1, 2, 3], SamplingParams(max_tokens=5))]
        assert [o.num_output_tokens for o in outs] == [1, 2, 3, 4, 5]
        assert outs[-1].finish_reason == "length"
    finally:
        await engine.shutdown()
    load = engine.load()
    assert load["free_blocks"] == load["num_blocks"]


async def test_full_waiting_queue_is_overloaded_with_retry_after() -> None:
    engine = AsyncEngine(sim_config(max_waiting_requests=2, max_num_seqs=1,
                                    max_num_batched_tokens=256))
    await engine.start()
    try:
        streams = [engine.generate(f"w{i}", [1, 2], SamplingParams(max_tokens=5))
                   for i in range(3)]
        # the third is refused: nothing has reached the engine yet, two are pending
        first_two = [asyncio.ensure_future(anext(s)) for s in streams[:2]]
        await asyncio.sleep(0)
        with pytest.raises(EngineOverloaded) as info:
            await anext(streams[2])
        assert info.value.retry_after >= 1
        await asyncio.gather(*first_two)
        for stream in streams[:2]:
            await stream.aclose()
        assert engine.stats_window(60)["rejections"]["by_reason"] == {"overloaded": 1}
    finally:
        await engine.shutdown()


async def test_too_many_waiting_tokens_is_overloaded() -> None:
    # max_waiting_tokens must hold one full-length request, so fill the queue first: one
    # request holds the only seat, a second waits with 1,500 tokens, a third would pass 2,048.
    engine = AsyncEngine(realtime_config(max_num_seqs=1, max_waiting_tokens=2048))
    await engine.start()
    waiting = engine.generate("wait", [1] * 1500, SamplingParams(max_tokens=10))
    try:
        running = engine.generate("run", [1] * 10, SamplingParams(max_tokens=1000))
        await anext(running)
        pending = asyncio.create_task(anext(waiting))
        await wait_for(lambda: engine.load()["waiting"] > 0)
        with pytest.raises(EngineOverloaded, match="max_waiting_tokens"):
            await collect(engine, "big", prompt=[1] * 1000, max_tokens=1)
    finally:
        await engine.shutdown()
    assert (await pending).finish_reason == "abort"


async def test_load_reports_outstanding_work_for_routing() -> None:
    """`outstanding_tokens`: every unfinished request's prefill left plus outputs left at most
    (what a gateway's least-loaded routing weighs), shrinking as outputs come. The snapshot
    that counts a token is published before the token is streamed, so it never lags what a
    stream has seen; the last sampled token is an output's work, not prefill left too."""
    engine = AsyncEngine(realtime_config(max_num_seqs=1))
    await engine.start()
    try:
        assert engine.load()["outstanding_tokens"] == 0
        running = engine.generate("run", [1] * 10, SamplingParams(max_tokens=1000))
        first = await anext(running)
        waiting = engine.generate("wait", [1] * 300, SamplingParams(max_tokens=50))
        pending = asyncio.create_task(anext(waiting))
        await wait_for(lambda: engine.load()["waiting"] == 1)
        # the waiting one's 300 + 50, the running one's 1000 less what it has generated
        assert engine.load()["outstanding_tokens"] <= 350 + 1000 - first.num_output_tokens
        assert engine.load()["outstanding_tokens"] > 350  # the running one is not done
        await running.aclose()
        await wait_for(lambda: engine.load()["outstanding_tokens"] <= 350)
        started = await pending  # its prompt is computed: only its outputs are left
        assert engine.load()["outstanding_tokens"] <= 50 - started.num_output_tokens
        await waiting.aclose()
        await wait_for(lambda: engine.load()["outstanding_tokens"] == 0)
    finally:
        await engine.shutdown()


async def test_shutdown_aborts_every_stream_and_frees_blocks() -> None:
    engine = AsyncEngine(realtime_config())
    await engine.start()
    streams = [engine.generate(f"s{i}", [1, 2, 3], SamplingParams(max_tokens=500))
               for i in range(8)]
    firsts = await asyncio.gather(*(anext(s) for s in streams))
    assert not any(o.finished for o in firsts)
    await engine.shutdown()
    for stream in streams:
        outs = [o async for o in stream]
        assert outs[-1].finish_reason == "abort"
    assert_all_blocks_free(engine)
    engine.llm_engine.scheduler.check_invariants()
    with pytest.raises(EngineStopped):
        await collect(engine, "late")


async def test_reconfigure_drains_then_parked_requests_run_under_new_knobs() -> None:
    engine = AsyncEngine(realtime_config())
    batch_sizes: list[tuple[int, int]] = []

    class Observer:
        def on_step(self, output: Any) -> None:
            batch_sizes.append((engine.config.max_num_seqs, len(output.scheduled)))

        def on_finished(self, record: Any) -> None:
            pass

    engine.add_observer(Observer())
    await engine.start()
    try:
        old = [asyncio.ensure_future(collect(engine, f"old{i}", max_tokens=40)) for i in range(8)]
        await wait_for(lambda: engine.load()["num_steps"] > 0)  # the old requests are running
        reconfig = asyncio.ensure_future(engine.reconfigure({"max_num_seqs": 2}))
        await wait_for(lambda: engine.load()["reconfiguring"])
        new = [asyncio.ensure_future(collect(engine, f"new{i}", max_tokens=5)) for i in range(6)]
        config = await reconfig
        assert config.max_num_seqs == 2 and engine.config.max_num_seqs == 2
        assert all(r[-1].finish_reason == "length" for r in await asyncio.gather(*old))
        assert all(r[-1].num_output_tokens == 5 for r in await asyncio.gather(*new))
        assert all(n <= seqs for seqs, n in batch_sizes)
        assert (2, 2) in batch_sizes and max(n for _, n in batch_sizes) > 2
        assert_all_blocks_free(engine)
    finally:
        await engine.shutdown()


async def test_reconfigure_abort_running_and_bad_changes() -> None:
    engine = AsyncEngine(realtime_config())
    await engine.start()
    try:
        running = asyncio.ensure_future(collect(engine, "r", max_tokens=1000))
        await wait_for(lambda: engine.load()["running"] == 1)
        await engine.reconfigure({"num_kv_blocks": 200}, abort_running=True)
        assert (await running)[-1].finish_reason == "abort"
        assert engine.load()["num_blocks"] == 200
        with pytest.raises(ValueError, match="unknown engine setting"):
            await engine.reconfigure({"nonsense": 1})
        with pytest.raises(ValueError, match="restart"):
            await engine.reconfigure({"sim_model": "small"})
        with pytest.raises(ValueError):
            await engine.reconfigure({"memory_fraction": "lots"})
        assert (await collect(engine, "after", max_tokens=3))[-1].finish_reason == "length"
    finally:
        await engine.shutdown()


async def test_reconfigure_drain_timeout_aborts_what_still_runs() -> None:
    engine = AsyncEngine(realtime_config())
    await engine.start()
    try:
        running = asyncio.ensure_future(collect(engine, "r", max_tokens=2000, prompt=[1]))
        await wait_for(lambda: engine.load()["running"] == 1)
        await engine.reconfigure({"max_num_seqs": 8}, drain_timeout=0.05)
        assert (await running)[-1].finish_reason == "abort"
    finally:
        await engine.shutdown()


async def test_failed_rebuild_keeps_the_old_configuration(engine: AsyncEngine) -> None:
    with pytest.raises(ValueError, match="context length"):
        await engine.reconfigure({"max_model_len": 10**6, "num_kv_blocks": None})
    assert engine.config.max_model_len == 256
    assert (await collect(engine, "ok", max_tokens=2))[-1].finish_reason == "length"


async def test_step_error_fails_requests_with_reason_error_and_loop_survives(
        engine: AsyncEngine) -> None:
    executor = engine.llm_engine.executor
    original = executor.execute
    calls = 0

    def flaky(plan: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("device lost")
        return original(plan)

    executor.execute = flaky  # type: ignore[method-assign]
    outs = await collect(engine, "doomed", max_tokens=50)
    assert outs[-1].finish_reason == "error"
    assert_all_blocks_free(engine)
    assert (await collect(engine, "next", max_tokens=4))[-1].finish_reason == "length"


async def test_from_engine_wraps_an_existing_llm_engine() -> None:
    from engine import LLMEngine

    core = LLMEngine(sim_config())
    engine = AsyncEngine.from_engine(core)
    assert engine.llm_engine is core
    await engine.start()
    try:
        assert (await collect(engine, "a", max_tokens=2))[-1].num_output_tokens == 2
        assert engine.stats_window(60)["ttft"]["count"] == 1
    finally:
        await engine.shutdown()

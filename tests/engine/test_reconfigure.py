"""Live reconfiguration: the phases of engine/reconfigure.py one transition at a time, counters
that outlive a rebuild, and an AsyncEngine reconfigured 30 times with requests streaming across:
every request ends, counters only grow, parked requests run under the new knobs, a failed
rebuild keeps the old ones."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

import pytest

from engine import EngineConfig, FinishReason, LLMEngine, SamplingParams, StepOutput
from engine.async_engine import AsyncEngine, EngineStopped
from engine.llm_engine import CUMULATIVE_COUNTERS
from engine.reconfigure import Draining, Idle, Reconfigurer, ReconfigureRequest
from tests.support.engines import sim_config
from tests.support.waiting import wait_for

# A rebuild that fails: validation passes, but sizing the KV pool from 1e-6 of the simulated
# device's memory leaves no room for one max_model_len request.
UNSATISFIABLE = {"num_kv_blocks": None, "memory_fraction": 1e-6}


@dataclass
class Parked:
    request_id: str


def drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def counters(stats: dict[str, Any]) -> tuple[int, ...]:
    return tuple(stats[key] for key in CUMULATIVE_COUNTERS)


def never_decrease(history: list[tuple[int, ...]]) -> bool:
    return all(a <= b for prev, cur in zip(history, history[1:], strict=False)
               for a, b in zip(prev, cur, strict=True))


# ---- the phases ------------------------------------------------------------------------------
def test_drain_parks_then_rebuild_resumes_the_parked_in_order() -> None:
    engine = LLMEngine(sim_config())
    machine: Reconfigurer[Parked] = Reconfigurer(engine, lambda: None)
    assert isinstance(machine.phase, Idle) and not machine.park(Parked("early"))
    engine.add_request("running", [1, 2, 3], SamplingParams(max_tokens=4))
    request = ReconfigureRequest(engine.config.replace(max_num_seqs=2), False, None)
    machine.begin(request)
    assert isinstance(machine.phase, Draining) and machine.reconfiguring
    assert all(machine.park(Parked(name)) for name in ("p1", "p2", "p3"))
    assert machine.unpark("p2") == Parked("p2") and machine.unpark("p2") is None
    second = ReconfigureRequest(engine.config.replace(max_num_seqs=4), False, None)
    machine.begin(second)  # refused: one reconfiguration at a time
    assert isinstance(second.future.exception(), RuntimeError)
    assert machine.advance(now=0.0) == [] and machine.reconfiguring  # still draining
    drain(engine)
    assert machine.advance(now=0.0) == [Parked("p1"), Parked("p3")]
    assert isinstance(machine.phase, Idle) and machine.unpark("p1") is None
    assert request.future.result().max_num_seqs == 2 == engine.config.max_num_seqs


def test_deadline_aborts_what_still_runs_then_rebuilds() -> None:
    engine = LLMEngine(sim_config())
    engine.add_request("long", [1, 2, 3], SamplingParams(max_tokens=200))
    engine.step()
    machine: Reconfigurer[Parked] = Reconfigurer(
        engine, lambda: engine.finish("long", FinishReason.ABORT))
    request = ReconfigureRequest(engine.config.replace(num_kv_blocks=48), False, deadline=5.0)
    machine.begin(request)
    assert machine.advance(now=4.9) == [] and engine.has_unfinished()
    machine.advance(now=5.0)
    assert not engine.has_unfinished() and isinstance(machine.phase, Idle)
    assert request.future.result().num_kv_blocks == 48 == engine.stats()["num_blocks"]


def test_failed_rebuild_keeps_serving_the_old_config() -> None:
    engine = LLMEngine(sim_config())
    old = engine.config
    machine: Reconfigurer[Parked] = Reconfigurer(engine, lambda: None)
    request = ReconfigureRequest(old.replace(**UNSATISFIABLE), False, None)
    machine.begin(request)
    machine.park(Parked("p"))
    assert machine.advance(now=0.0) == [Parked("p")] and isinstance(machine.phase, Idle)
    with pytest.raises(ValueError, match="KV blocks"):
        request.future.result()
    assert engine.config == old and engine.stats()["num_blocks"] == old.num_kv_blocks
    engine.add_request("after", [1, 2], SamplingParams(max_tokens=3))
    drain(engine)


def test_failed_allocation_reallocates_the_old_kv_pool() -> None:
    # a real device can run out of memory after the old cache is freed: it must be rebuilt
    engine = LLMEngine(sim_config())
    old, allocated = engine.config, []
    real_allocate = engine.executor.allocate_kv_cache

    def allocate(config: EngineConfig, capacity: Any) -> None:
        allocated.append(config)
        if config.num_kv_blocks == 4096:
            raise RuntimeError("out of device memory")
        real_allocate(config, capacity)

    engine.executor.allocate_kv_cache = allocate  # type: ignore[method-assign]
    machine: Reconfigurer[Parked] = Reconfigurer(engine, lambda: None)
    request = ReconfigureRequest(old.replace(num_kv_blocks=4096), False, None)
    machine.begin(request)
    machine.advance(now=0.0)
    with pytest.raises(RuntimeError, match="out of device memory"):
        request.future.result()
    assert allocated == [old.replace(num_kv_blocks=4096), old] and engine.config == old


def test_cancel_hands_back_the_parked_and_fails_the_caller() -> None:
    engine = LLMEngine(sim_config())
    machine: Reconfigurer[Parked] = Reconfigurer(engine, lambda: None)
    assert machine.cancel(EngineStopped("gone")) == []
    request = ReconfigureRequest(engine.config.replace(max_num_seqs=2), False, None)
    machine.begin(request)
    machine.park(Parked("p"))
    assert machine.cancel(EngineStopped("gone")) == [Parked("p")]
    assert isinstance(machine.phase, Idle) and engine.config.max_num_seqs == 16
    assert isinstance(request.future.exception(), EngineStopped)


def test_llm_engine_counters_are_totals_across_reconfigure() -> None:
    engine = LLMEngine(sim_config(num_kv_blocks=16, max_num_seqs=8))
    prompt = list(range(1, 49))  # three full blocks, shared: the later requests hit the cache
    for i in range(8):
        engine.add_request(f"a{i}", prompt, SamplingParams(max_tokens=60))
    drain(engine)
    before = counters(engine.stats())
    assert all(value > 0 for value in before)  # preempted, looked up and hit
    engine.reconfigure(engine.config.replace(num_kv_blocks=24))
    assert counters(engine.stats()) == before
    with pytest.raises(ValueError):
        engine.reconfigure(engine.config.replace(**UNSATISFIABLE))
    assert counters(engine.stats()) == before
    engine.add_request("b", prompt, SamplingParams(max_tokens=4))
    drain(engine)
    engine.add_request("c", prompt, SamplingParams(max_tokens=4))  # hits b's blocks
    drain(engine)
    after = counters(engine.stats())
    assert all(a >= b for a, b in zip(after, before, strict=True)) and after[2] > before[2]


# ---- many reconfigurations under load --------------------------------------------------------
CHANGES: list[dict[str, Any]] = [
    {"max_num_seqs": 2},
    {"max_num_seqs": 16, "num_kv_blocks": 16},
    {"num_kv_blocks": 32, "max_num_batched_tokens": 128},
    UNSATISFIABLE,
    {"max_num_seqs": 8, "max_num_batched_tokens": 256},
]
PROMPTS = [list(range(1, 33)) + [40 + k] * (8 + k) for k in range(3)]  # a shared 2-block prefix


class Recorder:
    """Observer: each request's config at its first step, counter totals after every step, and
    a gate that holds the engine thread inside a step, so that what the test submits meanwhile
    reaches the engine in one batch, in order."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine
        self.first_config: dict[str, EngineConfig] = {}
        self.totals: list[tuple[int, ...]] = []
        self.closed, self.held, self.opened = threading.Event(), threading.Event(), threading.Event()

    def on_step(self, output: StepOutput) -> None:
        core = self.engine.llm_engine  # on the engine thread: safe to read
        for request_id in output.scheduled:
            self.first_config.setdefault(request_id, core.config)
        self.totals.append(counters(core.stats()))
        if self.closed.is_set():
            self.held.set()
            self.opened.wait(timeout=30)
            self.held.clear()

    def on_finished(self, record: Any) -> None:
        pass

    def close(self) -> None:
        self.opened.clear()
        self.closed.set()

    def open(self) -> None:
        self.closed.clear()
        self.opened.set()


async def client(engine: AsyncEngine, name: str, stop: asyncio.Event,
                 reasons: dict[str, str | None]) -> None:
    n = 0
    while not stop.is_set():
        request_id, n = f"{name}-{n}", n + 1
        params = SamplingParams(max_tokens=10 + 7 * n % 30)
        async for out in engine.generate(request_id, PROMPTS[n % 3], params):
            reasons[request_id] = out.finish_reason


async def reconfigure_while_held(engine: AsyncEngine, recorder: Recorder, round_: int,
                                 probes: dict[str, asyncio.Future[Any]]) -> EngineConfig:
    """One round: with the engine thread held, submit the reconfiguration and then two probe
    requests (parked by construction); let go; return the config the probes must run under."""
    old, changes = engine.config, CHANGES[round_ % len(CHANGES)]
    abort_running, drain_timeout = round_ % 3 == 0, 0.01 if round_ % 3 == 1 else None
    recorder.close()
    await wait_for(recorder.held.is_set)
    waiting = engine.load()["waiting"]  # while held, only new submissions move it
    reconfig = asyncio.ensure_future(engine.reconfigure(changes, abort_running, drain_timeout))
    for k in range(2):  # tasks start in order: the reconfiguration is submitted first
        probes[f"p{round_}-{k}"] = asyncio.ensure_future(probe(engine, f"p{round_}-{k}"))
    await wait_for(lambda: engine.load()["waiting"] >= waiting + 2)
    recorder.open()
    if changes is UNSATISFIABLE:
        with pytest.raises(ValueError, match="KV blocks"):
            await asyncio.wait_for(reconfig, 30)
        assert engine.config == old
        return old
    config: EngineConfig = await asyncio.wait_for(reconfig, 30)  # the drain ends
    assert config == engine.config == old.replace(**changes)
    return config


async def probe(engine: AsyncEngine, request_id: str) -> str | None:
    outs = [o async for o in engine.generate(request_id, PROMPTS[0], SamplingParams(max_tokens=5))]
    return outs[-1].finish_reason


async def test_thirty_reconfigurations_with_requests_streaming_across() -> None:
    engine = AsyncEngine(sim_config(num_kv_blocks=32, sim_clock="realtime", sim_hardware="cpu"))
    recorder = Recorder(engine)
    engine.add_observer(recorder)
    await engine.start()
    stop = asyncio.Event()
    reasons: dict[str, str | None] = {}
    clients = [asyncio.ensure_future(client(engine, f"c{i}", stop, reasons)) for i in range(6)]
    probes: dict[str, asyncio.Future[Any]] = {}
    expected: dict[str, EngineConfig] = {}
    seen = [counters(engine.load())]
    try:
        for round_ in range(30):
            config = await reconfigure_while_held(engine, recorder, round_, probes)
            expected.update({f"p{round_}-{k}": config for k in range(2)})
            seen.append(counters(engine.load()))
        stop.set()
        await asyncio.wait_for(asyncio.gather(*clients), 60)  # never hung
        probe_reasons = await asyncio.wait_for(asyncio.gather(*probes.values()), 60)
    finally:
        recorder.open()
        stop.set()
        await engine.shutdown()
    assert set(reasons.values()) <= {"length", "abort"} and len(reasons) > 30
    assert set(probe_reasons) <= {"length", "abort"}
    # a probe that ran at all first ran under the config its reconfiguration left
    ran = {p: recorder.first_config[p] for p in probes if p in recorder.first_config}
    assert len(ran) >= 30 and all(config == expected[p] for p, config in ran.items())
    assert never_decrease(recorder.totals) and never_decrease(seen)
    assert all(value > 0 for value in recorder.totals[-1])
    engine.llm_engine.scheduler.check_invariants()
    load = engine.load()
    assert load["free_blocks"] == load["num_blocks"] and not load["reconfiguring"]

"""Sim mode: replay a workload through `LLMEngine` on the simulated executor's virtual clock.

A discrete-event replay: requests enter the engine at their arrival times; while the engine is
busy every arrival up to the clock's time is added before the next step, and while it is idle the
clock jumps to the next arrival. Each token's time is the virtual time of the step that produced
it (the scheduler stamps it after the executor has advanced the clock by the modelled step
time), so TTFT and inter-token gaps are what the modelled hardware would have served. No model
runs and no real time passes: a trial of thousands of requests takes seconds of CPU.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from engine.clock import VirtualClock
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import Request, SamplingParams
from protocol.measures import RequestTiming
from tuner.measures import StopRule
from tuner.traces import TraceRequest

_FRUITLESS_SLACK = 100  # preempting steps that run nothing, beyond one per live request


@dataclass(frozen=True)
class SimResult:
    # one per request of the workload, in workload order; a request the engine refused, or one
    # cut off by a stop, is ok=False with no token times (an SLO miss)
    timings: list[RequestTiming]
    elapsed_s: float  # virtual seconds from the first arrival to the last finish
    stopped: str | None  # why `stop` cut the run short, else None
    steps: int
    wall_s: float  # real seconds the simulation took
    preemptions: int
    refused: Counter[str] = field(default_factory=Counter)  # why the engine refused requests


def simulate(config: EngineConfig, requests: Sequence[TraceRequest], *,
             stop: StopRule | None = None, check_every: int = 50,
             max_cpu_s: float | None = None) -> SimResult:
    """Replay `requests` through a sim engine built from `config` (virtual clock).

    `max_cpu_s`: seconds of this process's CPU time after which the run is stopped (the rest
    failed), so no trial runs unbounded (CPU, not wall-clock time: a machine that is busy with
    other work, or a process that is stopped for a while, does not fail a trial that would
    have finished); an engine that only preempts, never running anything, is stopped too.

    `stop` sees the timings of the finished requests (refused ones included) every
    `check_every` finishes; a reason it returns aborts the rest of the run. ValueError when
    `config` is not a virtual-clock sim config or the engine cannot start under it (too little
    simulated memory, max_model_len beyond the model's context), with the engine's message."""
    if config.executor != "sim" or config.sim_clock != "virtual":
        raise ValueError(
            f"sim mode needs executor='sim' and sim_clock='virtual', got executor="
            f"{config.executor!r}, sim_clock={config.sim_clock!r}; set both in the engine config")
    if check_every < 1:
        raise ValueError(f"check_every must be >= 1, got {check_every}")
    started = time.perf_counter()
    first_arrival = min((r.arrival for r in requests), default=0.0)
    try:
        engine = LLMEngine(config, clock=VirtualClock(first_arrival))
    except (ValueError, RuntimeError) as error:
        raise ValueError(str(error)) from None
    replay = Replay(engine, requests, stop, check_every, max_cpu_s)
    stopped = replay.run()
    return SimResult(timings=replay.timings(), elapsed_s=replay.last_end - first_arrival,
                     stopped=stopped, steps=replay.steps,
                     wall_s=time.perf_counter() - started,
                     preemptions=int(engine.stats().get("num_preemptions", 0)),
                     refused=replay.refused)


class Replay:
    """One run's state: the arrival cursor, the live requests, the finished timings (also
    what tuner/fidelity.py replays on the wall clock)."""

    def __init__(self, engine: LLMEngine, requests: Sequence[TraceRequest],
                 stop: StopRule | None, check_every: int, max_cpu_s: float | None) -> None:
        self.engine = engine
        self.max_cpu_s = max_cpu_s
        self.cpu_started = time.process_time()
        self.clock = engine.clock
        self.requests = requests
        # arrival order, workload order among equal arrivals (sorted is stable)
        self.order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
        self.cursor = 0  # next position in `order` to add
        self.prompts = PromptBuilder(engine.executor.vocab_size)
        self.live: dict[str, tuple[int, Request]] = {}  # request id -> (workload index, request)
        self.done: dict[int, RequestTiming] = {}
        self.refused: Counter[str] = Counter()
        self.finished: list[RequestTiming] = []  # finish order, what `stop` sees
        self.stop = stop
        self.check_every = check_every
        self.next_check = check_every
        self.steps = 0
        self.last_end = min((r.arrival for r in requests), default=0.0)

    def run(self) -> str | None:
        """Step until every request has finished; the reason when stopped early."""
        fruitless = 0  # steps in a row that ran nothing
        while self.cursor < len(self.order) or self.live:
            self._admit_arrivals()
            if not self.live:
                self._jump_to_next_arrival()
                continue
            output = self.engine.step()
            if not output.scheduled:
                fruitless += 1
                if output.preempted and fruitless <= len(self.live) + _FRUITLESS_SLACK:
                    continue  # room was made; the next plan can use it
                if output.preempted:  # preempting round and round, never running anything
                    return self._abort_rest(f"the engine preempted {fruitless} times without "
                                            f"running any of its {len(self.live)} requests")
                # nothing could run (no step, no time): only a new arrival can change that
                if self.cursor < len(self.order):
                    self._jump_to_next_arrival()
                    continue
                return self._abort_rest(f"the engine stalled with {len(self.live)} requests "
                                        "it could not schedule")
            fruitless = 0
            self.steps += 1
            if self.max_cpu_s is not None and self.steps % 256 == 0 and \
                    time.process_time() - self.cpu_started > self.max_cpu_s:
                return self._abort_rest(f"the simulation ran past {self.max_cpu_s:g} s of "
                                        "CPU time")
            for request_id in output.finished:
                self._finish(request_id)
            reason = self._check_stop()
            if reason is not None:
                return self._abort_rest(reason)
        return None

    def _admit_arrivals(self) -> None:
        now = self.clock.now()
        order, requests = self.order, self.requests
        while self.cursor < len(order) and requests[order[self.cursor]].arrival <= now:
            self._add(order[self.cursor])
            self.cursor += 1

    def _jump_to_next_arrival(self) -> None:
        if self.cursor < len(self.order):
            arrival = self.requests[self.order[self.cursor]].arrival
            self.clock.sleep(arrival - self.clock.now())

    def _add(self, index: int) -> None:
        trace = self.requests[index]
        request_id = f"sim-{index}"
        try:
            params = SamplingParams(max_tokens=trace.output_tokens, ignore_eos=True)
            request = self.engine.add_request(
                request_id, self.prompts.build(index, trace), params, tenant=trace.tenant,
                priority=trace.priority or "interactive", arrival_time=trace.arrival)
        except ValueError as error:  # too long for max_model_len, an unknown priority, ...
            self.refused[self._refusal(str(error))] += 1
            self._record(index, _failed(trace.arrival, trace.arrival))
            return
        self.live[request_id] = (index, request)

    def _refusal(self, message: str) -> str:
        """The engine's reason, the same words for every request it applies to."""
        if "max_model_len" in message:
            return (f"prompt plus max_tokens longer than max_model_len "
                    f"({self.engine.config.resolved_max_model_len})")
        return message

    def _finish(self, request_id: str) -> None:
        index, request = self.live.pop(request_id)
        end = request.finished_time
        assert end is not None
        self._record(index, RequestTiming(start=request.arrival_time,
                                          token_times=request.token_times,
                                          num_output_tokens=request.num_output_tokens,
                                          end=end, ok=True))

    def _record(self, index: int, timing: RequestTiming) -> None:
        self.done[index] = timing
        self.finished.append(timing)
        self.last_end = max(self.last_end, timing.end)

    def _check_stop(self) -> str | None:
        if self.stop is None or len(self.finished) < self.next_check:
            return None
        self.next_check = (len(self.finished) // self.check_every + 1) * self.check_every
        return self.stop(self.finished)

    def _abort_rest(self, reason: str) -> str:
        """Abort the running requests and fail every one not finished."""
        now = self.clock.now()
        for request_id, (index, _) in self.live.items():
            self.engine.abort(request_id)
            self.done[index] = _failed(self.requests[index].arrival, now)
        self.live.clear()
        for index in self.order[self.cursor:]:
            arrival = self.requests[index].arrival
            self.done[index] = _failed(arrival, arrival)
        self.cursor = len(self.order)
        return reason

    def timings(self) -> list[RequestTiming]:
        return [self.done[i] for i in range(len(self.requests))]


def _failed(start: float, end: float) -> RequestTiming:
    return RequestTiming(start=start, token_times=(), num_output_tokens=0, end=end, ok=False)


class PromptBuilder:
    """Deterministic prompt token ids: each prefix hash names one fixed `block_tokens` run of
    ids (equal hashes, equal text: the prefix cache shares it as in a real replay), the rest of
    the prompt is unique to the request (its workload index is spelled in its first ids)."""

    TAG_PREFIX, TAG_UNIQUE = 0, 1  # first id of a run: prefix blocks never equal a unique tail

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._filler = [(7 + 31 * j) % vocab_size for j in range(4096)]
        self._blocks: dict[tuple[int, int], list[int]] = {}  # (hash, block_tokens) -> ids

    def build(self, index: int, trace: TraceRequest) -> list[int]:
        ids: list[int] = []
        for prefix_hash in trace.prefix_hashes:
            if len(ids) >= trace.prompt_tokens:
                break
            ids += self._block(prefix_hash, trace.block_tokens)
        del ids[trace.prompt_tokens:]
        ids += self._run(self.TAG_UNIQUE, index, trace.prompt_tokens - len(ids))
        return ids

    def _block(self, prefix_hash: int, block_tokens: int) -> list[int]:
        key = (prefix_hash, block_tokens)
        block = self._blocks.get(key)
        if block is None:
            block = self._blocks[key] = self._run(self.TAG_PREFIX, prefix_hash, block_tokens)
        return block

    def _run(self, tag: int, value: int, length: int) -> list[int]:
        """`length` ids: the tag, `value` in base vocab_size (three digits, then a hash of the
        rest: unique for any index below vocab_size**3), then filler."""
        vocab = self.vocab_size
        value = value if 0 <= value < vocab**3 else hash(value) % vocab**3
        head = [tag, value % vocab, value // vocab % vocab, value // vocab**2]
        ids = head[:length]
        while len(ids) < length:
            ids += self._filler[: length - len(ids)]
        return ids


def sample_workload(name_or_path: str | Path, rate: float | None, duration: float | None,
                    seed: int = 0) -> list[TraceRequest]:
    """The requests `fairgate bench --workload NAME` (or `--trace PATH`) would send at `rate`
    for `duration` seconds with `seed`: a named workload, else a trace file."""
    from tuner.workload import WORKLOADS, LoadShape, TraceReplay, build_requests, get_workload

    name = str(name_or_path)
    workload = (get_workload(name) if name in WORKLOADS
                else TraceReplay(Path(name).stem, Path(name)))
    return build_requests(workload, LoadShape(rate=rate, duration=duration, seed=seed))

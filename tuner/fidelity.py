"""Simulator fidelity: the same workload through the real engine in real time and through the
calibrated simulator on its virtual clock, measured the same way.

`replay_realtime` is `tuner.simulate.simulate` with a wall clock: the same replay loop (requests
enter at their arrival times, the engine steps while it has work, sleeps to the next arrival
while it has none), but the engine is the real one and a token's time is when its step really
ended. `fidelity_figures` reduces either side's timings to the figures the goals are stated in.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.config import EngineConfig
from engine.heap import serving_heap
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams
from protocol.measures import RequestTiming
from protocol.stats import percentile_of_sorted
from tuner.simulate import Replay, SimResult, simulate
from tuner.traces import TraceRequest

# (figure, allowed relative error): issue 14's goals for the calibrated simulator
GOALS: dict[str, float] = {"throughput_tok_s": 0.10, "ttft_p50_s": 0.10, "ttft_p99_s": 0.20,
                           "tpot_p50_s": 0.10, "tpot_p99_s": 0.20}


def replay_realtime(config: EngineConfig, requests: Sequence[TraceRequest],
                    warmup_requests: int = 4) -> SimResult:
    """Replay `requests` through a real-time engine built from `config`, arrival times honoured
    on the wall clock (offsets from the start of the replay), with the garbage collector as an
    engine server has it (`engine.heap.serving_heap`: without it a full collection stalled
    the engine 120-200 ms, two or three times a replay, which the simulator does not model and
    a server does not do)."""
    engine = LLMEngine(config)
    _warm_up(engine, warmup_requests)
    with serving_heap(engine.config.max_num_seqs):  # the collector as `fairgate engine` has it
        start = engine.clock.now()
        # shifted onto the engine's clock: the replay loop sleeps until each arrival comes
        shifted = [replace(r, arrival=start + r.arrival) for r in requests]
        replay = Replay(engine, shifted, None, 50, None)
        wall = time.perf_counter()
        stopped = replay.run()
    return SimResult(timings=replay.timings(), elapsed_s=replay.last_end - start,
                     stopped=stopped, steps=replay.steps, wall_s=time.perf_counter() - wall,
                     preemptions=int(engine.stats().get("num_preemptions", 0)))


def _warm_up(engine: LLMEngine, count: int) -> None:
    """A few requests before the clock starts: the first forward passes are slow."""
    vocab = engine.executor.vocab_size
    for i in range(count):
        prompt = [(i * 31 + j) % vocab for j in range(64)]
        engine.add_request(f"warmup-{i}", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def simulate_profiled(config: EngineConfig, profile_path: str,
                      requests: Sequence[TraceRequest]) -> SimResult:
    """The same replay on the simulated executor with the calibration profile."""
    sim = config.replace(executor="sim", sim_clock="virtual", sim_profile=profile_path)
    return simulate(sim, requests)


@dataclass(frozen=True)
class Figures:
    requests: int  # that finished
    throughput_tok_s: float  # output tokens per second from the first arrival to the last end
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float  # per request: (last token - first token) / (tokens - 1), the tuner's ITL
    tpot_p99_s: float

    def relative_errors(self, real: Figures) -> dict[str, float]:
        """(this - real) / real, per figure of `GOALS`."""
        return {name: (getattr(self, name) - getattr(real, name)) / getattr(real, name)
                for name in GOALS}


def segments(requests: Sequence[TraceRequest], count: int) -> list[list[TraceRequest]]:
    """`requests` cut into `count` runs of consecutive requests (as even as the count allows),
    each with its arrivals shifted to start at 0: a workload replayed a part at a time, with
    other work between the parts."""
    if not 1 <= count <= max(1, len(requests)):
        raise ValueError(f"cannot cut {len(requests)} requests into {count} segments")
    bounds = [round(i * len(requests) / count) for i in range(count + 1)]
    parts = []
    for lo, hi in itertools.pairwise(bounds):
        first = requests[lo].arrival if hi > lo else 0.0
        parts.append([replace(r, arrival=r.arrival - first) for r in requests[lo:hi]])
    return parts


def pooled(results: Sequence[SimResult]) -> SimResult:
    """Segments' results as one run: their requests together, their elapsed times added (so
    throughput is tokens over the time the segments served), steps and preemptions summed."""
    return SimResult(timings=[t for r in results for t in r.timings],
                     elapsed_s=sum(r.elapsed_s for r in results),
                     stopped=next((r.stopped for r in results if r.stopped), None),
                     steps=sum(r.steps for r in results), wall_s=sum(r.wall_s for r in results),
                     preemptions=sum(r.preemptions for r in results))


def mean_figures(runs: Sequence[Figures]) -> Figures:
    """The simulator's expected figures: each figure's mean over runs that differ only in the
    seed of their step noise (one noise stream's p99 rests on where its few slow stretches
    fell; the real engine is one draw of its own). `requests` is the fewest that finished."""
    if not runs:
        raise ValueError("no runs to average")
    return Figures(requests=min(f.requests for f in runs),
                   **{name: sum(getattr(f, name) for f in runs) / len(runs) for name in GOALS})


def fidelity_figures(result: SimResult) -> Figures:
    done: list[RequestTiming] = [t for t in result.timings if t.ok]
    ttfts = sorted(t.ttft for t in done if t.ttft is not None)
    tpots = sorted(t.tpot for t in done if t.tpot is not None)
    tokens = sum(t.num_output_tokens for t in done)
    return Figures(requests=len(done),
                   throughput_tok_s=tokens / result.elapsed_s if result.elapsed_s > 0 else 0.0,
                   ttft_p50_s=percentile_of_sorted(ttfts, 50),
                   ttft_p99_s=percentile_of_sorted(ttfts, 99),
                   tpot_p50_s=percentile_of_sorted(tpots, 50),
                   tpot_p99_s=percentile_of_sorted(tpots, 99))

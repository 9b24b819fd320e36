"""`engine.server.size_young_generation`: the collector as `fairgate engine` and an embedded
`fairgate serve` set it, so a step's own short-lived objects are not collected inside steps."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.server import YOUNG_PER_SEQ, size_young_generation

RUNNING = 1024


@pytest.fixture
def thresholds() -> Iterator[tuple[int, int, int]]:
    """CPython's defaults for the test, whatever the process had; put back after."""
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield gc.get_threshold()
    gc.set_threshold(*before)


def young_collections(engine: LLMEngine, steps: int) -> int:
    before = gc.get_stats()[0]["collections"]
    for _ in range(steps):
        engine.step()
    return gc.get_stats()[0]["collections"] - before


def test_a_sized_young_generation_is_not_collected_inside_steps(
        thresholds: tuple[int, int, int]) -> None:
    engine = LLMEngine(EngineConfig(executor="sim", max_num_seqs=RUNNING,
                                    max_num_batched_tokens=16384, max_model_len=4096))
    for i in range(RUNNING):
        engine.add_request(f"r{i}", [1 + i % 50] * 8, SamplingParams(max_tokens=200,
                                                                     ignore_eos=True))
    engine.step()  # every prefill, then decodes of all of them
    assert len(engine.scheduler.running) == RUNNING
    assert young_collections(engine, 20) >= 20  # CPython's 700: at least one a step
    assert size_young_generation(RUNNING) == YOUNG_PER_SEQ * RUNNING == gc.get_threshold()[0]
    assert young_collections(engine, 20) == 0


def test_it_never_lowers_the_threshold_nor_turns_the_collector_on(
        thresholds: tuple[int, int, int]) -> None:
    gc.set_threshold(50_000, 10, 10)
    assert size_young_generation(8) == 50_000 == gc.get_threshold()[0]
    gc.set_threshold(0)  # an operator who switched it off
    assert size_young_generation(RUNNING) == 0 and gc.get_threshold()[0] == 0

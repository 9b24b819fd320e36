"""engine.heap: the collector as `fairgate engine` and an embedded `fairgate serve` set it (a
step's own short-lived objects are not collected inside steps), and `serving_heap`, the same
for a measurement of the engine (calibration, the fidelity replay), undone after it."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.heap import YOUNG_PER_SEQ, serving_heap, size_young_generation

RUNNING = 1024


@pytest.fixture
def thresholds() -> Iterator[tuple[int, int, int]]:
    """CPython's defaults and an unfrozen heap for the test, whatever the process had; put
    back after."""
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    gc.set_threshold(700, 10, 10)
    gc.unfreeze()
    yield gc.get_threshold()
    gc.set_threshold(*before)
    if frozen:
        gc.freeze()


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
    assert young_collections(engine, 20) >= 10  # CPython's 700: about one a step
    assert size_young_generation(RUNNING) == YOUNG_PER_SEQ * RUNNING == gc.get_threshold()[0]
    assert young_collections(engine, 20) == 0


def test_it_never_lowers_the_threshold_nor_turns_the_collector_on(
        thresholds: tuple[int, int, int]) -> None:
    gc.set_threshold(50_000, 10, 10)
    assert size_young_generation(8) == 50_000 == gc.get_threshold()[0]
    gc.set_threshold(0)  # an operator who switched it off
    assert size_young_generation(RUNNING) == 0 and gc.get_threshold()[0] == 0


class Node:
    """A cycle's member: only the collector frees it."""

    def __init__(self) -> None:
        self.other: Node | None = None


def cycle() -> Node:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


def test_serving_heap_freezes_what_started_and_undoes_it_after(
        thresholds: tuple[int, int, int]) -> None:
    assert gc.get_freeze_count() == 0
    with serving_heap(64):
        frozen = gc.get_freeze_count()
        assert frozen > 0 and gc.get_threshold()[0] == YOUNG_PER_SEQ * 64
        node = cycle()  # alive when a block inside this one (a replay between rounds) begins
        garbage = weakref.ref(node)
        with serving_heap(4096):  # ... which freezes it
            assert gc.get_freeze_count() > frozen
            assert gc.get_threshold()[0] == YOUNG_PER_SEQ * 4096
        del node  # garbage now, but frozen
        gc.collect()
        assert garbage() is not None  # frozen: no collection reaches it
        assert gc.get_threshold()[0] == YOUNG_PER_SEQ * 64
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds
    gc.collect()
    assert garbage() is None  # unfrozen after the outermost block: collected as usual


def test_serving_heap_is_undone_when_the_measurement_fails(
        thresholds: tuple[int, int, int]) -> None:
    with pytest.raises(KeyboardInterrupt), serving_heap(512):
        raise KeyboardInterrupt
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == thresholds


def test_a_heap_frozen_before_stays_frozen(thresholds: tuple[int, int, int]) -> None:
    gc.freeze()  # a server's startup heap
    try:
        with serving_heap(64):
            pass
        assert gc.get_freeze_count() > 0 and gc.get_threshold() == thresholds
    finally:
        gc.unfreeze()

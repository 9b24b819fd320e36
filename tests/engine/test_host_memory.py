"""A CPU engine keeps the memory a step freed for the next step (engine/host_memory.py): a
large prefill is not faulted in page by page every time, unless the operator set glibc's
own tunables."""

from __future__ import annotations

import resource

import pytest

from engine import host_memory
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.request import SamplingParams

PROMPT = 480


def _prefill_faults(engine: LLMEngine, i: int) -> int:
    """Minor page faults of the step that prefills a PROMPT-token request (its own first
    token: no prefix-cache hit shortens it)."""
    vocab = engine.executor.vocab_size
    engine.add_request(f"r{i}", [(7 * j + 13 * i) % vocab for j in range(PROMPT)],
                       SamplingParams(max_tokens=1, ignore_eos=True))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    engine.step()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    while engine.has_unfinished():
        engine.step()
    return faults


def test_a_cpu_prefill_does_not_fault_its_activations_in_afresh() -> None:
    engine = LLMEngine(EngineConfig(model="random:tiny", max_num_batched_tokens=512))
    state = host_memory.state()  # set by the CPU executor's start (once per process)
    assert state is not None
    if not state.startswith("freed step memory kept"):
        pytest.skip(f"not applied here: {state}")
    _prefill_faults(engine, 0)
    faults = min(_prefill_faults(engine, i) for i in range(1, 4))
    # glibc's defaults: about 5,000 faults (each 4 KiB of activations mapped afresh); kept:
    # under 200, the pages the step's new tensors touch for the first time
    assert faults < 1000, faults


def test_the_operators_malloc_tunables_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")  # not one that the settings touch
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")
    assert host_memory._apply() == "malloc left to $MALLOC_TRIM_THRESHOLD_"
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert host_memory._apply() == "malloc left to $GLIBC_TUNABLES"

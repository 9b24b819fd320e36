"""tuner.fidelity: a workload cut into segments and the segments' results pooled, as
bench/sim_fidelity.py interleaves its replay with the calibration rounds."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.config import EngineConfig
from tuner.fidelity import GOALS, Figures, fidelity_figures, mean_figures, pooled, segments
from tuner.simulate import simulate
from tuner.traces import TraceRequest

SIM = EngineConfig.from_dict({"model": "random:tiny", "executor": "sim", "sim_clock": "virtual",
                              "max_num_seqs": 8, "max_num_batched_tokens": 256})


@given(gaps=st.lists(st.floats(0.0, 5.0), min_size=1, max_size=60), count=st.integers(1, 8))
def test_segments_keep_every_request_in_order_with_its_gaps(gaps: list[float],
                                                            count: int) -> None:
    arrivals = [sum(gaps[:i + 1]) for i in range(len(gaps))]
    requests = [TraceRequest(a, 10 + i, 5) for i, a in enumerate(arrivals)]
    if count > len(requests):
        with pytest.raises(ValueError, match="cannot cut"):
            segments(requests, count)
        return
    parts = segments(requests, count)
    assert len(parts) == count
    assert [r.prompt_tokens for part in parts for r in part] == [r.prompt_tokens for r in requests]
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1  # as even as the count allows
    for part in parts:
        assert part[0].arrival == 0.0  # each starts at 0 ...
        originals = [r for r in requests if r.prompt_tokens in {p.prompt_tokens for p in part}]
        for shifted, original in zip(part, originals, strict=True):  # ... keeping its gaps
            assert shifted.arrival == pytest.approx(original.arrival - originals[0].arrival)


def test_pooled_segments_are_one_run_of_their_requests() -> None:
    requests = [TraceRequest(i * 0.05, 40 + 7 * i, 6 + i % 5) for i in range(30)]
    results = [simulate(SIM, part) for part in segments(requests, 3)]
    whole = pooled(results)
    assert len(whole.timings) == 30 and all(t.ok for t in whole.timings)
    assert whole.elapsed_s == pytest.approx(sum(r.elapsed_s for r in results))
    assert whole.steps == sum(r.steps for r in results)
    figures = fidelity_figures(whole)
    tokens = sum(r.output_tokens for r in requests)
    assert figures.requests == 30
    assert figures.throughput_tok_s == pytest.approx(tokens / whole.elapsed_s)
    # one segment is the whole replay
    alone = simulate(SIM, requests)
    assert fidelity_figures(pooled([alone])) == fidelity_figures(alone)


def test_the_sims_figures_are_the_mean_of_its_noise_draws() -> None:
    draws = [Figures(300, 360.0, 0.050, 0.110, 0.008, 0.016),
             Figures(299, 362.0, 0.052, 0.150, 0.009, 0.020)]
    mean = mean_figures(draws)
    assert mean.requests == 299  # the fewest that finished
    for name in GOALS:
        assert getattr(mean, name) == pytest.approx(sum(getattr(d, name) for d in draws) / 2)
    assert mean_figures(draws[:1]) == draws[0]
    with pytest.raises(ValueError, match="no runs"):
        mean_figures([])

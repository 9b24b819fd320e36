"""A calibration profile's step noise: what `fairgate tune calibrate` records of how uneven the
real engine's steps were, and the sim executor replaying it (engine/sim_profile.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sim_profile import (
    FEATURES,
    SimProfile,
    StepNoise,
    lag_one_autocorrelation,
    load_profile,
    save_profile,
)
from tuner.calibrate import DISTURBED_ROUND, disturbed_rounds, step_noise
from tuner.fidelity import fidelity_figures
from tuner.simulate import simulate
from tuner.traces import TraceRequest

STEP = 1e-3  # seconds: every step of the profiles below, before noise


def profile_with(noise: StepNoise | None) -> SimProfile:
    return SimProfile(coefficients={"step": STEP}, kv_tokens=65536, kv_bytes_per_token=1024,
                      max_position=2048, model="random:tiny", device="cpu", noise=noise)


def saved(tmp_path: Path, noise: StepNoise | None, name: str = "profile.yaml") -> str:
    path = tmp_path / name
    save_profile(profile_with(noise), path)
    return str(path)


@given(ratios=st.lists(st.floats(0.3, 3.0), min_size=1, max_size=40),
       block=st.integers(1, 12), seed=st.integers(0, 2**32))
def test_the_stream_is_blocks_of_consecutive_ratios(ratios: list[float], block: int,
                                                    seed: int) -> None:
    noise = StepNoise(tuple(ratios), block)
    drawn = list(itertools.islice(noise.stream(seed), 5 * block))
    assert drawn == list(itertools.islice(noise.stream(seed), 5 * block))  # seeded
    n = len(ratios)
    for i in range(0, len(drawn), block):  # each block: a circular run of the ratios
        chunk = drawn[i:i + block]
        starts = [s for s in range(n) if all(chunk[k] == ratios[(s + k) % n]
                                             for k in range(block))]
        assert starts, chunk


def test_measured_ratios_keep_their_order_and_a_mean_of_one() -> None:
    noise = StepNoise.measured([1.0, 2.0, 3.0, 50.0, 0.01])  # a stall and a glitch: clipped
    assert noise.ratios == pytest.approx(np.array([1.0, 2.0, 3.0, 4.0, 0.25]) / 2.05, abs=1e-4)
    assert sum(noise.ratios) / len(noise.ratios) == pytest.approx(1.0, abs=1e-4)


def test_the_calibration_records_each_measured_step_over_its_prediction() -> None:
    coefficients = np.array([1e-3, 1e-5])  # step, tokens
    shapes = [(1.0, 10.0), (1.0, 100.0), (1.0, 400.0)]
    uneven = [0.9, 1.0, 1.3, 0.8, 1.1, 0.9]

    def run(factors: list[float]) -> list[tuple[tuple[float, ...], float]]:
        return [(f, float(np.dot(f, coefficients)) * k) for f, k in zip(shapes, factors, strict=True)]

    rounds = [[run(uneven[:3])], [run(uneven[3:])]]  # two rounds of one phase
    noise = step_noise(coefficients, rounds)
    assert noise.ratios == pytest.approx(uneven, abs=1e-4)  # in the order measured, mean 1


def test_with_three_rounds_a_step_is_measured_against_its_own_median() -> None:
    """The fit's own misses are not unevenness: a step the fit reads 30% short in every round
    records ratios about 1; what one round ran slower than the others still shows."""
    coefficients = np.array([1e-3, 1e-5])
    shapes = [(1.0, 10.0), (1.0, 100.0), (1.0, 400.0)]
    misfit = [1.0, 1.3, 1.0]  # the fit reads the middle shape short, every round
    slow = [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.2, 1.0]]  # a step of the third ran slow

    def run(factors: list[float]) -> list[tuple[tuple[float, ...], float]]:
        return [(f, float(np.dot(f, coefficients)) * m * k)
                for f, m, k in zip(shapes, misfit, factors, strict=True)]

    noise = step_noise(coefficients, [[run(r)] for r in slow])
    raw = [1.0] * 6 + [1.0, 1.2, 1.0]  # against each step's median over the rounds
    assert noise.ratios == pytest.approx(np.array(raw) / np.mean(raw), abs=1e-4)


def test_a_disturbed_round_is_left_out_of_the_noise_and_named() -> None:
    """A round that another process slowed (its p99 step far above the other rounds') is that
    process's unevenness, not the engine's: left out, as the median over rounds leaves it out
    of the fit. The other rounds' unevenness stays, in order."""
    coefficients = np.array([1e-3, 1e-5])
    shapes = [(1.0, float(t)) for t in range(10, 210, 10)]  # 20 steps a round
    calm = [1.0] * 20
    uneven = [1.0] * 5 + [1.1] + [1.0] * 14  # a calm round's own slow step
    disturbed = [1.0] * 10 + [2.0] * 10  # another process took the cores half the round

    def run(factors: list[float]) -> list[tuple[tuple[float, ...], float]]:
        return [(f, float(np.dot(f, coefficients)) * k) for f, k in zip(shapes, factors, strict=True)]

    said: list[str] = []
    noise = step_noise(coefficients, [[run(calm)], [run(disturbed)], [run(uneven)]], said.append)
    assert noise.ratios == pytest.approx(np.array(calm + uneven) / np.mean(calm + uneven),
                                         abs=1e-4)
    assert len(said) == 1 and "round 2 left out" in said[0] and "2.00x" in said[0], said
    said.clear()
    kept = step_noise(coefficients, [[run(calm)], [run(uneven)], [run(calm)]], said.append)
    assert len(kept.ratios) == 60 and not said  # calm rounds: nothing left out, nothing said


@given(p99s=st.lists(st.floats(0.5, 5.0), min_size=1, max_size=12))
def test_at_most_half_the_rounds_are_ever_left_out(p99s: list[float]) -> None:
    left_out = disturbed_rounds(p99s)
    assert len(left_out) <= len(p99s) // 2
    if len(p99s) < 3:
        assert left_out == []  # too few rounds to tell which one was disturbed
    else:
        kept = [p99s[i] for i in range(len(p99s)) if i not in left_out]
        assert all(p99s[i] > max(kept) for i in left_out)  # the most uneven rounds go first
        assert all(p99s[i] > DISTURBED_ROUND * min(kept) for i in left_out)  # and far out
        assert max(kept) <= DISTURBED_ROUND * float(np.median(p99s))


def test_a_phase_that_ran_other_plans_is_measured_against_the_fit() -> None:
    coefficients = np.array([1e-3, 1e-5])

    def step(tokens: float, factor: float) -> tuple[tuple[float, ...], float]:
        features = (1.0, tokens)
        return features, float(np.dot(features, coefficients)) * factor

    rounds = [[[step(10, 1.2), step(20, 1.2)]], [[step(10, 1.2), step(20, 1.2)]],
              [[step(10, 1.2), step(30, 1.2)]]]  # the third round's plans differ
    noise = step_noise(coefficients, rounds)
    assert noise.ratios == pytest.approx([1.0] * 6, abs=1e-4)  # 1.2 each, scaled to a mean of 1
    assert len(noise.ratios) == 6


def test_noise_round_trips_through_the_profile_file(tmp_path: Path) -> None:
    noise = StepNoise(tuple(round(0.5 + (i % 7) / 7, 4) for i in range(1000)), block=64)
    path = saved(tmp_path, noise)
    text = Path(path).read_text()
    assert len(text.splitlines()) < 200  # a wrapped flow list, not a line per ratio
    assert load_profile(path).noise == noise
    save_profile(profile_with(None), path)
    assert load_profile(path).noise is None and "noise" not in Path(path).read_text()


@pytest.mark.parametrize(("noise", "message"), [
    ({"block": 4}, "noise must be a mapping with a list `ratios`"),
    ({"ratios": []}, "noise.ratios is empty"),
    ({"ratios": [1.0, -0.5]}, "noise.ratios must all be numbers > 0"),
    ({"ratios": [1.0, "x"]}, "noise.ratios must all be numbers > 0"),
    ({"ratios": [1.0, float("inf")]}, "noise.ratios must all be numbers > 0"),
    ({"ratios": [1.0], "block": 0}, "noise.block must be a positive integer"),
])
def test_a_malformed_noise_section_is_a_clear_error(tmp_path: Path, noise: dict[str, object],
                                                    message: str) -> None:
    data = profile_with(None).to_dict() | {"noise": noise}
    with pytest.raises(ValueError, match=message):
        SimProfile.from_dict(data)


def test_the_sim_executor_multiplies_each_step_by_the_stream(tmp_path: Path) -> None:
    noise = StepNoise((0.5, 1.5, 1.0, 2.0, 0.25), block=3)
    path = saved(tmp_path, noise)

    def step_times(seed: int) -> list[float]:
        engine = LLMEngine(EngineConfig(executor="sim", sim_profile=path, seed=seed))
        engine.add_request("a", [1] * 8, SamplingParams(max_tokens=12, ignore_eos=True))
        return [engine.step().step_time for _ in range(12)]

    expected = list(itertools.islice(noise.stream(7), 12))
    assert step_times(7) == pytest.approx([STEP * r for r in expected])
    assert step_times(7) == step_times(7)  # one seed, one unevenness: common random numbers
    assert step_times(8) != step_times(7)


def test_stretches_of_slow_steps_lift_the_p99s_and_keep_the_total(tmp_path: Path) -> None:
    # the shape measured on a shared VM: mostly a little fast, with runs of slow steps
    stretchy = StepNoise.measured([0.85] * 200 + [1.6] * 60)
    steady = saved(tmp_path, None, "steady.yaml")
    uneven = saved(tmp_path, stretchy, "uneven.yaml")
    requests = [TraceRequest(i * 0.0125, 16, 40) for i in range(300)]  # ~80% busy
    config = EngineConfig(executor="sim", sim_clock="virtual", max_num_seqs=4,
                          max_num_batched_tokens=256)
    runs = {name: simulate(config.replace(sim_profile=path), requests)
            for name, path in (("steady", steady), ("uneven", uneven))}
    figures = {name: fidelity_figures(run) for name, run in runs.items()}
    assert figures["uneven"].tpot_p99_s > 1.2 * figures["steady"].tpot_p99_s
    assert figures["uneven"].ttft_p99_s > 1.2 * figures["steady"].ttft_p99_s
    # the ratios have a mean of 1: the same work takes about the same time in all
    assert runs["uneven"].elapsed_s == pytest.approx(runs["steady"].elapsed_s, rel=0.1)


def test_describe_names_the_spread_and_the_stretches() -> None:
    noise = StepNoise.measured([0.9] * 50 + [1.4] * 10 + [0.9] * 40)
    described = noise.describe()
    # mean 0.95: scaled by 1/0.95; 2 level changes in 99 pairs
    assert described == ("measured / predicted step time over 100 steps: p10 0.95, p50 0.95, "
                         "p90 1.47, p99 1.47, lag-1 autocorrelation 0.89")
    assert lag_one_autocorrelation([1.0, 2.0] * 50) == pytest.approx(-1.0, abs=0.02)
    assert lag_one_autocorrelation([1.0] * 10) == 0.0


def test_a_profile_without_noise_steps_at_its_prediction(tmp_path: Path) -> None:
    engine = LLMEngine(EngineConfig(executor="sim", sim_profile=saved(tmp_path, None)))
    engine.add_request("a", [1] * 8, SamplingParams(max_tokens=4, ignore_eos=True))
    assert [engine.step().step_time for _ in range(4)] == pytest.approx([STEP] * 4)
    assert set(profile_with(None).to_dict()["coefficients"]) == set(FEATURES)

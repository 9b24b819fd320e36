"""`fairgate tune calibrate`, the profile it writes, and the sim executor that loads it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.sim_profile import FEATURES, SimProfile, load_profile, save_profile
from fairgate.cli import _nested, main
from tuner import calibrate as calibration
from tuner.calibrate import (
    Calibrator,
    Design,
    Mix,
    Phase,
    check_fit,
    default_design,
    evaluate,
    fit,
    nnls,
)
from tuner.simulate import simulate
from tuner.traces import TraceRequest

# small enough that a calibration is a few seconds on a loaded 2-core machine
SMALL = ["--set", "max_num_seqs=8", "--set", "max_num_batched_tokens=128",
         "--set", "device_memory_gb=0.25"]


def known_profile(**coefficients: float) -> SimProfile:
    return SimProfile(coefficients=coefficients, kv_tokens=4096, kv_bytes_per_token=1024,
                      max_position=2048, model="random:tiny", device="cpu")


def test_calibrate_writes_a_profile_the_sim_executor_loads(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "profile.yaml"
    # --force: one round on a loaded CI machine may fit poorly; this test is about the file
    rc = main(["tune", "calibrate", *SMALL, "--out", str(out), "--repeats", "1",
               "--max-phase-tokens", "256", "--force"])
    assert rc == 0
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out
    assert "fit over" in captured.err  # progress on stderr
    profile = load_profile(out)
    # the fit is reported on held-out steps, and on the fitted ones
    fit_report = profile.fit
    assert fit_report["held_out_steps"] > 0 and fit_report["steps"] > 0
    assert {"r2", "median_rel_error", "train_r2", "train_median_rel_error"} <= set(fit_report)
    assert (f"held-out steps ({fit_report['held_out_steps']}): R^2 {fit_report['r2']:.3f}, "
            f"median relative error {fit_report['median_rel_error']:.1%}") in captured.out
    assert " s; " in captured.out  # the time it took
    # every measured step's unevenness, for the sim to replay (tests/engine/test_sim_noise.py)
    assert profile.noise is not None and len(profile.noise.ratios) >= profile.fit["steps"]
    assert f"step noise: {profile.noise.describe()}" in captured.err
    # what the first steps after idle cost (tests/engine/test_sim_wake.py)
    assert profile.wake is not None and len(profile.wake.extra_s) == calibration.WAKE_STEPS
    assert f"wake: {profile.wake.describe()}" in captured.err
    assert set(profile.coefficients) == set(FEATURES)
    assert all(c >= 0 for c in profile.coefficients.values())
    assert profile.model == "random:tiny" and profile.max_position == 4096
    assert profile.calibration["max_num_seqs"] == 8
    assert not list(tmp_path.glob(".profile.yaml.*"))  # the temporary file was renamed
    engine = LLMEngine(EngineConfig(executor="sim", sim_profile=str(out), block_size=16))
    assert engine.capacity.num_blocks == profile.kv_tokens // 16  # the real engine's cache
    assert engine.config.max_model_len == 4096
    engine.add_request("a", [1] * 40, SamplingParams(max_tokens=3, ignore_eos=True))
    times = [engine.step().step_time for _ in range(3)]
    assert not engine.has_unfinished() and all(t > 0 for t in times)


@pytest.fixture(scope="module")
def calibrator() -> Iterator[Calibrator]:
    import torch

    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=128, device_memory_gb=0.25)
    # the process's CPU time on one thread: other jobs on a shared CI machine stretch wall
    # time, and with several threads the ones spinning for a core count as work too
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        calibrator = Calibrator(config, clock=time.process_time)
        calibrator.run(Phase(2, 32, 4))  # warm-up
        yield calibrator
    finally:
        torch.set_num_threads(threads)


def _least_stretched(calibrator: Calibrator, phase: Phase, runs: int = 3) -> list[Any]:
    """The phase run `runs` times, each step's shortest time kept: another job on the machine
    only ever stretches a step, so the shortest is the closest to the engine's own time."""
    first = calibrator.run(phase)
    best = [t for _, t in first]
    for _ in range(runs - 1):
        again = calibrator.run(phase)
        if [f for f, _ in again] != [f for f, _ in first]:
            continue  # a different sequence of steps: nothing to pair
        best = [min(a, t) for a, (_, t) in zip(best, again, strict=True)]
    return [(f, t) for (f, _), t in zip(first, best, strict=True)]


def test_the_fit_predicts_held_out_shapes(calibrator: Calibrator) -> None:
    train = [Phase(1, 16), Phase(1, 200), Phase(4, 16), Phase(4, 100), Phase(8, 16),
             Phase(8, 48, staggered=True), Phase(2, 300, 8)]
    held_out = [Phase(3, 64, 8), Phase(6, 24, 8, staggered=True)]
    samples = [s for phase in train for s in _least_stretched(calibrator, phase)]
    coefficients, quality = fit(samples)
    assert quality["steps"] == len(samples) and np.all(coefficients >= 0)
    profile = known_profile(**dict(zip(FEATURES, coefficients.tolist(), strict=True)))
    measured = [s for phase in held_out for s in _least_stretched(calibrator, phase)]
    # loose on purpose: a loaded CI machine stretches some steps (about 0.12 on a quiet one);
    # a wrong model is off by far more
    assert evaluate(profile, measured)["median_rel_error"] < 0.6


def test_the_fit_recovers_known_coefficients() -> None:
    rng = np.random.default_rng(0)
    truth = np.array([1e-3, 4e-5, 2e-5, 3e-5, 5e-4, 1e-7, 4e-7])
    features = np.column_stack([np.ones(300), rng.integers(1, 512, 300), rng.integers(1, 32, 300),
                                rng.integers(0, 32, 300), rng.integers(0, 3, 300),
                                rng.uniform(0, 2e5, 300), rng.uniform(0, 2e4, 300)])
    times = features @ truth * rng.normal(1.0, 0.01, 300)
    times[:5] *= 20  # stalls the fit must not follow
    coefficients, quality = fit(list(zip(map(tuple, features), times, strict=True)))
    assert coefficients == pytest.approx(truth, rel=0.1)
    assert quality["outliers_dropped"] >= 5 and quality["r2"] > 0.99


def test_the_reported_fit_is_the_held_out_steps(calibrator: Calibrator,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    train = [Phase(1, 40, 6), Phase(3, 20, 6), Phase(4, 60, 6, staggered=True)]
    held_out = Mix(requests=5, concurrency=2, max_prompt_tokens=50, max_output_tokens=6)
    expected_steps = len(calibrator.run(held_out))  # the scheduler is deterministic
    monkeypatch.setattr(calibration, "Calibrator", lambda config: calibrator)
    profile = calibration.calibrate(calibrator.engine.config, Design(train, [held_out]),
                                    repeats=1)
    assert profile.fit["held_out_steps"] == expected_steps
    assert profile.fit["steps"] == sum(len(calibrator.run(p)) for p in train)
    assert profile.fit["r2"] <= 1 and profile.fit["median_rel_error"] >= 0


def test_a_mix_keeps_its_concurrency_and_its_lengths(calibrator: Calibrator) -> None:
    mix = Mix(requests=7, concurrency=3, max_prompt_tokens=60, max_output_tokens=8, seed=5)
    assert mix.lengths() == mix.lengths()  # fixed by the seed: every round runs the same steps
    assert all(16 <= p <= 60 and 4 <= o <= 8 for p, o in mix.lengths())
    samples = calibrator.run(mix)
    seqs = [int(f[FEATURES.index("seqs")]) for f, _ in samples]
    assert max(seqs) == 3  # never more than `concurrency` in one step, and it gets there
    decoded = sum(int(f[FEATURES.index("sampled")]) for f, _ in samples)
    assert decoded == sum(o for _, o in mix.lengths())  # every request ran to its end


def test_the_default_design_holds_out_steps_it_does_not_fit() -> None:
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, max_model_len=600)
    design = default_design(config, max_position=4096, max_phase_tokens=2048)
    assert design.held_out and not set(design.held_out) & set(design.train)
    batches = {p.batch for p in design.train if isinstance(p, Phase)}
    assert {1, 2, 3, 5, 8} <= batches and max(batches) == 8  # irregular, capped at max_num_seqs
    lengths = [n for phase in design.phases for n in phase.lengths()]
    assert all(p + o <= 600 for p, o in lengths)  # within max_model_len
    assert all(sum(p for p, _ in phase.lengths()) <= 2048 for phase in design.train
               if isinstance(phase, Phase) and not phase.staggered)


def test_check_fit_names_both_figures() -> None:
    assert check_fit({"r2": 0.99, "median_rel_error": 0.05}) is None
    assert check_fit({"r2": 0.95, "median_rel_error": 0.15}) is None  # the bounds pass
    reason = check_fit({"r2": 0.9, "median_rel_error": 0.05})
    assert reason is not None and "R^2 0.900" in reason and "5.0%" in reason
    assert check_fit({"r2": 0.99, "median_rel_error": 0.2}) is not None
    assert check_fit({}) is not None  # a profile without a report is no good fit


def _poor_profile(*_: Any, **__: Any) -> SimProfile:
    coefficients = dict.fromkeys(FEATURES, 0.0) | {"step": 1e-3}
    return SimProfile(coefficients=coefficients, kv_tokens=4096, kv_bytes_per_token=1024,
                      max_position=2048, model="random:tiny", device="cpu",
                      fit={"steps": 400, "held_out_steps": 80, "r2": 0.62,
                           "median_rel_error": 0.31, "train_r2": 0.7,
                           "train_median_rel_error": 0.25})


def test_a_poor_fit_is_refused_unless_forced(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(calibration, "calibrate", _poor_profile)
    out = tmp_path / "profile.yaml"
    rc = main(["tune", "calibrate", "--out", str(out)])
    assert rc == 1
    captured = capsys.readouterr()
    assert len(captured.err.strip().splitlines()) == 1, captured.err
    assert "R^2 0.620" in captured.err and "31.0%" in captured.err
    assert "--force" in captured.err and captured.out == ""
    assert not out.exists() and not list(tmp_path.iterdir())  # nothing written
    assert main(["tune", "calibrate", "--out", str(out), "--force"]) == 0
    captured = capsys.readouterr()
    assert f"wrote {out}" in captured.out and "R^2 0.620" in captured.err
    assert load_profile(out).fit["r2"] == 0.62


def test_one_slowed_round_does_not_scale_the_profile() -> None:
    coefficients = np.array([1e-3, 1e-5])
    steps = [((1.0, float(n)), 1e-3 + n * 1e-5) for n in (1, 50, 500)]
    typical = [[[(f, t * 1.1) for f, t in steps]]]  # a round: one phase, its steps 10% slower
    slowed = [[[(f, t * 3) for f, t in steps]]]  # another process took the core throughout
    assert calibration.mean_scale(coefficients, typical * 2 + slowed) == pytest.approx(1.1)
    assert calibration.mean_scale(coefficients, slowed * 3) == 2.0  # bounded: disturbed


def test_nnls_keeps_coefficients_non_negative() -> None:
    a = np.array([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]])
    x = nnls(a, np.array([3.0, 2.0, 1.0]))  # unconstrained slope would be -1
    assert x[1] == 0 and x[0] == pytest.approx(2.0)


def test_a_missing_profile_is_a_clear_error(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["tune", "calibrate", "--set", "sim_profile=missing.yaml", "--out",
               str(tmp_path / "p.yaml")])
    assert rc == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert "sim_profile" in err and "missing.yaml" in err
    with pytest.raises(ValueError, match="sim_profile: .*missing.yaml"):
        EngineConfig(executor="sim", sim_profile="missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("coefficients: [1, 2\n")
    with pytest.raises(ValueError, match="sim_profile: .*bad.yaml"):
        EngineConfig(executor="sim", sim_profile=str(bad))
    bad.write_text("version: 1\nmax_position: 10\nkv_tokens: 10\nkv_bytes_per_token: 1\n"
                   "coefficients: {tokens: -1}\n")
    with pytest.raises(ValueError, match="coefficient tokens must be a number >= 0"):
        EngineConfig(executor="sim", sim_profile=str(bad))


def test_calibrate_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tune", "calibrate", "--set", "executor=sim"]) == 2
    assert "executor must be torch" in capsys.readouterr().err
    assert main(["tune", "calibrate", "--out", str(tmp_path / "no" / "p.yaml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["tune", "calibrate", "--repeats", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "--repeats must be" in err, err


def test_only_tune_then_calibrate_is_the_nested_command() -> None:
    assert _nested(["tune", "calibrate", "--out", "p.yaml"]) is not None
    assert _nested(["tune", "--workload", "calibrate"]) is None
    assert _nested(["tune"]) is None and _nested([]) is None


def test_sim_step_times_follow_the_profile(tmp_path: Path) -> None:
    path = tmp_path / "profile.yaml"
    save_profile(known_profile(step=1e-3, tokens=1e-5, decode_attention=1e-7), path)
    assert load_profile(path) == load_profile(str(path))
    config = EngineConfig(executor="sim", sim_profile=str(path), block_size=16)
    engine = LLMEngine(config)
    assert engine.capacity.num_blocks == 4096 // 16 and engine.config.max_model_len == 2048
    engine.add_request("a", [1] * 100, SamplingParams(max_tokens=3, ignore_eos=True))
    steps = [engine.step().step_time for _ in range(3)]
    assert steps[0] == pytest.approx(1e-3 + 100 * 1e-5)  # the prefill
    assert steps[1] == pytest.approx(1e-3 + 1e-5 + 101 * 1e-7)  # a decode at context 101
    assert steps[2] == pytest.approx(1e-3 + 1e-5 + 102 * 1e-7)
    result = simulate(config, [TraceRequest(0.0, 100, 3)])
    (timing,) = result.timings
    assert timing.ttft == pytest.approx(steps[0])
    assert timing.tpot == pytest.approx((steps[1] + steps[2]) / 2)


def test_a_late_chunk_costs_its_whole_context(tmp_path: Path) -> None:
    path = tmp_path / "profile.yaml"
    save_profile(known_profile(prefill_square=1e-6, prefill_context=1e-4), path)
    config = EngineConfig(executor="sim", sim_profile=str(path), max_num_batched_tokens=64,
                          max_num_seqs=4)
    engine = LLMEngine(config)
    engine.add_request("a", [1] * 100, SamplingParams(max_tokens=1, ignore_eos=True))
    first, second = engine.step().step_time, engine.step().step_time  # chunks 0..64, 64..100
    assert first == pytest.approx(64**2 * 1e-6 + 64 * 1e-4)
    assert second == pytest.approx(36**2 * 1e-6 + 100 * 1e-4)  # the gather reads all 100
    old = load_profile(path).to_dict()
    del old["coefficients"]["prefill_square"]  # a profile from before the feature: it is 0
    assert SimProfile.from_dict(old).weights[FEATURES.index("prefill_square")] == 0.0


def test_a_profile_too_small_for_max_model_len_cannot_start(tmp_path: Path) -> None:
    path = tmp_path / "profile.yaml"
    save_profile(SimProfile(coefficients={"step": 1e-3}, kv_tokens=1000, kv_bytes_per_token=1024,
                            max_position=2048), path)
    with pytest.raises(ValueError, match="out of memory: the profiled engine's KV cache"):
        LLMEngine(EngineConfig(executor="sim", sim_profile=str(path)))
    # num_kv_blocks overrides the profiled capacity, as it does the roofline's
    engine = LLMEngine(EngineConfig(executor="sim", sim_profile=str(path), num_kv_blocks=128))
    assert engine.capacity.num_blocks == 128


def test_tune_runs_its_trials_on_a_profile(tmp_path: Path) -> None:
    profile = tmp_path / "profile.yaml"
    coefficients = dict.fromkeys(FEATURES, 0.0) | {"step": 0.002, "tokens": 1e-5}
    save_profile(SimProfile(coefficients=coefficients, kv_tokens=6000, kv_bytes_per_token=1024,
                            max_position=8192, model="random:tiny", device="cpu"), profile)
    out = tmp_path / "out"
    rc = main(["tune", "--mode", "sim", "--sim-profile", str(profile), "--set", "executor=sim",
               "--set", "max_model_len=6000",
               "--workload", "uniform", "--rate", "5", "--duration", "4", "--slo-ttft-p99",
               "1", "--slo-itl-p99", "0.05", "--trials", "3", "--robustness", "0",
               "--storage", f"sqlite:///{tmp_path / 's.db'}", "--study", "p", "--out", str(out)])
    assert rc == 0
    best = (out / "best.yaml").read_text()
    assert f"sim_profile: {profile}" in best  # the winner keeps running on the profile
    # the space's max_model_len stops at the profiled engine's KV cache
    assert "max_model_len 1024..6000" in (out / "report.md").read_text()


def test_after_round_runs_between_the_rounds(calibrator: Calibrator,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/sim_fidelity.py replays a segment after each round: the hook sees every round
    done before it, and nothing of the next."""
    phases = [Phase(1, 40, 4), Phase(2, 20, 4)]
    held_out = Mix(requests=3, concurrency=2, max_prompt_tokens=40, max_output_tokens=4)
    runs: list[str] = []
    real_run = calibrator.run

    def run(phase: Any) -> Any:
        runs.append("phase")
        return real_run(phase)

    monkeypatch.setattr(calibrator, "run", run)
    monkeypatch.setattr(calibration, "Calibrator", lambda config: calibrator)
    calibration.calibrate(calibrator.engine.config, Design(phases, [held_out]), repeats=3,
                          after_round=lambda i: runs.append(f"after {i}"))
    per_round = ["phase"] * 3  # two fitted phases and the held-out mix
    assert runs == ["phase", *per_round, "after 0", *per_round, "after 1", *per_round, "after 2"]

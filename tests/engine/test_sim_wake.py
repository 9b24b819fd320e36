"""A calibration profile's wake cost: what the first steps after an idle spell cost beyond their
prediction, measured by `fairgate tune calibrate` and added by the sim executor
(engine/sim_profile.py's `Wake`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import EngineConfig
from engine.clock import VirtualClock
from engine.sim import SimExecutor
from engine.sim_profile import MAX_WAKE_STEPS, SimProfile, Wake, load_profile, save_profile
from tuner.calibrate import Calibrator, measure_wake
from tuner.simulate import simulate
from tuner.traces import TraceRequest

STEP = 1e-3  # seconds: every step of the profiles below, before the wake
WAKE = Wake(idle_s=0.2, extra_s=(0.004, 0.002, 0.001))


def saved(tmp_path: Path, wake: Wake | None) -> str:
    path = tmp_path / "profile.yaml"
    save_profile(SimProfile(coefficients={"step": STEP}, kv_tokens=65536, kv_bytes_per_token=1024,
                            max_position=2048, model="random:tiny", device="cpu", wake=wake),
                 path)
    return str(path)


def test_the_wake_round_trips_through_the_profile_file(tmp_path: Path) -> None:
    assert load_profile(saved(tmp_path, WAKE)).wake == WAKE
    assert load_profile(saved(tmp_path, None)).wake is None


@pytest.mark.parametrize(("idle_s", "extra_s", "message"), [
    (0, (0.001,), "wake.idle_s must be a number > 0"),
    ("0.2", (0.001,), "wake.idle_s must be a number > 0"),
    (float("inf"), (0.001,), "wake.idle_s must be a number > 0"),
    (0.2, (float("nan"),), "wake.extra_s must all be numbers >= 0"),
    (0.2, (), "wake.extra_s must list 1 to 16"),
    (0.2, (0.001,) * (MAX_WAKE_STEPS + 1), "wake.extra_s must list 1 to 16"),
    (0.2, (0.001, -0.001), "wake.extra_s must all be numbers >= 0"),
])
def test_a_malformed_wake_is_refused(idle_s: object, extra_s: tuple[object, ...],
                                     message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Wake(idle_s, extra_s)  # type: ignore[arg-type]


@pytest.mark.parametrize("wake", [[0.2], {"idle_s": 0.2}, {"idle_s": 0.2, "extra_s": 0.001},
                                  {"idle_s": 0.2, "extra_s": [0.001], "colour": "blue"}])
def test_a_profile_file_with_a_malformed_wake_names_it(tmp_path: Path, wake: object) -> None:
    data = SimProfile(coefficients={"step": STEP}, kv_tokens=65536, kv_bytes_per_token=1024,
                      max_position=2048).to_dict()
    with pytest.raises(ValueError, match="wake must be a mapping with `idle_s` and a list"):
        SimProfile.from_dict({**data, "wake": wake})


def test_the_first_steps_after_idle_pay_the_wake_in_proportion_to_the_idle(
        tmp_path: Path) -> None:
    config = EngineConfig(executor="sim", sim_clock="virtual", sim_profile=saved(tmp_path, WAKE),
                          max_num_seqs=4, max_num_batched_tokens=256)
    extra = sum(WAKE.extra_s)
    busy = 4 * STEP + extra  # a 4-token request after a full idle: prefill + 3 decodes
    # a: the engine's first request (a fresh engine is cold); b: after 1 s of nothing; c: right
    # behind b (no idle: no wake); d: a quarter of idle_s after c ends, a quarter of the wake
    b_end = 1.0 + busy
    c_end = b_end + 4 * STEP
    requests = [TraceRequest(0.0, 16, 4), TraceRequest(1.0, 16, 4), TraceRequest(b_end, 16, 4),
                TraceRequest(c_end + WAKE.idle_s / 4, 16, 4)]
    timings = simulate(config, requests).timings
    ttft = [t.ttft for t in timings]
    assert ttft == pytest.approx([STEP + WAKE.extra_s[0]] * 2 + [STEP, STEP + WAKE.extra_s[0] / 4])
    e2e = [t.e2e for t in timings]
    assert e2e == pytest.approx([busy, busy, 4 * STEP, 4 * STEP + extra / 4])


def test_without_a_wake_every_step_is_its_prediction(tmp_path: Path) -> None:
    config = EngineConfig(executor="sim", sim_clock="virtual", sim_profile=saved(tmp_path, None),
                          max_num_seqs=4, max_num_batched_tokens=256)
    timings = simulate(config, [TraceRequest(0.0, 16, 4), TraceRequest(1.0, 16, 4)]).timings
    assert [t.e2e for t in timings] == pytest.approx([4 * STEP, 4 * STEP])


def test_the_calibration_measures_a_known_wake(tmp_path: Path) -> None:
    """measure_wake against an engine whose wake is known: the sim executor on a virtual clock
    with a profile that has one; the idle is slept on that clock."""
    config = EngineConfig(executor="sim", sim_clock="virtual", sim_profile=saved(tmp_path, WAKE),
                          max_num_seqs=4, max_num_batched_tokens=256)
    clock = VirtualClock()
    calibrator = Calibrator(config, executor=SimExecutor(config, clock), clock=clock.now)
    measured = measure_wake(calibrator, idle_s=0.5, pairs=5, prompt_tokens=16, steps=4,
                            sleep=clock.sleep)
    assert measured.idle_s == 0.5
    assert measured.extra_s == pytest.approx((*WAKE.extra_s, 0.0))  # the 4th step pays none
    # an idle shorter than the engine's: a proportional share, as the sim executor adds it
    short = measure_wake(calibrator, idle_s=0.05, pairs=3, prompt_tokens=16, steps=2,
                         sleep=clock.sleep)
    assert short.extra_s == pytest.approx([e / 4 for e in WAKE.extra_s[:2]])


def test_describe_names_the_idle_and_each_steps_extra() -> None:
    assert WAKE.describe() == "after 0.2 s idle, the first steps take +[4.00, 2.00, 1.00] ms"

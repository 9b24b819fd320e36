"""Does the calibrated simulator predict the real engine? Both sides in one run.

    .venv/bin/python bench/sim_fidelity.py [--requests 300] [--rate 6] [--profile FILE]
                                          [--set KNOB=VALUE ...] [--save-profile FILE]
                                          [--no-interleave] [--sim-seeds 8] [--noise-floor]
                                          [--threads N]

Calibrates the real engine (`fairgate tune calibrate`'s `tuner.calibrate.calibrate`; or loads
`--profile`) and replays one synthetic workload (uniform prompt and output lengths, Poisson
arrivals) through (a) the real engine (TorchExecutor) in real time, arrivals honoured on the
wall clock, and (b) `simulate()` on the sim executor with the profile and the same knobs. By
default the real replay is cut into one segment per calibration round and each segment runs
right after its round (`--no-interleave`: the whole replay after the calibration), so a shared
machine whose speed drifts over minutes drifts under the calibration and the replay alike; the
simulator replays the same segments, and the figures pool them. The simulator replays the
profile's step noise (each segment with its own seed) and its wake cost (the first steps after
idle); its figures are the means over `--sim-seeds` draws of the noise (the simulator's
expected figures: one draw's p99 rests on where its few slow stretches fell); beside it, as the
baseline, the same profile with every step at its predicted time (the steady sim, what it was
before both). Prints throughput (output tokens/s), p50/p99 TTFT and TPOT (each request's mean inter-token gap, the
tuner's ITL) for both, the relative errors, and PASS/FAIL against issue 14's goals: within 10%
for throughput and the p50s, 20% for the p99s. Exit status 1 when a goal is missed.
`--noise-floor` replays each segment a second time and holds that replay to the same goals
against the first: how far the real engine moves between two identical runs on this machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from bench.common import machine  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.sim_profile import load_profile, save_profile  # noqa: E402
from fairgate.engine_cli import parse_overrides  # noqa: E402
from tuner.calibrate import calibrate, check_fit  # noqa: E402
from tuner.fidelity import (  # noqa: E402
    GOALS,
    Figures,
    fidelity_figures,
    mean_figures,
    pooled,
    replay_realtime,
    segments,
    simulate_profiled,
)
from tuner.simulate import SimResult  # noqa: E402
from tuner.traces import TraceRequest  # noqa: E402
from tuner.workload import Lengths, LoadShape, Synthetic, build_requests  # noqa: E402

BASE = {"model": "random:tiny", "max_num_seqs": 32, "max_num_batched_tokens": 512}


def workload(args: argparse.Namespace) -> list[TraceRequest]:
    spec = Synthetic("fidelity", Lengths.parse(args.prompt_tokens),
                     Lengths.parse(args.output_tokens))
    shape = LoadShape(rate=args.rate, duration=None, num_requests=args.requests, seed=args.seed)
    return build_requests(spec, shape)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--rate", type=float, default=6.0, help="requests/s (Poisson)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=[32, 512], metavar=("LO", "HI"))
    parser.add_argument("--output-tokens", type=int, nargs=2, default=[16, 128], metavar=("LO", "HI"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KNOB=VALUE", help=f"engine knob on top of {BASE}")
    parser.add_argument("--profile", help="use this profile instead of calibrating")
    parser.add_argument("--save-profile", help="keep the calibrated profile here")
    parser.add_argument("--repeats", type=int, default=3, help="calibration rounds")
    parser.add_argument("--no-interleave", dest="interleave", action="store_false",
                        help="calibrate first, then replay the whole workload (by default each "
                             "calibration round is followed by a third of the replay)")
    parser.add_argument("--noise-floor", action="store_true",
                        help="replay each segment twice and hold the second real replay to the "
                             "goals against the first (the machine's own run-to-run spread)")
    parser.add_argument("--sim-seeds", type=_positive, default=8,
                        help="noise draws the sim's figures are the mean of (default 8): one "
                             "draw's p99 rests on where its slow stretches fell")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads for the real engine (default: torch's own); 1 is "
                             "steadier on a shared machine")
    args = parser.parse_args()
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)  # before calibrating: both real runs share it
    config = EngineConfig.from_dict({**BASE, **parse_overrides(args.overrides)})
    requests = workload(args)
    print(f"engine: {config.model}, max_num_seqs {config.max_num_seqs}, max_num_batched_tokens "
          f"{config.max_num_batched_tokens}; {len(requests)} requests at {args.rate:g}/s, prompts "
          f"{args.prompt_tokens}, outputs {args.output_tokens}; {machine()}, torch threads "
          f"{_threads()}")
    # interleaved: round i of the calibration, then segment i of the replay, so the machine's
    # drift over the minutes of a run (2-core shared VMs move 10-20%) falls on both alike
    interleave = args.interleave and args.profile is None
    parts = segments(requests, args.repeats if interleave else 1)
    real_parts: list[SimResult] = []
    replay_s = [0.0]  # seconds the real replay took, within the calibration when interleaved
    again_parts: list[SimResult] = []  # --noise-floor: each segment replayed a second time

    def replay_next(_round: int = 0) -> None:
        part = parts[len(real_parts)]
        started = time.perf_counter()
        real_parts.append(replay_realtime(config, part))
        if args.noise_floor:
            again_parts.append(replay_realtime(config, part))
        replay_s[0] += time.perf_counter() - started
        print(f"  replayed segment {len(real_parts)}/{len(parts)}: {len(part)} requests, "
              f"{real_parts[-1].wall_s:.1f} s{' (twice)' if args.noise_floor else ''}",
              file=sys.stderr)

    with tempfile.TemporaryDirectory() as tmp:
        path = args.profile or args.save_profile or str(Path(tmp) / "profile.yaml")
        if args.profile is None:
            started = time.perf_counter()
            save_profile(calibrate(config, repeats=args.repeats,
                                   progress=lambda line: print(f"  {line}", file=sys.stderr),
                                   after_round=replay_next if interleave else None),
                         path)
            fit = load_profile(path).fit
            took = time.perf_counter() - started - replay_s[0]
            print(f"calibrated in {took:.1f} s"
                  f"{f' (and {replay_s[0]:.1f} s of replay between its rounds)' if interleave else ''}"
                  f": {fit}; "
                  f"{check_fit(fit) or 'a good fit'}")
        if not real_parts:
            replay_next()
        real = pooled(real_parts)
        profile = load_profile(path)
        steady = str(Path(tmp) / "steady.yaml")  # the baseline: every step at its prediction
        save_profile(replace(profile, noise=None, wake=None), steady)
        if profile.noise is not None:
            print(f"step noise: {profile.noise.describe()}")
        if profile.wake is not None:
            print(f"wake: {profile.wake.describe()}")
        # a seed per segment (each real segment met its own unevenness) and per noise draw
        draws = args.sim_seeds if profile.noise is not None else 1
        sims = [pooled([simulate_profiled(config.replace(seed=config.seed + draw * len(parts) + i),
                                          path, part) for i, part in enumerate(parts)])
                for draw in range(draws)]
        baseline = pooled([simulate_profiled(config, steady, part) for part in parts])
    sim_figures = [fidelity_figures(s) for s in sims]
    print(f"real: {real.wall_s:.1f} s wall, {real.steps} steps, {real.preemptions} preemptions; "
          f"sim: {sum(s.wall_s for s in sims):.1f} s wall, {sims[0].steps} steps, "
          f"{sims[0].preemptions} preemptions (the first of {draws} noise draws); "
          f"{len(parts)} segment{'s' if len(parts) > 1 else ''}")
    if draws > 1:
        p99s = [f.ttft_p99_s for f in sim_figures]
        low, high = min(p99s), max(p99s)
        print(f"the sim's figures are the means over {draws} noise draws (its TTFT p99 ranged "
              f"{low * 1e3:.1f}-{high * 1e3:.1f} ms over them)")
    real_figures = fidelity_figures(real)
    failed = report(real_figures, mean_figures(sim_figures), fidelity_figures(baseline))
    if again_parts:
        noise_floor(real_figures, fidelity_figures(pooled(again_parts)))
    return failed


def _positive(text: str) -> int:
    value = int(text) if text.strip().isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, got {text!r}")
    return value


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def report(real: Figures, sim: Figures, baseline: Figures) -> int:
    """The goals are the sim's (the profile as calibrated, step noise and wake and all);
    `baseline` is the same profile with every step at its predicted time, what the simulator
    did before it replayed either (its misses are not counted)."""
    errors, baseline_errors = sim.relative_errors(real), baseline.relative_errors(real)
    print(f"{'':22}{'real':>10}{'sim':>10}{'error':>9}   goal{'':12}{'steady sim':>11}{'error':>9}")
    failed = 0
    for name, allowed in GOALS.items():
        ok = abs(errors[name]) <= allowed
        failed += not ok
        scale, unit = (1.0, "") if name.startswith("throughput") else (1e3, " ms")
        print(f"{name + unit:22}{getattr(real, name) * scale:10.2f}{getattr(sim, name) * scale:10.2f}"
              f"{errors[name]:+9.1%}   <= {allowed:.0%}: {'PASS' if ok else 'FAIL'}"
              f"{getattr(baseline, name) * scale:11.2f}{baseline_errors[name]:+9.1%}")
    steady_failed = sum(abs(baseline_errors[n]) > allowed for n, allowed in GOALS.items())
    print(f"requests finished: real {real.requests}, sim {sim.requests}")
    print(f"the steady sim (no step noise, no wake) would have {'passed' if not steady_failed else f'missed {steady_failed}'}")
    print("PASS" if not failed else f"FAIL ({failed} of {len(GOALS)} goals missed)")
    return 1 if failed else 0


def noise_floor(first: Figures, second: Figures) -> None:
    """The real engine against itself: the same segments replayed again straight after the
    first replay, held to the same goals. Where this misses, the machine moved more between
    two identical runs than the goals allow, and no simulator could have matched both."""
    errors = second.relative_errors(first)
    missed = [name for name, allowed in GOALS.items() if abs(errors[name]) > allowed]
    print("noise floor, the second real replay against the first: "
          + ", ".join(f"{name} {errors[name]:+.1%}" for name in GOALS)
          + f": {'within every goal' if not missed else 'missed ' + ', '.join(missed)}")


if __name__ == "__main__":
    sys.exit(main())

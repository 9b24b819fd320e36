"""`fairgate tune calibrate`: fit the simulator's step times to the real engine.

    fairgate tune calibrate [-c fairgate.yaml] [--set KNOB=VALUE ...] [--out sim-profile.yaml]
                            [--repeats N] [--max-phase-tokens N] [--force]

Runs the real engine (the `engine:` section with `--set` on top; `executor` must be torch) over
a designed set of step shapes, fits the cost model of engine/sim_profile.py, and writes the
profile that `--set sim_profile=FILE` (with `executor=sim`) loads. Progress goes to stderr; the
file written, the time taken and the fit's quality (R² and median relative step error on
held-out steps, and on the fitted ones) to stdout. Bad input is one line and exit status 2; a
fit below tuner.calibrate's MIN_R2 or above its MAX_MEDIAN_ERROR is refused, one line naming
the figures and exit status 1 with nothing written, unless `--force`.
"""

from __future__ import annotations

import argparse
import sys
import time

from fairgate.engine_cli import build_config
from protocol.validators import check_out_file
from tuner import calibrate as calibration  # no torch until a run: --help stays quick

DEFAULT_OUT = "sim-profile.yaml"


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-c", "--config", metavar="FILE",
                        help="fairgate.yaml; its `engine` section is the engine to measure")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KNOB=VALUE", help="override one engine knob (YAML value)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="FILE",
                        help=f"the profile to write (default {DEFAULT_OUT}), atomically")
    parser.add_argument("--repeats", type=int, default=3, metavar="N",
                        help="rounds over the step shapes (default 3); each step's time is "
                             "the median over the rounds")
    parser.add_argument("--max-phase-tokens", type=int, default=4096, metavar="N",
                        help="prompt tokens per measured phase at most (default 4096)")
    parser.add_argument("--force", action="store_true",
                        help=f"write the profile even when it fits poorly (held-out R^2 below "
                             f"{calibration.MIN_R2:g} or median relative step error above "
                             f"{calibration.MAX_MEDIAN_ERROR * 100:.0f}%%)")


def run(args: argparse.Namespace) -> int:
    from engine.sim_profile import save_profile

    config = build_config(args.config, args.overrides)
    if config.executor != "torch":
        raise ValueError(f"calibrate measures the real engine: executor must be torch, got "
                         f"{config.executor!r}")
    for name in ("repeats", "max_phase_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    out = check_out_file("--out", args.out)  # before minutes of measuring, not after
    started = time.perf_counter()
    profile = calibration.calibrate(
        config, repeats=args.repeats, max_phase_tokens=args.max_phase_tokens,
        progress=lambda line: print(line, file=sys.stderr, flush=True))
    seconds = time.perf_counter() - started
    poor = calibration.check_fit(profile.fit)
    if poor is not None and not args.force:
        print(f"fairgate {args.command}: {poor}; nothing written to {out} (another process "
              "busy on the machine? rerun, or --force to write it anyway)", file=sys.stderr)
        return 1
    save_profile(profile, out)
    print(f"wrote {out}: {config.model} on {profile.device}, measured in {seconds:.0f} s; "
          f"{describe_fit(profile.fit)}; simulate with --set executor=sim "
          f"--set sim_profile={out}")
    if poor is not None:
        print(f"fairgate {args.command}: warning: {poor}; written anyway (--force)",
              file=sys.stderr)
    return 0


def describe_fit(fit: dict[str, float]) -> str:
    return (f"held-out steps ({fit['held_out_steps']}): R^2 {fit['r2']:.3f}, median relative "
            f"error {fit['median_rel_error']:.1%}; fitted steps ({fit['steps']}): R^2 "
            f"{fit['train_r2']:.3f}, median relative error {fit['train_median_rel_error']:.1%}")

"""`fairgate tune calibrate`: fit the simulator's step times to the real engine.

    fairgate tune calibrate [-c fairgate.yaml] [--set KNOB=VALUE ...] [--out sim-profile.yaml]
                            [--repeats N] [--max-phase-tokens N]

Runs the real engine (the `engine:` section with `--set` on top; `executor` must be torch) over
a designed set of step shapes, fits the cost model of engine/sim_profile.py, and writes the
profile that `--set sim_profile=FILE` (with `executor=sim`) loads. Progress goes to stderr; the
file written and the fit's quality to stdout. Bad input is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fairgate.engine_cli import build_config

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
    parser.add_argument("--max-phase-tokens", type=int, default=8192, metavar="N",
                        help="prompt tokens per measured phase at most (default 8192)")


def run(args: argparse.Namespace) -> int:
    from engine.sim_profile import save_profile
    from tuner.calibrate import calibrate

    config = build_config(args.config, args.overrides)
    if config.executor != "torch":
        raise ValueError(f"calibrate measures the real engine: executor must be torch, got "
                         f"{config.executor!r}")
    for name in ("repeats", "max_phase_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    out = Path(args.out)
    if not out.parent.is_dir():  # before minutes of measuring, not after
        raise ValueError(f"--out {out}: directory {out.parent} does not exist")
    profile = calibrate(config, repeats=args.repeats, max_phase_tokens=args.max_phase_tokens,
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    save_profile(profile, out)
    fit = profile.fit
    print(f"wrote {out}: {config.model} on {profile.device}, {fit['steps']} steps, R^2 "
          f"{fit['r2']:.3f}, median relative error {fit['median_rel_error']:.1%}; simulate with "
          f"--set executor=sim --set sim_profile={out}")
    return 0

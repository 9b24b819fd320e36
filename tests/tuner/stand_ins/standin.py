"""What the engine stand-ins share: each parses exactly its engine's flags (argparse refuses any
other, exit 2), then behaves as its model name says:

- `oom`: prints the engine's out-of-memory error inside a traceback, as it does when the KV
  cache does not fit, and exits 1; `oom-above-N`: the same when max_num_seqs > N;
- `broken`: fails the same way whatever the knobs (a timestamped error line, exit 1);
- `hang`: never listens;
- anything else: serves with `fairgate engine` (sim executor, real time, random:tiny) on the
  given host and port, the engine's flags mapped to fairgate knobs; it execs the engine, so the
  stand-in's pid is the server's.

Each start appends {"argv": [...], "knobs": {...}} to the file $STANDIN_LOG when it is set.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[3]
LOG_ENV = "STANDIN_LOG"


KnobFlags = dict[str, tuple[str, type]]  # the engine's flag -> (fairgate knob, its type)


def add_flags(parser: argparse.ArgumentParser, host: str, port: int, knob_flags: KnobFlags
              ) -> None:
    """--host and --port with the engine's defaults, and the engine's flag for each knob."""
    parser.add_argument("--host", default=host)
    parser.add_argument("--port", type=int, default=port)
    for flag, (knob, kind) in knob_flags.items():
        parser.add_argument(flag, dest=knob, type=kind)


def run(model: str, args: argparse.Namespace, knob_flags: KnobFlags, oom_line: str) -> NoReturn:
    """Serve `model` (or fail as it says) on `args`' host and port with the knobs given."""
    knobs = {knob: getattr(args, knob) for knob, _ in knob_flags.values()}
    given = {k: v for k, v in knobs.items() if v is not None}
    log = os.environ.get(LOG_ENV)
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"argv": sys.argv[1:], "knobs": given}) + "\n")
    if model == "oom" or (model.startswith("oom-above-")
                          and given.get("max_num_seqs", 0) > int(model.rsplit("-", 1)[1])):
        _fail(["Traceback (most recent call last):", '  File "worker.py", line 212, in init',
               oom_line, "", "RuntimeError: Engine core initialization failed. See root "
               "cause above."])
    if model == "broken":
        stamp = time.strftime("%m-%d %H:%M:%S")
        _fail([f"ERROR {stamp} [api_server.py:91] (pid={os.getpid()}) RuntimeError: no "
               "weights found for model 'broken'"])
    if model == "hang":
        while True:
            signal.pause()
    sets = [arg for knob, value in given.items() for arg in ("--set", f"{knob}={value}")]
    argv = [sys.executable, "-m", "fairgate", "engine", "--host", args.host, "--port", str(args.port),
            "--set", "executor=sim", "--set", "sim_clock=realtime", "--set", "model=random:tiny",
            *sets]
    os.chdir(ROOT)
    os.execve(sys.executable, argv, {**os.environ, "PYTHONPATH": str(ROOT)})


def _fail(lines: list[str]) -> NoReturn:
    print("\n".join(lines), flush=True)
    sys.exit(1)

"""The one `fairgate` command. A subcommand that reads fairgate.yaml lives in `fairgate/`; one
that needs no more than its own package (`bench`) lives with that package.

Subcommand modules are imported lazily so `fairgate tenants list` never pays for torch.
Each module exposes `register(parser)` (add its arguments) and `run(args) -> int`. A nested
command (`fairgate tune calibrate`) is a module of its own, chosen when its two words come first.
Before anything else, `fairgate.guard` checks that fairgate's import names are fairgate's own.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import importlib
import os
import signal
import sys
from typing import NoReturn

from fairgate import guard

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("fairgate.serve_cli", "gateway with an embedded or remote engine"),
    "engine": ("fairgate.engine_cli", "a standalone engine server"),
    "tenants": ("fairgate.tenants_cli", "create, list, update, delete, import, export tenants"),
    "keys": ("fairgate.keys_cli", "create, list, revoke API keys"),
    "bench": ("tuner.bench_cli", "load test an OpenAI-compatible endpoint"),
    "tune": ("fairgate.tune_cli", "search engine knobs with Optuna against p99 SLOs "
             "(`fairgate tune calibrate`: fit the simulator's step times to the real engine)"),
    "jobs": ("fairgate.jobs_cli", "tuning jobs through a gateway's admin API: create, list, "
             "show, cancel, resume, apply"),
}
# (command, subcommand) -> (module, one-line help)
NESTED: dict[tuple[str, str], tuple[str, str]] = {
    ("tune", "calibrate"): ("fairgate.calibrate_cli",
                            "fit the simulator's step times to the real engine (--sim-profile)"),
}


class Parser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line, as every fairgate error is (argparse's
    own prints the usage first, up to 14 lines). `add_subparsers` builds each subcommand's
    parser, and theirs, of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; `{self.prog} --help` lists its usage\n")


def build_parser(argv: list[str]) -> Parser:
    parser = Parser(prog="fairgate", description="multi-tenant LLM serving")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text)
        if name == wanted:  # only import what runs
            importlib.import_module(module).register(sp)
    return parser


def _nested(argv: list[str]) -> tuple[str, str, str, list[str]] | None:
    """(name, module, help, the rest of argv) when argv's first word and the word right after it
    name a nested command (`tune calibrate`; not `tune --workload calibrate`)."""
    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if first is None or first + 1 >= len(argv):
        return None
    entry = NESTED.get((argv[first], argv[first + 1]))
    if entry is None:
        return None
    return f"{argv[first]} {argv[first + 1]}", *entry, argv[first + 2:]


def main(argv: list[str] | None = None) -> int:
    shadowed = guard.check()
    if shadowed is not None:
        print(shadowed, file=sys.stderr)
        return 2
    argv = list(sys.argv[1:] if argv is None else argv)
    if not _die_with_parent():
        return 1
    nested = _nested(argv)
    if nested is not None:
        name, module_name, help_text, rest = nested
        module = importlib.import_module(module_name)
        parser = Parser(prog=f"fairgate {name}", description=help_text)
        module.register(parser)
        args, unknown = parser.parse_known_args(rest)
        args.command = name
    else:
        parser = build_parser(argv)
        args, unknown = parser.parse_known_args(argv)
        if not args.command:
            parser.print_help()
            return 2
        module = importlib.import_module(SUBCOMMANDS[args.command][0])
    if unknown:
        print(unknown_arguments(args.command, unknown), file=sys.stderr)
        return 2
    try:
        return int(module.run(args) or 0)
    except (ValueError, OSError) as exc:  # bad input, missing files, a port already in use
        print(f"fairgate {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def unknown_arguments(command: str, unknown: list[str]) -> str:
    """One line for arguments no parser of `command` took (argparse's own is two: the usage,
    then 'unrecognized arguments'). `fairgate engine` takes vLLM's flags for the knobs it has
    and names the vLLM flags it knows it lacks; any other flag may be vLLM's too."""
    flags = [a.split("=", 1)[0] for a in unknown if a.startswith("-")]
    if not flags:
        return f"fairgate {command}: error: unexpected argument {unknown[0]!r}"
    vllm = " (if it is vLLM's, fairgate has no such knob)" if command == "engine" else ""
    return (f"fairgate {command}: error: {', '.join(flags)}: not a flag of fairgate "
            f"{command}{vllm}; `fairgate {command} --help` lists its flags")


PARENT_PID_ENV = "FAIRGATE_PARENT_PID"  # set by a gateway for its tune jobs' workers


def _die_with_parent() -> bool:
    """A gateway's tune job worker (FAIRGATE_PARENT_PID set) is killed when the gateway dies
    (Linux's PR_SET_PDEATHSIG), so a restarted gateway never resumes a study an orphan still
    runs; False when the gateway is already gone. Set here, in the worker itself, not between
    fork and exec in the gateway, which has threads."""
    parent = os.environ.pop(PARENT_PID_ENV, None)  # not for the worker's own children
    if not parent:
        return True
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    return str(os.getppid()) == parent


if __name__ == "__main__":
    sys.exit(main())

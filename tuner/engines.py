"""The servers `fairgate tune` launches and writes flags for: one table per engine.

Each table names the engine's flag for every knob it has (vLLM's and SGLang's own names for
max_num_seqs, max_num_batched_tokens, max_model_len and memory_fraction; fairgate sets any
knob with `--set KNOB=VALUE`), its health path, its host and port flags, and the lines its log
shows when a start-up fails because of the knobs (out of memory, a context longer than the
model's). A launch that fails with such a line is an infeasible trial for those knobs; any
other failure is the command's or the machine's, the same for every trial (tuner.remote stops
the study when it repeats).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine import vllm_flags
from engine.config import KNOBS
from protocol.validators import check_choice

DEFAULT_ENGINE = "fairgate"
LOOPBACK = "127.0.0.1"  # the tuner talks to the servers it launches on this machine only


def flag_value(value: Any) -> str:
    """A knob's value on a command line, as YAML reads it back (null, true, 0.9)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


@dataclass(frozen=True)
class Engine:
    """One engine's command line: knob -> flag, where it answers health checks, and the
    start-up failures its log names (cause, pattern), tried in order."""

    name: str
    knob_flags: Mapping[str, str]
    health_path: str
    failures: tuple[tuple[str, re.Pattern[str]], ...]
    model_command: tuple[str, ...]  # `--model M`: the command, M in place of {model}
    host_flag: str = "--host"
    port_flag: str = "--port"

    @property
    def knobs(self) -> tuple[str, ...]:
        return tuple(self.knob_flags)

    def knob_args(self, knob: str, value: Any) -> list[str]:
        """The arguments that set `knob` to `value`; ValueError for a knob without a flag."""
        self.check_knobs([knob])
        return [self.knob_flags[knob], flag_value(value)]

    def check_knobs(self, knobs: Sequence[str]) -> None:
        missing = [k for k in knobs if k not in self.knob_flags]
        if missing:
            raise ValueError(f"--engine {self.name} has no flag for {', '.join(missing)}; its "
                             f"knobs: {', '.join(self.knobs)} (or place a knob in --command "
                             "yourself, as {knob})")

    def flags(self, values: Mapping[str, Any]) -> list[str]:
        """The arguments for `values` (knob: value) in order; an unset (None) knob is left to
        the engine's own default."""
        return [arg for knob, value in values.items() if value is not None
                for arg in self.knob_args(knob, value)]

    def flags_for(self, params: Mapping[str, Any]) -> list[str]:
        """`flags` for the knobs in `params` this engine has a flag for (best.yaml's winner
        as this engine's command line); the others are left out."""
        return self.flags({k: v for k, v in params.items() if k in self.knobs})

    def sets(self, argv: Sequence[str], knob: str) -> bool:
        """Whether `argv` already sets `knob` (its flag, or `flag=value`)."""
        return knob in self.knob_flags and sets_flag(argv, self.knob_flags[knob])

    def infeasible_cause(self, line: str) -> str | None:
        """The cause a start-up log line names ("out of memory"), None for any other line."""
        for cause, pattern in self.failures:
            if pattern.search(line):
                return cause
        return None

    def command_for(self, model: str) -> str:
        """The engine's serve command for `model`, as --command takes it (no knobs, no port)."""
        return shlex.join(model if arg == "{model}" else arg for arg in self.model_command)


@dataclass(frozen=True)
class FairgateEngine(Engine):
    """`fairgate engine`: every EngineConfig knob is `--set KNOB=VALUE` (YAML scalars)."""

    @property
    def knobs(self) -> tuple[str, ...]:
        return KNOBS

    def knob_args(self, knob: str, value: Any) -> list[str]:
        self.check_knobs([knob])
        return ["--set", f"{knob}={flag_value(value)}"]

    def check_knobs(self, knobs: Sequence[str]) -> None:
        missing = [k for k in knobs if k not in KNOBS]
        if missing:
            raise ValueError(f"{', '.join(missing)} is not an engine knob")

    def sets(self, argv: Sequence[str], knob: str) -> bool:
        pairs = zip(argv, [*argv[1:], ""], strict=True)
        return any((arg == "--set" and value.startswith(f"{knob}="))
                   or arg.startswith(f"--set={knob}=") for arg, value in pairs)


def sets_flag(argv: Sequence[str], flag: str) -> bool:
    """Whether `argv` holds `flag` (as `--flag value` or `--flag=value`)."""
    return any(arg == flag or arg.startswith(f"{flag}=") for arg in argv)


def _patterns(*pairs: tuple[str, str]) -> tuple[tuple[str, re.Pattern[str]], ...]:
    return tuple((cause, re.compile(pattern, re.IGNORECASE)) for cause, pattern in pairs)


OUT_OF_MEMORY = "out of memory"
CONTEXT_TOO_LONG = "max_model_len longer than the model's context"
KNOBS_REFUSED = "the engine refused the knobs"

VLLM = Engine(
    name="vllm",
    knob_flags={knob: vllm_flags.flag_for(knob) for knob in (
        "max_num_seqs", "max_num_batched_tokens", "max_model_len", "memory_fraction")},
    health_path="/health",
    failures=_patterns(
        (OUT_OF_MEMORY, r"CUDA out of memory|torch\.(cuda\.)?OutOfMemoryError"
                        r"|No available memory for the cache blocks"
                        r"|larger than the (maximum number of tokens that can be stored in KV "
                        r"cache|available KV cache memory)"
                        r"|less than desired GPU memory utilization"),
        (CONTEXT_TOO_LONG, r"max_model_len.*(is )?(larger|greater) than"),
        (KNOBS_REFUSED, r"max_num_batched_tokens.*(is smaller than|must be greater than)")),
    model_command=("vllm", "serve", "{model}"))

SGLANG = Engine(
    name="sglang",
    knob_flags={"max_num_seqs": "--max-running-requests",
                "max_num_batched_tokens": "--chunked-prefill-size",
                "max_model_len": "--context-length",
                "memory_fraction": "--mem-fraction-static"},
    health_path="/health",
    failures=_patterns(
        (OUT_OF_MEMORY, r"out of memory|Not enough memory|OutOfMemoryError"),
        (CONTEXT_TOO_LONG, r"context_length.*(larger|greater) than")),
    model_command=("python", "-m", "sglang.launch_server", "--model-path", "{model}"))

FAIRGATE = FairgateEngine(
    name="fairgate",
    knob_flags={},  # any knob: --set
    health_path="/health",
    failures=_patterns(
        (OUT_OF_MEMORY, r"out of memory|not enough memory for the KV cache"),
        (CONTEXT_TOO_LONG, r"max_model_len \(\d+\) is larger than the model's context")),
    model_command=("fairgate", "engine", "--set", "model={model}"))

ENGINES: dict[str, Engine] = {e.name: e for e in (FAIRGATE, VLLM, SGLANG)}


def engine_named(name: str) -> Engine:
    """The table for --engine NAME; ValueError naming the choices."""
    check_choice("--engine", name, tuple(ENGINES))
    return ENGINES[name]

"""The one tune spec: every user-level option of `fairgate tune` and of a tune job, with one set
of defaults and one set of checks.

`TuneOptions.from_mapping(mapping, surface)` builds it from field names and values, whoever
wrote them: the command line (argv -> argparse -> mapping, fairgate/tune_cli.py), a spec file
(`fairgate tune --spec FILE`, which a tune job's worker is given) or a job's JSON body
(POST /admin/tune-jobs, control/jobs.py). `OPTIONS` is the table: each field's name (the
TuneOptions attribute and the JSON/YAML key), its flags, how its value is checked, whether a job
may set it, and the modes it means something in. A mistake is an `OptionError` naming the field
as its surface names it: `--trials` on the command line, `trials` in a file or a job body.

What needs the world is the caller's to check: files, the tenant database (an SLO not given is
the strictest enabled tenant's: `settle_slos`), a running engine, the gateway's shadow targets.
Credentials are no part of a spec: they travel in argv or the environment, never in a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.config import KNOBS
from protocol.measures import SLO
from protocol.validators import check_choice, check_http_url, check_known_keys, check_number
from tuner.engines import ENGINES
from tuner.runners import MODES, RunnerOptions
from tuner.spec import (
    BASELINES,
    DEFAULT_HOLDOUT_TOP,
    DEFAULT_RECHECK,
    DEFAULT_TRIALS,
    HEARTBEAT_S,
    MAX_RECHECK,
    OBJECTIVES,
)
from tuner.traces import TRACE_FORMATS
from tuner.workload import WORKLOADS

Schema = dict[str, Any]

DEFAULT_HOLDOUT = 3  # held-out windows in sim mode; replay and launch run in real time: 0
MAX_HOLDOUT = 16
MAX_TRIALS = 10_000
JOB_MODES = ("sim", "replay", "shadow")  # launch runs a command line: not from an HTTP API
TRAFFIC_MODES = ("sim", "replay", "launch")  # the modes that run a workload of their own
SLO_FIELDS = {"ttft": "slo_ttft_p99_s", "tpot": "slo_tpot_p99_s", "itl": "slo_itl_p99_s"}
SOURCES = ("workload", "trace", "workload_file")


class OptionError(ValueError):
    """A tune option that is wrong; `field` is its name in the table (a job's 400 `param`)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


# ---- how a value is checked (one kind per shape of value) -----------------------------------
class Kind(Protocol):
    def check(self, name: str, value: Any) -> Any:
        """The value as TuneOptions holds it; ValueError naming `name` when it is wrong."""
        ...

    def dump(self, value: Any) -> Any:
        """The value as a spec file or a job body holds it (JSON-shaped)."""
        ...

    def schema(self) -> Schema:
        """JSON Schema for the value (a job body's)."""
        ...


class _Plain:
    def dump(self, value: Any) -> Any:
        return value


@dataclass(frozen=True)
class Choice(_Plain):
    choices: tuple[str, ...]
    note: str = ""  # said after the choices when the value is not one of them

    def check(self, name: str, value: Any) -> str:
        try:
            return check_choice(name, value, self.choices)
        except ValueError as exc:
            raise ValueError(f"{exc}{self.note}") from None

    def schema(self) -> Schema:
        return {"enum": list(self.choices)}


@dataclass(frozen=True)
class Integer(_Plain):
    low: int
    high: int

    def check(self, name: str, value: Any) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # JSON's 3.0: JSON Schema's integer too
        wanted = "a positive integer" if self.low == 1 else f"in [{self.low}, {self.high}]"
        if isinstance(value, bool) or not isinstance(value, int):
            kind = wanted if self.low == 1 else f"an integer {wanted}"
            raise ValueError(f"{name} must be {kind}, got {_shown(value)}")
        if value < self.low or (value > self.high and self.low != 1):
            raise ValueError(f"{name} must be {wanted}, got {_shown(value)}")
        if value > self.high:
            raise ValueError(f"{name} must be at most {self.high}, got {_shown(value)}")
        return value

    def schema(self) -> Schema:
        return {"type": "integer", "minimum": self.low, "maximum": self.high}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


@dataclass(frozen=True)
class Number(_Plain):
    low: float = 0
    open_low: bool = True
    high: float | None = None

    def check(self, name: str, value: Any) -> float:
        return float(check_number(name, value, low=self.low, high=self.high,
                                  open_low=self.open_low))

    def schema(self) -> Schema:
        bound = "exclusiveMinimum" if self.open_low else "minimum"
        return {"type": "number", bound: self.low,
                **({} if self.high is None else {"maximum": self.high})}


class Text(_Plain):
    def check(self, name: str, value: Any) -> str:
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
        return value

    def schema(self) -> Schema:
        return {"type": "string", "minLength": 1}


@dataclass(frozen=True)
class Flag(_Plain):
    negatable: bool = False  # the command line has --no-FLAG too (its default is true)

    def check(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value

    def schema(self) -> Schema:
        return {"type": "boolean"}


class Address(Text):
    """One server's URL, kept as text (the gateway a shadow study runs through)."""

    def check(self, name: str, value: Any) -> str:
        return check_http_url(name, value)

    def schema(self) -> Schema:
        return {"type": "string", "pattern": "^https?://"}


class Urls:
    """One engine's URL or a list of them (replay: a worker each)."""

    def check(self, name: str, value: Any) -> tuple[str, ...]:
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list | tuple) or not values:
            raise ValueError(f"{name} must be a URL or a list of URLs, got {value!r}")
        return tuple(check_http_url(name, v) for v in values)

    def dump(self, value: tuple[str, ...]) -> Any:
        return list(value)

    def schema(self) -> Schema:
        url = {"type": "string", "pattern": "^https?://"}
        return {"anyOf": [url, {"type": "array", "items": url, "minItems": 1}]}


class Url:
    """One engine's URL (a job tunes one engine)."""

    def check(self, name: str, value: Any) -> tuple[str, ...]:
        return (check_http_url(name, value),)

    def dump(self, value: tuple[str, ...]) -> Any:
        return value[0]

    def schema(self) -> Schema:
        return {"type": "string", "pattern": "^https?://"}


class Knobs:
    """Base engine knobs {knob: value}; whether they go together is the engine config's to say
    (with the config file's engine section under them)."""

    def check(self, name: str, value: Any) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise ValueError(f"{name} must be a mapping of engine knob: value, got {value!r}")
        try:
            check_known_keys("engine", value, KNOBS)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        return dict(value)

    def dump(self, value: dict[str, Any]) -> Any:
        return dict(value)

    def schema(self) -> Schema:
        return {"type": "object", "propertyNames": {"enum": list(KNOBS)}}


@dataclass(frozen=True)
class SearchSpace:
    """`{knob: {low, high, log?, step?} | {choices: [...]}}`, or (`files`) a YAML file's path."""

    files: bool = True

    def check(self, name: str, value: Any) -> str | dict[str, Any]:
        if self.files and isinstance(value, str) and value:
            return value  # read by the caller (tuner.space.load_space_file)
        if not isinstance(value, Mapping):
            wanted = "a YAML file's path or " if self.files else ""
            raise ValueError(f"{name} must be {wanted}a mapping of engine knob: {{low, high}} "
                             f"or {{choices: [...]}}, got {value!r}")
        from tuner.space import parse_space  # Optuna's distributions: only when there is one

        try:
            parse_space(dict(value))
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{name}: {exc}") from None
        return dict(value)

    def dump(self, value: Any) -> Any:
        return value

    def schema(self) -> Schema:
        return {"type": "object", "minProperties": 1, "propertyNames": {"type": "string"}}


# ---- the table ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Option:
    """One field of the spec on every surface."""

    name: str  # TuneOptions' attribute, the key in a spec file and in a job body
    flags: tuple[str, ...]  # the command line's; the first is the one messages say
    kind: Kind
    help: str
    job: Kind | bool = False  # a job body's kind (True: the same); False: not in a job
    modes: tuple[str, ...] = MODES  # where it means something; another mode refuses it
    off_mode: str = ""  # why it is refused in another mode ({name}, {mode}, {modes}, {value})
    idle: tuple[Any, ...] = ()  # values that mean "none" and are fine in any mode
    aliases: tuple[str, ...] = ()  # older names a file or a body may use
    metavar: str | None = None
    dest: str | None = None  # argparse's, where the name is taken (`command`: the subcommand)

    @property
    def flag(self) -> str:
        return self.flags[0]

    def job_kind(self) -> Kind | None:
        if isinstance(self.job, bool):
            return self.kind if self.job else None
        return self.job


_SHADOW_DROP = "{mode} shadow runs on the gateway's mirrored live traffic: drop {name}"
OPTIONS: tuple[Option, ...] = (
    Option("mode", ("--mode",), Choice(MODES), "sim: in process on a virtual clock; replay: "
           "reconfigure a running `fairgate engine` per trial; launch: start a server per trial "
           "from --command; shadow: the gateway's shadow target on mirrored live traffic. "
           "replay and launch run in real time (default sim)",
           job=Choice(JOB_MODES, " (launch starts a command line: only `fairgate tune` does)")),
    Option("target", ("--url",), Urls(), "replay: the running `fairgate engine` "
           "(http://host:port); repeat it for several engines, one worker each", job=Url(),
           modes=("replay",), metavar="URL"),
    Option("command", ("--command",), Text(), "launch: the server command, split like a "
           "shell line (no shell); {port} is a free port, {max_num_seqs} etc. the trial's knobs",
           modes=("launch",), metavar="TEMPLATE", dest="launch_command"),
    Option("engine", ("--engine",), Choice(tuple(ENGINES)), "vllm | sglang | fairgate "
           "(default): launch: the server --command starts; its flags for the tuned knobs (and "
           "--host/--port unless --command has {port}) are appended, its out-of-memory lines "
           "make a trial infeasible. best.yaml gives the winner as its flags", metavar="NAME"),
    Option("apply", ("--apply",), Flag(), "replay: leave the engine on the recommended config "
           "at the end (default: put it back on its own)", modes=("replay",),
           off_mode="{name} leaves a replayed engine on the winner: it is for {mode} replay, "
                    "not {mode} {value}"),
    Option("launch_timeout_s", ("--launch-timeout",), Number(), "launch: seconds a server has "
           f"to answer /health (default {RunnerOptions.launch_timeout_s:g})", modes=("launch",),
           metavar="S"),
    Option("gateway", ("--gateway",), Address(), "shadow: the gateway whose shadow target the "
           "trials run on", modes=("shadow",), metavar="URL"),
    Option("shadow", ("--shadow",), Text(), "shadow: the gateway's shadow target (a fairgate "
           "engine: reconfigured per trial)", job=True, modes=("shadow",), metavar="NAME"),
    Option("shadow_requests", ("--shadow-requests",), Integer(1, 1_000_000), "shadow: "
           f"mirrored requests per trial (default {RunnerOptions.shadow_requests})", job=True,
           modes=("shadow",), metavar="N"),
    Option("shadow_window_s", ("--shadow-window",), Number(high=86400), "shadow: the longest "
           f"a trial waits for them (default {RunnerOptions.shadow_window_s:g} s)", job=True,
           modes=("shadow",), metavar="S"),
    Option("recheck", ("--recheck",), Integer(0, MAX_RECHECK), "shadow: after the study, "
           "re-check the recommendation and the next best feasible configs, N in all, on the "
           "traffic the gateway captured during it (replay on the shadow engine, mirroring "
           "paused, and sim; needs gateway.capture). "
           f"Default {DEFAULT_RECHECK}, 0: off", job=True, modes=("shadow",),
           off_mode="{name} re-checks a shadow study on its captured traffic: it is for "
                    "{mode} shadow, not {mode} {value}", metavar="N"),
    Option("config", ("-c", "--config"), Text(), "fairgate.yaml: its `engine` section is the "
           "base config, its `database` the default study storage and the tenants whose SLOs "
           "are the defaults (default: ./fairgate.yaml if present)", metavar="FILE"),
    Option("set", ("--set",), Knobs(), "override one base engine knob (YAML value); a spec "
           "file and a job take a mapping {knob: value}", job=True, metavar="KNOB=VALUE"),
    Option("sim_profile", ("--sim-profile",), Text(), "sim: step times and KV size from a "
           "`fairgate tune calibrate` profile (the same as --set sim_profile=FILE)",
           metavar="FILE"),
    Option("workload", ("--workload",), Choice(WORKLOADS), "a named workload: "
           f"{', '.join(WORKLOADS)}", job=True, modes=TRAFFIC_MODES, off_mode=_SHADOW_DROP,
           metavar="NAME"),
    Option("trace", ("--trace",), Text(), "a trace file (azure CSV, mooncake or fairgate "
           "JSONL)", modes=TRAFFIC_MODES, off_mode=_SHADOW_DROP, metavar="FILE"),
    Option("workload_file", ("--workload-file",), Text(), "YAML/JSON tenant mix",
           modes=TRAFFIC_MODES, off_mode=_SHADOW_DROP, metavar="FILE"),
    Option("trace_format", ("--trace-format",), Choice(TRACE_FORMATS), "the trace's format "
           "(default auto)", modes=TRAFFIC_MODES, off_mode=_SHADOW_DROP, metavar="FORMAT"),
    Option("rate", ("--rate",), Number(), "requests/s (traces: rescales time so that R is the "
           "mean over the train window)", job=True, modes=TRAFFIC_MODES, off_mode=_SHADOW_DROP,
           metavar="R"),
    Option("duration", ("--duration",), Number(high=86400), "seconds of workload per window "
           "(default: long enough for 1,000 requests, at least 60 s)", job=True,
           modes=TRAFFIC_MODES, off_mode=_SHADOW_DROP, metavar="S"),
    Option("start", ("--start",), Number(open_low=False), "traces: the train window starts S "
           "trace-seconds in (default 0)", job=True, modes=TRAFFIC_MODES,
           off_mode=_SHADOW_DROP, metavar="S"),
    Option("window", ("--window",), Number(), "traces: each window is S trace-seconds long "
           "(default: what holds 1,000 requests, or --rate x --duration of them)", job=True,
           modes=TRAFFIC_MODES, off_mode=_SHADOW_DROP, metavar="S"),
    Option("slo_ttft_p99_s", ("--slo-ttft-p99",), Number(), "p99 TTFT target, seconds "
           "(default: the strictest an enabled tenant of the database sets)", job=True,
           metavar="S"),
    Option("slo_tpot_p99_s", ("--slo-tpot-p99",), Number(), "p99 TPOT target (each request's "
           "time per output token after the first), seconds (default: the strictest tenant's)",
           job=True, metavar="S"),
    Option("slo_itl_p99_s", ("--slo-itl-p99",), Number(), "p99 ITL target (every gap between "
           "two tokens, pooled over the trial, as vllm bench serve's ITL), seconds (default: "
           "the strictest tenant's)", job=True, metavar="S"),
    Option("tenant_slos", ("--tenant-slos",), Flag(negatable=True), "an SLO not given is the strictest an "
           "enabled tenant sets (default); --no-tenant-slos: only the SLOs given", job=True),
    Option("objective", ("--objective",), Choice(OBJECTIVES), "goodput (req/s meeting the "
           "SLOs, the default), capacity (the highest rate at which the p99s hold; slow in "
           "replay/launch mode: each probe is a real-time replay), pareto (output tokens/s "
           "against p99 TTFT)", job=True, metavar="NAME"),
    Option("baseline", ("--baseline",), Choice(BASELINES), "vllm-grid: vLLM auto_tune's 8 "
           "configs (max_num_seqs 128/256 x max_num_batched_tokens 512..4096, memory_fraction "
           "probed from 0.98 down) join the study", job=True, metavar="NAME"),
    Option("holdout", ("--holdout", "--robustness"), Integer(0, MAX_HOLDOUT), "choose the "
           "recommendation on K held-out windows of the workload (a trace's other windows, a "
           "synthetic workload's other seeds); 0: the study's own best (default "
           f"{DEFAULT_HOLDOUT} in sim mode, 0 in replay/launch: real time)", job=True,
           modes=TRAFFIC_MODES, idle=(0,), aliases=("robustness",),
           off_mode="{name} re-runs other draws of a workload: {mode} shadow has none (its "
                    "traffic is live)", metavar="K"),
    Option("holdout_top", ("--holdout-top", "--robust-top"), Integer(1, 1000), "the study's "
           "top configs run on the held-out windows beside the baselines (default 3)",
           job=True, aliases=("robust_top",), metavar="N"),
    Option("workers", ("--workers",), Integer(1, 1024), "trials in parallel: sim and launch "
           "in N processes, replay one per --url (default: 1, replay: the number of --url)",
           metavar="N"),
    Option("heartbeat_s", ("--heartbeat",), Integer(1, 86400), "seconds between a running "
           f"trial's heartbeats; a trial silent for two is re-run (default {HEARTBEAT_S})",
           job=True, metavar="S"),
    Option("space", ("--space",), SearchSpace(), "YAML search space (default: the token "
           "budget, max_num_seqs, max_model_len, memory_fraction); a spec file may hold the "
           "mapping itself, a job must", job=SearchSpace(files=False), metavar="FILE"),
    Option("trials", ("--trials",), Integer(1, MAX_TRIALS), "the study's size in finished "
           f"trials, counting earlier runs of the same study (default {DEFAULT_TRIALS})",
           job=True, metavar="N"),
    Option("timeout_s", ("--timeout",), Number(), "run trials for S seconds (instead of "
           "--trials)", job=True, metavar="S"),
    Option("study", ("--study",), Text(), "study name; an existing one resumes (default: a new "
           "tune-<time> study)", metavar="NAME"),
    Option("storage", ("--storage",), Text(), "Optuna storage (default: "
           "$FAIRGATE_TUNE_STORAGE, else the config's database URL)", metavar="URL"),
    Option("out", ("--out",), Text(), "best.yaml, trials.csv, report.md (default "
           "tune-<study>)", metavar="DIR"),
    Option("seed", ("--seed",), Integer(0, 2**32 - 1), "sampler and workload seed "
           "(default 0)", job=True, metavar="N"),
)
BY_NAME = {o.name: o for o in OPTIONS}
ALIASES = {alias: o.name for o in OPTIONS for alias in o.aliases}
JOB_OPTIONS = tuple(o for o in OPTIONS if o.job_kind() is not None)


@dataclass(frozen=True)
class Surface:
    """Where a mapping comes from: how its messages name the fields and which it may hold."""

    what: str  # "a tune spec", "a job spec": for an unknown field
    flags: frozenset[str] = frozenset()  # the fields it names by their flag (the command line)
    job: bool = False  # a job body: the job's fields, checked as a job's
    provided: frozenset[str] = frozenset()  # fields its caller fills in after the check
    # fields its caller takes out before the check (a job's captured_minutes): named among the
    # fields a mapping may hold when one is unknown, and guessed for a misspelling
    taken: frozenset[str] = frozenset()

    def name(self, field_name: str) -> str:
        return BY_NAME[field_name].flag if field_name in self.flags else field_name

    def named(self, field_name: str) -> str:
        """The field with what it takes, for "needs ..." messages: `--url URL`, `target`."""
        option = BY_NAME[field_name]
        if field_name in self.flags and option.metavar:
            return f"{option.flag} {option.metavar}"
        return self.name(field_name)

    def kind(self, option: Option) -> Kind | None:
        return option.job_kind() if self.job else option.kind

    def from_argv(self, fields: Iterable[str]) -> Surface:
        """This surface with `fields` given on the command line (named by their flags)."""
        return dataclasses.replace(self, flags=self.flags | frozenset(fields))


CLI = Surface("`fairgate tune`", flags=frozenset(BY_NAME))
FILE = Surface("a tune spec")
# a job's gateway is the worker's --gateway; its captured traffic, a trace the gateway writes
JOB = Surface("a job spec", job=True, provided=frozenset({"gateway", "trace"}),
              taken=frozenset({"captured_minutes"}))


# ---- the spec -------------------------------------------------------------------------------
@dataclass(frozen=True)
class TuneOptions:
    """Every user-level option of a study, each at its one default; build it with
    `from_mapping` (which checks it) rather than directly."""

    mode: str = "sim"
    target: tuple[str, ...] = ()
    command: str | None = None
    engine: str = RunnerOptions.engine
    apply: bool = False
    launch_timeout_s: float = RunnerOptions.launch_timeout_s
    gateway: str | None = None
    shadow: str | None = None
    shadow_requests: int = RunnerOptions.shadow_requests
    shadow_window_s: float = RunnerOptions.shadow_window_s
    recheck: int | None = None  # None: DEFAULT_RECHECK (shadow)
    config: str | None = None
    set: dict[str, Any] = field(default_factory=dict)
    sim_profile: str | None = None
    workload: str | None = None
    trace: str | None = None
    workload_file: str | None = None
    trace_format: str = "auto"
    rate: float | None = None
    duration: float | None = None
    start: float | None = None
    window: float | None = None
    slo_ttft_p99_s: float | None = None
    slo_tpot_p99_s: float | None = None
    slo_itl_p99_s: float | None = None
    tenant_slos: bool = True
    objective: str = "goodput"
    baseline: str | None = None
    holdout: int | None = None  # None: DEFAULT_HOLDOUT in sim mode, else 0 (`holdout_count`)
    holdout_top: int = DEFAULT_HOLDOUT_TOP
    workers: int | None = None  # None: 1, replay: one per target (`worker_count`)
    heartbeat_s: int = HEARTBEAT_S
    space: str | dict[str, Any] | None = None
    trials: int | None = DEFAULT_TRIALS  # None only with timeout_s
    timeout_s: float | None = None
    study: str | None = None
    storage: str | None = None
    out: str | None = None
    seed: int = 0

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any], surface: Surface = FILE) -> TuneOptions:
        """The spec `mapping` gives (a null value: not given); OptionError for the first
        mistake, in the table's order, named as `surface` names it."""
        values = _field_values(mapping, surface)
        if values.get("timeout_s") is not None and "trials" not in values:
            values["trials"] = None  # a study bounded by time alone
        options = cls(**values)
        _check_together(options, surface)
        return options

    def to_mapping(self, surface: Surface = FILE) -> dict[str, Any]:
        """The spec as a file (or, `surface` JOB, a job body) holds it: every field `surface`
        has that is set, defaults included (so that reading it back gives these options even
        after a default changes) but for those of other modes."""
        out: dict[str, Any] = {}
        defaults = TuneOptions()
        for option in OPTIONS:
            kind = surface.kind(option)
            value = getattr(self, option.name)
            if kind is None or value is None or value in ((), {}) or (
                    self.mode not in option.modes and value == getattr(defaults, option.name)):
                continue
            out[option.name] = kind.dump(value)
        return out

    # the defaults that depend on the mode
    @property
    def holdout_count(self) -> int:
        if self.holdout is not None:
            return self.holdout
        return DEFAULT_HOLDOUT if self.mode == "sim" else 0

    @property
    def recheck_count(self) -> int:
        if self.mode != "shadow":
            return 0
        return DEFAULT_RECHECK if self.recheck is None else self.recheck

    @property
    def worker_count(self) -> int:
        if self.workers is not None:
            return self.workers
        return max(1, len(self.target)) if self.mode == "replay" else 1

    @property
    def slo(self) -> SLO:
        return SLO(ttft_s=self.slo_ttft_p99_s, tpot_s=self.slo_tpot_p99_s,
                   itl_s=self.slo_itl_p99_s)

    @property
    def source(self) -> str | None:
        """The workload as it was given: a workload's name or a file's path."""
        return self.workload or self.trace or self.workload_file


def _field_values(mapping: Mapping[str, Any], surface: Surface) -> dict[str, Any]:
    """Each field's value checked by its kind; unknown fields and aliases given twice refused."""
    if not isinstance(mapping, Mapping):
        raise OptionError("", f"{surface.what} must be a mapping of field: value, got "
                              f"{type(mapping).__name__}")
    allowed = [o.name for o in OPTIONS if surface.kind(o) is not None]
    given: dict[str, Any] = {}
    keys: dict[str, str] = {}  # field -> the key that gave it
    for key, value in mapping.items():
        name = ALIASES.get(key, key)
        if name not in allowed or not isinstance(key, str):
            raise OptionError(str(key), _unknown(str(key), [*allowed, *surface.taken], surface))
        if name in given:
            raise OptionError(name, f"give {keys[name]} or {key}, not both (one field)")
        given[name], keys[name] = value, key
    values: dict[str, Any] = {}
    for option in OPTIONS:  # the table's order: the order a user reads them
        value = given.get(option.name)
        kind = surface.kind(option)
        if value is None or kind is None:
            continue
        try:
            values[option.name] = kind.check(surface.name(option.name), value)
        except ValueError as exc:
            raise OptionError(option.name, str(exc)) from None
    return values


def _unknown(key: str, allowed: list[str], surface: Surface) -> str:
    match = difflib.get_close_matches(key, allowed, n=1, cutoff=0.75)
    guess = f"; did you mean {match[0]}?" if match else ""
    return f"unknown field {key!r}{guess} ({surface.what} has: {', '.join(sorted(allowed))})"


NEEDS = {"replay": ("target",), "launch": ("command",), "shadow": ("gateway", "shadow")}
NEEDS_TAIL = {"replay": " of a running fairgate engine"}


def _check_together(options: TuneOptions, surface: Surface) -> None:
    """The rules between fields, each named as `surface` names it."""
    n = surface.name
    if options.trials is not None and options.timeout_s is not None:
        raise OptionError("timeout_s", f"give {n('trials')} or {n('timeout_s')}, not both")
    sources = [s for s in SOURCES if getattr(options, s) is not None]
    if len(sources) > 1:
        raise OptionError(sources[1], f"give one of {n('workload')}, {n('trace')} or "
                                      f"{n('workload_file')}, not {n(sources[0])} and "
                                      f"{n(sources[1])}")
    mode = options.mode
    missing = [f for f in NEEDS.get(mode, ()) if getattr(options, f) in (None, ())
               and f not in surface.provided]
    if missing:
        raise OptionError(missing[0], f"{n('mode')} {mode} needs "
                          f"{' and '.join(surface.named(f) for f in missing)}"
                          f"{NEEDS_TAIL.get(mode, '')}")
    _check_modes(options, surface)
    if mode == "shadow" and options.objective != "goodput":
        raise OptionError("objective", f"{n('mode')} shadow scores SLO attainment against the "
                                       f"live engine: {n('objective')} goodput only")
    if mode != "shadow" and not sources and "trace" not in surface.provided:
        raise OptionError("workload", "give the workload: "
                          f"{', '.join(surface.named(s) for s in SOURCES[:-1])} or "
                          f"{surface.named(SOURCES[-1])}")


def _check_modes(options: TuneOptions, surface: Surface) -> None:
    """A field given in a mode it means nothing in is refused (it would be ignored)."""
    defaults = TuneOptions()
    for option in OPTIONS:
        value = getattr(options, option.name)
        if options.mode in option.modes or value == getattr(defaults, option.name) or (
                value in option.idle):
            continue
        why = option.off_mode or "{name} is for {mode} {modes}, not {mode} {value}"
        raise OptionError(option.name, why.format(
            name=surface.name(option.name), mode=surface.name("mode"),
            modes=" | ".join(option.modes), value=options.mode))


def settle_slos(options: TuneOptions, strictest: Mapping[str, float],
                surface: Surface = FILE) -> TuneOptions:
    """The SLOs to tune for: those given, and (tenant_slos) each one not given from
    `strictest` (field -> the strictest an enabled tenant sets); at least one. The result says
    tenant_slos false: it is settled, and a worker reading it asks no database again."""
    filled: dict[str, Any] = {name: strictest[name] for name in SLO_FIELDS.values()
              if options.tenant_slos and getattr(options, name) is None and name in strictest}
    settled = dataclasses.replace(options, **filled, tenant_slos=False)
    if settled.slo.unset:
        fields = list(SLO_FIELDS.values())
        raise OptionError(fields[0], "give at least one SLO (seconds): "
                          f"{', '.join(surface.named(f) for f in fields[:-1])} or "
                          f"{surface.named(fields[-1])}; "
                          + ("no enabled tenant sets one" if options.tenant_slos
                             else f"{surface.name('tenant_slos')} is off"))
    return settled


def job_schema(extra: Mapping[str, Schema] | None = None) -> Schema:
    """A job body's JSON Schema, from the table: each field's kind, its default, its help
    (a null is the default, as an absent field is)."""
    defaults = TuneOptions()
    properties: dict[str, Schema] = {}
    for option in JOB_OPTIONS:
        kind = option.job_kind()
        assert kind is not None
        schema: Schema = {"anyOf": [kind.schema(), {"type": "null"}],
                          "description": f"`fairgate tune {option.flag}`: {option.help}"}
        default = getattr(defaults, option.name)
        if default not in (None, (), {}):
            schema["default"] = kind.dump(default)
        properties[option.name] = schema
        for alias in option.aliases:
            properties[alias] = {**schema, "description": f"The older name of {option.name}."}
    properties.update(extra or {})
    return {"type": "object", "additionalProperties": False, "properties": properties}


def argparse_kwargs(option: Option) -> dict[str, Any]:
    """`add_argument` keywords for an option: its type, its help; no default (a flag not
    given is not in the mapping, so a spec file's value or the one default holds)."""
    kwargs: dict[str, Any] = {"dest": option.dest or option.name, "default": None,
                              "help": option.help}
    if option.metavar:
        kwargs["metavar"] = option.metavar
    if isinstance(option.kind, Flag):
        kwargs["action"] = argparse.BooleanOptionalAction if option.kind.negatable \
            else "store_true"
        kwargs.pop("metavar", None)
    elif isinstance(option.kind, Integer):
        kwargs["type"] = int
    elif isinstance(option.kind, Number):
        kwargs["type"] = float
    elif isinstance(option.kind, Urls | Knobs):
        kwargs["action"] = "append"
    return kwargs


def field_of(dest: str) -> str:
    """The field an argparse destination holds."""
    return next((o.name for o in OPTIONS if (o.dest or o.name) == dest), dest)



def read_spec(path: str) -> dict[str, Any]:
    """A spec file's mapping: JSON when it ends in .json (a gateway writes spec.json), else
    YAML; ValueError naming the file. Its values are checked by `from_mapping`."""
    import json
    from pathlib import Path

    from protocol.yaml_files import load_yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"--spec {path}: cannot read it ({exc.strerror or exc})") from None
    try:
        # YamlError names the file and the line itself
        data = json.loads(text) if path.endswith(".json") else load_yaml(path, text=text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--spec {path} is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--spec {path} must hold a mapping of field: value, got "
                         f"{type(data).__name__}")
    return data

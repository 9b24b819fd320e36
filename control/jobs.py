"""Tuning jobs through the admin API: `fairgate tune` run as a worker process per job, its state
in the database (`tenants.jobs`, beside Optuna's tables), never on the gateway's event loop.

A job spec is `fairgate tune`'s spec (tuner/options.py): its body goes through the same
`TuneOptions.from_mapping` as the command line's flags, with the fields a job may set, and a
mistake is a 400 naming the field. `captured_minutes` is a job's own: the gateway writes that
window of its capture as the worker's trace. The gateway opens no path a spec gives: a sim
profile is named from those it holds (`SimProfiles`: uploaded with PUT /admin/sim-profiles/NAME,
or put in jobs.dir/sim-profiles by hand), read in a thread, capped and of regular files only,
and the worker's spec holds that file's path. Nothing is made before the spec is checked; then
the job's folder holds spec.json (the checked spec, SLOs settled, with its study and folder)
and the worker is `python -m fairgate tune --spec DIR/spec.json` (a shadow job adds
`--gateway URL`: this gateway, as it is reached now), its storage and the admin key in the
environment, its log in DIR/worker.log. The manager runs at most `jobs.max_running` at once,
oldest first, never two on one engine. Workers die with the gateway (PR_SET_PDEATHSIG,
fairgate/cli.py), so a gateway that starts and finds a job `running` knows its worker is gone:
the job becomes `interrupted`, and `resume` runs the same worker on the same spec.json again:
the study holds every finished trial, and the trial the killed worker was running is re-run
once with the same knobs (its heartbeat went stale), so nothing is lost or repeated.

Progress, the best trial and the trials table are read from the study itself (in a thread),
so they are the same after a restart as before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import re
import secrets
import shutil
import socket
import stat
import sys
import tempfile
import threading
import time
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.exc import SQLAlchemyError

from control.canary import MAX_CANARY_WEIGHT, ServedWindow
from engine.config import ENGINE_ADMIN_KEY_ENV, ENGINE_KEY_ENV, EngineConfig
from engine.presets import MODEL_PRESETS, model_preset
from engine.sim_profile import (
    FEATURES,
    MAX_WAKE_STEPS,
    PROFILE_VERSION,
    SimProfile,
    profile_text,
)
from gateway.admin import RETRY_AFTER_S
from gateway.config import ADMIN_KEY_ENV, BackendConfig, ShadowConfig
from gateway.outlier import Verdict
from protocol.errors import ApiError, bad_request
from protocol.openai import server_root
from protocol.serving import wait_event
from protocol.yaml_files import YamlError, load_yaml
from tenants.jobs import ACTIVE_STATES, JobRecord, JobStore

if TYPE_CHECKING:  # tuner.options is imported when a spec is first checked (Optuna is big)
    from tuner.options import TuneOptions

Schema = dict[str, Any]

log = logging.getLogger("fairgate.gateway")
NO_FEASIBLE = "no trial met both SLOs"  # fairgate tune's last line when it exits 1 for that
APPLY_ENDED = ("promoted", "rolled_back", "failed")
LEASE_S = 10.0  # a gateway renews its running jobs this often; 3 missed: another takes over
JOB_ID_PATTERN = "^job-[0-9a-f]{12}$"
CANCEL_GRACE_S = 10.0  # SIGTERM, then SIGKILL
DEFAULT_CANARY_WINDOW_S = 60.0
DEFAULT_MIN_REQUESTS = 20
DRAIN_TIMEOUT_S = 120.0  # a draining replica's streams get this long before it is reconfigured
JOB_FILES = ("report.html", "report.md", "best.yaml", "trials.csv", "recheck.csv", "worker.log")
SPEC_FILE = "spec.json"  # the worker's spec (`fairgate tune --spec`), in the job's folder
TRACE_FILE = "trace.jsonl"  # captured_minutes: the capture's window, the worker's trace
MAX_CAPTURED_MINUTES = 7 * 24 * 60
MAX_WINDOW_REQUESTS = 200_000  # rate x duration: one window's requests (a trial replays them)
RANDOM_MODELS = tuple(f"random:{name}" for name in MODEL_PRESETS)  # what `set.model` may name
CAPTURED_MINUTES: Schema = {
    "type": "number", "exclusiveMinimum": 0, "maximum": MAX_CAPTURED_MINUTES,
    "description": "The last N minutes of captured traffic (gateway.capture) as the workload: "
                   "the job's trace."}


# ---- the spec -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobSpec:
    """A checked job spec: the options its worker runs (tuner.options, the SLOs settled), the
    captured minutes the gateway writes as its trace, and the engine it reconfigures."""

    options: TuneOptions
    captured_minutes: float | None
    target: str | None  # replay: its engine's root URL; shadow: the shadow target's

    @property
    def fields(self) -> dict[str, Any]:
        """The spec as the job's row and the API show it (every field set, defaults too)."""
        from tuner.options import JOB

        extra = {} if self.captured_minutes is None else {
            "captured_minutes": self.captured_minutes}
        return {**self.options.to_mapping(JOB), **extra}


def parse_spec(body: Any, shadows: dict[str, str],
               default_slos: Mapping[str, float]) -> JobSpec:
    """A job spec from a POST body, through `fairgate tune`'s own TuneOptions.from_mapping;
    ApiError 400 naming the field that is wrong. `shadows`: the gateway's shadow targets
    (name -> engine URL); `default_slos`: the strictest tenant SLOs by field name, for the
    SLOs the spec does not give."""
    from tuner.options import OptionError

    try:
        return _parse_spec(body, shadows, default_slos)
    except OptionError as exc:
        raise bad_request(str(exc), exc.field or None) from None


def _parse_spec(body: Any, shadows: dict[str, str],
                default_slos: Mapping[str, float]) -> JobSpec:
    from tuner.options import JOB, Number, OptionError, TuneOptions, settle_slos

    if not isinstance(body, dict):
        raise OptionError("", "the body must be a JSON object: a job spec")
    fields = dict(body)
    minutes = fields.pop("captured_minutes", None)
    options = TuneOptions.from_mapping(fields, JOB)
    if minutes is not None:
        try:
            minutes = Number(high=MAX_CAPTURED_MINUTES).check("captured_minutes", minutes)
        except ValueError as exc:
            raise OptionError("captured_minutes", str(exc)) from None
    if options.mode == "shadow" and minutes is not None:
        raise OptionError("captured_minutes", "mode shadow runs on the gateway's mirrored live "
                                              "traffic: drop captured_minutes")
    if options.mode != "shadow" and (options.workload is None) == (minutes is None):
        raise OptionError("workload", "give one of workload (a named workload) or "
                                      "captured_minutes (the last N minutes of captured traffic)")
    target: str | None = None
    if options.mode == "replay":
        target = server_root(options.target[0])
    elif options.mode == "shadow":
        if options.shadow not in shadows:
            raise OptionError("shadow", "mode shadow needs shadow: one of the gateway's shadow "
                              f"targets ({', '.join(sorted(shadows)) or 'none configured'}), "
                              f"got {options.shadow!r}")
        target = server_root(shadows[options.shadow])
    _check_set(options)
    _check_choices(options)
    _check_window(options)
    return JobSpec(settle_slos(options, default_slos, JOB), minutes, target)


def _check_set(options: TuneOptions) -> None:
    """A job's base config: the defaults with its knobs on top, its sim_model one that exists,
    its model a random: preset and its sim profile a name (the file is read in `submit`)."""
    from tuner.options import OptionError

    knobs = dict(options.set)
    profile = knobs.pop("sim_profile", None)
    if profile is not None:
        _check_profile_name("set", profile, options.mode)
    model = knobs.get("model")
    if model is not None and model not in RANDOM_MODELS:
        raise OptionError("set", f"set.model must be one of {', '.join(RANDOM_MODELS)} in a "
                                 "job: a checkpoint is its engine's own, in that engine's config")
    try:
        model_preset(EngineConfig.from_dict(knobs).sim_model)
    except (ValueError, TypeError) as exc:
        raise OptionError("set", f"set: {exc}") from None


def _check_choices(options: TuneOptions) -> None:
    """Each choice of the space a value its knob takes: of the knob's type, and for a knob of
    names (policy, sim_model, ...) a name the engine knows; sim profiles by name."""
    from tuner.options import OptionError

    space = options.space if isinstance(options.space, dict) else {}
    for knob, dimension in space.items():
        for value in dimension.get("choices") or ():
            if knob == "sim_profile":
                _check_profile_name("space", value, options.mode)
                continue
            try:
                _check_knob_value(knob, value)
            except (ValueError, TypeError) as exc:
                raise OptionError("space", f"space.{knob}: choice {value!r}: {exc}") from None


def _check_knob_value(knob: str, value: Any) -> None:
    """ValueError unless `value` is of `knob`'s type (an integer where a number goes) and, a
    name or a switch, one the engine takes (a number's fit is the trial's: it depends on the
    other knobs)."""
    hint = typing.get_type_hints(EngineConfig)[knob]
    types = typing.get_args(hint) or (hint,)
    kind = float if type(value) is int and float in types else type(value)
    if kind not in types:
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ValueError(f"{knob} takes {names}")
    if knob == "sim_model":
        model_preset(value)
    elif kind in (str, bool):
        EngineConfig.from_dict({knob: value})


def _check_window(options: TuneOptions) -> None:
    """rate x duration, the requests of one window, within MAX_WINDOW_REQUESTS (a trace
    without a rate: as many as it holds)."""
    from tuner.options import OptionError
    from tuner.windows import DEFAULT_DURATION_S
    from tuner.workload import Synthetic, get_workload

    rate = options.rate
    if rate is None and options.workload is not None:
        workload = get_workload(options.workload)
        rate = workload.default_rate if isinstance(workload, Synthetic) else None
    if rate is None or options.mode == "shadow":
        return
    requests = rate * (options.duration or DEFAULT_DURATION_S)
    if requests > MAX_WINDOW_REQUESTS:
        field = "rate" if options.rate is not None else "duration"
        raise OptionError(field, f"rate x duration is {requests:,.0f} requests a window; a job "
                                 f"runs at most {MAX_WINDOW_REQUESTS:,}: lower rate or duration")


def job_spec_schema() -> Schema:
    """The POST body's JSON Schema: tuner.options' table for a job, and captured_minutes."""
    from tuner.options import job_schema

    schema = job_schema({"captured_minutes": {"anyOf": [CAPTURED_MINUTES, {"type": "null"}],
                                              "description": CAPTURED_MINUTES["description"]}})
    schema["description"] = (
        "The options of `fairgate tune` a job may set, by their spec names (README: Tuning "
        "jobs); null is the default. An SLO not given is the strictest an enabled tenant "
        "sets (any combination, at least one; tenant_slos false: only those given). The "
        "worker runs `fairgate tune --spec spec.json` on the checked spec, written to the "
        "job's folder.")
    knobs = schema["properties"]["set"]["anyOf"][0]
    knobs["properties"] = {
        "sim_profile": {"type": ["string", "null"], "pattern": PROFILE_NAME_PATTERN,
                        "description": "mode sim: the name of a sim profile the gateway holds "
                                       "(GET /admin/sim-profiles), never a path."},
        "model": {"enum": [*RANDOM_MODELS, None], "description": "A random: preset; a "
                  "checkpoint is its engine's own."},
        "sim_model": {"enum": list(MODEL_PRESETS)}}
    given = {"workload": {"type": "string"}, "captured_minutes": {"type": "number"}}
    schema["allOf"] = [
        {"not": {"required": list(given), "properties": given},
         "description": "workload or captured_minutes, not both"},
        {"if": {"required": ["mode"], "properties": {"mode": {"const": "shadow"}}},
         "then": {"properties": {name: {"type": "null"} for name in given}},
         "else": {"anyOf": [{"required": [name], "properties": {name: kind}}
                            for name, kind in given.items()]},
         "description": "mode shadow runs on mirrored live traffic; the others on a workload "
                        "or captured_minutes"}]
    return schema


JOB_RULES = (  # what the TuneJobSpec schema cannot say: the operation's description says it
    "Refused with a 400 although the schema allows it: fields that do not go together (a "
    "field for another mode than the job's, trials and timeout_s), a space or set the engine "
    "cannot run (max_num_batched_tokens below max_num_seqs, a choice of the wrong type for "
    "its knob), rate x duration over "
    f"{MAX_WINDOW_REQUESTS:,} requests a window (a synthetic workload's rate is 10/s when "
    "not given), set.sim_profile (or a space choice of it) that names no profile the gateway "
    "holds, or in another mode than sim; captured_minutes without the gateway's capture or "
    "with no request in that span; no SLO when no enabled tenant sets one.")


def worker_options(options: TuneOptions, job_id: str, out: Path, captured: bool,
                   profiles: Mapping[str, Path] | None = None) -> TuneOptions:
    """What the job's worker runs: the spec, its study and folder, its captured trace, the
    files of the sim profiles it names (`profiles`: name -> path)."""
    return dataclasses.replace(with_profile_paths(options, profiles or {}), study=job_id,
                               out=str(out), trace=str(out / TRACE_FILE) if captured else None)


def record_options(job: JobRecord, profiles: Mapping[str, Path] | None = None) -> TuneOptions:
    """The worker's options from a job's row (a job queued before the gateway wrote spec
    files: its row holds the checked spec, its sim profiles by name)."""
    options = row_options(job)
    return worker_options(options, job.study, Path(job.out_dir),
                          job.spec.get("captured_minutes") is not None, profiles)


def row_options(job: JobRecord) -> TuneOptions:
    from tuner.options import JOB, TuneOptions

    fields = {k: v for k, v in job.spec.items() if k != "captured_minutes"}
    return dataclasses.replace(TuneOptions.from_mapping(fields, JOB), tenant_slos=False)


def write_spec_file(options: TuneOptions, path: Path) -> None:
    path.write_text(json.dumps(options.to_mapping(), indent=2) + "\n")


def _make_folder(out: Path, options: TuneOptions, trace: str | None) -> None:
    out.mkdir(parents=True)
    if trace is not None:
        (out / TRACE_FILE).write_text(trace)
    write_spec_file(options, out / SPEC_FILE)


def worker_argv(job: JobRecord, gateway_url: str | None) -> list[str]:
    """`fairgate tune` arguments for the job: its spec file, and for a shadow job this
    gateway's address (it may change when the gateway restarts). The study's storage (a
    database URL, perhaps with a password) and the admin key travel in the environment."""
    argv = ["tune", "--spec", str(Path(job.out_dir) / SPEC_FILE)]
    if job.spec.get("mode") == "shadow":
        assert gateway_url is not None
        argv += ["--gateway", gateway_url]
    return argv


# ---- sim profiles: named, never a path -------------------------------------------------------
PROFILE_FOLDER = "sim-profiles"  # under jobs.dir: jobs.dir/sim-profiles/NAME.yaml
PROFILE_NAME_PATTERN = "^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$"  # no slash, no leading dot
MAX_PROFILE_BYTES = 1 << 20
MAX_PROFILE_INT = 2**31 - 1
NOT_HELD = ("{field}.sim_profile must name one of the gateway's sim profiles (GET "
            "/admin/sim-profiles lists them; PUT /admin/sim-profiles/NAME uploads one): a job "
            "names a profile, never a path")
_PROFILE_SCALARS = {"model": str, "device": str, "dtype": str}
_PROFILE_COUNTS = ("max_position", "kv_tokens", "kv_bytes_per_token")
SIM_PROFILE_SCHEMA: Schema = {
    "type": "object", "additionalProperties": False,
    "required": ["version", "coefficients", *_PROFILE_COUNTS],
    "description": "A `fairgate tune calibrate` profile (engine/sim_profile.py): what was "
                   "measured, the profiled engine's context and KV cache, the fitted seconds per "
                   "unit of each step feature, the fit's report and the knobs it ran under.",
    "properties": {
        "version": {"const": PROFILE_VERSION},
        **{name: {"type": "string"} for name in _PROFILE_SCALARS},
        **{name: {"type": "integer", "minimum": 1, "maximum": MAX_PROFILE_INT}
           for name in _PROFILE_COUNTS},
        "coefficients": {"type": "object", "propertyNames": {"enum": list(FEATURES)},
                         "additionalProperties": {"type": "number", "minimum": 0}},
        "fit": {"type": "object", "additionalProperties": {"type": "number"}},
        "calibration": {"type": "object", "additionalProperties": {
            "type": ["string", "number", "boolean", "null"]}},
        "noise": {"type": "object", "additionalProperties": False, "required": ["ratios"],
                  "description": "How uneven the measured steps were: each step's measured "
                                 "over predicted time, in order; the simulator replays them in "
                                 "blocks of `block` steps.",
                  "properties": {
                      "block": {"type": "integer", "minimum": 1, "maximum": MAX_PROFILE_INT},
                      "ratios": {"type": "array", "minItems": 1,
                                 "items": {"type": "number", "exclusiveMinimum": 0}}}},
        "wake": {"type": "object", "additionalProperties": False,
                 "required": ["idle_s", "extra_s"],
                 "description": "What the first steps after an idle spell cost beyond their "
                                "prediction: `extra_s[k]` seconds for the k-th step after "
                                "`idle_s` of idle (less after a shorter idle).",
                 "properties": {
                     "idle_s": {"type": "number", "exclusiveMinimum": 0},
                     "extra_s": {"type": "array", "minItems": 1, "maxItems": MAX_WAKE_STEPS,
                                 "items": {"type": "number", "minimum": 0}}}}}}


class NotHeld(LookupError):
    """A sim profile name the gateway holds no profile under (or a path: never one)."""


def is_profile_name(name: Any) -> bool:
    return isinstance(name, str) and re.fullmatch(PROFILE_NAME_PATTERN, name) is not None


def _check_profile_name(field: str, value: Any, mode: str) -> None:
    from tuner.options import OptionError

    if not is_profile_name(value):
        raise OptionError(field, NOT_HELD.format(field=field))
    if mode != "sim":
        raise OptionError(field, f"{field}.sim_profile is for mode sim: a {mode} job's engine "
                                 "runs on its own config")


def profile_names(options: TuneOptions) -> dict[str, str]:
    """The sim profiles a spec names -> the field that names it (set or space)."""
    names: dict[str, str] = {}
    if options.set.get("sim_profile") is not None:
        names[options.set["sim_profile"]] = "set"
    space = options.space if isinstance(options.space, dict) else {}
    for name in (space.get("sim_profile") or {}).get("choices") or ():
        names.setdefault(name, "space")
    return names


def with_profile_paths(options: TuneOptions, paths: Mapping[str, Path]) -> TuneOptions:
    """The options with each sim profile name replaced by its file's path (the worker's)."""
    if not paths:
        return options
    knobs = dict(options.set)
    if knobs.get("sim_profile") is not None:
        knobs["sim_profile"] = str(paths[knobs["sim_profile"]])
    space = options.space
    if isinstance(space, dict) and "sim_profile" in space:
        choices = space["sim_profile"]["choices"]
        space = {**space, "sim_profile": {"choices": [str(paths[c]) for c in choices]}}
    return dataclasses.replace(options, set=knobs, space=space)


def read_regular_file(path: Path, limit: int) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes. NotHeld when it is missing,
    a symlink, a FIFO, a device or a directory: refused before any read could block on it or
    flood memory (O_NONBLOCK, O_NOFOLLOW, fstat); ValueError when it is larger. Blocking I/O:
    call it in a thread."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        raise NotHeld(path.name) from None
    try:
        regular = stat.S_ISREG(os.fstat(fd).st_mode)
    except OSError:
        regular = False
    if not regular:
        os.close(fd)
        raise NotHeld(path.name)
    with os.fdopen(fd, "rb") as file:
        data = file.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"its file is larger than {limit} bytes")
    return data


def profile_from_upload(body: bytes, as_json: bool) -> SimProfile:
    """An uploaded profile (YAML, or JSON when sent as JSON): each field as SIM_PROFILE_SCHEMA
    says, then as the simulator loads it; ApiError 400 naming the field."""
    try:
        data = json.loads(body) if as_json else load_yaml("<body>", text=body)
    except YamlError as exc:  # <body>:<line>: <problem>
        raise bad_request(str(exc), None) from None
    except ValueError as exc:
        raise bad_request(f"the body is not JSON: {str(exc).splitlines()[0]}", None) from None
    if not isinstance(data, dict):
        raise bad_request("a sim profile is a mapping (`fairgate tune calibrate --out` writes "
                          "one)", None)
    allowed = SIM_PROFILE_SCHEMA["properties"]
    for key, value in data.items():
        if key not in allowed:
            raise bad_request(f"unknown field {str(key)[:40]!r}; a sim profile has "
                              f"{', '.join(allowed)}", str(key)[:40])
        _check_profile_field(key, value)
        if key == "version" or key in _PROFILE_COUNTS:
            data[key] = int(value)  # JSON's 5.0 is JSON Schema's integer too
        if key == "noise" and "block" in value:
            value["block"] = int(value["block"])
    try:
        return SimProfile.from_dict(data)
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc), None) from None


def _check_profile_field(key: str, value: Any) -> None:
    def number(v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    def whole(v: Any) -> bool:
        return number(v) and float(v).is_integer()

    if key == "version" and (not whole(value) or value != PROFILE_VERSION):
        wrong = f"version must be {PROFILE_VERSION}"
    elif key in _PROFILE_SCALARS and not isinstance(value, str):
        wrong = f"{key} must be a string"
    elif key in _PROFILE_COUNTS and (not whole(value) or not 1 <= value <= MAX_PROFILE_INT):
        wrong = f"{key} must be a whole number from 1 to {MAX_PROFILE_INT}"
    elif key == "coefficients" and not (isinstance(value, dict) and all(
            k in FEATURES and number(v) and v >= 0 for k, v in value.items())):
        wrong = f"coefficients must map features ({', '.join(FEATURES)}) to numbers >= 0"
    elif key == "fit" and not (isinstance(value, dict) and all(
            isinstance(k, str) and number(v) for k, v in value.items())):
        wrong = "fit must map names to numbers"
    elif key == "calibration" and not (isinstance(value, dict) and all(
            isinstance(k, str) and (v is None or isinstance(v, str | bool) or number(v))
            for k, v in value.items())):
        wrong = "calibration must map knobs to their values (strings, numbers, true/false, null)"
    elif key == "noise" and not (isinstance(value, dict) and "ratios" in value
                                 and set(value) <= {"ratios", "block"}):
        wrong = "noise must be a mapping with `ratios` (and optionally `block`)"
    elif key == "noise" and not (isinstance(value["ratios"], list) and value["ratios"] and all(
            number(v) and v > 0 for v in value["ratios"])):
        wrong = "noise.ratios must be a non-empty list of numbers > 0"
    elif key == "noise" and "block" in value and not (
            whole(value["block"]) and 1 <= value["block"] <= MAX_PROFILE_INT):
        wrong = f"noise.block must be a whole number from 1 to {MAX_PROFILE_INT}"
    elif key == "wake" and not (
            isinstance(value, dict) and set(value) == {"idle_s", "extra_s"}
            and number(value["idle_s"]) and value["idle_s"] > 0
            and isinstance(value["extra_s"], list) and 1 <= len(value["extra_s"]) <= MAX_WAKE_STEPS
            and all(number(v) and v >= 0 for v in value["extra_s"])):
        wrong = (f"wake must be a mapping of `idle_s` (seconds > 0) and `extra_s` (1 to "
                 f"{MAX_WAKE_STEPS} numbers >= 0)")
    else:
        return
    raise bad_request(wrong, key)


@dataclass(frozen=True)
class SimProfiles:
    """The sim profiles a gateway holds, by name: `folder/NAME.yaml` (jobs.dir/sim-profiles),
    uploaded or put there by hand. Every method does file I/O: call it in a thread."""

    folder: Path

    def path(self, name: str) -> Path:
        return (self.folder / f"{name}.yaml").absolute()

    def load(self, name: str) -> SimProfile:
        """NotHeld unless `name` names a held profile; ValueError when its file is no profile."""
        if not is_profile_name(name):
            raise NotHeld(str(name)[:40])
        try:
            data = read_regular_file(self.path(name), MAX_PROFILE_BYTES)
            # named by its file's name: the gateway's folders are not the client's business
            return SimProfile.from_dict(load_yaml(f"{name}.yaml", text=data))
        except NotHeld:
            raise NotHeld(name) from None
        except (ValueError, TypeError) as exc:  # YamlError, UnicodeDecodeError: ValueErrors
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ValueError(f"{name!r} is not a valid profile: {reason}") from None

    def resolve(self, names: Iterable[str]) -> dict[str, Path]:
        """Each name's file, once it is read and loads as a profile (NotHeld, ValueError)."""
        paths = {}
        for name in names:
            self.load(name)
            paths[name] = self.path(name)
        return paths

    def names(self) -> list[str]:
        try:
            entries = list(os.scandir(self.folder))
        except OSError:  # no folder yet: none uploaded
            return []
        return sorted(e.name.removesuffix(".yaml") for e in entries
                      if e.name.endswith(".yaml") and e.is_file(follow_symlinks=False)
                      and is_profile_name(e.name.removesuffix(".yaml")))

    def describe(self) -> list[dict[str, Any]]:
        """Each held profile: what was measured and its fit, or why it cannot be used."""
        out: list[dict[str, Any]] = []
        for name in self.names():
            try:
                out.append(profile_summary(name, self.load(name)))
            except NotHeld:
                continue  # gone, or replaced by something that is no file, meanwhile
            except ValueError as exc:
                out.append({"name": name, "error": str(exc)})
        return out

    def put(self, name: str, profile: SimProfile) -> bool:
        """Keep `profile` as `name` (0600, written whole: a reader never sees half of one);
        whether it replaced one."""
        assert is_profile_name(name), name
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        existed = name in self.names()
        fd, tmp = tempfile.mkstemp(prefix=f".{name}.", dir=self.folder)  # 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(profile_text(profile))
            os.replace(tmp, self.path(name))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return existed


def profile_summary(name: str, profile: SimProfile) -> dict[str, Any]:
    return {"name": name, "model": profile.model, "device": profile.device,
            "dtype": profile.dtype, "max_position": profile.max_position,
            "kv_tokens": profile.kv_tokens, "fit": dict(profile.fit),
            "noise": None if profile.noise is None else profile.noise.summary(),
            "wake": None if profile.wake is None else profile.wake.to_dict()}


# ---- the manager --------------------------------------------------------------------------------
@dataclass
class _Running:
    process: asyncio.subprocess.Process
    cancelled: bool = False


class JobManager:
    """Queues, runs, cancels and resumes jobs; describes them from their rows and studies."""

    def __init__(self, store: JobStore, storage: str, folder: Path, max_running: int,
                 admin_key: str | None, capture_window: Callable[..., Any] | None) -> None:
        self.store = store
        self.storage = storage
        self.folder = folder
        self.max_running = max_running
        self.admin_key = admin_key
        self.capture_window = capture_window
        self.running: dict[str, _Running] = {}
        self.gateway_url: str | None = None  # this gateway's own address (shadow jobs call it)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._waiters: set[asyncio.Task[None]] = set()
        self._optuna: Any = None
        self._optuna_opening = threading.Lock()  # views run in threads: one storage for all
        self.applying: asyncio.Task[dict[str, Any]] | None = None
        self._apply_lock = asyncio.Lock()
        self.launching: set[str] = set()  # jobs between `running` and their worker's start
        self.owner = f"{socket.gethostname()}:{os.getpid()}"  # this gateway, in the rows
        self.pool: Any = None  # the gateway's backends (an apply's replicas, drained there)
        self.shadows: Any = None  # the gateway's shadow targets (a shadow job's engine)
        self.served = ServedWindow()  # what an apply's canary is judged on (control/app.py)
        self.profiles = SimProfiles(folder / PROFILE_FOLDER)  # what `set.sim_profile` names

    async def start(self) -> None:
        await self._interrupt_orphans()
        await self._recover_applies()
        self._task = asyncio.create_task(self._scheduler(), name="tune jobs")

    def _gone(self, job: JobRecord) -> bool:
        """Whether the gateway that ran `job` is gone: one on this host whose process is dead
        (or is this one, restarted), or any whose lease ran out."""
        if job.owner is None or job.updated_at < time.time() - 3 * LEASE_S:
            return True
        host, _, pid = job.owner.rpartition(":")
        if job.owner == self.owner:
            return job.id not in self.running and job.id not in self.launching
        if host != socket.gethostname() or not pid.isdigit():
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    async def _interrupt_orphans(self) -> None:
        moved = await self.store.interrupt_orphans(
            self._gone, "the gateway stopped while this job ran (its worker stopped with it): "
            "resume it to finish the study")
        for job_id in moved:
            log.warning("tune job %s was running when its gateway stopped: now interrupted "
                        "(POST /admin/tune-jobs/%s/resume finishes it)", job_id, job_id)

    async def _recover_applies(self) -> None:
        """An apply cut short by a gateway that died: every replica it switched goes back."""
        for job in await self.store.jobs(["succeeded"]):
            record = job.apply
            if not record or record.get("state") in APPLY_ENDED:
                continue
            previous = record.get("previous") or {}
            steps = list(record.get("steps") or [])
            state = "rolled_back"
            for backend in reversed(record.get("switched") or []):
                try:
                    await reconfigure(backend, previous.get(backend) or {},
                                      drain_timeout=DRAIN_TIMEOUT_S,
                                      admin_key=self.engine_keys(backend).admin_key)
                    steps.append({"at": time.time(), "step": f"after a gateway restart: put "
                                  f"{backend} back on its knobs"})
                except (OSError, ValueError) as exc:
                    state = "failed"
                    steps.append({"at": time.time(), "step": f"after a gateway restart: could "
                                  f"not put {backend} back ({exc}): do it by hand with POST "
                                  f"{backend}/admin/reconfigure "
                                  f"{json.dumps({'changes': previous.get(backend)})}"})
            steps.append({"at": time.time(), "step": "the gateway stopped during this apply; "
                          + ("every replica runs its previous knobs" if state == "rolled_back"
                             else "a replica may still run the new knobs")})
            await self.store.update(job.id, apply={**record, "state": state, "switched": [],
                                                   "steps": steps})
            log.warning("tune job %s: an apply cut short by a restart was rolled back (%s)",
                        job.id, state)

    async def close(self) -> None:
        """The gateway stops: running jobs' workers are stopped and their jobs interrupted
        (what a killed gateway's next start finds too)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for task in list(self._waiters):
            task.cancel()
        if self.applying is not None and not self.applying.done():
            self.applying.cancel()  # it rolls the canary back first
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.applying
        for job_id, run in list(self.running.items()):
            with contextlib.suppress(ProcessLookupError):
                run.process.kill()
            await run.process.wait()
            with contextlib.suppress(Exception):  # the database may be gone: start() does it
                await self.store.transition(
                    job_id, ["running"], "interrupted", owner=None,
                    error="the gateway stopped while this job ran: resume it to finish the study")
        self.running.clear()

    # ---- requests ---------------------------------------------------------------------------
    async def submit(self, spec: JobSpec) -> JobRecord:
        """Queue a checked spec. Everything that can refuse it is asked before anything is
        made (no row, no folder); what was made is removed when a later step fails."""
        if spec.target is not None:
            busy = [j for j in await self.store.jobs(ACTIVE_STATES) if j.target == spec.target]
            if busy:
                raise ApiError(409, f"job {busy[0].id} is already tuning {spec.target}: cancel it "
                               "or wait for it (two jobs may not tune one engine at once)",
                               code="engine_busy", param="target")
        profiles = await self.profile_paths(spec.options)
        trace = None
        if spec.captured_minutes is not None:
            trace = await self._capture(spec.captured_minutes)
        job_id = "job-" + secrets.token_hex(6)
        out = (self.folder / job_id).absolute()  # the worker and a restarted gateway find it
        options = worker_options(spec.options, job_id, out, trace is not None, profiles)
        try:
            await asyncio.to_thread(_make_folder, out, options, trace)
            job = await self.store.create(job_id, spec.fields, spec.target, job_id, str(out),
                                          spec.options.trials)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, out, True)
            raise
        self._wake.set()
        return job

    async def profile_paths(self, options: TuneOptions) -> dict[str, Path]:
        """The file of each sim profile the options name, read and checked in a thread;
        ApiError 400 when one is not held (the same words whatever was given) or is no
        profile."""
        paths = {}
        for name, field in profile_names(options).items():
            try:
                paths.update(await asyncio.to_thread(self.profiles.resolve, [name]))
            except NotHeld:
                raise bad_request(NOT_HELD.format(field=field), field) from None
            except ValueError as exc:
                raise bad_request(f"{field}.sim_profile: {exc}", field) from None
        return paths

    async def _capture(self, minutes: float) -> str:
        """The capture's last `minutes` (fairgate JSONL); ApiError 400 when there is none."""
        if self.capture_window is None:
            raise ApiError(400, "captured_minutes needs the gateway's trace capture: set "
                           "gateway.capture.path", code="no_capture", param="captured_minutes")
        now = time.time()
        try:
            text: str = await self.capture_window(now - 60 * minutes, now, None)
        except OSError as exc:
            raise ApiError(503, f"cannot read the trace capture ({exc.strerror or exc}); try "
                           "again shortly", code="capture_unavailable", retry_after=5.0) from None
        if sum(1 for line in text.splitlines() if line and not line.startswith("#")) == 0:
            raise ApiError(400, f"the capture holds no request from the last {minutes:g} "
                           "minutes", code="empty_capture", param="captured_minutes")
        return text

    async def cancel(self, job_id: str) -> JobRecord:
        job = await self.get(job_id)
        if job.state == "queued" and await self.store.transition(
                job_id, ["queued"], "cancelled", finished_at=time.time()):
            return await self.get(job_id)
        while job_id in self.launching:  # its worker is starting: cancel that
            await asyncio.sleep(0.01)
        run = self.running.get(job_id)
        if job.state == "running" and run is None and job.owner != self.owner:
            raise ApiError(409, f"job {job_id} runs on another gateway ({job.owner}): cancel it "
                           "there", code="job_elsewhere")
        if run is None or run.process.returncode is not None:
            job = await self.get(job_id)
            raise ApiError(409, f"job {job_id} is {job.state}: only a queued or running job can "
                           "be cancelled", code="job_not_active")
        run.cancelled = True
        with contextlib.suppress(ProcessLookupError):
            run.process.terminate()
        try:
            await asyncio.wait_for(asyncio.shield(run.process.wait()), CANCEL_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                run.process.kill()
        while job_id in self.running:  # its waiter settles the row and the engine
            await asyncio.sleep(0.01)
        return await self.get(job_id)

    async def resume(self, job_id: str) -> JobRecord:
        job = await self.get(job_id)
        if job.target is not None:
            busy = [j for j in await self.store.jobs(ACTIVE_STATES)
                    if j.target == job.target and j.id != job_id]
            if busy:
                raise ApiError(409, f"job {busy[0].id} is tuning {job.target} now",
                               code="engine_busy")
        if not await self.store.transition(job_id, ["interrupted", "failed", "cancelled"],
                                           "queued", error=None, finished_at=None):
            raise ApiError(409, f"job {job_id} is {job.state}: only an interrupted, failed or "
                           "cancelled job can be resumed", code="job_not_resumable")
        self._wake.set()
        return await self.get(job_id)

    # ---- apply: canary, promote or roll back (control/canary.py) ------------------------------
    async def apply(self, job_id: str, body: Any, gateway: Any) -> dict[str, Any]:
        """Start applying the job's best config to `body["backend"]` as a canary; the apply's
        record (its steps appear in the job as they happen)."""
        options = _apply_options(body)
        async with self._apply_lock:  # checked and started as one: one canary at a time
            return await self._start_apply(job_id, options, gateway)

    async def _start_apply(self, job_id: str, options: dict[str, Any],
                           gateway: Any) -> dict[str, Any]:
        from control.canary import Apply, ApplyPlan, canary_weight

        job = await self.get(job_id)
        if job.state != "succeeded":
            raise ApiError(409, f"job {job_id} is {job.state}: only a succeeded job's best config "
                           "can be applied", code="job_not_succeeded")
        if self.applying is not None and not self.applying.done():
            raise ApiError(409, "another apply is in progress: one canary at a time",
                           code="apply_in_progress")
        config = await asyncio.to_thread(best_knobs, job)
        pool = gateway.pool
        tuning = [j for j in await self.store.jobs(ACTIVE_STATES)
                  if j.target is not None and pool.by_name(j.target) is not None]
        if tuning:
            raise ApiError(409, f"job {tuning[0].id} is tuning {tuning[0].target}, one of these "
                           "replicas: wait for it or cancel it", code="engine_busy")
        fairgate = [b.name for b in pool.backends if getattr(b, "fairgate", False)]
        canary = server_root(options["backend"]) if options["backend"].startswith(
            ("http://", "https://")) else options["backend"]
        if canary not in fairgate:
            raise bad_request(f"backend must be one of this gateway's fairgate engine backends "
                              f"({', '.join(fairgate) or 'none'}), got {options['backend']!r}",
                              "backend")
        previous = {}
        for name in fairgate:
            knobs = await engine_knobs(name, sorted(config), self.engine_keys(name).admin_key)
            if knobs is None:
                raise ApiError(503, f"{name} did not say its knobs (GET /admin/config): it is "
                               "needed to roll back", code="backend_unavailable",
                               retry_after=5.0)
            previous[name] = knobs
        replicas = pool.serves(pool.by_name(canary).model_name)
        plan = ApplyPlan(job_id, canary, [n for n in fairgate if n != canary], config, previous,
                         options["canary_window_s"], options["min_requests"],
                         options["max_wait_s"],
                         canary_weight(options["canary_weight"], len(replicas)))

        async def drain(name: str) -> None:
            pool.draining.add(name)
            backend = pool.by_name(name)
            deadline = time.monotonic() + DRAIN_TIMEOUT_S
            while backend is not None and backend.inflight and time.monotonic() < deadline:
                await asyncio.sleep(0.02)  # its streams finish; nothing new is sent

        def undrain(name: str) -> None:
            pool.draining.discard(name)
            gateway.dispatcher.pump()

        async def record(value: dict[str, Any]) -> None:
            await self.store.update(job_id, apply=value)

        async def switch(name: str, knobs: dict[str, Any]) -> dict[str, Any]:
            return await reconfigure(name, knobs, drain_timeout=DRAIN_TIMEOUT_S,
                                     admin_key=self.engine_keys(name).admin_key)

        def heard(backend: Any, verdict: Verdict) -> None:
            self.served.attempt(backend.name, verdict is Verdict.FAILED)

        run = Apply(plan, self.served, drain, undrain, switch, record,
                    limit_share=pool.limit_share)
        await record(run.record)
        pool.results.append(heard)  # every replica's attempts, while the apply runs
        self.applying = asyncio.create_task(run.run(), name=f"apply {job_id}")
        self.applying.add_done_callback(lambda _: pool.results.remove(heard))
        return run.record

    async def get(self, job_id: str) -> JobRecord:
        """The job `job_id`: ApiError 404 when there is none."""
        job = await self.store.get(job_id)
        if job is None:
            raise ApiError(404, f"no tune job {job_id!r}", code="job_not_found")
        return job

    # ---- running ----------------------------------------------------------------------------
    async def _scheduler(self) -> None:
        """Launch what can run when woken (a job queued or ended), and every LEASE_S renew this
        gateway's lease on its running jobs and take over those whose gateway is gone."""
        while True:
            await wait_event(self._wake, LEASE_S)
            self._wake.clear()
            try:
                await self.store.renew(list(self.running), self.owner)
                await self._interrupt_orphans()
                await self._launch_ready()
            except Exception:  # noqa: BLE001 - a database hiccup: try again on the next wake
                log.exception("tune jobs: scheduling failed")
                await asyncio.sleep(1.0)
                self._wake.set()

    async def _launch_ready(self) -> None:
        queued = await self.store.jobs(["queued"])
        busy = {j.target for j in await self.store.jobs(["running"]) if j.target is not None}
        busy |= self._applying_to()
        for job in queued:
            if len(self.running) + len(self.launching) >= self.max_running:
                return
            if job.target is not None and job.target in busy:
                continue
            self.launching.add(job.id)  # before any await: a cancel now waits for the worker
            try:
                if not await self.store.transition(job.id, ["queued"], "running",
                                                   started_at=job.started_at or time.time(),
                                                   runs=job.runs + 1, owner=self.owner):
                    continue  # cancelled meanwhile
                if job.target is not None:
                    busy.add(job.target)
                await self._launch(job)
            finally:
                self.launching.discard(job.id)

    def engine_keys(self, url: str) -> EngineKeys:
        """The keys of the engine at `url`: its backend's or shadow target's here."""
        backends = [getattr(b, "config", None) for b in getattr(self.pool, "backends", [])]
        shadows = [m.config for m in getattr(self.shadows, "mirrors", {}).values()]
        return keys_for(url, [*backends, *shadows], os.environ)

    def _applying_to(self) -> set[str]:
        """The replicas an apply in progress may reconfigure (no job tunes them meanwhile)."""
        if self.applying is None or self.applying.done() or self.pool is None:
            return set()
        return {b.name for b in self.pool.backends}

    async def _launch(self, job: JobRecord) -> None:
        out = Path(job.out_dir)
        argv = worker_argv(job, self.gateway_url)
        env = dict(os.environ, FAIRGATE_PARENT_PID=str(os.getpid()),  # dies with us
                   FAIRGATE_TUNE_STORAGE=self.storage)
        if self.admin_key is not None:
            env[ADMIN_KEY_ENV] = self.admin_key  # the same variable `fairgate serve` reads
        if job.target is not None:  # its engine's keys, as `fairgate tune` reads them
            env.update(self.engine_keys(job.target).environment())
        try:
            if not await asyncio.to_thread((out / SPEC_FILE).exists):  # queued before spec files
                paths = await asyncio.to_thread(self.profiles.resolve,
                                                profile_names(row_options(job)))
                await asyncio.to_thread(write_spec_file, record_options(job, paths),
                                        out / SPEC_FILE)
            if job.target is not None:
                await self._snapshot(job)
            logfile = await asyncio.to_thread(open, out / "worker.log", "ab")
            try:
                logfile.write(f"==== run {job.runs + 1}: fairgate {' '.join(argv)}\n".encode())
                logfile.flush()
                process = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "fairgate", *argv, stdin=asyncio.subprocess.DEVNULL,
                    stdout=logfile, stderr=logfile, env=env)
            finally:
                logfile.close()  # the child holds its own copy
        except (OSError, ValueError, NotHeld) as exc:  # ValueError: a row's spec or profile
            what = f"no sim profile {exc} is held" if isinstance(exc, NotHeld) else exc
            await self.store.transition(job.id, ["running"], "failed", error=f"the worker did "
                                        f"not start: {what}", finished_at=time.time())
            return
        self.running[job.id] = _Running(process)
        task = asyncio.create_task(self._wait(job, process), name=f"tune job {job.id}")
        self._waiters.add(task)
        task.add_done_callback(self._waiters.discard)

    async def _wait(self, job: JobRecord, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        run = self.running.get(job.id)
        try:
            if run is not None and run.cancelled:
                await self._restore(job)
                await self.store.transition(job.id, ["running"], "cancelled",
                                            finished_at=time.time(),
                                            error="cancelled: the running trial was stopped")
            elif code == 0:
                await self.store.transition(job.id, ["running"], "succeeded",
                                            finished_at=time.time(), error=None)
            elif code == 1 and NO_FEASIBLE in await self._log_tail(job):
                # the study ran; no trial met both SLOs (a crash exits 1 too: it says otherwise)
                await self.store.transition(job.id, ["running"], "succeeded",
                                            finished_at=time.time(),
                                            error="no trial met both SLOs: no best config")
            else:
                await self.store.transition(job.id, ["running"], "failed",
                                            finished_at=time.time(),
                                            error=await self._last_line(job, code))
        finally:
            self.running.pop(job.id, None)
            self._wake.set()

    async def _log_tail(self, job: JobRecord, lines: int = 5) -> str:
        def read() -> str:
            try:
                text = (Path(job.out_dir) / "worker.log").read_text(errors="replace")
            except OSError:
                return ""
            return "\n".join(text.splitlines()[-lines:])

        return await asyncio.to_thread(read)

    async def _last_line(self, job: JobRecord, code: int) -> str:
        def read() -> str:
            try:
                lines = (Path(job.out_dir) / "worker.log").read_text(errors="replace").splitlines()
            except OSError:
                lines = []
            said = [line for line in lines if line.strip() and not line.startswith("====")]
            return said[-1].strip() if said else ""

        how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
        line = await asyncio.to_thread(read)
        return f"the worker ended with {how}" + (f": {line}" if line else "")

    async def _snapshot(self, job: JobRecord) -> None:
        """The target engine's knobs before the job touches them (restored on cancel)."""
        path = Path(job.out_dir) / "engine-before.json"
        if await asyncio.to_thread(path.exists):
            return  # a resumed job: the first run's snapshot is the one to go back to
        knobs = await engine_knobs(job.target or "", job_knobs(job.spec),
                                   self.engine_keys(job.target or "").admin_key)
        if knobs is None:
            log.warning("tune job %s: %s did not say its knobs (GET /admin/config): a cancel "
                        "cannot put them back", job.id, job.target)
            return
        await asyncio.to_thread(path.write_text, json.dumps(knobs))

    async def _restore(self, job: JobRecord) -> None:
        if job.target is None:
            return
        path = Path(job.out_dir) / "engine-before.json"
        try:
            knobs = json.loads(await asyncio.to_thread(path.read_text))
        except (OSError, ValueError):
            return
        try:
            await reconfigure(job.target, knobs,
                              admin_key=self.engine_keys(job.target).admin_key)
        except (OSError, ValueError) as exc:
            log.error("tune job %s cancelled: could not put %s back on its knobs (%s); do it "
                      "with POST %s/admin/reconfigure %s", job.id, job.target, exc, job.target,
                      json.dumps({"changes": knobs}))

    # ---- what the API shows -----------------------------------------------------------------
    async def describe(self, job: JobRecord, detail: bool = True) -> dict[str, Any]:
        study = await asyncio.to_thread(self._study_view, job, detail)
        elapsed = None
        if job.started_at is not None:
            elapsed = (job.finished_at or time.time()) - job.started_at
        done, planned = study["done"], job.planned_trials
        left = None
        if elapsed and done and planned and job.state == "running":
            left = max(0.0, elapsed / done * (planned - done))
        base = f"/admin/tune-jobs/{job.id}"
        files = await asyncio.to_thread(
            lambda: [n for n in JOB_FILES if (Path(job.out_dir) / n).exists()])
        out: dict[str, Any] = {
            "id": job.id, "state": job.state, "spec": job.spec, "target": job.target,
            "study": job.study, "created_at": job.created_at, "started_at": job.started_at,
            "finished_at": job.finished_at, "runs": job.runs, "error": job.error,
            "worker_pid": run.process.pid if (run := self.running.get(job.id)) else None,
            "progress": {"trials_done": done, "trials_planned": planned,
                         "elapsed_s": elapsed, "estimate_left_s": left},
            "best": study["best"], "apply": job.apply,
            "links": {name: f"{base}/files/{name}" for name in files}}
        if detail:
            out["trials"] = study["trials"]
        return out

    def _study_view(self, job: JobRecord, detail: bool) -> dict[str, Any]:
        """The study's trials (a thread: Optuna's storage is synchronous)."""
        import optuna

        from tuner.outcome import TrialRow
        from tuner.study_lock import open_rdb_storage

        try:
            with self._optuna_opening:  # the worker may be creating the tables this moment
                if self._optuna is None:
                    optuna.logging.set_verbosity(optuna.logging.WARNING)
                    self._optuna = open_rdb_storage(self.storage, writer=False)
            study = optuna.load_study(study_name=job.study, storage=self._optuna)
            trials = study.get_trials(deepcopy=False)
        except KeyError:  # not created yet: the worker has not started
            return {"done": 0, "best": None, "trials": []}
        except (ValueError, SQLAlchemyError) as exc:  # ValueError: open_rdb_storage's
            raise ApiError(503, f"the studies' database is unavailable ({exc}); try again "
                           "shortly", code="database_unavailable",
                           retry_after=RETRY_AFTER_S) from None
        rows = [TrialRow.of(t) for t in trials]
        feasible = [r for r in rows if r.feasible and r.value is not None]
        best = max(feasible, key=lambda r: r.value or 0.0, default=None)
        return {"done": sum(1 for r in rows if r.state == "COMPLETE"),
                "best": None if best is None else _row(best),
                "trials": [_row(r) for r in rows] if detail else []}


def _row(row: Any) -> dict[str, Any]:
    return {"number": row.number, "state": row.state, "params": row.params,
            "value": row.value, "feasible": row.feasible, "infeasible": row.infeasible,
            "measures": row.measures, "baseline": row.baseline,
            "retried_from": row.retried_from}


def _number(fields: dict[str, Any], name: str, *, low: float = 0.0, integer: bool = False,
            high: float = math.inf) -> Any:
    value = fields.get(name)
    if value is None:
        return None
    kind = "a whole number" if integer else "a number"
    try:
        finite = not isinstance(value, bool) and isinstance(value, (int, float)) and \
            math.isfinite(value) and (not integer or float(value).is_integer())
    except OverflowError:  # an integer past a float's range
        finite = False
    if not finite:
        raise bad_request(f"{name} must be {kind}, got {str(value)[:40]}", name)
    if integer:
        least = math.ceil(low) if low > 0 else 0
        if not least <= value <= high:
            raise bad_request(f"{name} must be a whole number from {least} to {high:g}, got "
                              f"{value!r}", name)
    elif not low < value <= high:
        raise bad_request(f"{name} must be more than {low:g} and at most {high:g}, got "
                          f"{value!r}", name)
    fields[name] = int(value) if integer else float(value)  # as the worker's argv needs it
    return fields[name]


def _apply_options(body: Any) -> dict[str, Any]:
    """The apply body, checked; canary_weight None: the canary's default share (an even share
    of its model's replicas, at most MAX_CANARY_WEIGHT), known once the replicas are."""
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object {backend, canary_window_s, "
                          "min_requests, max_wait_s, canary_weight}", None)
    unknown = sorted(set(body) - {"backend", "canary_window_s", "min_requests", "max_wait_s",
                                  "canary_weight"})
    if unknown:
        raise bad_request(f"unknown field {unknown[0]!r}", unknown[0])
    backend = body.get("backend")
    if not isinstance(backend, str) or not backend:
        raise bad_request("backend is needed: the engine backend to apply the config to first",
                          "backend")
    window = _number(body, "canary_window_s", high=86400)
    window = DEFAULT_CANARY_WINDOW_S if window is None else window
    least = _number(body, "min_requests", low=0.5, integer=True, high=1_000_000)
    wait = _number(body, "max_wait_s", high=7 * 86400)
    return {"backend": backend, "canary_window_s": window,
            "min_requests": DEFAULT_MIN_REQUESTS if least is None else least,
            "max_wait_s": 5 * window if wait is None else max(wait, window),
            "canary_weight": _number(body, "canary_weight", high=MAX_CANARY_WEIGHT)}


def best_knobs(job: JobRecord) -> dict[str, Any]:
    """The knobs the job searched, as its best.yaml has them (a thread: file I/O)."""
    path = Path(job.out_dir) / "best.yaml"
    try:
        engine = (load_yaml(path) or {}).get("engine") or {}
    except (OSError, YamlError):
        raise ApiError(409, f"job {job.id} has no best config (no trial met both SLOs)",
                       code="no_best_config") from None
    knobs = {k: engine[k] for k in space_knobs(job.spec) if k in engine}
    if not knobs:
        raise ApiError(409, f"job {job.id}'s best.yaml holds none of its knobs",
                       code="no_best_config")
    return knobs


# ---- talking to an engine's admin API ------------------------------------------------------------
DEFAULT_SPACE_KNOBS = ("max_num_batched_tokens", "max_num_seqs", "max_model_len",
                       "memory_fraction")  # tuner.space.default_space's


def space_knobs(spec: dict[str, Any]) -> list[str]:
    """The knobs a job searches: its space's, or the default space's."""
    return sorted(spec.get("space") or DEFAULT_SPACE_KNOBS)


def job_knobs(spec: dict[str, Any]) -> list[str]:
    """The knobs a job may change on its engine: its space's and its `set`'s."""
    return sorted(set(space_knobs(spec)) | set(spec.get("set") or {}))


@dataclass(frozen=True)
class EngineKeys:
    """What a fairgate engine is sent: api_key on /v1/* and /load, admin_key on /admin/*."""

    api_key: str | None = None
    admin_key: str | None = None

    def environment(self) -> dict[str, str]:
        """As `fairgate tune` reads them ($FAIRGATE_ENGINE_KEY, $FAIRGATE_ENGINE_ADMIN_KEY)."""
        pairs = ((ENGINE_KEY_ENV, self.api_key), (ENGINE_ADMIN_KEY_ENV, self.admin_key))
        return {name: key for name, key in pairs if key is not None}


def keys_for(url: str, engines: Iterable[object], environ: Mapping[str, str]) -> EngineKeys:
    """The keys of the engine at `url`: those of the backend or shadow target there (a
    BackendConfig or ShadowConfig among `engines`), else the environment's, which a job's
    worker inherits."""
    root = server_root(url)
    for config in engines:
        if isinstance(config, BackendConfig | ShadowConfig) and config.base_url == root:
            return EngineKeys(config.api_key, config.effective_admin_key)
    api_key = environ.get(ENGINE_KEY_ENV) or None
    return EngineKeys(api_key, environ.get(ENGINE_ADMIN_KEY_ENV) or api_key)


async def engine_knobs(url: str, names: list[str], admin_key: str | None = None
                       ) -> dict[str, Any] | None:
    """The engine's `names` knobs now (GET /admin/config), None when it does not say."""
    from tuner.remote import request_json

    try:
        status, body = await asyncio.to_thread(request_json, f"{url}/admin/config", admin_key,
                                               timeout=10.0)
    except OSError:
        return None
    config = body.get("config") if status == 200 and isinstance(body, dict) else None
    if not isinstance(config, dict):
        return None
    return {k: config[k] for k in names if k in config}


async def reconfigure(url: str, knobs: dict[str, Any], drain_timeout: float | None = None,
                      admin_key: str | None = None) -> dict[str, Any]:
    """POST /admin/reconfigure; the engine's config after. ValueError when it refused."""
    from tuner.remote import error_text, request_json

    body: dict[str, Any] = {"changes": knobs}
    if drain_timeout is not None:
        body["drain_timeout"] = drain_timeout
    status, answer = await asyncio.to_thread(request_json, f"{url}/admin/reconfigure",
                                             admin_key, method="POST", body=body,
                                             timeout=600.0)
    if status != 200:
        raise ValueError(f"{url} refused the reconfigure ({status}): "
                         f"{error_text(answer, status)}")
    return dict(answer.get("config") or {})

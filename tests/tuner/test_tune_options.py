"""The one tune spec (tuner/options.py): the command line, a spec file and a job body go through
the same TuneOptions.from_mapping, to the same options, with the same defaults; a mistake is the
same message on each, the field named as that surface names it; the job body's JSON Schema
accepts exactly the values from_mapping does."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any

import jsonschema_rs
import pytest
import yaml

from fairgate.cli import build_parser, main
from fairgate.tune_cli import options_from_args, register
from tuner.options import (
    CLI,
    DEFAULT_TRIALS,
    FILE,
    JOB,
    JOB_OPTIONS,
    NEEDS,
    OPTIONS,
    Integer,
    Number,
    OptionError,
    Surface,
    TuneOptions,
    job_schema,
    settle_slos,
)

SIM = {"workload": "uniform", "rate": 10, "duration": 4}
SIM_ARGV = ["--workload", "uniform", "--rate", "10", "--duration", "4"]


def from_argv(*argv: str) -> TuneOptions:
    options, _ = options_from_args(build_parser(["tune"]).parse_args(["tune", *argv]))
    return options


def test_the_table_is_the_dataclass() -> None:
    """One row per TuneOptions field, in its order; each row's flag reaches its field."""
    assert [f.name for f in dataclasses.fields(TuneOptions)] == [o.name for o in OPTIONS]
    parser = argparse.ArgumentParser()
    register(parser)
    unset = vars(parser.parse_args([]))
    assert all(unset[o.dest or o.name] is None for o in OPTIONS)  # no second set of defaults
    assert DEFAULT_TRIALS == TuneOptions().trials == 30


# (a spec file's or a job body's mapping, the same on the command line)
SAME = [
    ({**SIM}, SIM_ARGV),
    ({**SIM, "trials": 12, "slo_ttft_p99_s": 0.5, "slo_itl_p99_s": 0.02},
     [*SIM_ARGV, "--trials", "12", "--slo-ttft-p99", "0.5", "--slo-itl-p99", "0.02"]),
    ({**SIM, "timeout_s": 60, "seed": 4, "objective": "capacity", "baseline": "vllm-grid"},
     [*SIM_ARGV, "--timeout", "60", "--seed", "4", "--objective", "capacity",
      "--baseline", "vllm-grid"]),
    ({**SIM, "robustness": 2, "robust_top": 5}, [*SIM_ARGV, "--robustness", "2",
                                                 "--robust-top", "5"]),
    ({**SIM, "holdout": 2, "holdout_top": 5, "start": 10, "window": 40, "tenant_slos": False},
     [*SIM_ARGV, "--holdout", "2", "--holdout-top", "5", "--start", "10", "--window", "40",
      "--no-tenant-slos"]),
    ({**SIM, "set": {"max_num_seqs": 8, "policy": "fcfs"}, "heartbeat_s": 3},
     [*SIM_ARGV, "--set", "max_num_seqs=8", "--set", "policy=fcfs", "--heartbeat", "3"]),
    ({"mode": "replay", "target": "http://127.0.0.1:9", **SIM, "apply": True},
     ["--mode", "replay", "--url", "http://127.0.0.1:9", *SIM_ARGV, "--apply"]),
    ({"mode": "shadow", "shadow": "cand", "gateway": "http://g:8080", "shadow_requests": 40,
      "shadow_window_s": 30, "recheck": 0},
     ["--mode", "shadow", "--shadow", "cand", "--gateway", "http://g:8080",
      "--shadow-requests", "40", "--shadow-window", "30", "--recheck", "0"]),
    ({"mode": "launch", "command": "serve --port {port}", "engine": "vllm", **SIM,
      "launch_timeout_s": 30, "workers": 2},
     ["--mode", "launch", "--command", "serve --port {port}", "--engine", "vllm", *SIM_ARGV,
      "--launch-timeout", "30", "--workers", "2"]),
]


@pytest.mark.parametrize(("mapping", "argv"), SAME)
def test_the_same_spec_through_every_surface(mapping: dict[str, Any], argv: list[str],
                                             tmp_path: Path) -> None:
    """Flags, a YAML file, a JSON file and (its fields) a job body: one TuneOptions."""
    options = TuneOptions.from_mapping(mapping)
    assert from_argv(*argv) == options
    for name, text in (("spec.yaml", yaml.safe_dump(mapping)), ("spec.json", json.dumps(mapping))):
        (tmp_path / name).write_text(text)
        assert from_argv("--spec", str(tmp_path / name)) == options
    job_fields = {o.name for o in JOB_OPTIONS} | {"robustness", "robust_top"}
    if set(mapping) <= job_fields:
        assert TuneOptions.from_mapping(mapping, JOB) == options
    # written back, it reads the same (defaults included); a job's body too
    assert TuneOptions.from_mapping(options.to_mapping()) == options
    if set(mapping) <= job_fields:
        assert TuneOptions.from_mapping(options.to_mapping(JOB), JOB) == options


def test_defaults_are_one_set() -> None:
    options = TuneOptions.from_mapping(SIM)
    assert options == from_argv(*SIM_ARGV) == TuneOptions.from_mapping(SIM, JOB)
    assert (options.mode, options.trials, options.objective, options.holdout_count,
            options.holdout_top, options.heartbeat_s, options.seed) == (
        "sim", 30, "goodput", 3, 3, 10, 0)
    assert TuneOptions.from_mapping({**SIM, "mode": "replay", "target": "http://e:1"}
                                    ).holdout_count == 0  # real time
    shadow = TuneOptions.from_mapping({"mode": "shadow", "shadow": "c", "gateway": "http://g"})
    assert (shadow.recheck_count, shadow.shadow_requests, shadow.shadow_window_s) == (
        3, 100, 300.0)
    assert TuneOptions.from_mapping({**SIM, "timeout_s": 5}).trials is None


def _as_fields(message: str) -> str:
    """A command-line message as a file's: each flag (with what it takes) as its field."""
    for option in OPTIONS:
        taking = rf" {option.metavar}\b" if option.metavar else ""
        for flag in (f for f in option.flags if f.startswith("--")):
            message = re.sub(rf"(?<![\w-]){flag}(?![\w-]){taking}", option.name, message)
            message = re.sub(rf"(?<![\w-]){flag}(?![\w-])", option.name, message)
    return message


# mappings with one mistake each, and the field it is
MISTAKES = [
    ({**SIM, "trials": 0}, "trials"),
    ({**SIM, "trials": 10**400}, "trials"),
    ({**SIM, "trials": 2.5}, "trials"),
    ({**SIM, "trials": True}, "trials"),
    ({**SIM, "trials": "30"}, "trials"),
    ({**SIM, "rate": -1}, "rate"),
    ({**SIM, "rate": math.inf}, "rate"),
    ({**SIM, "slo_ttft_p99_s": 0}, "slo_ttft_p99_s"),
    ({**SIM, "slo_tpot_p99_s": "fast"}, "slo_tpot_p99_s"),
    ({**SIM, "start": -1}, "start"),
    ({**SIM, "window": 0}, "window"),
    ({**SIM, "holdout": 17}, "holdout"),
    ({**SIM, "holdout_top": 0}, "holdout_top"),
    ({**SIM, "heartbeat_s": 0}, "heartbeat_s"),
    ({**SIM, "seed": -1}, "seed"),
    ({**SIM, "mode": "simm"}, "mode"),
    ({**SIM, "objective": "paretto"}, "objective"),
    ({**SIM, "baseline": "vllm"}, "baseline"),
    ({**SIM, "workload": "nope"}, "workload"),
    ({**SIM, "set": {"max_num_seq": 8}}, "set"),
    ({**SIM, "space": {"max_num_seqs": {"low": 64, "high": 8}}}, "space"),
    ({**SIM, "tenant_slos": "yes"}, "tenant_slos"),
    ({**SIM, "trials": 3, "timeout_s": 60}, "timeout_s"),
    ({**SIM, "target": "http://127.0.0.1:9"}, "target"),
    ({**SIM, "recheck": 2}, "recheck"),
    ({**SIM, "shadow_requests": 5}, "shadow_requests"),
    ({**SIM, "apply": True}, "apply"),
    ({"mode": "replay", **SIM}, "target"),
    ({"mode": "replay", "target": "localhost:9", **SIM}, "target"),
    ({"mode": "shadow", "shadow": "c", "gateway": "http://g", **SIM}, "workload"),
    ({"mode": "shadow", "shadow": "c", "gateway": "http://g", "holdout": 2}, "holdout"),
    ({"mode": "shadow", "shadow": "c", "gateway": "http://g", "objective": "pareto"},
     "objective"),
    ({"workload": "uniform", "trace": "t.csv"}, "trace"),
    ({"rate": 3}, "workload"),
]


@pytest.mark.parametrize(("mapping", "field"), MISTAKES)
def test_a_mistake_is_one_message_naming_the_field_as_its_surface_does(
        mapping: dict[str, Any], field: str) -> None:
    messages = {}
    for name, surface in (("cli", CLI), ("file", FILE), ("job", JOB)):
        if surface is JOB and (not set(mapping) <= {o.name for o in JOB_OPTIONS}
                               or field == "workload" and "workload" not in mapping):
            continue  # not a job's fields; a job's workload may be its captured traffic
        with pytest.raises(OptionError) as refused:
            TuneOptions.from_mapping(mapping, surface)
        assert refused.value.field == field, (name, str(refused.value))
        messages[name] = str(refused.value)
    cli_flag = next(o for o in OPTIONS if o.name == field).flag
    assert cli_flag in messages["cli"] and field in messages["file"], messages
    assert _as_fields(messages["cli"]) == messages["file"]
    if "job" in messages and field != "mode":  # a job has fewer modes
        assert messages["job"] == messages["file"]


def test_an_unknown_field_is_refused_with_a_guess() -> None:
    with pytest.raises(OptionError, match="unknown field 'trails'; did you mean trials?") as e:
        TuneOptions.from_mapping({**SIM, "trails": 3})
    assert e.value.field == "trails"
    for field in ("workers", "storage", "study", "out", "trace", "command", "config"):
        with pytest.raises(OptionError, match=f"unknown field '{field}'"):
            TuneOptions.from_mapping({**SIM, field: "x"}, JOB)  # not a job's to choose
    with pytest.raises(OptionError, match="give holdout or robustness, not both"):
        TuneOptions.from_mapping({**SIM, "holdout": 1, "robustness": 2})


def test_a_job_specs_unknown_field_lists_and_guesses_captured_minutes_too() -> None:
    """A job takes captured_minutes itself (control/jobs.py) before the table checks the rest:
    the refusal of an unknown field names it among a job's fields, and guesses it."""
    with pytest.raises(OptionError, match="did you mean captured_minutes?") as e:
        TuneOptions.from_mapping({**SIM, "captured_minute": 5}, JOB)
    listed = str(e.value).rsplit("(a job spec has: ", 1)[1].rstrip(")").split(", ")
    assert "captured_minutes" in listed and "trials" in listed
    with pytest.raises(OptionError) as e:
        TuneOptions.from_mapping({**SIM, "captured_minute": 5})  # a tune spec has none
    assert "captured_minutes" not in str(e.value)


def test_slos_in_any_combination_at_least_one() -> None:
    tenants = {"slo_ttft_p99_s": 0.3, "slo_itl_p99_s": 0.1}
    bare = TuneOptions.from_mapping(SIM)
    assert settle_slos(bare, tenants).slo.itl_s == 0.1
    given = TuneOptions.from_mapping({**SIM, "slo_tpot_p99_s": 0.05})
    settled = settle_slos(given, tenants)
    assert (settled.slo_ttft_p99_s, settled.slo_tpot_p99_s, settled.slo_itl_p99_s) == (
        0.3, 0.05, 0.1)
    assert not settled.tenant_slos and settle_slos(settled, {"slo_tpot_p99_s": 9}) == settled
    only = dataclasses.replace(given, tenant_slos=False)
    assert settle_slos(only, tenants).slo_ttft_p99_s is None
    with pytest.raises(OptionError, match="give at least one SLO") as refused:
        settle_slos(bare, {}, CLI)
    assert "--slo-ttft-p99 S, --slo-tpot-p99 S or --slo-itl-p99 S" in str(refused.value)
    with pytest.raises(OptionError, match="tenant_slos is off"):
        settle_slos(dataclasses.replace(bare, tenant_slos=False), tenants)


def test_a_spec_file_with_flags_on_top(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                       ) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**SIM, "trials": 4, "robustness": 1,
                                    "set": {"max_num_seqs": 8, "policy": "fcfs"},
                                    "space": {"max_num_seqs": {"low": 4, "high": 16}}}))
    options = from_argv("--spec", str(spec), "--trials", "6", "--holdout", "0",
                        "--set", "max_num_seqs=12")
    assert (options.trials, options.holdout) == (6, 0)
    assert options.set == {"max_num_seqs": 12, "policy": "fcfs"}
    assert options.space == {"max_num_seqs": {"low": 4, "high": 16}}
    # a mistake in the file names the file and its field; one on the command line, the flag
    spec.write_text(yaml.safe_dump({**SIM, "trials": 0}))
    with pytest.raises(OptionError, match=f"^--spec {spec}: trials must be a positive"):
        from_argv("--spec", str(spec))
    with pytest.raises(OptionError, match="^--rate must be"):
        from_argv("--spec", str(spec), "--trials", "2", "--rate", "0")
    (tmp_path / "slo.json").write_text(json.dumps({**SIM, "slo_itl_p99_s": 0.00001}))
    assert from_argv("--spec", str(tmp_path / "slo.json")).slo_itl_p99_s == 0.00001
    # end to end: a study from a spec file; its mistakes are one line and exit 2
    spec.write_text(yaml.safe_dump({**SIM, "trials": 2, "holdout": 0, "slo_ttft_p99_s": 0.5,
                                    "storage": f"sqlite:///{tmp_path / 'studies.db'}",
                                    "out": str(tmp_path / "out"), "study": "s"}))
    assert main(["tune", "--spec", str(spec)]) == 0
    assert (tmp_path / "out" / "best.yaml").exists()
    (tmp_path / "bad.yaml").write_text("trials: [1\n")
    assert main(["tune", "--spec", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"fairgate tune: error: {tmp_path / 'bad.yaml'}:2: invalid YAML")


# ---- a job body's schema says what from_mapping takes ----------------------------------------
def _base(option_name: str) -> dict[str, Any]:
    """A job body the option means something in."""
    modes = next(o for o in OPTIONS if o.name == option_name).modes
    if "sim" in modes:
        return {**SIM}
    if modes == ("replay",):
        return {"mode": "replay", "target": "http://e:1", **SIM}
    return {"mode": "shadow", "shadow": "cand"}


def _kind(option_name: str) -> Any:
    return next(o for o in OPTIONS if o.name == option_name).job_kind()


def _edges(option_name: str) -> list[Any]:
    kind = _kind(option_name)
    values: list[Any] = [None, "7", True, [], {}, 0, 1, 2.0, 2.5, -1, "", math.inf, math.nan,
                         10**400]
    if isinstance(kind, Integer):
        values += [kind.low - 1, kind.low, kind.high, kind.high + 1, 2**63]
    if isinstance(kind, Number):
        values += [kind.low, kind.low + 1e-9, kind.low - 1e-9, 1e300]
        if kind.high is not None:
            values += [kind.high, kind.high + 1e-6]
    values += [*getattr(kind, "choices", ()), "http://e:2", "ftp://e", ["http://e:2"],
               {"max_num_seqs": 8}, {"nope": 1}, {"max_num_seqs": {"low": 8, "high": 16}}]
    return values


def _accepted(body: dict[str, Any]) -> bool:
    try:
        TuneOptions.from_mapping(body, JOB)
    except OptionError:
        return False
    return True


# mode: the others need their own fields (a rule between fields no schema spells); a space's
# inner rules (low <= high, a knob's type) are the space parser's
EDGED = [o.name for o in JOB_OPTIONS if o.name not in ("mode", "space")]


@pytest.mark.parametrize("name", EDGED)
def test_each_job_fields_schema_is_what_from_mapping_takes(name: str) -> None:
    schema = job_schema()
    validator = jsonschema_rs.validator_for(schema)
    for value in _edges(name):
        body = {**_base(name), name: value}
        if value is None and name in {f for fields in NEEDS.values() for f in fields}:
            continue  # a mode's own field, absent: refused, though null is its default
        if isinstance(value, float) and not math.isfinite(value) or (
                value == 10**400 and isinstance(_kind(name), Number)):
            valid = False  # JSON Schema has no NaN, no infinity and no bound at a float's end
        else:
            valid = validator.is_valid(body)
        assert _accepted(body) == valid, (name, value)


def test_the_schema_holds_the_defaults_and_no_other_fields() -> None:
    schema = job_schema()
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == {o.name for o in JOB_OPTIONS} | {"robustness",
                                                                          "robust_top"}
    assert schema["properties"]["trials"]["default"] == DEFAULT_TRIALS
    assert schema["properties"]["mode"]["default"] == "sim"
    assert schema["properties"]["mode"]["anyOf"][0] == {"enum": ["sim", "replay", "shadow"]}
    validator = jsonschema_rs.validator_for(schema)
    assert not validator.is_valid({**SIM, "workers": 2})
    assert validator.is_valid({**SIM, "space": {"max_num_seqs": {"low": 8, "high": 16}}})
    assert not validator.is_valid({**SIM, "space": "space.yaml"})


def test_a_surface_names_given_flags_by_their_flag() -> None:
    surface: Surface = FILE.from_argv(["trials"])
    assert (surface.name("trials"), surface.name("rate")) == ("--trials", "rate")
    assert CLI.named("target") == "--url URL" and JOB.named("target") == "target"

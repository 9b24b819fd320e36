"""Every `fairgate` subcommand, given the mistakes new users make, exits 2 with one stderr line
that names the command and the offending thing (the file, the field, the value), never a
traceback; a refused `tenants import` leaves the database as it was.

Nothing here serves or measures: `serve`, `engine`'s server, a study and a calibration are
stand-ins that fail the test when a bad input gets that far. Each case is a command line with
{tmp} (this test's folder, which holds the files below), {db} (a SQLite URL there), {port} (a
closed port on 127.0.0.1) and {sim} (a fairgate.yaml whose engine is simulated)."""

from __future__ import annotations

import re
import shlex
import threading
from pathlib import Path
from typing import Any, NoReturn

import pytest
import yaml

from fairgate.cli import NESTED, main
from tests.support.processes import free_port

FILES = {
    "empty.yaml": "",
    "notyaml.yaml": "engine: [1,\n",
    "list.yaml": "- engine\n- gateway\n",
    "typo.yaml": "engine: {}\nenigne: {}\n",
    "seqs.yaml": "engine:\n  max_num_seqs: lots\n",
    "engine5.yaml": "engine: 5\n",
    "slo.yaml": "slo:\n  ttft_p99: 1\n",
    "gwport.yaml": "gateway:\n  port: abc\n",
    "backend.yaml": "gateway:\n  backends: [notaurl]\n",
    "dbint.yaml": "database: 5\n",
    "dbpath.yaml": "database: fairgate.db\n",
    "dbmysql.yaml": "database: mysql://u@h/db\n",
    "sim.yaml": "engine:\n  executor: sim\ngateway:\n  port: 0\n  metrics_port: null\n",
    "tenants-notyaml.yaml": "tenants: [\n",
    "tenants-list.yaml": "- name: acme\n",
    "tenants-dup.yaml": "tenants:\n  - name: zed\n  - name: zed\n",
    "tenants-limit.yaml": "tenants:\n  - name: zed\n    limits:\n      requests_per_min: -5\n",
    "tenants-field.yaml": "tenants:\n  - name: zed\n    wieght: 2\n",
    "trace.csv": "time,prompt,output\n1,2,3\n",
    "trace.jsonl": '{"bogus": 1}\n',
    "empty.jsonl": "",
    "spec.yaml": "mode: sim\n",
    "tenants.yaml": "tenants:\n  - name: zed\n",
    "spec-typo.yaml": "trails: 3\n",
    "spec-type.yaml": "trials: many\n",
    "spec-bad.json": '{"trials": 3,}',
    "space.yaml": "max_num_seqs: {low: 8}\n",
}
SEARCH = "--workload fixed --slo-ttft-p99 1 --trials 2"  # a valid `fairgate tune` study


@pytest.fixture
def places(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "adir").mkdir()
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # no ./fairgate.yaml, no default database here
    monkeypatch.delenv("FAIRGATE_TUNE_STORAGE", raising=False)
    for target in ("fairgate.serve_cli.serve", "fairgate.engine_cli.serve",
                   "fairgate.tune_cli.run_study", "tuner.calibrate.calibrate"):
        monkeypatch.setattr(target, got_too_far)
    return {"tmp": str(tmp_path), "db": f"sqlite:///{tmp_path / 't.db'}",
            "port": str(free_port()), "sim": str(tmp_path / "sim.yaml")}


def got_too_far(*args: Any, **kwargs: Any) -> NoReturn:
    raise AssertionError("the bad input was not refused: the command went on to serve or run")


# bench says its plan before it sends; an error found while sending is the line after it
PLAN = re.compile(r"fairgate bench: \d+ requests over ")


def run(argv: list[str]) -> tuple[int | str | None, list[threading.ExceptHookArgs]]:
    """main's exit status, and the exceptions of the threads it left behind (a real process
    prints them as tracebacks as it exits)."""
    failed: list[threading.ExceptHookArgs] = []
    hook, threading.excepthook = threading.excepthook, failed.append
    started = set(threading.enumerate())
    try:
        try:
            code: int | str | None = main(argv)
        except SystemExit as exc:
            code = exc.code
        for thread in set(threading.enumerate()) - started:
            thread.join(timeout=5)
    finally:
        threading.excepthook = hook
    return code, failed


def fails(capsys: pytest.CaptureFixture[str], template: str, places: dict[str, str],
          *names: str) -> str:
    """Run `fairgate TEMPLATE`; its one error line, checked to exit 2 and name `names` (a
    dashed name may be said with underscores: --max-tokens or max_tokens)."""
    argv = shlex.split(template.format(**places))
    code, failed = run(argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert not failed, f"a thread left running fails with a traceback: {failed[0].exc_value!r}"
    lines = [line for line in err.splitlines() if not PLAN.match(line)]
    assert code == 2 and len(lines) == 1, (code, err)
    command = " ".join(argv[:2]) if tuple(argv[:2]) in NESTED else argv[0]
    assert lines[0].startswith(f"fairgate {command}"), lines[0]
    for name in names:
        name = name.format(**places)
        assert name in lines[0] or name.replace("-", "_") in lines[0], (name, lines[0])
    return lines[0]


CONFIG_USERS = ["serve", "engine", "tenants list", "keys list", f"tune {SEARCH}",
                "tune calibrate"]
CONFIG_MISTAKES = [
    pytest.param("missing.yaml", ("{tmp}/missing.yaml", "not found"), id="missing"),
    pytest.param("adir", ("{tmp}/adir", "directory"), id="a-directory"),
    pytest.param("notyaml.yaml", ("{tmp}/notyaml.yaml:2", "invalid YAML"), id="not-yaml"),
    pytest.param("list.yaml", ("{tmp}/list.yaml", "mapping"), id="a-list"),
    pytest.param("typo.yaml", ("{tmp}/typo.yaml", "enigne"), id="unknown-section"),
    pytest.param("slo.yaml", ("{tmp}/slo.yaml", "'slo'"), id="section-that-lives-elsewhere"),
]


@pytest.mark.parametrize("config,names", CONFIG_MISTAKES)
@pytest.mark.parametrize("command", CONFIG_USERS)
def test_a_bad_config_file(command: str, config: str, names: tuple[str, ...],
                           places: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    fails(capsys, f"{command} -c {{tmp}}/{config}", places, *names)


DATABASE_USERS = ["tenants list", "tenants create zed", "tenants delete zed",
                  "tenants import {tmp}/tenants.yaml", "tenants export", "keys list",
                  "keys create zed", "keys revoke key_x"]


@pytest.mark.parametrize("command", DATABASE_USERS)
@pytest.mark.parametrize("url,names", [
    pytest.param("fairgate.db", ("'fairgate.db'",), id="a-path-not-a-url"),
    pytest.param("::::", ("'::::'",), id="malformed"),
    pytest.param("mysql://u@h/db", ("mysql",), id="unsupported-scheme"),
    pytest.param("sqlite+pysqlite:///t.db", ("pysqlite",), id="sync-driver"),
    pytest.param("postgresql://u@127.0.0.1:{port}/db", ("127.0.0.1:{port}",), id="unreachable"),
])
def test_a_bad_database_url(command: str, url: str, names: tuple[str, ...],
                            places: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    fails(capsys, f"{command} --database {url}", places, *names)


def test_a_sqlite_database_in_a_missing_folder(places: dict[str, str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    for command in DATABASE_USERS * 3:  # each run loses the race about half the time
        fails(capsys, f"{command} --database sqlite:///{{tmp}}/nodir/t.db", places,
              "{tmp}/nodir/t.db")
    assert not Path(places["tmp"], "nodir").exists()


@pytest.mark.parametrize("config,names", [
    pytest.param("dbint.yaml", ("database",), id="not-a-string"),
    pytest.param("dbpath.yaml", ("'fairgate.db'",), id="a-path-not-a-url"),
    pytest.param("dbmysql.yaml", ("mysql",), id="unsupported-scheme"),
])
@pytest.mark.parametrize("command", ["serve", "tenants list"])
def test_a_bad_database_in_the_config(command: str, config: str, names: tuple[str, ...],
                                      places: dict[str, str],
                                      capsys: pytest.CaptureFixture[str]) -> None:
    fails(capsys, f"{command} -c {{tmp}}/{config}", places, *names)


def test_an_empty_config_file_is_the_defaults(places: dict[str, str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tenants", "list", "-c", f"{places['tmp']}/empty.yaml",
                 "--database", places["db"]]) == 0, capsys.readouterr().err


CASES = [
    # serve
    pytest.param("serve -c {tmp}/seqs.yaml", ("max_num_seqs", "'lots'"), id="serve-wrong-type"),
    pytest.param("serve -c {tmp}/engine5.yaml", ("'engine'", "mapping"),
                 id="serve-section-not-mapping"),
    pytest.param("serve -c {tmp}/gwport.yaml", ("gateway.port", "'abc'"), id="serve-bad-port"),
    pytest.param("serve -c {tmp}/backend.yaml", ("backends", "'notaurl'"),
                 id="serve-backend-not-url"),
    pytest.param("serve --port abc", ("--port", "'abc'"), id="serve-port-not-int"),
    pytest.param("serve --log-level LOUD", ("--log-level", "'LOUD'"), id="serve-log-level"),
    pytest.param("serve --bogus", ("--bogus",), id="serve-unknown-flag"),
    *(pytest.param(f"serve -c {{sim}} --port {port}", ("--port", port), id=f"serve-port{port}")
      for port in ("70000", "-1")),
    # engine
    pytest.param("engine -c {tmp}/seqs.yaml", ("max_num_seqs", "'lots'"), id="engine-wrong-type"),
    pytest.param("engine -c {tmp}/engine5.yaml", ("'engine'", "mapping"),
                 id="engine-section-not-mapping"),
    pytest.param("engine --port 0", ("--port", "0"), id="engine-port0"),
    pytest.param("engine --port 70000", ("--port", "70000"), id="engine-port-too-big"),
    pytest.param("engine --max-num-seqs 0", ("--max-num-seqs", "0"), id="engine-seqs0"),
    pytest.param("engine --max-num-seqs -3", ("--max-num-seqs", "-3"), id="engine-seqs-neg"),
    pytest.param("engine --gpu-memory-utilization 2", ("--gpu-memory-utilization", "2"),
                 id="engine-memory-fraction"),
    pytest.param("engine --set max_num_seqs=0", ("max_num_seqs", "0"), id="engine-set-zero"),
    pytest.param("engine --set max_num_seqs=[", ("max_num_seqs", "'['"), id="engine-set-not-yaml"),
    pytest.param("engine --set bogus_knob=1", ("bogus_knob",), id="engine-set-unknown"),
    pytest.param("engine --set max_num_seqs", ("--set", "'max_num_seqs'"),
                 id="engine-set-no-value"),
    pytest.param("engine {tmp}/nomodel", ("{tmp}/nomodel",), id="engine-missing-model"),
    pytest.param("engine --model random:nosuch", ("'nosuch'",), id="engine-unknown-preset"),
    pytest.param("engine --api-key 'fg key'", ("--api-key",), id="engine-api-key-space"),
    pytest.param("engine --host 0.0.0.0", ("--host 0.0.0.0", "--allow-unauthenticated"),
                 id="engine-open-host"),
    pytest.param("engine --no-such-flag", ("--no-such-flag",), id="engine-unknown-flag"),
    # bench
    pytest.param("bench --url http://127.0.0.1:{port} --workload nosuch", ("'nosuch'",),
                 id="bench-unknown-workload"),
    pytest.param("bench --url notaurl --workload fixed", ("--url", "'notaurl'"),
                 id="bench-url-not-url"),
    pytest.param("bench --url localhost:8000 --workload fixed", ("--url", "'localhost:8000'"),
                 id="bench-url-no-scheme"),
    pytest.param("bench --url http://127.0.0.1:{port} --workload fixed --num-requests 1",
                 ("cannot reach", "http://127.0.0.1:{port}"), id="bench-unreachable"),
    pytest.param("bench --workload fixed", ("--url",), id="bench-no-url"),
    pytest.param("bench --url http://127.0.0.1:{port}", ("--workload",), id="bench-no-workload"),
    pytest.param("bench --url http://127.0.0.1:{port} --trace {tmp}/missing.jsonl",
                 ("{tmp}/missing.jsonl",), id="bench-trace-missing"),
    pytest.param("bench --url http://127.0.0.1:{port} --trace {tmp}/adir", ("{tmp}/adir",),
                 id="bench-trace-directory"),
    pytest.param("bench --url http://127.0.0.1:{port} --trace {tmp}/trace.csv",
                 ("{tmp}/trace.csv:1", "TIMESTAMP"), id="bench-trace-wrong-csv"),
    pytest.param("bench --url http://127.0.0.1:{port} --trace {tmp}/trace.jsonl",
                 ("{tmp}/trace.jsonl:1", "format"), id="bench-trace-unknown-format"),
    pytest.param("bench --url http://127.0.0.1:{port} --trace {tmp}/trace.jsonl "
                 "--trace-format mooncake", ("{tmp}/trace.jsonl:1", "timestamp"),
                 id="bench-trace-wrong-format"),
    pytest.param("bench --url http://127.0.0.1:{port} --trace {tmp}/empty.jsonl",
                 ("{tmp}/empty.jsonl",), id="bench-trace-empty"),
    pytest.param("bench --url http://127.0.0.1:{port} --trace {tmp}/empty.jsonl "
                 "--trace-format fairgate", ("{tmp}/empty.jsonl", "no requests"),
                 id="bench-trace-empty-fairgate"),
    pytest.param("bench --url http://127.0.0.1:{port} --workload-file {tmp}/missing.yaml",
                 ("{tmp}/missing.yaml",), id="bench-workload-file-missing"),
    pytest.param("bench --url http://127.0.0.1:{port} --workload-file {tmp}/notyaml.yaml",
                 ("{tmp}/notyaml.yaml:2",), id="bench-workload-file-not-yaml"),
    pytest.param("bench --url http://127.0.0.1:{port} --workload-file {tmp}/list.yaml",
                 ("{tmp}/list.yaml", "tenants"), id="bench-workload-file-list"),
    pytest.param("bench --url http://127.0.0.1:{port} --workload fixed --rate 0",
                 ("rate", "0"), id="bench-rate0"),
    pytest.param("bench --url http://127.0.0.1:{port} --workload fixed --rate -1",
                 ("rate", "-1"), id="bench-rate-neg"),
    pytest.param("bench --url http://127.0.0.1:{port} --workload fixed --max-concurrency 0",
                 ("max-concurrency", "0"), id="bench-concurrency0"),
    pytest.param("bench --url http://127.0.0.1:{port} --workload fixed --speed 0",
                 ("speed", "0"), id="bench-speed0"),
    pytest.param("bench --url http://127.0.0.1:{port} --workload fixed --num-requests 1 "
                 "--save-trace {tmp}/nodir/x.jsonl", ("{tmp}/nodir/x.jsonl",),
                 id="bench-save-trace-missing-folder"),
    *(pytest.param(f"bench --url http://127.0.0.1:{{port}} --workload fixed {flag} {value}",
                   (flag.lstrip("-"), value), id=f"bench{flag}{value}")
      for flag, value in (("--duration", "-5"), ("--num-requests", "-1"))),
    *(pytest.param(f"bench --url http://127.0.0.1:{{port}} --workload fixed --num-requests 1 "
                   f"{flag} {value}", (flag.lstrip("-"), value), id=f"bench{flag}{value}")
      for flag, value in (("--scale-tokens", "0"), ("--max-prompt-tokens", "0"),
                          ("--request-timeout", "0"), ("--slo-ttft", "-1"))),
    *(pytest.param(f"bench --url http://127.0.0.1:{{port}} --workload fixed --num-requests 1 "
                   f"{flag} {{tmp}}/nodir/x", ("{tmp}/nodir/x",), id=f"bench{flag}-missing-folder")
      for flag in ("--json", "--csv")),
    *(pytest.param(f"bench --url {url} --workload fixed --num-requests 1", ("--url",),
                   id=f"bench-url-{name}")
      for name, url in (("no-host", "http://"), ("unparsable", "http://[::1"))),
    # tune
    pytest.param("tune --workload fixed", ("--slo-ttft-p99",), id="tune-no-slo"),
    pytest.param("tune --workload nosuch --slo-ttft-p99 1", ("--workload", "'nosuch'"),
                 id="tune-unknown-workload"),
    pytest.param("tune --trace {tmp}/missing.jsonl --slo-ttft-p99 1", ("{tmp}/missing.jsonl",),
                 id="tune-trace-missing"),
    pytest.param("tune --trace {tmp}/trace.csv --slo-ttft-p99 1", ("{tmp}/trace.csv:1",),
                 id="tune-trace-wrong-format"),
    pytest.param("tune --trace {tmp}/empty.jsonl --slo-ttft-p99 1", ("{tmp}/empty.jsonl",),
                 id="tune-trace-empty"),
    pytest.param("tune --workload-file {tmp}/missing.yaml --slo-ttft-p99 1",
                 ("{tmp}/missing.yaml",), id="tune-workload-file-missing"),
    pytest.param("tune --workload fixed --trace {tmp}/trace.csv --slo-ttft-p99 1",
                 ("--workload", "--trace"), id="tune-two-workloads"),
    pytest.param("tune --workload fixed --slo-ttft-p99 1 --trials 0", ("--trials", "0"),
                 id="tune-trials0"),
    pytest.param("tune --workload fixed --slo-ttft-p99 1 --trials -3", ("--trials", "-3"),
                 id="tune-trials-neg"),
    pytest.param("tune --workload fixed --slo-ttft-p99 0", ("--slo-ttft-p99", "0"),
                 id="tune-slo0"),
    pytest.param("tune --workload fixed --slo-ttft-p99 -1", ("--slo-ttft-p99", "-1"),
                 id="tune-slo-neg"),
    pytest.param(f"tune {SEARCH} --rate 0", ("--rate", "0"), id="tune-rate0"),
    pytest.param(f"tune {SEARCH} --duration -5", ("--duration", "-5"), id="tune-duration-neg"),
    pytest.param(f"tune {SEARCH} --workers 0", ("--workers", "0"), id="tune-workers0"),
    pytest.param("tune --workload fixed --slo-ttft-p99 1 --timeout 0", ("--timeout", "0"),
                 id="tune-timeout0"),
    pytest.param(f"tune {SEARCH} -c {{tmp}}/seqs.yaml", ("max_num_seqs", "'lots'"),
                 id="tune-config-wrong-type"),
    pytest.param(f"tune {SEARCH} --set max_num_seqs=0", ("max_num_seqs", "0"),
                 id="tune-set-zero"),
    pytest.param(f"tune {SEARCH} --set bogus_knob=1", ("bogus_knob",), id="tune-set-unknown"),
    pytest.param(f"tune {SEARCH} --set nope", ("--set", "'nope'"), id="tune-set-no-value"),
    pytest.param(f"tune {SEARCH} --space {{tmp}}/missing.yaml", ("{tmp}/missing.yaml",),
                 id="tune-space-missing"),
    pytest.param(f"tune {SEARCH} --space {{tmp}}/space.yaml", ("{tmp}/space.yaml",
                                                                 "max_num_seqs"),
                 id="tune-space-bad"),
    pytest.param(f"tune {SEARCH} --sim-profile {{tmp}}/missing.yaml", ("{tmp}/missing.yaml",),
                 id="tune-sim-profile-missing"),
    pytest.param(f"tune {SEARCH} --out {{tmp}}/spec.yaml/x", ("--out", "{tmp}/spec.yaml"),
                 id="tune-out-under-a-file"),
    pytest.param("tune --spec {tmp}/missing.yaml", ("--spec", "{tmp}/missing.yaml"),
                 id="tune-spec-missing"),
    pytest.param("tune --spec {tmp}/adir", ("--spec", "{tmp}/adir"), id="tune-spec-directory"),
    pytest.param("tune --spec {tmp}/notyaml.yaml", ("{tmp}/notyaml.yaml:2",),
                 id="tune-spec-not-yaml"),
    pytest.param("tune --spec {tmp}/spec-bad.json", ("--spec", "{tmp}/spec-bad.json", "JSON"),
                 id="tune-spec-not-json"),
    pytest.param("tune --spec {tmp}/list.yaml", ("--spec", "{tmp}/list.yaml"),
                 id="tune-spec-list"),
    pytest.param("tune --spec {tmp}/spec-typo.yaml", ("{tmp}/spec-typo.yaml", "'trails'"),
                 id="tune-spec-unknown-field"),
    pytest.param("tune --spec {tmp}/spec-type.yaml", ("{tmp}/spec-type.yaml", "trials",
                                                      "'many'"), id="tune-spec-wrong-type"),
    pytest.param(f"tune --mode bogus {SEARCH}", ("--mode", "'bogus'"), id="tune-mode-unknown"),
    pytest.param(f"tune --mode replay {SEARCH}", ("--mode replay", "--url"),
                 id="tune-replay-no-url"),
    pytest.param(f"tune --mode replay --url notaurl {SEARCH}", ("--url", "'notaurl'"),
                 id="tune-replay-url-not-url"),
    pytest.param(f"tune --mode replay --url http://127.0.0.1:{{port}} {SEARCH}",
                 ("cannot reach", "--url http://127.0.0.1:{port}"), id="tune-replay-unreachable"),
    pytest.param("tune --mode shadow --gateway http://127.0.0.1:{port} --shadow s --admin-key k "
                 "--slo-ttft-p99 1", ("cannot reach", "--gateway http://127.0.0.1:{port}"),
                 id="tune-shadow-unreachable"),
    pytest.param("tune --mode shadow --gateway notaurl --shadow s --admin-key k "
                 "--slo-ttft-p99 1", ("--gateway", "'notaurl'"), id="tune-shadow-gateway-not-url"),
    pytest.param(f"tune {SEARCH} -c {{tmp}}/dbpath.yaml", ("'fairgate.db'",),
                 id="tune-config-database-not-url"),
    # tune calibrate
    pytest.param("tune calibrate -c {tmp}/seqs.yaml", ("max_num_seqs", "'lots'"),
                 id="calibrate-wrong-type"),
    pytest.param("tune calibrate --set executor=sim", ("executor", "torch"),
                 id="calibrate-not-torch"),
    pytest.param("tune calibrate --repeats 0", ("--repeats", "0"), id="calibrate-repeats0"),
    pytest.param("tune calibrate --repeats -1", ("--repeats", "-1"), id="calibrate-repeats-neg"),
    pytest.param("tune calibrate --repeats abc", ("--repeats", "'abc'"),
                 id="calibrate-repeats-not-int"),
    pytest.param("tune calibrate --max-phase-tokens 0", ("--max-phase-tokens", "0"),
                 id="calibrate-phase0"),
    pytest.param("tune calibrate --set nope", ("--set", "'nope'"), id="calibrate-set-no-value"),
    pytest.param("tune calibrate --out {tmp}/nodir/p.yaml", ("--out", "{tmp}/nodir"),
                 id="calibrate-out-missing-folder"),
    pytest.param("tune calibrate --out {tmp}/adir", ("--out", "{tmp}/adir"),
                 id="calibrate-out-a-directory"),
    # jobs
    *(pytest.param(f"jobs {action} --gateway http://127.0.0.1:{{port}}",
                   ("cannot reach", "--gateway http://127.0.0.1:{port}"),
                   id=f"jobs-{action.split()[0]}-no-gateway")
      for action in ("list", "show j1", "cancel j1", "resume j1",
                     "apply j1 --backend http://127.0.0.1:1", "create --spec {tmp}/spec.yaml")),
    pytest.param("jobs list --gateway notaurl", ("--gateway", "'notaurl'"),
                 id="jobs-gateway-not-url"),
    pytest.param("jobs create --spec {tmp}/missing.yaml --gateway http://127.0.0.1:{port}",
                 ("--spec", "{tmp}/missing.yaml"), id="jobs-spec-missing"),
    pytest.param("jobs create --spec {tmp}/adir --gateway http://127.0.0.1:{port}",
                 ("--spec", "{tmp}/adir"), id="jobs-spec-directory"),
    pytest.param("jobs create --spec {tmp}/notyaml.yaml --gateway http://127.0.0.1:{port}",
                 ("{tmp}/notyaml.yaml:2",), id="jobs-spec-not-yaml"),
    pytest.param("jobs create --spec {tmp}/spec-bad.json --gateway http://127.0.0.1:{port}",
                 ("{tmp}/spec-bad.json", "JSON"), id="jobs-spec-not-json"),
    pytest.param("jobs create --spec {tmp}/list.yaml --gateway http://127.0.0.1:{port}",
                 ("{tmp}/list.yaml",), id="jobs-spec-list"),
    pytest.param("jobs create --gateway http://127.0.0.1:{port}", ("--spec",),
                 id="jobs-create-no-spec"),
    pytest.param("jobs show --gateway http://127.0.0.1:{port}", ("ID",), id="jobs-show-no-id"),
    *(pytest.param(command, ("choose an action",), id=f"{command}-no-action")
      for command in ("tenants", "keys", "jobs")),
]


@pytest.mark.parametrize("template,names", CASES)
def test_a_bad_input(template: str, names: tuple[str, ...], places: dict[str, str],
                     capsys: pytest.CaptureFixture[str]) -> None:
    fails(capsys, template, places, *names)


@pytest.mark.parametrize("storage,names", [
    pytest.param("not-a-url", ("--storage", "'not-a-url'"), id="malformed"),
    pytest.param("sqlite:///{tmp}/nodir/s.db", ("--storage", "{tmp}/nodir/s.db"),
                 id="sqlite-missing-folder"),
    pytest.param("mysql://u@h/db", ("--storage", "mysql://u@h/db"), id="unsupported-scheme"),
])
def test_a_bad_tune_storage(storage: str, names: tuple[str, ...], places: dict[str, str],
                            capsys: pytest.CaptureFixture[str],
                            monkeypatch: pytest.MonkeyPatch) -> None:
    import tuner.study

    def opened_or_refused(spec: Any) -> NoReturn:
        real_open_storage(spec)
        raise AssertionError("the storage opened: the bad --storage was not refused")

    real_open_storage = tuner.study.open_storage
    monkeypatch.setattr("fairgate.tune_cli.run_study", tuner.study.run_study)
    monkeypatch.setattr(tuner.study, "open_storage", opened_or_refused)
    fails(capsys, f"tune {SEARCH} --holdout 0 --storage {storage} --out {{tmp}}/out",
          places, *names)
    assert not Path(places["tmp"], "out").exists()


# ---- tenants and keys, against a database that holds acme and its key ----------------------

@pytest.fixture
def seeded(places: dict[str, str], capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    for argv in (["tenants", "create", "acme", "--key"], ["tenants", "create", "bob"]):
        assert main([*argv, "--database", places["db"]]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return places


TENANT_CASES = [
    pytest.param("tenants create acme", ("'acme'", "exists"), id="create-duplicate"),
    pytest.param("tenants create bad/name", ("'bad/name'",), id="create-bad-name"),
    pytest.param("tenants create zed --weight 0", ("weight", "0"), id="create-weight0"),
    pytest.param("tenants create zed --weight -1", ("weight", "-1"), id="create-weight-neg"),
    pytest.param("tenants create zed --weight abc", ("--weight", "'abc'"),
                 id="create-weight-not-number"),
    pytest.param("tenants create zed --requests-per-min 0", ("requests-per-min", "0"),
                 id="create-rpm0"),
    pytest.param("tenants create zed --max-tokens 1.5", ("--max-tokens", "'1.5'"),
                 id="create-max-tokens-float"),
    pytest.param("tenants create zed --queue-timeout -1", ("queue-timeout", "-1"),
                 id="create-queue-timeout-neg"),
    pytest.param("tenants create zed --default-priority urgent", ("'urgent'",),
                 id="create-unknown-priority"),
    pytest.param("tenants create zed --allowed-priorities fast", ("'fast'",),
                 id="create-unknown-allowed"),
    pytest.param("tenants update ghost --weight 2", ("'ghost'",), id="update-unknown"),
    pytest.param("tenants update acme", ("--weight",), id="update-nothing"),
    pytest.param("tenants update acme --weight 0", ("weight", "0"), id="update-weight0"),
    pytest.param("tenants update acme --max-concurrent -2", ("max-concurrent", "-2"),
                 id="update-concurrent-neg"),
    pytest.param("tenants delete ghost", ("'ghost'",), id="delete-unknown"),
    pytest.param("tenants import {tmp}/missing.yaml", ("{tmp}/missing.yaml",),
                 id="import-missing"),
    pytest.param("tenants import {tmp}/tenants-notyaml.yaml", ("{tmp}/tenants-notyaml.yaml:2",),
                 id="import-not-yaml"),
    pytest.param("tenants import {tmp}/tenants-list.yaml", ("{tmp}/tenants-list.yaml",
                                                           "'tenants'"), id="import-a-list"),
    pytest.param("tenants import {tmp}/tenants-dup.yaml", ("{tmp}/tenants-dup.yaml", "'zed'",
                                                          "twice"), id="import-duplicate"),
    pytest.param("tenants import {tmp}/tenants-limit.yaml", ("{tmp}/tenants-limit.yaml",
                                                            "requests_per_min", "-5"),
                 id="import-bad-limit"),
    pytest.param("tenants import {tmp}/tenants-field.yaml", ("{tmp}/tenants-field.yaml",
                                                            "wieght"), id="import-unknown-field"),
    pytest.param("tenants import {tmp}/adir", ("{tmp}/adir", "directory"),
                 id="import-a-directory"),
    pytest.param("tenants export -o {tmp}/nodir/t.yaml", ("{tmp}/nodir/t.yaml",),
                 id="export-missing-folder"),
    pytest.param("keys create ghost", ("'ghost'",), id="keys-create-unknown"),
    pytest.param("keys create bad/name", ("'bad/name'",), id="keys-create-bad-name"),
    pytest.param("keys revoke key_nope", ("'key_nope'",), id="keys-revoke-unknown"),
    pytest.param("keys list --tenant ghost", ("'ghost'",), id="keys-list-unknown-tenant"),
]


@pytest.mark.parametrize("template,names", TENANT_CASES)
def test_a_bad_tenants_or_keys_input_changes_nothing(
        template: str, names: tuple[str, ...], seeded: dict[str, str],
        capsys: pytest.CaptureFixture[str]) -> None:
    before = export(capsys, seeded)
    fails(capsys, f"{template} --database {{db}}", seeded, *names)
    assert export(capsys, seeded) == before


def export(capsys: pytest.CaptureFixture[str], places: dict[str, str]) -> str:
    assert main(["tenants", "export", "--database", places["db"]]) == 0
    return capsys.readouterr().out


def test_an_import_refused_mid_transaction_leaves_the_database_as_it_was(
        seeded: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    before = export(capsys, seeded)
    acme_key = yaml.safe_load(before)["tenants"][0]["keys"][0]["hash"]
    # zed is created and acme updated before bob claims acme's key: all of it must roll back
    Path(seeded["tmp"], "claim.yaml").write_text(
        "tenants:\n  - name: zed\n  - name: acme\n    weight: 5\n"
        f"  - name: bob\n    keys:\n      - hash: '{acme_key}'\n")
    fails(capsys, "tenants import {tmp}/claim.yaml --database {db}", seeded, acme_key[:20],
          "another tenant")
    assert export(capsys, seeded) == before


@pytest.mark.parametrize("file", ["tenants-notyaml.yaml", "tenants-dup.yaml",
                                  "tenants-limit.yaml"])
def test_a_refused_import_creates_no_database(file: str, places: dict[str, str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    fails(capsys, f"tenants import {{tmp}}/{file} --database {{db}}", places, f"{{tmp}}/{file}")
    assert not Path(places["tmp"], "t.db").exists()


def test_a_refused_create_creates_no_database(places: dict[str, str],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    fails(capsys, "tenants create zed --weight 0 --database {db}", places, "weight")
    assert not Path(places["tmp"], "t.db").exists()


def test_export_to_a_directory_blames_the_file_not_the_database(
        places: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    line = fails(capsys, "tenants export -o {tmp}/adir --database {db}", places, "{tmp}/adir")
    assert "database" not in line


def test_serve_with_a_database_in_a_missing_folder(places: dict[str, str],
                                                   capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from protocol.serving import serve

    def serve_until_listening(*args: Any, **kwargs: Any) -> None:
        # the real start-up (the database opens there) on a free port; listening fails the test
        app, host = args[:2]
        serve(app, host, 0, **{**kwargs, "on_listening": got_too_far})

    config = Path(places["tmp"], "nodb.yaml")
    config.write_text(FILES["sim.yaml"] + f"database: sqlite:///{places['tmp']}/nodir/t.db\n")
    monkeypatch.setattr("fairgate.serve_cli.serve", serve_until_listening)
    fails(capsys, f"serve -c {config}", places, "{tmp}/nodir/t.db")


"""protocol.yaml_files: the one YAML loader. A duplicated key is refused at any depth, and every
mistake is one line `<source>:<line>: <problem>`; then each reader of a file fairgate reads
(fairgate.yaml through serve, engine and tune; tenants.yaml; a sim profile, on disk and
uploaded; a space, a workload and a tune spec) says that same line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from control.jobs import PROFILE_FOLDER
from engine.sim_profile import SimProfile, load_profile
from fairgate.cli import main
from protocol.yaml_files import LineDict, YamlError, load_yaml
from tests.gateway.helpers import start_gateway

ADMIN = {"Authorization": "Bearer admin-key-0123456789"}
TUNE = ["--mode", "sim", "--workload", "uniform", "--rate", "10", "--duration", "4",
        "--no-tenant-slos", "--slo-ttft-p99", "0.5", "--slo-tpot-p99", "0.05"]


@pytest.mark.parametrize(("text", "line", "key"), [
    ("engine: {}\ngateway: {}\nengine: {}\n", 3, "engine"),
    ("engine:\n  max_num_seqs: 8\n  policy: fcfs\n  max_num_seqs: 16\n", 4, "max_num_seqs"),
    ("tenants:\n  - name: a\n  - name: b\n    weight: 1\n    name: c\n", 5, "name"),
    ("a: {b: {c: 1, c: 2}}\n", 1, "c"),
    ("1: x\n1: y\n", 2, 1),
])
def test_a_duplicated_key_is_refused_at_any_depth_naming_source_line_and_key(
        text: str, line: int, key: object) -> None:
    with pytest.raises(YamlError) as info:
        load_yaml("fairgate.yaml", text=text)
    assert str(info.value) == f"fairgate.yaml:{line}: duplicate key {key!r}"
    assert (info.value.source, info.value.line) == ("fairgate.yaml", line)
    assert isinstance(info.value, ValueError)  # what the CLI turns into exit 2


def test_a_merged_key_may_be_overridden_but_not_written_twice() -> None:
    text = "base: &b {x: 1, y: 2}\nmine:\n  <<: *b\n  x: 3\n"
    assert load_yaml("m.yaml", text=text) == yaml.safe_load(text)
    assert load_yaml("m.yaml", text=text)["mine"] == {"x": 3, "y": 2}
    with pytest.raises(YamlError, match=r"^m\.yaml:5: duplicate key 'x'$"):
        load_yaml("m.yaml", text=text + "  x: 4\n")


@pytest.mark.parametrize(("text", "line", "problem"), [
    ("engine:\n  max_num_seqs: [8\n", 3, r"invalid YAML: expected ',' or ']', but got "
     r"'<stream end>' \(while parsing a flow sequence on line 2\)"),
    ("engine:\n  a: 1\n b: 2\n", 3, "invalid YAML: .+"),
    ("a: 1\n---\nb: 2\n", 2, r"invalid YAML: .*single document in the stream on line 1\)"),
    (b"a: 1\nb: \xff\n", 2, "invalid YAML: .+"),  # not UTF-8
])
def test_a_syntax_error_names_source_and_line_in_one_line(
        text: str | bytes, line: int, problem: str) -> None:
    with pytest.raises(YamlError, match=rf"^space\.yaml:{line}: {problem}$") as info:
        load_yaml("space.yaml", text=text)
    assert "\n" not in str(info.value) and info.value.line == line


@pytest.mark.parametrize("text", [
    "", "# only a comment\n", "a: 1\nb: [1, 2, {c: d}]\n", "- &x {a: 1}\n- *x\n",
    "when: 2024-01-02\non: yes\nn: ~\nf: 1e-3\n", "[1, 2, 3]\n", "just text\n",
])
def test_what_loads_is_what_safe_load_gives(text: str) -> None:
    assert load_yaml("x.yaml", text=text) == yaml.safe_load(text)
    assert load_yaml("x.yaml", text=text, lines=True) == yaml.safe_load(text)


def test_a_path_is_read_and_names_its_messages(tmp_path: Path) -> None:
    path = tmp_path / "fairgate.yaml"
    path.write_text("engine:\n  policy: fcfs\n  policy: sjf\n")
    with pytest.raises(YamlError) as info:
        load_yaml(path)
    assert str(info.value) == f"{path}:3: duplicate key 'policy'"
    path.write_text("engine:\n  policy: fcfs\n")
    assert load_yaml(str(path)) == {"engine": {"policy": "fcfs"}}
    with pytest.raises(FileNotFoundError):
        load_yaml(tmp_path / "missing.yaml")


def test_lines_gives_each_mapping_its_first_line() -> None:
    doc = load_yaml("t.yaml", text="tenants:\n  - name: a\n\n  - name: b\n    limits: {x: 1}\n",
                    lines=True)
    assert isinstance(doc, LineDict) and doc.line == 1
    first, second = doc["tenants"]
    assert (first.line, second.line, second["limits"].line) == (2, 4, 5)
    assert type(load_yaml("t.yaml", text="a: {b: 1}\n")["a"]) is dict  # plain dicts otherwise


# ---- every reader says the same line ---------------------------------------------------------
def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str], command: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    prefix = f"fairgate {command}: error: "
    assert err.startswith(prefix), err
    return err.removeprefix(prefix).rstrip("\n")


@pytest.mark.parametrize("argv", [["serve"], ["engine"], ["tune", *TUNE]],
                         ids=["serve", "engine", "tune"])
def test_a_duplicated_key_in_fairgate_yaml_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        argv: list[str]) -> None:
    monkeypatch.chdir(tmp_path)  # nothing a command might make lands in the checkout
    config = tmp_path / "fairgate.yaml"
    config.write_text("engine:\n  executor: sim\n  max_num_seqs: 8\n  max_num_seqs: 16\n")
    line = _one_error_line(capsys, [argv[0], "-c", str(config), *argv[1:]], argv[0])
    assert line == f"{config}:4: duplicate key 'max_num_seqs'"
    config.write_text("engine: {}\ngateway: {}\nengine: {}\n")
    line = _one_error_line(capsys, [argv[0], "-c", str(config), *argv[1:]], argv[0])
    assert line == f"{config}:3: duplicate key 'engine'"


def test_a_duplicated_key_in_a_tenants_file_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  - name: a\n    weight: 1\n    limits: {max_tokens: 4,"
                       " max_tokens: 8}\n")
    db = tmp_path / "t.db"
    line = _one_error_line(capsys, ["tenants", "import", str(tenants), "--database",
                                    f"sqlite:///{db}"], "tenants")
    assert line == f"{tenants}:4: duplicate key 'max_tokens'"
    assert not db.exists()  # refused before the database is opened


def _profile_yaml() -> str:
    profile = SimProfile(coefficients={"step": 2e-3, "tokens": 2e-5, "seqs": 1e-4},
                         kv_tokens=400_000, kv_bytes_per_token=1024, max_position=8192,
                         model="random:tiny", device="cpu", dtype="float32")
    return yaml.safe_dump(profile.to_dict(), sort_keys=False)


def _with_duplicate(text: str, key: str) -> tuple[str, int]:
    """`text` with the line of `key` written twice; the second one's line number."""
    lines = text.splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith(f"{key}:"))
    return "".join([*lines[:at + 1], lines[at], *lines[at + 1:]]), at + 2


def test_a_duplicated_key_in_a_sim_profile_names_its_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    profile = tmp_path / "profile.yaml"
    text, line = _with_duplicate(_profile_yaml(), "kv_tokens")
    profile.write_text(text)
    expected = f"{profile}:{line}: duplicate key 'kv_tokens'"
    with pytest.raises(YamlError) as info:
        load_profile(profile)
    assert str(info.value) == expected
    config = tmp_path / "fairgate.yaml"  # an engine that names the profile
    config.write_text(f"engine:\n  executor: sim\n  sim_profile: {profile}\n")
    assert expected in _one_error_line(capsys, ["engine", "-c", str(config)], "engine")


@pytest.mark.parametrize(("flag", "text", "line", "key"), [
    ("--space", "max_num_seqs: {low: 8, high: 64}\nmax_num_seqs: {low: 8, high: 32}\n", 2,
     "max_num_seqs"),
    ("--workload-file", "rate: 10\ntenants:\n  - {tenant: a, share: 1, share: 2}\n", 3, "share"),
    ("--spec", "trials: 2\nmode: sim\ntrials: 3\n", 3, "trials"),
])
def test_a_duplicated_key_in_a_tune_file_is_one_line_and_exit_2(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        flag: str, text: str, line: int, key: str) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "file.yaml"
    path.write_text(text)
    argv = ["tune", *TUNE, flag, str(path)]
    if flag == "--workload-file":
        argv.remove("--workload")
        argv.remove("uniform")
    assert _one_error_line(capsys, argv, "tune") == f"{path}:{line}: duplicate key {key!r}"


def test_a_job_spec_file_with_a_duplicated_key_is_refused_before_the_gateway_is_called(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text("mode: sim\nworkload: uniform\nmode: replay\n")
    # port 9 (discard): nothing answers there, and nothing is asked
    line = _one_error_line(capsys, ["jobs", "create", "--spec", str(spec), "--gateway",
                                    "http://127.0.0.1:9"], "jobs")
    assert line == f"{spec}:3: duplicate key 'mode'"


@pytest.fixture
def db_url(tmp_path: Path) -> str:
    return f"sqlite+aiosqlite:///{tmp_path / 'gateway.db'}"


async def test_an_uploaded_sim_profile_with_a_duplicated_key_is_a_400_naming_the_line(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    h = await start_gateway(aiohttp_client, db_url,
                            gateway={"jobs": {"dir": str(tmp_path / "jobs")}})
    text, line = _with_duplicate(_profile_yaml(), "kv_tokens")
    resp = await h.client.put("/admin/sim-profiles/dup", data=text,
                              headers={**ADMIN, "Content-Type": "application/yaml"})
    assert resp.status == 400, await resp.text()
    error = (await resp.json())["error"]
    assert error["message"] == f"<body>:{line}: duplicate key 'kv_tokens'"
    assert error["type"] == "invalid_request_error"
    listed = await (await h.client.get("/admin/sim-profiles", headers=ADMIN)).json()
    assert listed == {"profiles": []}


async def test_a_held_sim_profile_with_a_duplicated_key_is_a_400_naming_the_line(
        aiohttp_client: Any, db_url: str, tmp_path: Path) -> None:
    h = await start_gateway(aiohttp_client, db_url,
                            gateway={"jobs": {"dir": str(tmp_path / "jobs")}})
    held = tmp_path / "jobs" / PROFILE_FOLDER
    held.mkdir(parents=True)
    text, line = _with_duplicate(_profile_yaml(), "kv_tokens")
    (held / "dup.yaml").write_text(text)  # put there by hand
    spec = {"mode": "sim", "workload": "uniform", "rate": 10, "duration": 4, "trials": 2,
            "holdout": 0, "slo_ttft_p99_s": 0.5, "slo_tpot_p99_s": 0.05,
            "set": {"sim_profile": "dup"}}
    resp = await h.client.post("/admin/tune-jobs", json=spec, headers=ADMIN)
    assert resp.status == 400, await resp.text()
    message = (await resp.json())["error"]["message"]
    assert f"dup.yaml:{line}: duplicate key 'kv_tokens'" in message, message
    assert str(tmp_path) not in message  # the gateway's folders stay its own

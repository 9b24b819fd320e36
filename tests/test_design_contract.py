"""The public contracts DESIGN.md promises, used as a new user reading it would use them: the
`fairgate` commands of its command-line block and the options it names, the gateway's HTTP
routes (the admin ones behind the admin key, unknown ones answered in OpenAI's error shape) and
the sections of fairgate.yaml. The engine's Python snippet is tests/engine/test_public_contract.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from fairgate.cli import main
from fairgate.config import FairgateConfig
from tests.gateway.helpers import ControlledBackend, Harness, start_gateway

ADMIN_KEY = "admin-key-0123456789"  # the one tests.gateway.helpers.start_gateway configures
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
NO_KEY: dict[str, str] = {}

# ---- the command line -----------------------------------------------------------------------
# `fairgate WORDS --help` -> what DESIGN.md's command-line block has a user type after WORDS
OPTIONS: dict[tuple[str, ...], tuple[str, ...]] = {
    ("serve",): ("-c",),
    ("engine",): ("-c", "--port"),
    ("tenants",): ("create", "list", "import", "delete"),
    ("keys",): ("create", "list", "revoke"),
    ("bench",): ("--url", "--api-key", "--workload", "--trace"),
    ("tune",): ("--mode",),
}
# `fairgate keys create TENANT | list | revoke ID`: the positional argument each one takes
POSITIONALS = {("keys", "create"): "tenant", ("keys", "revoke"): "id"}
TUNE_MODES = ("replay", "shadow", "sim")


def printed_help(capsys: pytest.CaptureFixture[str], run: Callable[[list[str]], int],
                 *words: str) -> str:
    """What `WORDS --help` prints with `run` as the program's main, in-process; it exits 0."""
    with pytest.raises(SystemExit) as exited:
        run([*words, "--help"])
    assert exited.value.code == 0
    out, err = capsys.readouterr()
    assert err == ""
    return out


def help_of(capsys: pytest.CaptureFixture[str], *words: str) -> str:
    """What `fairgate WORDS --help` prints."""
    return printed_help(capsys, main, *words)


def names(text: str) -> set[str]:
    """The words and option strings of a help text (`-c` is not found inside `--config`)."""
    return set(re.findall(r"(?<![\w-])-{0,2}[A-Za-z][\w-]*", text))


def test_fairgate_help_lists_every_command_design_names(
        capsys: pytest.CaptureFixture[str]) -> None:
    commands = {words[0] for words in OPTIONS}
    assert commands <= names(help_of(capsys))


@pytest.mark.parametrize(("words", "options"), list(OPTIONS.items()),
                         ids=[" ".join(w) for w in OPTIONS])
def test_each_command_help_names_the_options_design_names(
        capsys: pytest.CaptureFixture[str], words: tuple[str, ...],
        options: tuple[str, ...]) -> None:
    found = names(help_of(capsys, *words))
    assert [o for o in options if o not in found] == []


@pytest.mark.parametrize(("words", "positional"), list(POSITIONALS.items()),
                         ids=[" ".join(w) for w in POSITIONALS])
def test_keys_create_and_revoke_take_their_positional(
        capsys: pytest.CaptureFixture[str], words: tuple[str, ...], positional: str) -> None:
    usage = help_of(capsys, *words).split("\n\n")[0]
    assert usage.split()[-1].lower() == positional  # the usage line ends with it
    with pytest.raises(SystemExit) as exited:  # and it is required
        main(list(words))
    assert exited.value.code == 2
    assert "the following arguments are required" in capsys.readouterr().err


def test_tune_mode_help_and_its_refusal_name_replay_shadow_and_sim(
        capsys: pytest.CaptureFixture[str]) -> None:
    text = " ".join(help_of(capsys, "tune").split())
    mode_help = text[text.index("--mode MODE "):text.index(" --url URL ")]
    assert [m for m in TUNE_MODES if f"{m}:" not in mode_help] == []
    assert main(["tune", "--mode", "no-such-mode"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    listed = line.split("--mode must be one of ", 1)[1].split(",")[0].split(" | ")
    assert set(TUNE_MODES) <= set(listed), line


# ---- HTTP (gateway) -------------------------------------------------------------------------
ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("GET", "/metrics"), ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/dashboard")]


@pytest.fixture
async def gateway(aiohttp_client: Any, tmp_path: Path) -> Harness:
    """The gateway as `fairgate serve` builds it (control plane included), on a backend the
    test holds; wrong admin keys do not run out the address's failed-attempt budget."""
    return await start_gateway(aiohttp_client, f"sqlite+aiosqlite:///{tmp_path / 'gw.db'}",
                               backends=[ControlledBackend()],
                               gateway={"auth_failure_burst": 10_000})


def served_routes(app: web.Application) -> set[tuple[str, str]]:
    return {(r.method, r.resource.canonical) for r in app.router.routes()
            if r.method != "HEAD" and r.resource is not None}


async def test_every_route_design_names_is_served(gateway: Harness) -> None:
    served = served_routes(gateway.app)
    assert [route for route in ROUTES if route not in served] == []
    assert any(path.startswith("/admin/") for _, path in served)


async def test_every_admin_route_wants_the_admin_key(gateway: Harness) -> None:
    """No key and a tenant's key are 401 in OpenAI's shape on every /admin/* route; the admin
    key gets past that (to whatever the route answers an empty body for a missing name)."""
    admin = sorted((m, p) for m, p in served_routes(gateway.app) if p.startswith("/admin/"))
    refused: list[tuple[str, str, int]] = []
    let_in: list[tuple[str, str, int]] = []
    for method, path in admin:
        url = re.sub(r"\{\w+\}", "no-such-name", path)
        for headers in (NO_KEY, gateway.auth("acme")):
            resp = await gateway.client.request(method, url, headers=headers, json={})
            body = await resp.json()
            if resp.status != 401 or body["error"]["code"] != "invalid_admin_key":
                refused.append((method, path, resp.status))
        resp = await gateway.client.request(method, url, headers=ADMIN, json={})
        if resp.status in (401, 403) or resp.status >= 500:
            let_in.append((method, path, resp.status))
    assert refused == [], "admin routes that did not refuse a missing or tenant key with 401"
    assert let_in == [], "admin routes that refused the admin key or failed"


@pytest.mark.parametrize(("method", "path", "status"), [
    ("POST", "/v1/embeddings", 404),  # an OpenAI route the gateway does not serve
    ("GET", "/v2/models", 404),
    ("GET", "/admin/no-such-thing", 404),
    ("GET", "/v1/chat/completions", 405),  # a route DESIGN names, with the wrong method
    ("DELETE", "/v1/models", 405),
])
async def test_unknown_routes_answer_in_openais_json_error_shape(
        gateway: Harness, method: str, path: str, status: int) -> None:
    for headers in (NO_KEY, gateway.auth("acme"), ADMIN):
        resp = await gateway.client.request(method, path, headers=headers)
        assert resp.status == status and resp.content_type == "application/json", (
            headers, resp.status, await resp.text())
        error = (await resp.json())["error"]
        assert {"message", "type", "param", "code"} <= set(error) and error["message"]
        assert isinstance(error["type"], str) and error["type"]


# ---- fairgate.yaml --------------------------------------------------------------------------
# DESIGN.md names seven sections; the settings of three of them live elsewhere, and the file
# refuses them with where (fairgate.config.ELSEWHERE): named there, nothing read them. `tuner`
# is best.yaml's (the winner as another engine's flags), which `fairgate engine -c` takes.
READ = ("engine", "gateway", "database", "tuner")
WHERE = {"tenants": "fairgate tenants import", "slo": "slo_ttft_p99_s",
         "shadow": "gateway.shadow"}


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fairgate.yaml"
    path.write_text(text)
    return path


def test_the_sections_fairgate_reads_are_accepted(tmp_path: Path) -> None:
    path = write_config(tmp_path, "engine: {model: 'random:tiny', max_num_seqs: 8}\n"
                                  "gateway: {port: 9000}\ndatabase: sqlite:///x.db\n"
                                  "tuner: {engine: vllm, flags: [--max-num-seqs, '8']}\n")
    config = FairgateConfig.load(path)
    assert config.engine.max_num_seqs == 8 and config.gateway.port == 9000
    assert config.database == "sqlite:///x.db"


@pytest.mark.parametrize("value", ["5", "{}", "[]", "{ttft_p99_s: 0.5}"])
@pytest.mark.parametrize("name", list(WHERE))
def test_a_section_whose_settings_live_elsewhere_says_where(tmp_path: Path, name: str,
                                                            value: str) -> None:
    path = write_config(tmp_path, f"engine: {{}}\n{name}: {value}\n")
    with pytest.raises(ValueError) as raised:
        FairgateConfig.load(path)
    message = str(raised.value)
    assert f"no section {name!r}" in message and WHERE[name] in message
    assert all(section in message for section in READ)


def test_an_unknown_top_level_key_is_named_with_the_sections(tmp_path: Path) -> None:
    path = write_config(tmp_path, "engnie:\n  model: random:tiny\ngateway: {}\n")
    with pytest.raises(ValueError, match="unknown section") as raised:
        FairgateConfig.load(path)
    message = str(raised.value)
    assert "engnie" in message and all(name in message for name in READ)
    assert "gateway," not in message.split(";")[0]  # only the unknown one is named unknown


@pytest.mark.parametrize("words", [("tenants", "list"), ("keys", "list")])
@pytest.mark.parametrize(("text", "says"), [
    ("databse: sqlite:///x.db\n", "unknown section(s) databse"),
    ("slo: {ttft_p99_s: 1}\n", "no section 'slo'")])
def test_a_command_reading_the_file_says_so_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], words: tuple[str, ...], text: str,
        says: str) -> None:
    path = write_config(tmp_path, text)
    assert main([*words, "-c", str(path)]) == 2
    out, err = capsys.readouterr()
    [line] = err.splitlines()
    assert out == "" and line.startswith(f"fairgate {words[0]}: error: ")
    assert says in line

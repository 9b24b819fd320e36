"""README.md and docs/deploy.md as a new user meets them: the make targets the README names do
what it says (read from the Makefile, not run), its quickstart works on the built-in defaults
(the first start, the demo key printed once, the curl, the OpenAI base_url), each command,
action, option and value of its command table is one `fairgate` takes, and every file, module
and name it quotes exists; every file, overlay, port, image, secret, variable and probe path
docs/deploy.md quotes is the one deploy/ and the code have, and the probes answer on the apps
the manifests start. (Links, the site, the command table's pages and the architecture map:
tests/test_docs.py; the manifests' own rules: tests/deploy/.)"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import runpy
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from control.app import make_app
from engine.async_engine import AsyncEngine
from engine.config import ENGINE_ADMIN_KEY_ENV, ENGINE_KEY_ENV, EngineConfig
from engine.server import make_app as make_engine_app
from engine.tokenizer import ByteTokenizer
from fairgate import engine_cli, tenants_common
from fairgate.cli import build_parser, main
from fairgate.config import FairgateConfig, load_config_file
from fairgate.serve_cli import print_demo_key
from gateway.app import SECRET_ENV
from gateway.backends.embedded import EmbeddedBackend
from gateway.config import ADMIN_KEY_ENV
from gateway.state import GATEWAY
from tenants.keys import KEY_PREFIX
from tests.deploy.test_compose import (
    compose,
    dockerfile_instructions,
    interpolate,
    mounts_of,
    services,
)
from tests.deploy.test_k8s_manifests import OVERLAYS as RENDERED_OVERLAYS
from tests.test_design_contract import help_of, names
from tests.test_docs import command_rows, section
from tuner.workload import WORKLOADS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DEPLOY_PAGE = ROOT / "docs" / "deploy.md"
MAKEFILE = ROOT / "Makefile"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE_FILES = (DEPLOY / "docker-compose.yaml", DEPLOY / "docker-compose.gpu.yaml")

Words = tuple[str, ...]
OPTION = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")
PATH = re.compile(r"\.?[\w.-]*/[\w./-]*|[\w-]+\.(?:py|md|yml|toml|json)")


def spans(text: str) -> list[str]:
    """The inline code spans of a markdown text (fenced blocks left out), whitespace joined."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", text)]


def code_block(text: str, marker: str) -> str:
    """The first fenced block that contains `marker`, continuation lines joined."""
    block = next(b for b in re.findall(r"```\w*\n(.*?)```", text, flags=re.S) if marker in b)
    return block.replace("\\\n", " ")


def readme() -> str:
    return README.read_text()


def page() -> str:
    return " ".join(DEPLOY_PAGE.read_text().split())


# ---- the Makefile ---------------------------------------------------------------------------
def make_rules() -> dict[str, tuple[list[str], list[str]]]:
    """target -> (prerequisites, recipe lines), the Makefile's variables expanded (those given
    on make's command line, such as ARGS, stay `$(ARGS)`)."""
    variables: dict[str, str] = {}
    rules: dict[str, tuple[list[str], list[str]]] = {}

    def expand(text: str) -> str:
        return re.sub(r"\$\((\w+)\)", lambda m: variables.get(m[1], m[0]), text)

    target = None
    for line in MAKEFILE.read_text().splitlines():
        assignment = re.fullmatch(r"(\w+) *[:?]?= *(.*)", line)
        rule = re.fullmatch(r"([^\s:=#]+): *([^=]*)", line)
        if line.startswith("\t") and target is not None:
            rules[target][1].append(expand(line.strip()))
        elif assignment:
            variables[assignment[1]] = expand(assignment[2])
        elif rule and not rule[1].startswith("."):
            target = expand(rule[1])
            rules[target] = (expand(rule[2]).split(), [])
    return rules


def recipe_line(target: str, *words: str) -> str:
    [line] = [line for line in make_rules()[target][1] if all(w in line for w in words)]
    return line


def packages() -> set[str]:
    return {name.rstrip("*") for name in PYPROJECT["tool"]["setuptools"]["packages"]["find"][
        "include"]}


def test_every_make_target_the_readme_names_is_a_rule() -> None:
    named = set(re.findall(r"\bmake (\w+)", readme()))
    assert named >= {"run", "test"}
    assert sorted(named - set(make_rules())) == []


def test_make_run_installs_the_project_then_runs_fairgate_serve_with_args() -> None:
    assert "(Python 3.11+, no GPU needed)" in readme()
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"
    rules = make_rules()
    [stamp] = rules["run"][0]
    assert recipe_line(stamp, "-m venv").endswith("-m venv .venv")  # creates .venv
    assert recipe_line(stamp, "pip install", "-e") == ".venv/bin/pip install -q -e '.[dev]'"
    assert rules["run"][1] == [".venv/bin/fairgate serve $(ARGS)"]
    assert PYPROJECT["project"]["scripts"] == {"fairgate": "fairgate.cli:main"}  # .venv/bin


def test_make_test_installs_then_runs_ruff_mypy_and_the_whole_suite() -> None:
    rules = make_rules()
    stamp = rules["run"][0][0]
    assert stamp in rules["test"][0] and "lint" in rules["test"][0]
    ruff = recipe_line("lint", "ruff").split()
    assert ruff[:2] == [".venv/bin/ruff", "check"]
    assert packages() | {"tests"} <= set(ruff[2:])
    assert recipe_line("lint", "mypy") == ".venv/bin/mypy"  # pyproject's packages, all of them
    assert set(PYPROJECT["tool"]["mypy"]["packages"]) == packages()
    pytest_args = recipe_line("test", "pytest").split(" -m pytest ")[1].split()
    assert [a for a in pytest_args if not a.startswith(("-", "$(")) and a not in ("2", "loadgroup")
            ] == [], "a path or a selection: not the whole suite"
    assert not {"-m", "-k", "--ignore", "--deselect"} & set(pytest_args)
    assert PYPROJECT["tool"]["pytest"]["ini_options"]["testpaths"] == ["tests"]


def test_the_torch_pin_the_readme_quotes_is_the_one_installed() -> None:
    [pin] = re.findall(r"`(torch==[\d.]+)`", readme())
    assert pin in PYPROJECT["project"]["dependencies"]
    assert recipe_line(make_rules()["run"][0][0], "pip install", "torch==").endswith(pin)
    assert not list(ROOT.glob("requirements*.txt")), "the README: from pyproject.toml only"


def torch_install(*make_args: str) -> str:
    """The torch install line `make` would run (a dry run: nothing is installed)."""
    dry = subprocess.run(["make", "-n", "-B", ".venv/.installed", *make_args], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    [line] = [line for line in dry.splitlines() if "pip install" in line and "torch==" in line]
    return line


def test_torch_index_the_readme_names_chooses_where_torch_comes_from() -> None:
    """pip's own index by default (these machines serve the CPU build there); the README's
    TORCH_INDEX for a machine whose index is PyPI, where Linux torch is the CUDA build."""
    [index] = re.findall(r"`TORCH_INDEX=(\S+)`", readme())
    assert index == "https://download.pytorch.org/whl/cpu"
    assert "--index-url" not in torch_install()
    assert f"--index-url {index} torch==" in torch_install(f"TORCH_INDEX={index}")


def parsed(argv: list[str]) -> argparse.Namespace:
    """`fairgate ARGV` as the real parser reads it; it takes every argument."""
    args, unknown = build_parser(argv).parse_known_args(argv)
    assert unknown == [], f"fairgate {' '.join(argv)}: not taken: {unknown}"
    return args


def test_make_run_args_reach_fairgate_serve() -> None:
    found = re.search(r'`make run ARGS="([^"]*)"` passes arguments to `fairgate (\w+)`',
                      readme())
    assert found, "the README's ARGS example"
    recipe = make_rules()["run"][1][0].replace("$(ARGS)", found[1])
    argv = shlex.split(recipe)[1:]
    assert argv[0] == found[2]
    assert parsed(argv).config == "fairgate.yaml"


# ---- the quickstart, on the built-in defaults -----------------------------------------------
def quickstart_curl() -> tuple[str, dict[str, str], dict[str, Any]]:
    """The quickstart's curl: its URL, headers and JSON body."""
    words = shlex.split(code_block(section(readme(), "Quickstart"), "curl "))
    assert words[0] == "curl"
    headers = dict(h.split(": ", 1) for flag, h in zip(words, words[1:], strict=False)
                   if flag == "-H")
    body = json.loads(words[words.index("-d") + 1])
    return words[1], headers, body


async def first_start(aiohttp_client: Any) -> Any:
    """The app `make run` starts (`fairgate serve`, no -c: the built-in defaults), in-process,
    printing the demo key as `fairgate serve` does."""
    config = FairgateConfig.load(None, {})
    return await aiohttp_client(make_app(config.gateway, engine=config.engine,
                                         database=config.database, on_demo_key=print_demo_key))


def printed_keys(capsys: pytest.CaptureFixture[str]) -> list[str]:
    return re.findall(rf"{KEY_PREFIX}[\w-]+", capsys.readouterr().out)


@pytest.fixture
def fresh_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A checkout with no fairgate.db yet: the working directory of `make run`."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


async def test_the_first_start_prints_a_demo_key_once_and_the_curl_answers(
        aiohttp_client: Any, fresh_directory: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = readme()
    assert "creates a SQLite database (`fairgate.db`), a `demo` tenant" in " ".join(text.split())
    client = await first_start(aiohttp_client)
    [key] = printed_keys(capsys)
    assert (fresh_directory / "fairgate.db").is_file()
    assert isinstance(client.app[GATEWAY].pool.primary, EmbeddedBackend)  # the embedded engine

    url, headers, body = quickstart_curl()
    defaults = FairgateConfig().gateway
    assert (urlsplit(url).hostname, urlsplit(url).port) == (defaults.host, defaults.port)
    assert headers["Authorization"] == f"Bearer {KEY_PREFIX}..."
    headers["Authorization"] = f"Bearer {key}"
    resp = await client.post(urlsplit(url).path, data=json.dumps(body), headers=headers)
    assert resp.status == 200, await resp.text()
    answer = await resp.json()
    assert body["model"] == answer["model"] == EngineConfig().model  # the default model
    assert re.search(rf"default model is `{body['model']}` \(random weights, byte-level",
                     " ".join(text.split()))
    usage = answer["usage"]
    assert usage["prompt_tokens"] == len(ByteTokenizer().encode(body["prompt"]))
    assert usage["completion_tokens"] == body["max_tokens"]

    [base_url] = re.findall(r'base_url="([^"]+)"', text)
    assert base_url == f"http://{defaults.host}:{defaults.port}/v1"
    models = await client.get(f"{urlsplit(base_url).path}/models", headers=headers)
    assert body["model"] in [m["id"] for m in (await models.json())["data"]]
    await client.close()

    await first_start(aiohttp_client)  # the next start: the key was printed once
    assert printed_keys(capsys) == []


def test_a_checkpoint_postgresql_and_remote_engines_are_configuration(tmp_path: Path) -> None:
    text = " ".join(readme().split())
    assert "point `engine.model` at a local Hugging Face checkpoint folder" in text
    config = FairgateConfig.from_dict({
        "engine": {"model": str(tmp_path)},
        "database": "postgresql+asyncpg://fairgate@db:5432/fairgate",
        "gateway": {"backends": [{"url": "http://engine-0:8100"}]}})
    assert config.engine.model == str(tmp_path)
    assert config.database.startswith("postgresql")
    assert [b.url for b in config.gateway.backends] == ["http://engine-0:8100"]


# ---- the commands ---------------------------------------------------------------------------
def table() -> list[tuple[Words, list[str], set[str]]]:
    """Each row of the command table: the command's words (`tune calibrate`), what its first
    cell shows after them (`[-c`, `fairgate.yaml]` -> `-c`, `fairgate.yaml`) and every option
    the row names (`--set KNOB=VALUE` in its prose too)."""
    rows = []
    for command, row in command_rows():
        cells = spans(row.replace("\\|", "|"))
        words = tuple(command.split()[1:])
        shown = [w.strip("[]") for w in cells[0].split()[1 + len(words):]]
        options = {o for cell in cells if cell.startswith(("fairgate ", "-"))
                   for o in OPTION.findall(cell)}
        rows.append((words, [w for w in shown if w and w != "..."], options))
    return rows


def listed(shown: list[str]) -> tuple[list[str], dict[str, list[str]]]:
    """A row's actions (`create|list|...` after the command) and the values it lists for an
    option (`--mode sim|replay|...`)."""
    actions: list[str] = []
    values: dict[str, list[str]] = {}
    for before, word in zip(["", *shown], shown, strict=False):
        if "|" in word:
            (values.setdefault(before, []) if before.startswith("-") else actions).extend(
                word.split("|"))
    return actions, values


TABLE = table()
COMMANDS = [words for words, _, _ in TABLE]
WITH_ACTIONS = [words + (action,) for words, shown, _ in TABLE for action in listed(shown)[0]]


def help_actions(text: str) -> list[str]:
    """The actions `fairgate CMD --help` lists (the indented names under ACTION)."""
    return re.findall(r"^ {4}(\w+) ", text, flags=re.M)


def test_python_m_fairgate_is_the_fairgate_command(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert "`python -m fairgate` is the same" in " ".join(readme().split())
    monkeypatch.setattr(sys, "argv", ["fairgate", "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("fairgate", run_name="__main__")
    assert exited.value.code == 0
    assert capsys.readouterr().out == help_of(capsys)


@pytest.mark.parametrize("words", COMMANDS + WITH_ACTIONS, ids=" ".join)
def test_every_command_and_action_takes_dash_h(capsys: pytest.CaptureFixture[str],
                                               words: Words) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*words, "-h"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: fairgate {' '.join(words)} ")


# what a command wants besides the mistake, so the mistake is the only one
REQUIRED: dict[Words, list[str]] = {
    ("bench",): ["--url", "http://127.0.0.1:8080", "--workload", WORKLOADS[0]],
    **{("tenants", action): ["acme"] for action in ("create", "update", "delete", "import")},
    ("keys", "create"): ["acme"], ("keys", "revoke"): ["1"], ("jobs", "create"): ["--spec", "x"],
    **{("jobs", action): ["1"] for action in ("show", "cancel", "resume")},
    ("jobs", "apply"): ["1", "--backend", "http://127.0.0.1:8100"],
}


@pytest.mark.parametrize("words", COMMANDS + WITH_ACTIONS, ids=" ".join)
def test_an_unknown_flag_is_one_line_on_stderr_and_status_2(
        capsys: pytest.CaptureFixture[str], words: Words) -> None:
    assert main([*words, *REQUIRED.get(words, []), "--no-such-flag"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1 and "--no-such-flag" in err, err


def exit_status(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exited:
        return int(exited.code or 0)


@pytest.mark.parametrize("argv", [
    ["no-such-command"], ["serve", "--port", "eighty"], ["tenants", "no-such-action"],
    ["keys", "create"], ["bench", "--workload", WORKLOADS[0]]], ids=" ".join)
def test_a_mistake_argparse_finds_is_one_line_too(capsys: pytest.CaptureFixture[str],
                                                  argv: list[str]) -> None:
    assert exit_status(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err


@pytest.mark.parametrize(("words", "shown", "options"), TABLE, ids=[" ".join(w) for w in COMMANDS])
def test_each_row_names_options_and_actions_its_command_has(
        capsys: pytest.CaptureFixture[str], words: Words, shown: list[str],
        options: set[str]) -> None:
    text = help_of(capsys, *words)
    assert sorted(options - names(text)) == []
    actions, _ = listed(shown)
    if actions or help_actions(text):
        assert sorted(actions) == sorted(help_actions(text))


def test_the_tune_modes_in_the_table_are_the_ones_tune_takes(
        capsys: pytest.CaptureFixture[str]) -> None:
    [modes] = [listed(shown)[1]["--mode"] for words, shown, _ in TABLE if words == ("tune",)]
    assert main(["tune", "--mode", "no-such-mode"]) == 2
    refusal = capsys.readouterr().err
    taken = refusal.split("must be one of ", 1)[1].split(",")[0].split(" | ")
    assert sorted(modes) == sorted(taken)


def test_the_engine_row_sets_knobs_by_model_vllm_flags_and_set() -> None:
    args = parsed(["engine", "random:tiny", "--max-num-seqs", "8",
                   "--set", "max_num_batched_tokens=1024"])
    config = engine_cli.build_config(args.config, args.overrides, engine_cli.flag_knobs(args))
    assert (config.model, config.max_num_seqs, config.max_num_batched_tokens) == (
        "random:tiny", 8, 1024)


def test_the_bench_row_parses_as_shown() -> None:
    args = parsed(["bench", "--url", "http://127.0.0.1:8080", "--workload", WORKLOADS[0]])
    assert (args.url, args.workload) == ("http://127.0.0.1:8080", WORKLOADS[0])


# ---- what the README names ------------------------------------------------------------------
def readme_names() -> Iterator[tuple[Path, str]]:
    """(a folder the name may be relative to, the name) of each code span: a row of the tour
    names files in its own folder (`fairgate/`'s `cli.py`) beside paths from the root."""
    rest = []
    for line in readme().splitlines():
        cells = spans(line)
        if line.startswith("| `") and cells[0].endswith("/"):
            yield from ((ROOT / cells[0], cell) for cell in cells)
        else:
            rest.append(line)
    yield from ((ROOT, cell) for cell in spans("\n".join(rest)))


def test_every_path_the_readme_names_exists() -> None:
    paths = {(base, name) for base, name in readme_names()
             if PATH.fullmatch(name) and not name.startswith(".venv")}
    assert len(paths) > 20
    missing = {name for base, name in paths
               if not (base / name).exists() and not (ROOT / name).exists()}
    assert sorted(missing) == []


def test_every_module_and_name_the_readme_quotes_imports() -> None:
    dotted = {name for _, name in readme_names()
              if re.fullmatch(r"[a-z_]+(?:\.[a-z_]+){2,}", name)}
    assert {"control.app.make_app", "gateway.app.make_app"} <= dotted
    for name in dotted:
        module, attribute = name.rsplit(".", 1)
        assert hasattr(importlib.import_module(module), attribute), name
    # "`config.py`: `load_config_file`, `FairgateConfig`" in the `fairgate/` row
    quoted = re.findall(r"\| `(\w+)/` \|.*?`(\w+)\.py`: ((?:`\w+`(?:, )?)+)", readme())
    assert quoted
    for folder, module, attributes in quoted:
        for attribute in re.findall(r"`(\w+)`", attributes):
            assert hasattr(importlib.import_module(f"{folder}.{module}"), attribute), attribute


def test_make_installs_mkdocs_for_the_docs_site() -> None:
    assert "`.venv/bin/mkdocs serve` after `make test` has installed it" in " ".join(
        readme().split())
    dev = PYPROJECT["project"]["optional-dependencies"]["dev"]
    assert any(re.match(r"mkdocs\b", requirement) for requirement in dev)
    assert "'.[dev]'" in recipe_line(make_rules()["test"][0][0], "pip install", "-e")


def test_migration_0005_renames_the_itl_slo_to_tpot() -> None:
    text = " ".join(readme().split())
    assert "tenants migration 0005" in text and "so it now is `slo_tpot_p99_s`" in text
    [migration] = (ROOT / "tenants" / "migrations" / "versions").glob("0005_*.py")
    assert 'alter_column("slo_itl_p99_s", new_column_name="slo_tpot_p99_s")' in (
        migration.read_text())


# ---- docs/deploy.md: files, image, Compose --------------------------------------------------
# where a relative path the page quotes is read from: compose's variables by
# deploy/docker-compose.yaml, `base/` by the overlays
RELATIVE_TO = {"./": DEPLOY, "base/": K8S}
USER_FILES = {"deploy/.env", "checkpoint/"}  # the user's: secrets, a model


def deploy_paths() -> set[str]:
    words = {w for span in spans(DEPLOY_PAGE.read_text()) for part in span.split()
             for w in part.split("=")}
    return {w for w in words if PATH.fullmatch(w) and not w.startswith("/")
            and "kubernetes.io" not in w} - USER_FILES


def resolve(path: str) -> Path:
    base = next((b for prefix, b in RELATIVE_TO.items() if path.startswith(prefix)), ROOT)
    return base / path


def test_every_file_and_folder_the_deploy_page_names_exists() -> None:
    paths = deploy_paths()
    assert len(paths) >= 10
    assert sorted(p for p in paths if not resolve(p).exists()) == []


def test_the_image_is_the_one_the_page_builds() -> None:
    [tag] = re.findall(r"docker build -f deploy/Dockerfile -t (\S+) \.", page())
    assert interpolate(services()["gateway"]["image"]) == tag
    base = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    [image] = base["images"]
    assert f"{image['newName']}:{image['newTag']}" == tag
    args = dict(rest.split("=", 1) for word, rest in dockerfile_instructions()
                if word == "ARG" and "=" in rest)
    assert f"(CPU torch {args['TORCH_VERSION']})" in page()
    [build_arg] = re.findall(r"--build-arg (\w+)=", page())
    assert build_arg in args and args[build_arg].endswith("/whl/cpu")


def test_the_cuda_image_is_the_one_the_gpu_overlay_and_compose_run() -> None:
    text = page()
    [cuda] = re.findall(r"and tag it `(\S+)`, the image the GPU overlay runs", text)
    assert re.search(rf"overlays/gpu`: one GPU per engine, the `{cuda}` image", text)
    gpu = yaml.safe_load((K8S / "overlays" / "gpu" / "kustomization.yaml").read_text())
    [image] = gpu["images"]
    assert f"{image['newName']}:{image['newTag']}" == cuda
    [tag] = re.findall(r"`FAIRGATE_TAG=(\w+)`", text)
    image = services()["gateway"]["image"]
    assert re.sub(r"\$\{FAIRGATE_TAG:-\w+\}", tag, image) == cuda


def image_health_url() -> str:
    """What the image's HEALTHCHECK asks for when nothing overrides FAIRGATE_HEALTH_URL."""
    env = dict(re.findall(r"(\w+)=(\S+)", dict(dockerfile_instructions())["ENV"]))
    return env["FAIRGATE_HEALTH_URL"]


def test_the_image_health_check_is_the_gateways_liveness_path() -> None:
    assert "a HEALTHCHECK on `/healthz`" in page()
    url = urlsplit(image_health_url())
    assert (url.port, url.path) == (FairgateConfig().gateway.port, "/healthz")
    assert dict(dockerfile_instructions())["CMD"] == '["serve", "--host", "0.0.0.0"]'


def published_ports() -> dict[int, tuple[str, int]]:
    """Host port -> (service, container port) of every port Compose publishes."""
    return {int(host): (name, int(container)) for name, service in services().items()
            for host, container in (p.split(":") for p in service.get("ports", []))}


def test_compose_publishes_the_ports_the_page_quotes() -> None:
    quoted = {int(port) for port in re.findall(r"`:(\d+)`", page())}
    assert quoted == set(published_ports()), "the metrics listener stays unpublished"
    gateway = load_config_file(DEPLOY / "compose" / "fairgate.yaml")["gateway"]
    assert published_ports()[8080] == ("gateway", gateway["port"])
    assert published_ports()[9090][0] == "prometheus"
    assert services()["grafana"]["network_mode"] == "service:prometheus"  # :3000 is Grafana's
    assert {"postgres", "redis"} <= set(services())
    engines = [name for name, s in services().items() if s.get("command", [""])[0] == "engine"]
    assert len(engines) == 2 and "two simulated real-time engines" in page()


def test_every_variable_the_page_names_is_read_by_the_code_or_compose() -> None:
    variables = {w for span in spans(DEPLOY_PAGE.read_text()) for part in span.split()
                 for w in part.split("=")[:1] if re.fullmatch(r"[A-Z][A-Z0-9_]{3,}", w)}
    code = {ADMIN_KEY_ENV, SECRET_ENV, tenants_common.SECRET_ENV, ENGINE_KEY_ENV,
            ENGINE_ADMIN_KEY_ENV}
    compose_text = "".join(path.read_text() for path in COMPOSE_FILES)
    by_compose = {v for v in variables if f"${{{v}:" in compose_text}
    given = {v for v in variables if v in services()["gateway"]["environment"]}  # PGPASSWORD
    assert len(variables) >= 8
    assert sorted(variables - code - by_compose - given) == []


def compose_engine_args(name: str) -> argparse.Namespace:
    """The Compose engine's command as `fairgate engine` reads it, its -c file the mounted one."""
    mounts = {str(target): str(source) for target, source in mounts_of(name).items()}
    return parsed([mounts.get(word, word) for word in services()[name]["command"]])


def test_compose_secrets_have_defaults_and_reach_the_engines_and_the_gateway() -> None:
    text = page()
    secrets = re.search(r"The secrets \((.*?)\) come from the environment or `deploy/\.env`, "
                        r"with development defaults", text)
    assert secrets
    compose_text = (DEPLOY / "docker-compose.yaml").read_text()
    for name in re.findall(r"`(\w+)`", secrets[1]):
        assert re.search(rf"\$\{{{name}:-[^}}]+\}}", compose_text), f"{name}: no default"
    environment = {s: {k: interpolate(v) for k, v in services()[s]["environment"].items()}
                   for s in ("gateway", "engine-0", "engine-1")}
    gateway = FairgateConfig.from_dict(load_config_file(DEPLOY / "compose" / "fairgate.yaml"),
                                       environment["gateway"])
    assert gateway.gateway.admin_key == environment["gateway"][ADMIN_KEY_ENV]
    for name in ("engine-0", "engine-1"):
        access = engine_cli.build_access(compose_engine_args(name), environment[name])
        for backend in gateway.gateway.backends:  # the gateway sends what the engines want
            assert (backend.api_key, backend.admin_key) == (access.api_key, access.admin_key)


def test_the_secrets_file_the_page_names_is_git_ignored() -> None:
    assert "`deploy/.env`" in page()
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", "deploy/.env"], cwd=ROOT)
    assert ignored.returncode == 0


def test_the_checkpoint_variables_point_at_a_config_that_loads_from_the_models_folder() -> None:
    text = page()
    [path] = re.findall(r"FAIRGATE_ENGINE_CONFIG=(\S+)`", text)
    config = EngineConfig.from_dict(load_config_file(resolve(path))["engine"])
    [folder] = re.findall(r"`FAIRGATE_MODELS_DIR` to a folder holding the Hugging Face folder "
                          r"`(\w+)/` \(the engines load `([^`]+)`\)", text)
    assert config.model == folder[1] == f"/models/{folder[0]}"
    for compose_file in COMPOSE_FILES:
        engine = compose(compose_file)["services"]["engine-0"]
        [models] = [v for v in engine["volumes"] if v.split(":")[-2] == "/models"]
        assert models.startswith("${FAIRGATE_MODELS_DIR:")
    gpu_engine = compose(COMPOSE_FILES[1])["services"]["engine-0"]
    assert f"{path}:/etc/fairgate/engine.yaml:ro" in gpu_engine["volumes"]  # the same checkpoint


# ---- docs/deploy.md: Kubernetes ---------------------------------------------------------------
def manifests(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def deployment(path: Path) -> dict[str, Any]:
    [found] = [d for d in manifests(path) if d["kind"] == "Deployment"]
    return found


def secret_env(path: Path) -> dict[str, str]:
    """Variable -> key of fairgate-secrets, for the first container of the file's Deployment."""
    container = deployment(path)["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e["valueFrom"]["secretKeyRef"]["key"] for e in container["env"]
            if "secretKeyRef" in e.get("valueFrom", {})
            and e["valueFrom"]["secretKeyRef"]["name"] == "fairgate-secrets"}


def test_the_overlays_the_page_names_are_the_overlays() -> None:
    text = page()
    named = set(re.findall(r"deploy/k8s/overlays/([\w-]+)", text))
    folders = {p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml")}
    assert named == folders and "There are two overlays" in text and len(folders) == 2
    assert "`tests/deploy` renders both overlays with `kubectl kustomize`" in text
    assert set(RENDERED_OVERLAYS) == folders
    cpu_demo = yaml.safe_load((K8S / "overlays" / "cpu-demo" / "kustomization.yaml").read_text())
    assert {"postgres.yaml", "redis.yaml"} <= set(cpu_demo["resources"])
    assert cpu_demo["replicas"] == [{"name": "fairgate-engine", "count": 2}]
    gpu = deployment(K8S / "overlays" / "gpu" / "engine-gpu.yaml")["spec"]["template"]["spec"]
    assert gpu["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    [claim] = re.findall(r"from the `([\w-]+)` volume", text)
    assert {"name": "models", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}
            } in gpu["volumes"]
    [pvc] = manifests(K8S / "overlays" / "gpu" / "models-pvc.yaml")
    assert pvc["metadata"]["name"] == claim
    [model] = re.findall(r"the overlay's engine config loads `([^`]+)`", text)
    assert load_config_file(K8S / "overlays" / "gpu" / "config" / "engine.yaml")["engine"][
        "model"] == model
    mounts = {m["name"]: m["mountPath"] for m in gpu["containers"][0]["volumeMounts"]}
    assert model.startswith(mounts["models"] + "/")


def test_the_secret_keys_are_the_variables_the_page_pairs_them_with() -> None:
    text = page()
    pairs = dict(re.findall(r"`([a-z-]+)` \(= `(\w+)`\)", text))
    engine_pair = re.search(r"`([a-z-]+)` and `([a-z-]+)` \(= `(\w+)`, `(\w+)`, given to the "
                            r"engines and the gateway\)", text)
    assert engine_pair and len(pairs) == 3
    engine_keys = dict(zip(engine_pair.groups()[:2], engine_pair.groups()[2:], strict=True))
    [secret] = manifests(K8S / "base" / "secret.yaml")
    assert f"placeholder Secret `{secret['metadata']['name']}`" in text
    assert set(secret["stringData"]) == set(pairs) | set(engine_keys)
    gateway = secret_env(K8S / "base" / "gateway.yaml")
    engine = secret_env(K8S / "base" / "engine.yaml")
    assert gateway == {variable: key for key, variable in {**pairs, **engine_keys}.items()}
    assert engine == {variable: key for key, variable in engine_keys.items()}


def test_the_network_policies_select_what_the_page_quotes() -> None:
    text = page()
    policies = manifests(K8S / "base" / "networkpolicy.yaml")
    peers = [peer for policy in policies for rule in policy["spec"]["ingress"]
             for peer in rule.get("from", [])]
    [label] = re.findall(r"pods `([\w./-]+: \w+)` in namespace `(\w+)`", text)
    name, value = label[0].split(": ")
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": label[1]}},
                  "podSelector": {"matchLabels": {name: value}}}
    assert prometheus in peers
    selected = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]
                for p in policies}
    assert {"fairgate-postgres", "fairgate-redis"} <= selected
    assert all(re.search(rf"`{s}`", text) for s in ("fairgate-postgres", "fairgate-redis"))


def test_the_hpa_scales_on_the_metrics_the_adapter_serves_not_cpu() -> None:
    assert "not on CPU, through the Prometheus adapter" in page()
    [hpa] = manifests(K8S / "base" / "hpa.yaml")
    metrics = hpa["spec"]["metrics"]
    assert {m["type"] for m in metrics} == {"Pods"}
    wanted = {m["pods"]["metric"]["name"] for m in metrics}
    assert wanted == {"fairgate_engine_requests_waiting", "fairgate_engine_kv_cache_usage_ratio"}
    values = yaml.safe_load((K8S / "prometheus-adapter-values.yaml").read_text())
    assert wanted <= {rule["name"]["as"] for rule in values["rules"]["custom"]}


# ---- the probes, on the apps they probe -----------------------------------------------------
def probe_paths(path: Path) -> set[str]:
    """Every httpGet path of the file's Deployment, and the path of its FAIRGATE_HEALTH_URL."""
    container = deployment(path)["spec"]["template"]["spec"]["containers"][0]
    paths = {container[p]["httpGet"]["path"] for p in container if p.endswith("Probe")}
    env = {e["name"]: e.get("value") for e in container["env"]}
    if env.get("FAIRGATE_HEALTH_URL"):
        paths.add(urlsplit(env["FAIRGATE_HEALTH_URL"]).path)
    return paths


async def test_the_gateway_probe_paths_answer_on_the_served_gateway(
        aiohttp_client: Any, fresh_directory: Path) -> None:
    paths = probe_paths(K8S / "base" / "gateway.yaml") | {urlsplit(image_health_url()).path}
    client = await first_start(aiohttp_client)
    statuses = {path: (await client.get(path)).status for path in sorted(paths)}
    assert statuses == dict.fromkeys(sorted(paths), 200)


async def test_the_engine_probe_paths_answer_without_a_key(aiohttp_client: Any) -> None:
    """Kubelet and Compose's health check send no key: on an engine started as the manifests
    start it (0.0.0.0, with its keys), every path they probe still answers."""
    engine = services()["engine-0"]
    urls = [engine["environment"]["FAIRGATE_HEALTH_URL"],
            re.findall(r"http://[^']+", " ".join(engine["healthcheck"]["test"]))[0]]
    paths = probe_paths(K8S / "base" / "engine.yaml") | {urlsplit(u).path for u in urls}
    assert {urlsplit(u).port for u in urls} == {8100}
    args = compose_engine_args("engine-0")
    assert args.port == 8100
    config = engine_cli.build_config(args.config, args.overrides)
    environment = {k: interpolate(v) for k, v in engine["environment"].items()}
    access = engine_cli.build_access(args, environment)
    assert access.api_key is not None
    client = await aiohttp_client(make_engine_app(AsyncEngine(config), access=access))
    statuses = {path: (await client.get(path)).status for path in sorted(paths)}
    assert statuses == dict.fromkeys(sorted(paths), 200)
    assert (await client.get("/load")).status == 401  # the keys hold on what is not a probe

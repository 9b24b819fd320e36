"""deploy/k8s: each overlay renders with `kubectl kustomize`, every rendered object is valid
against the Kubernetes JSON schemas (offline, `kubernetes-validate`), and the render holds what
a working install needs: probes on the engine's paths, an HPA that does not scale on CPU alone,
a PDB on every Deployment, the Secrets the pods name, a fairgate.yaml the project's loader
accepts with the admin key from the Secret, engines that start on 0.0.0.0 only with the keys the
Secret gives them (and the gateway the same keys), and NetworkPolicies that let only the gateway
and Prometheus reach the engines, and only the gateway the database and Redis."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.config import ENGINE_ADMIN_KEY_ENV, ENGINE_KEY_ENV, EngineConfig
from fairgate.config import FairgateConfig, load_config_file, section
from gateway.config import ADMIN_KEY_ENV

ROOT = Path(__file__).resolve().parents[2]
K8S_DIR = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu-demo", "gpu")
K8S_VERSION = "1.32.0"  # the kubectl here; kubernetes-validate bundles its schemas
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}
NO_KUBECTL = "kubectl is not installed: it renders the overlays (`kubectl kustomize`)"
NO_VALIDATOR = ("kubernetes-validate is not installed: add it to the dev extras "
                "(pip install 'kubernetes-validate>=1.32') to check the manifests' schemas")


def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip(NO_KUBECTL)
    return path


def render(overlay: str) -> list[dict[str, Any]]:
    result = subprocess.run([kubectl(), "kustomize", str(K8S_DIR / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, f"kubectl kustomize {overlay} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(request.param)


@pytest.fixture(scope="module")
def validator() -> Any:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason=NO_VALIDATOR)
    return kubernetes_validate


def objects(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [doc for doc in objects(docs, kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def containers(pod_owner: dict[str, Any]) -> Iterator[dict[str, Any]]:
    spec = pod_owner["spec"]["template"]["spec"]
    yield from spec.get("initContainers", [])
    yield from spec["containers"]


def container(pod_owner: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in containers(pod_owner) if c["name"] == name)


def config_map_file(docs: list[dict[str, Any]], volume_owner: dict[str, Any],
                    volume: str, key: str) -> str:
    """The text of `key` in the ConfigMap that `volume` of a pod template mounts."""
    volumes = {v["name"]: v for v in volume_owner["spec"]["template"]["spec"]["volumes"]}
    name = volumes[volume]["configMap"]["name"]  # kustomize's hashed name
    return one(docs, "ConfigMap", name)["data"][key]


def test_every_object_matches_the_kubernetes_schema(rendered: list[dict[str, Any]],
                                                    validator: Any) -> None:
    checked = 0
    for doc in rendered:
        if (doc["apiVersion"], doc["kind"]) in CRD_KINDS:
            continue  # no schema bundled for CRDs: checked structurally below
        validator.validate(doc, K8S_VERSION, strict=True)  # raises naming the bad field
        checked += 1
    assert checked >= 10


def test_the_validator_rejects_a_broken_object(rendered: list[dict[str, Any]],
                                               validator: Any) -> None:
    # the check above is only worth something if a mistake fails it
    deployment = yaml.safe_load(yaml.safe_dump(one(rendered, "Deployment", "fairgate-engine")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"][
        "pathh"] = "/readyz"
    with pytest.raises(validator.ValidationError):
        validator.validate(deployment, K8S_VERSION, strict=True)


def test_service_monitors_are_well_formed(rendered: list[dict[str, Any]]) -> None:
    monitors = objects(rendered, "ServiceMonitor")
    assert {m["metadata"]["name"] for m in monitors} == {"fairgate-engine", "fairgate-gateway"}
    services = objects(rendered, "Service")
    for monitor in monitors:
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        labels = monitor["spec"]["selector"]["matchLabels"]
        matching = [s for s in services
                    if labels.items() <= s["metadata"].get("labels", {}).items()]
        assert len(matching) == 1, f"{monitor['metadata']['name']} selects {len(matching)} Services"
        port_names = {p["name"] for p in matching[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in port_names
            assert endpoint["path"] == "/metrics"


def test_engine_probes_use_the_engine_paths(rendered: list[dict[str, Any]]) -> None:
    engine = container(one(rendered, "Deployment", "fairgate-engine"), "engine")
    assert engine["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert engine["livenessProbe"]["httpGet"]["path"] == "/health"
    assert engine["args"][0] == "engine" and "0.0.0.0" in engine["args"]
    gateway = container(one(rendered, "Deployment", "fairgate-gateway"), "gateway")
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert gateway["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_hpa_scales_engines_on_load_not_cpu_alone(rendered: list[dict[str, Any]]) -> None:
    hpa = one(rendered, "HorizontalPodAutoscaler", "fairgate-engine")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": "fairgate-engine"}
    load_metrics = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]
                    if m["type"] == "Pods"}
    assert load_metrics & {"fairgate_engine_requests_waiting",
                           "fairgate_engine_kv_cache_usage_ratio"}
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_hpa_metrics_are_series_the_engine_exports(rendered: list[dict[str, Any]]) -> None:
    from tests.deploy.exposition import engine_names

    hpa = one(rendered, "HorizontalPodAutoscaler", "fairgate-engine")
    for metric in hpa["spec"]["metrics"]:
        if metric["type"] == "Pods":
            assert metric["pods"]["metric"]["name"] in engine_names()


def selects(selector: dict[str, Any], pod_owner: dict[str, Any]) -> bool:
    assert set(selector) == {"matchLabels"}, f"only matchLabels are checked here: {selector}"
    labels = pod_owner["spec"]["template"]["metadata"]["labels"]
    return bool(selector["matchLabels"].items() <= labels.items())


def fewest_replicas(docs: list[dict[str, Any]], deployment: dict[str, Any]) -> int:
    """The replicas it may run at its lowest: its HPA's minReplicas, else spec.replicas."""
    name = deployment["metadata"]["name"]
    for hpa in objects(docs, "HorizontalPodAutoscaler"):
        if hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": name}:
            return int(hpa["spec"].get("minReplicas", 1))
    return int(deployment["spec"].get("replicas", 1))


def test_every_deployment_has_one_pdb_that_lets_a_drain_through(
        rendered: list[dict[str, Any]]) -> None:
    budgets = objects(rendered, "PodDisruptionBudget")
    deployments = objects(rendered, "Deployment")
    assert {"fairgate-engine", "fairgate-gateway"} <= {d["metadata"]["name"] for d in deployments}
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        # an eviction fails outright when two budgets select a pod
        guarding = [b for b in budgets if selects(b["spec"]["selector"], deployment)]
        assert len(guarding) == 1, f"{name}: {len(guarding)} PodDisruptionBudgets select its pods"
        spec = guarding[0]["spec"]
        replicas = fewest_replicas(rendered, deployment)
        # at its fewest replicas a drain may still evict one pod (minAvailable == replicas,
        # e.g. minAvailable 1 on one replica, would block every node drain)
        if "maxUnavailable" in spec:
            assert isinstance(spec["maxUnavailable"], int) and spec["maxUnavailable"] >= 1, name
        else:
            assert isinstance(spec["minAvailable"], int) and spec["minAvailable"] < replicas, (
                f"{name}: minAvailable {spec['minAvailable']} of {replicas} blocks every drain")
    for budget in budgets:
        selected = [d for d in deployments if selects(budget["spec"]["selector"], d)]
        assert len(selected) == 1, (f"{budget['metadata']['name']} selects {len(selected)} "
                                    "Deployments")


def test_every_secret_key_a_pod_names_is_rendered(rendered: list[dict[str, Any]]) -> None:
    secrets = {s["metadata"]["name"]: s for s in objects(rendered, "Secret")}
    named = 0
    for owner in objects(rendered, "Deployment"):
        for c in containers(owner):
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is None:
                    continue
                assert ref["name"] in secrets, f"{owner['metadata']['name']}: no Secret {ref}"
                secret = secrets[ref["name"]]
                keys = set(secret.get("stringData", {})) | set(secret.get("data", {}))
                assert ref["key"] in keys, f"Secret {ref['name']} has no key {ref['key']}"
                named += 1
    gateway = container(one(rendered, "Deployment", "fairgate-gateway"), "gateway")
    assert {ADMIN_KEY_ENV, "FAIRGATE_KEY_SECRET", "PGPASSWORD"} <= {e["name"]
                                                                   for e in gateway["env"]}
    assert named >= 3


def secret_env(docs: list[dict[str, Any]], pod_owner: dict[str, Any],
               container_name: str) -> dict[str, str]:
    """The variables `container_name` gets from Secrets, with the rendered Secrets' values."""
    secrets = {s["metadata"]["name"]: s.get("stringData", {}) for s in objects(docs, "Secret")}
    env = {}
    for item in container(pod_owner, container_name).get("env", []):
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        if ref is not None:
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def test_gateway_config_loads_with_the_admin_key_from_the_secret(
        rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    """The gateway container reads the ConfigMap's fairgate.yaml as it is (no init container
    renders it) and its admin key from the Secret, as `fairgate serve` loads them."""
    gateway = one(rendered, "Deployment", "fairgate-gateway")
    assert "initContainers" not in gateway["spec"]["template"]["spec"]
    args = container(gateway, "gateway")["args"]
    assert args[:2] == ["serve", "-c"]
    config_path = Path(args[-1])
    mounts = {m["mountPath"]: m["name"] for m in container(gateway, "gateway")["volumeMounts"]}
    path = tmp_path / "fairgate.yaml"
    path.write_text(config_map_file(rendered, gateway, mounts[str(config_path.parent)],
                                    config_path.name))
    data = load_config_file(path)
    assert "admin_key" not in section(data, "gateway"), "a key in a ConfigMap"
    env = secret_env(rendered, gateway, "gateway")
    config = FairgateConfig.from_dict(data, env)
    gateway_config = config.gateway
    secret = one(rendered, "Secret", "fairgate-secrets")["stringData"]
    assert env[ADMIN_KEY_ENV] == secret["admin-key"]
    assert gateway_config.admin_key == secret["admin-key"]
    assert gateway_config.host == "0.0.0.0" and gateway_config.metrics_host == "0.0.0.0"
    # every engine pod, one backend each, through the headless Service
    assert [(b.url, b.discover) for b in gateway_config.backends] == [
        ("http://fairgate-engine-headless:8100", "dns")]
    headless = one(rendered, "Service", "fairgate-engine-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert gateway_config.redis == "redis://fairgate-redis:6379/0"
    assert config.database.startswith("postgresql+asyncpg://")
    ports = {p["containerPort"] for p in container(gateway, "gateway")["ports"]}
    assert {gateway_config.port, gateway_config.metrics_port} == ports


def test_engine_config_loads(rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    engine = one(rendered, "Deployment", "fairgate-engine")
    path = tmp_path / "engine.yaml"
    path.write_text(config_map_file(rendered, engine, "config", "engine.yaml"))
    EngineConfig.from_dict(section(load_config_file(path), "engine"))


def test_cpu_demo_runs_two_simulated_engines(tmp_path: Path) -> None:
    docs = render("cpu-demo")
    engine = one(docs, "Deployment", "fairgate-engine")
    assert engine["spec"]["replicas"] == 2
    assert one(docs, "HorizontalPodAutoscaler", "fairgate-engine")["spec"]["minReplicas"] == 2
    path = tmp_path / "engine.yaml"
    path.write_text(config_map_file(docs, engine, "config", "engine.yaml"))
    config = EngineConfig.from_dict(section(load_config_file(path), "engine"))
    assert (config.executor, config.sim_clock) == ("sim", "realtime")
    resources = container(engine, "engine")["resources"]
    assert "nvidia.com/gpu" not in resources.get("limits", {})
    # the database and Redis the base config names are part of the demo
    one(docs, "Service", "fairgate-postgres")
    one(docs, "Service", "fairgate-redis")


def test_gpu_overlay_asks_for_a_gpu_and_loads_a_checkpoint(tmp_path: Path) -> None:
    docs = render("gpu")
    engine = one(docs, "Deployment", "fairgate-engine")
    spec = engine["spec"]["template"]["spec"]
    resources = container(engine, "engine")["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert spec["nodeSelector"] and any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    path = tmp_path / "engine.yaml"
    path.write_text(config_map_file(docs, engine, "config", "engine.yaml"))
    config = EngineConfig.from_dict(section(load_config_file(path), "engine"))
    assert config.executor == "torch" and config.model.startswith("/models/")
    mounts = {m["mountPath"] for m in container(engine, "engine")["volumeMounts"]}
    assert "/models" in mounts
    claim = next(v for v in spec["volumes"] if v["name"] == "models")
    one(docs, "PersistentVolumeClaim", claim["persistentVolumeClaim"]["claimName"])
    assert all(c["image"].endswith(":cuda") for c in containers(engine))


def test_base_asks_for_no_gpu() -> None:
    engine = (K8S_DIR / "base" / "engine.yaml").read_text()
    docs = [d for d in yaml.safe_load_all(engine) if d]
    deployment = one(docs, "Deployment", "fairgate-engine")
    assert "nvidia.com/gpu" not in str(container(deployment, "engine")["resources"])


def test_the_prometheus_adapter_serves_the_hpa_metrics(rendered: list[dict[str, Any]]) -> None:
    values = yaml.safe_load((K8S_DIR / "prometheus-adapter-values.yaml").read_text())
    served = {rule["name"]["as"] for rule in values["rules"]["custom"]}
    hpa = one(rendered, "HorizontalPodAutoscaler", "fairgate-engine")
    wanted = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert wanted <= served, f"no adapter rule for {wanted - served}"


# ---- the engines' keys and who may reach them --------------------------------------------------
def engine_args(pod_owner: dict[str, Any]) -> argparse.Namespace:
    """The engine container's arguments as `fairgate engine` reads them."""
    from fairgate.engine_cli import register

    args = container(pod_owner, "engine")["args"]
    assert args[0] == "engine"
    parser = argparse.ArgumentParser()
    register(parser)
    return parser.parse_args(args[1:])


def test_engines_start_on_every_address_only_with_the_secrets_keys(
        rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    from fairgate.engine_cli import build_access

    engine = one(rendered, "Deployment", "fairgate-engine")
    args = engine_args(engine)
    path = tmp_path / "engine.yaml"
    path.write_text(config_map_file(rendered, engine, "config", "engine.yaml"))
    args.config = str(path)  # the ConfigMap's file, where the pod mounts it
    env = secret_env(rendered, engine, "engine")
    secret = one(rendered, "Secret", "fairgate-secrets")["stringData"]
    assert env == {ENGINE_KEY_ENV: secret["engine-key"],
                   ENGINE_ADMIN_KEY_ENV: secret["engine-admin-key"]}
    access = build_access(args, env)  # ValueError for a key under 16 characters
    assert (access.api_key, access.admin_key) == (secret["engine-key"], secret["engine-admin-key"])
    assert not access.allow_unauthenticated and "api_key" not in path.read_text()
    with pytest.raises(ValueError, match="no api key"):  # bound to 0.0.0.0: never open
        build_access(args, {})


def test_the_gateway_sends_every_engine_the_keys_the_engines_want(
        rendered: list[dict[str, Any]], tmp_path: Path) -> None:
    gateway = one(rendered, "Deployment", "fairgate-gateway")
    args = container(gateway, "gateway")["args"]
    mounts = {m["mountPath"]: m["name"] for m in container(gateway, "gateway")["volumeMounts"]}
    path = tmp_path / "fairgate.yaml"
    path.write_text(config_map_file(rendered, gateway, mounts[str(Path(args[-1]).parent)],
                                    Path(args[-1]).name))
    data = load_config_file(path)
    assert all("api_key" not in b and "admin_key" not in b
               for b in section(data, "gateway").get("backends", [])), "a key in a ConfigMap"
    config = FairgateConfig.from_dict(data, secret_env(rendered, gateway, "gateway"))
    engine_env = secret_env(rendered, one(rendered, "Deployment", "fairgate-engine"), "engine")
    assert config.gateway.backends
    for backend in config.gateway.backends:
        assert (backend.api_key, backend.effective_admin_key) == (
            engine_env[ENGINE_KEY_ENV], engine_env[ENGINE_ADMIN_KEY_ENV])


PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def policies_for(docs: list[dict[str, Any]], deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in objects(docs, "NetworkPolicy") if selects(p["spec"]["podSelector"],
                                                                 deployment)]


def allowed_peers(policy: dict[str, Any], port: str | int) -> list[dict[str, Any]]:
    """The `from` peers of the policy's rules that open `port` (a rule without `from`: {})."""
    peers: list[dict[str, Any]] = []
    for rule in policy["spec"].get("ingress", []):
        if any(p["port"] == port for p in rule.get("ports", [])):
            peers.extend(rule.get("from", [{}]))
    return peers


def gateway_pods_only(docs: list[dict[str, Any]], peer: dict[str, Any]) -> bool:
    return set(peer) == {"podSelector"} and selects(
        peer["podSelector"], one(docs, "Deployment", "fairgate-gateway"))


def test_network_policies_are_rendered_and_valid(rendered: list[dict[str, Any]],
                                                 validator: Any) -> None:
    policies = objects(rendered, "NetworkPolicy")
    assert {p["metadata"]["name"] for p in policies} == {
        "fairgate-engine", "fairgate-gateway", "fairgate-postgres", "fairgate-redis"}
    for policy in policies:
        assert policy["apiVersion"] == "networking.k8s.io/v1"
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        validator.validate(policy, K8S_VERSION, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(policies[0]))
    broken["spec"]["ingress"][0]["fromm"] = broken["spec"]["ingress"][0].pop("from")
    with pytest.raises(validator.ValidationError):
        validator.validate(broken, K8S_VERSION, strict=True)


def test_only_the_gateway_and_prometheus_reach_the_engines(
        rendered: list[dict[str, Any]]) -> None:
    engine = one(rendered, "Deployment", "fairgate-engine")
    [policy] = policies_for(rendered, engine)
    ports = {p["name"] for p in container(engine, "engine")["ports"]}
    for rule in policy["spec"]["ingress"]:
        assert {p["port"] for p in rule["ports"]} <= ports and rule["from"], rule
    peers = allowed_peers(policy, "http")
    assert len(peers) == 2 and PROMETHEUS in peers
    assert gateway_pods_only(rendered, next(p for p in peers if p != PROMETHEUS))


def test_the_gateways_metrics_port_is_for_prometheus_only(
        rendered: list[dict[str, Any]]) -> None:
    gateway = one(rendered, "Deployment", "fairgate-gateway")
    [policy] = policies_for(rendered, gateway)
    assert allowed_peers(policy, "metrics") == [PROMETHEUS]
    assert allowed_peers(policy, "http") == [{}]  # the API: from anywhere
    assert {p["name"] for p in container(gateway, "gateway")["ports"]} == {"http", "metrics"}


def test_only_the_gateway_reaches_the_database_and_redis() -> None:
    docs = render("cpu-demo")  # the overlay that runs them
    for name, port in (("fairgate-postgres", 5432), ("fairgate-redis", 6379)):
        deployment = one(docs, "Deployment", name)
        [policy] = policies_for(docs, deployment)
        peers = allowed_peers(policy, port)
        assert len(peers) == 1 and gateway_pods_only(docs, peers[0]), (name, peers)
        served = {p["containerPort"] for c in containers(deployment) for p in c["ports"]}
        assert served == {port}

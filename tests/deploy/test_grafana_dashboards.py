"""deploy/grafana: each dashboard is well-formed Grafana JSON, uses only variables it defines, and
queries only series the gateway and engine expose or the recording rules define."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.exposition import (
    DASHBOARDS_DIR,
    ROOT,
    engine_names,
    gateway_names,
    metric_names,
    promtool,
    recorded_names,
    rule_files,
)

DASHBOARDS = ("fairgate-gateway.json", "fairgate-engine.json", "fairgate-shadow.json")
PANEL_TYPES = {"timeseries", "stat"}
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s",
                    "__range_ms"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
# values a Grafana variable may take, to hand a query to promtool as PromQL
_SAMPLE_VALUES = {"__rate_interval": "5m", "__interval": "1m", "__range": "6h", "datasource": "x"}
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"


def _load(name: str) -> dict[str, Any]:
    return json.loads((DASHBOARDS_DIR / name).read_text())


def _variables(board: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {var["name"]: var for var in board["templating"]["list"]}


def _used_variables(text: str) -> set[str]:
    return {next(name for name in match.groups() if name) for match in _VARIABLE.finditer(text)}


def _exprs(board: dict[str, Any]) -> list[str]:
    return [target["expr"] for panel in board["panels"] for target in panel["targets"]]


def _variable_queries(board: dict[str, Any]) -> list[str]:
    """label_values(metric, label) of each query variable, as PromQL selecting `metric`."""
    queries = []
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["definition"])
            assert match, f"variable {var['name']}: expected label_values(metric, label)"
            queries.append(match.group(1))
    return queries


@pytest.fixture(scope="module")
def known_series() -> set[str]:
    return gateway_names() | engine_names() | recorded_names(rule_files())


def test_every_dashboard_is_there() -> None:
    assert sorted(path.name for path in DASHBOARDS_DIR.glob("*.json")) == sorted(DASHBOARDS)


@pytest.mark.parametrize("name", DASHBOARDS)
def test_dashboard_structure(name: str) -> None:
    board = _load(name)
    assert board["uid"] == name.removesuffix(".json")
    assert board["title"] and 36 <= board["schemaVersion"] <= 41
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {name}"
    for panel in board["panels"]:
        where = f"{name} panel {panel['id']} ({panel['title']})"
        assert panel["type"] in PANEL_TYPES, where
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24 and grid["h"] > 0, where
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where
        assert panel["targets"], f"{where}: no targets"
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), where
        for target in panel["targets"]:
            assert target.get("expr", "").strip(), f"{where}: target {target['refId']} has no expr"


@pytest.mark.parametrize("name", DASHBOARDS)
def test_dashboard_uses_only_defined_variables(name: str) -> None:
    board = _load(name)
    variables = _variables(board)
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    used = _used_variables(json.dumps(board["panels"]))
    for var in variables.values():
        used |= _used_variables(json.dumps(var.get("datasource", "")))
    assert used - GRAFANA_BUILTINS - set(variables) == set()
    defined_not_used = set(variables) - used
    assert defined_not_used == set(), f"variables no panel uses: {defined_not_used}"


@pytest.mark.parametrize("name", DASHBOARDS)
def test_dashboard_queries_only_exported_or_recorded_series(name: str,
                                                            known_series: set[str]) -> None:
    board = _load(name)
    unknown = {expr: sorted(metric_names(expr) - known_series)
               for expr in _exprs(board) + _variable_queries(board)}
    assert not {expr: names for expr, names in unknown.items() if names}
    assert all(metric_names(expr) for expr in _exprs(board)), "an expr reads no metric"


def test_dashboard_exprs_are_promql(tmp_path: Path) -> None:
    """promtool parses each expression, with Grafana's variables replaced by sample values."""
    tool = promtool()
    if tool is None:
        pytest.skip("promtool is not installed: run deploy/ci/install-tools.sh promtool "
                    "to parse the dashboards' PromQL")
    exprs = [expr for name in DASHBOARDS for expr in _exprs(_load(name))]
    rules = [{"record": f"dashboard:expr:{i}", "expr": _substitute(expr)}
             for i, expr in enumerate(exprs)]
    path = tmp_path / "dashboard-exprs.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run([tool, "check", "rules", str(path)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _substitute(expr: str) -> str:
    def value(match: re.Match[str]) -> str:
        name = next(group for group in match.groups() if group)
        return _SAMPLE_VALUES.get(name, ".*")

    return _VARIABLE.sub(value, expr)


def test_provisioning_matches_the_dashboards() -> None:
    datasources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yaml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus"
    for name in DASHBOARDS:
        assert _variables(_load(name))["datasource"]["current"]["value"] == source["uid"]
    providers = yaml.safe_load((PROVISIONING / "dashboards" / "fairgate.yaml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_exposition_names_are_what_a_scrape_shows() -> None:
    """The name derivation above: a Counter named x is scraped as x_total."""
    names = gateway_names() | engine_names()
    assert {"fairgate_engine_preemptions_total", "fairgate_gateway_slo_requests_total",
            "fairgate_gateway_ttft_seconds_bucket", "fairgate_engine_requests_waiting"} <= names
    assert "fairgate_engine_preemptions" not in names

"""deploy/prometheus: the rules load in Prometheus (promtool check rules), their unit tests pass
(promtool test rules), and they read only series the gateway and engine really expose."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.exposition import (
    RULE_TESTS_DIR,
    engine_names,
    gateway_names,
    metric_names,
    promtool,
    recorded_names,
    rule_files,
    rules,
)

NO_PROMTOOL = ("promtool is not installed: run deploy/ci/install-tools.sh promtool "
               "(apt-get install prometheus) to check the alerting rules")
BURN_WINDOWS = ("5m", "30m", "1h", "6h", "3d")
ERROR_BUDGET = "fairgate:slo_error_budget:ratio"


@pytest.fixture(scope="module")
def promtool_path() -> str:
    path = promtool()
    if path is None:
        pytest.skip(NO_PROMTOOL)
    return path


def _run(*args: str) -> str:
    result = subprocess.run(args, capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{output}"
    return output


def _rule_tests() -> list[Path]:
    return sorted(RULE_TESTS_DIR.glob("*.yaml"))


def test_promtool_check_rules(promtool_path: str) -> None:
    files = rule_files()
    assert {path.name for path in files} >= {"fairgate-slo.yaml", "fairgate-engine.yaml"}
    output = _run(promtool_path, "check", "rules", *map(str, files))
    assert "FAILED" not in output


def test_promtool_test_rules(promtool_path: str) -> None:
    files = _rule_tests()
    assert files, f"no rule unit tests in {RULE_TESTS_DIR}"
    output = _run(promtool_path, "test", "rules", *map(str, files))
    assert output.count("SUCCESS") == len(files), output


def test_rules_read_only_exposed_or_recorded_series() -> None:
    known = gateway_names() | engine_names() | recorded_names(rule_files())
    unknown = {
        rule.get("record") or rule["alert"]: sorted(metric_names(rule["expr"]) - known)
        for rule in rules(rule_files())
    }
    assert not {name: names for name, names in unknown.items() if names}


def test_every_alert_fires_in_a_unit_test() -> None:
    alerts = {rule["alert"] for rule in rules(rule_files()) if "alert" in rule}
    fired: set[str] = set()
    for path in _rule_tests():
        for group in yaml.safe_load(path.read_text())["tests"]:
            for case in group.get("alert_rule_test", []):
                if case.get("exp_alerts"):
                    fired.add(case["alertname"])
    assert alerts - fired == set(), "alerts no unit test shows firing"


def test_alerts_say_what_to_check() -> None:
    for rule in rules(rule_files()):
        if "alert" in rule:
            assert rule["labels"]["severity"] in {"page", "ticket", "warning"}, rule["alert"]
            assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]


def test_burn_rates_divide_by_the_one_error_budget() -> None:
    by_name = {rule["record"]: rule["expr"] for rule in rules(rule_files()) if "record" in rule}
    assert by_name[ERROR_BUDGET].strip() == "vector(0.01)"  # SLO target 99%
    for window in BURN_WINDOWS:
        assert f"fairgate:slo_miss_ratio:rate{window}" in by_name
        burn = by_name[f"fairgate:slo_burn_rate:rate{window}"]
        assert metric_names(burn) == {f"fairgate:slo_miss_ratio:rate{window}", ERROR_BUDGET}
    budget_literals = [name for name, expr in by_name.items() if "0.01" in expr]
    assert budget_literals == [ERROR_BUDGET]

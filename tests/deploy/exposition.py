"""What the deploy/ rules and dashboards may refer to: the series names the gateway and the engine
really expose (built from their registries, as a scrape would see them), the series the recording
rules define, and the metric names a PromQL expression reads."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import CollectorRegistry

ROOT = Path(__file__).resolve().parents[2]
RULES_DIR = ROOT / "deploy" / "prometheus" / "rules"
RULE_TESTS_DIR = ROOT / "deploy" / "prometheus" / "tests"
DASHBOARDS_DIR = ROOT / "deploy" / "grafana" / "dashboards"

# prometheus_client's exposition: a family of each type becomes these sample names
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "unknown": ("",),
}

PROMQL_WORDS = frozenset({
    # aggregations and their modifiers
    "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "by", "without",
    # binary operators and vector matching
    "and", "or", "unless", "bool", "on", "ignoring", "group_left", "group_right", "offset",
    "atan2",
    # literals
    "inf", "nan",
})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_LABEL_LISTS = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w.:$])[a-zA-Z_:][\w:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names `expr` selects: identifiers that are not functions, keywords, labels,
    durations or Grafana variables."""
    text = _STRING.sub('""', expr)
    text = _MATCHERS.sub("", text)
    text = _RANGES.sub("", text)
    text = _LABEL_LISTS.sub("", text)
    names: set[str] = set()
    for match in _NAME.finditer(text):
        name = match.group()
        if name in PROMQL_WORDS or text[match.end():].lstrip().startswith("("):
            continue
        names.add(name)
    return names


def exposed_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name `registry` exposes, including label sets not created yet."""
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in SAMPLE_SUFFIXES[family.type])
    return names


def gateway_names() -> set[str]:
    from control.shadow_metrics import ShadowMetrics
    from gateway.metrics import GatewayMetrics

    metrics = GatewayMetrics()
    ShadowMetrics(metrics.registry)  # the control plane's, on the gateway's registry
    return exposed_names(metrics.registry)


def engine_names() -> set[str]:
    from engine import EngineConfig
    from engine.async_engine import AsyncEngine
    from engine.metrics import EngineMetrics

    engine = AsyncEngine(EngineConfig(executor="sim", max_model_len=512, max_num_seqs=8,
                                      max_num_batched_tokens=512))
    return exposed_names(EngineMetrics(engine).registry)


def rule_files() -> list[Path]:
    return sorted(RULES_DIR.glob("*.yaml"))


def rules(paths: Iterable[Path]) -> list[dict[str, Any]]:
    found = []
    for path in paths:
        for group in yaml.safe_load(path.read_text())["groups"]:
            found.extend(group["rules"])
    return found


def recorded_names(paths: Iterable[Path]) -> set[str]:
    return {rule["record"] for rule in rules(paths) if "record" in rule}


def promtool() -> str | None:
    return shutil.which("promtool")

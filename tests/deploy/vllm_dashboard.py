"""vLLM's own Grafana dashboard, as test data (vllm_grafana_promql.yaml: the PromQL of each panel
of two versions of it, and the query of its model_name variable), and the sample names each
version's panels read."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.exposition import metric_names

DASHBOARDS: dict[str, dict[str, Any]] = yaml.safe_load(
    (Path(__file__).parent / "vllm_grafana_promql.yaml").read_text())["dashboards"]


def dashboard_samples(dashboard: Mapping[str, Any]) -> dict[str, set[str]]:
    """Sample name -> the titles of the panels whose PromQL reads it."""
    read: dict[str, set[str]] = {}
    for title, exprs in dashboard["panels"].items():
        for expr in exprs:
            for name in metric_names(expr):
                read.setdefault(name, set()).add(title)
    return read


def every_dashboard_sample() -> set[str]:
    """The sample names any version of the dashboard reads."""
    return {name for dashboard in DASHBOARDS.values() for name in dashboard_samples(dashboard)}

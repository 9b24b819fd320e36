"""Packages depend downward only: fairgate -> control -> gateway, tuner -> engine, tenants ->
protocol; engine -> kernels. The control plane (tune jobs, canary, shadow, capture, dashboard)
sits above the serving path and the tuner: gateway imports neither (it publishes request events
that control subscribes to, gateway/events.py). Nothing below imports fairgate, and nothing but
fairgate imports control."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# package -> the fairgate packages it may import (directly; the rest come through them)
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "kernels": set(),
    "engine": {"protocol", "kernels"},
    "tenants": {"protocol"},
    "tuner": {"engine", "protocol"},
    "gateway": {"engine", "tenants", "protocol"},
    "control": {"gateway", "tuner", "engine", "tenants", "protocol"},  # jobs check specs, read studies
    "fairgate": {"control", "gateway", "engine", "tenants", "tuner", "protocol", "kernels"},
}


def imported_packages(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(ALLOWED)


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_imports_go_downward_only(package: str) -> None:
    upward = {str(path.relative_to(ROOT)): sorted(found)
              for path in sorted((ROOT / package).rglob("*.py"))
              if (found := imported_packages(path) - ALLOWED[package] - {package})}
    assert upward == {}, f"{package} may import only {sorted(ALLOWED[package])}"

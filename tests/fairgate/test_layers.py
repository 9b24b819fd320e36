"""Packages depend downward only: fairgate -> control -> gateway, tuner -> engine, tenants ->
protocol; engine -> kernels. The control plane (tune jobs, canary, shadow, capture, dashboard)
sits above the serving path and the tuner: gateway imports neither (it publishes request events
that control subscribes to, gateway/events.py). Nothing below imports fairgate, and nothing but
fairgate imports control."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from aiohttp import web

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


def _routes(app: web.Application) -> set[tuple[str, str]]:
    return {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
            if r.method != "HEAD" and r.resource is not None}


def test_the_serving_app_has_no_control_plane_and_the_control_app_adds_it(
        tmp_path: Path) -> None:
    """gateway.app.make_app serves and documents the serving path's routes only; control.app's
    make_app adds the control plane's, and its request observers, on top."""
    from control import openapi as control_openapi
    from control.app import make_app as make_control_app
    from gateway import openapi
    from gateway.app import make_app
    from gateway.config import GatewayConfig
    from gateway.state import GATEWAY

    config = GatewayConfig.from_dict({"demo_tenant": False,
                                      "backends": [{"url": "http://127.0.0.1:9"}]})
    database = f"sqlite+aiosqlite:///{tmp_path / 'layers.db'}"
    serving = make_app(config, database=database)
    assert _routes(serving) == {(r.method, r.path) for r in openapi.ROUTES}
    assert not serving[GATEWAY].observers
    full = make_control_app(config, database=database)
    assert _routes(full) == {(r.method, r.path) for r in control_openapi.ROUTES}
    assert _routes(full) > _routes(serving)
    assert len(full[GATEWAY].observers) == 2  # the shadow set and the canary's window

"""fairgate owns seven top-level import names; check that each still resolves to fairgate's tree.

Installing another distribution that ships a package of the same name (Hugging Face's `kernels`)
silently replaces or shadows fairgate's, and the failure shows up much later as a confusing
ImportError or a wrong function. The check finds each package's spec without importing it and
reads the first line of its `__init__.py`, which names the package (`fairgate-package: NAME`).
"""

from __future__ import annotations

import importlib.util
from importlib.machinery import ModuleSpec
from pathlib import Path

PACKAGES = ("fairgate", "protocol", "engine", "gateway", "tuner", "control", "tenants", "kernels")
MARKER = "fairgate-package:"
ROOT = Path(__file__).resolve().parents[1]  # the folder that holds fairgate's packages


def problem(name: str, root: Path = ROOT) -> str | None:
    """What is wrong with the import name `name` (one line), or None when it is fairgate's
    package in `root`."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    if spec is None:  # e.g. another package's uninstall removed files the two shared
        return (f"the import name {name!r} resolves to nothing; reinstall fairgate, in its "
                f"own virtualenv or container")
    path = _shadowing_path(spec, name, root)
    if path is None:
        return None
    return (f"the import name {name!r} resolves to {path}, not fairgate's; another installed "
            f"package (pip show {name}) shadows it: install fairgate in its own virtualenv or "
            f"container")


def _shadowing_path(spec: ModuleSpec, name: str, root: Path) -> str | None:
    """Its `__init__.py` (or the folder of a namespace package) unless that is fairgate's."""
    if spec.origin is None or not spec.origin.endswith("__init__.py"):
        return spec.origin or ", ".join(spec.submodule_search_locations or [name])
    init = Path(spec.origin).resolve()
    if init.parent != root / name or not _has_marker(init, name):
        return str(init)
    return None


def _has_marker(init: Path, name: str) -> bool:
    try:
        with init.open(encoding="utf-8", errors="replace") as f:
            first = f.readline()
    except OSError:
        return False
    return first.strip().removeprefix('"""').strip() == f"{MARKER} {name}"


def check(packages: tuple[str, ...] = PACKAGES, root: Path = ROOT) -> str | None:
    """One error line for the first of `packages` that is not fairgate's own, else None."""
    for name in packages:
        found = problem(name, root)
        if found is not None:
            return f"fairgate: error: {found}"
    return None

"""Private means private: no module of the project uses another module's underscore names.

Every .py under the packages is scanned with `ast` for
- `from pkg.mod import _name` (relative imports too) where pkg.mod is a module of this project,
- `import pkg.mod` (or `from pkg import mod`, with or without `as`) followed by `mod._name`,
- `thing._name` on anything but `self` and `cls` when nothing in the same file defines `_name`
  (a def, a class, an assignment, a `__slots__` string): another module's object's internals.
  Library names that only look private are listed in LIBRARY_NAMES, each with its reason.
Dunder names (`__version__`) are public. What two modules really share gets a public name (and a
docstring), or the two are one module.

Tests are out of the scan: a test may reach into internals to check them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("fairgate", "protocol", "engine", "gateway", "tuner", "tenants", "kernels",
            "control", "bench")


# (file, attribute) read from a library object, not from a module of this project
LIBRARY_NAMES = {
    ("*", "_replace"),  # namedtuple's and urllib's SplitResult's public API
    ("*", "_asdict"),
    ("tuner/remote.py", "_exit"),  # os._exit: a forked worker must not run the parent's atexit
    ("tuner/evaluate.py", "_storage"),  # optuna: a trial's heartbeat has no public call
    ("tuner/evaluate.py", "_trial_id"),
    # prometheus_client: a histogram child has no public call to add many observations at
    # once (a stream's ITL gaps; tests/gateway/test_histogram_batches.py holds it to observe())
    ("gateway/metrics.py", "_buckets"),
    ("gateway/metrics.py", "_sum"),
}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_module(dotted: str) -> bool:
    """Whether `dotted` names a module or package of this project."""
    path = ROOT.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def absolute(node: ast.ImportFrom, package: str) -> str:
    """The module an ImportFrom reads from, resolved against `package` when it is relative."""
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    base = parts[:len(parts) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def violations(path: Path) -> list[str]:
    """`file:line: module.name` for each underscore name `path` takes from another module."""
    here = module_name(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    where = path.relative_to(ROOT)
    return [f"{where}:{line}: {use}"
            for line, use in private_uses(path.read_text(encoding="utf-8"), here, package)]


def private_uses(source: str, here: str, package: str) -> list[tuple[int, str]]:
    """(line, module.name) for each underscore name of another project module that `source`
    (module `here`, in `package`) imports or reads as an attribute."""
    tree = ast.parse(source)
    found: list[tuple[int, str]] = []
    modules: dict[str, str] = {}  # a local name -> the project module it is bound to

    def report(node: ast.AST, module: str, name: str) -> None:
        if module != here:
            found.append((getattr(node, "lineno", 0), f"{module}.{name}"))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if is_module(alias.name):
                    if alias.asname:
                        modules[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        modules[top] = top
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node, package)
            if not module or module.split(".")[0] not in PACKAGES or not is_module(module):
                continue
            for alias in node.names:
                if is_module(f"{module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{module}.{alias.name}"
                elif is_private(alias.name):
                    report(node, module, alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            module = dotted_module(node.value, modules)
            if module is not None:
                report(node, module, node.attr)
    return found


def dotted_module(node: ast.expr, modules: dict[str, str]) -> str | None:
    """The project module `node` (a name or a chain of attributes) stands for, if it is one."""
    if isinstance(node, ast.Name):
        return modules.get(node.id)
    if isinstance(node, ast.Attribute):
        parent = dotted_module(node.value, modules)
        if parent is not None and is_module(f"{parent}.{node.attr}"):
            return f"{parent}.{node.attr}"
    return None


def foreign_attributes(source: str, where: str) -> list[str]:
    """`where:line: expr` for each `thing._name` (not on self or cls) whose `_name` nothing in
    `source` (the file `where`) defines: it belongs to another module."""
    tree = ast.parse(source)
    defined: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            defined.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            defined.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            defined.add(node.value)  # a __slots__ entry, a getattr name
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and is_private(node.attr)
                and node.attr not in defined
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
                and not {(where, node.attr), ("*", node.attr)} & LIBRARY_NAMES):
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def sources() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                  if ".venv" not in p.parts)


def test_no_module_uses_another_modules_private_names() -> None:
    found = [line for path in sources() for line in violations(path)]
    assert found == [], ("underscore names used outside their module (make them public, or "
                         "keep them to their module):\n" + "\n".join(found))


def test_no_module_reaches_into_another_modules_objects() -> None:
    found = [line for path in sources()
             for line in foreign_attributes(path.read_text(encoding="utf-8"),
                                            str(path.relative_to(ROOT)))]
    assert found == [], ("underscore attributes of another module's objects (make them "
                         "public, or list a library's in LIBRARY_NAMES):\n" + "\n".join(found))


def test_the_scan_sees_each_kind_of_use() -> None:
    """The scanner on a probe module (gateway.probe): every kind of use it must flag, and what
    it must not (public and dunder names, a library's internals, attributes of a class)."""
    probe = """
import gateway.backends.remote
import gateway.upstream as upstream
from gateway import metrics
from gateway.backends import _hidden, Job, __all__
from .outlier import _rate
from aiohttp import _private_of_a_library
gateway.backends.remote._own_or
upstream._Limit
metrics._series
metrics.__name__
Job._fields
"""
    found = [use for _, use in private_uses(probe, "gateway.probe", "gateway")]
    assert sorted(found) == sorted([
        "gateway.backends._hidden", "gateway.outlier._rate", "gateway.backends.remote._own_or",
        "gateway.upstream._Limit", "gateway.metrics._series"])
    probe = """
class Local:
    __slots__ = ("_slot",)
    def _mine(self): return self._other
def use(jobs, local, parts):
    jobs._job(1)
    local._mine()
    local._slot
    parts._replace(netloc="x")
"""
    assert [line.split(": ", 1)[1] for line in foreign_attributes(probe, "gateway/probe.py")] == [
        "jobs._job"]

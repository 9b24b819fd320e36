"""fairgate.guard: a package that shadows one of fairgate's import names stops `fairgate` at
start with one line (exit 2); the real tree passes without importing any of the packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fairgate import guard

ROOT = Path(__file__).resolve().parents[2]
FOREIGN_INIT = '"""Hugging Face kernels."""\n'


def fairgate_help(cwd: Path, pythonpath: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(map(str, pythonpath))
    return subprocess.run([sys.executable, "-m", "fairgate", "--help"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def expected_line(name: str, path: Path) -> str:
    return (f"fairgate: error: the import name {name!r} resolves to {path}, not fairgate's; "
            f"another installed package (pip show {name}) shadows it: install fairgate in its "
            f"own virtualenv or container\n")


def test_the_real_tree_passes_without_importing_the_packages() -> None:
    assert guard.check() is None
    probe = ("import sys; from fairgate import guard; assert guard.check() is None; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in guard.PACKAGES))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['fairgate', 'fairgate.guard']"
    shown = fairgate_help(ROOT, [ROOT])
    assert shown.returncode == 0 and "serve" in shown.stdout, shown.stderr


def test_every_package_carries_its_marker() -> None:
    for name in guard.PACKAGES:
        first = (ROOT / name / "__init__.py").read_text(encoding="utf-8").splitlines()[0]
        assert first == f'"""fairgate-package: {name}'


def test_a_package_earlier_on_the_path_shadows_fairgates(tmp_path: Path) -> None:
    fake = tmp_path / "site-packages" / "kernels" / "__init__.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(FOREIGN_INIT)
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    done = fairgate_help(elsewhere, [fake.parents[1], ROOT])
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == expected_line("kernels", fake.resolve())


def copy_of_the_tree(dest: Path) -> Path:
    """fairgate/ whole and every other package's __init__.py: all that `--help` reads."""
    shutil.copytree(ROOT / "fairgate", dest / "fairgate",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for name in guard.PACKAGES[1:]:
        (dest / name).mkdir()
        shutil.copy(ROOT / name / "__init__.py", dest / name / "__init__.py")
    return dest


@pytest.mark.parametrize("damage", ["overwritten", "removed"])
def test_a_damaged_init_in_fairgates_own_tree(tmp_path: Path, damage: str) -> None:
    tree = copy_of_the_tree(tmp_path.resolve())
    assert fairgate_help(tree, []).returncode == 0  # the intact copy passes
    init = tree / "kernels" / "__init__.py"
    if damage == "overwritten":  # what `pip install kernels` did to a non-editable install
        init.write_text(FOREIGN_INIT)
        shadow = init
    else:  # what a later `pip uninstall kernels` leaves: a namespace package
        init.unlink()
        shadow = init.parent
    done = fairgate_help(tree, [])
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == expected_line("kernels", shadow)


def test_another_root_is_not_fairgates(tmp_path: Path) -> None:
    line = guard.check(root=tmp_path)
    assert line == expected_line("fairgate", ROOT / "fairgate" / "__init__.py").rstrip("\n")

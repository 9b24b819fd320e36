"""The documentation: the MkDocs site under docs/ builds with --strict (a broken link or anchor
fails it), the README's relative links point at files that exist, each command in the README's
command table links to a docs page that talks about it, and the README's map of the parts (the
folder tour and the layer diagram) is the one docs/architecture.md shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def readme() -> str:
    return README.read_text()


def section(text: str, heading: str) -> str:
    """The body of the `## heading` section of a markdown text (up to the next `## `)."""
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def relative_links(text: str) -> list[str]:
    return [target for target in LINK.findall(text)
            if not target.startswith(("http://", "https://", "mailto:", "#"))]


def test_the_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install -e '.[dev]' "
                        "installs it, as make test does) - the docs build check needs it")
    pytest.importorskip("material", reason="mkdocs-material (the site's theme) is not "
                        "installed (pip install -e '.[dev]')")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
         str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    problems = [line for line in proc.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert proc.returncode == 0, "\n".join(problems) or proc.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()


def test_every_relative_link_in_the_readme_points_at_a_file() -> None:
    links = relative_links(readme())
    assert links, "the README links into docs/"
    missing = [link for link in links if not (ROOT / link.split("#")[0]).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"


def test_every_docs_page_is_in_the_site_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert [p for p in pages if f": {p}" not in nav] == []


def command_rows() -> list[tuple[str, str]]:
    """(command, row) of each row of the README's command table: `fairgate serve`, `fairgate
    tune calibrate` (a nested command), ..., whatever the options after it."""
    from fairgate.cli import NESTED

    rows = []
    for line in section(readme(), "Commands").splitlines():
        found = re.match(r"\| `fairgate ([a-z]+)(?: ([a-z]+))?", line)
        if found:
            name, word = found.groups()
            nested = word is not None and (name, word) in NESTED
            rows.append((f"fairgate {name} {word}" if nested else f"fairgate {name}", line))
    return rows


def test_the_command_table_lists_every_subcommand() -> None:
    from fairgate.cli import NESTED, SUBCOMMANDS

    listed = {command for command, _ in command_rows()}
    wanted = {f"fairgate {name}" for name in SUBCOMMANDS}
    wanted |= {f"fairgate {' '.join(words)}" for words in NESTED}
    assert sorted(wanted - listed) == []


def test_every_command_in_the_readme_has_a_docs_page_that_covers_it() -> None:
    rows = command_rows()
    assert rows
    for command, row in rows:
        pages = [link.split("#")[0] for link in relative_links(row)
                 if link.startswith("docs/")]
        assert pages, f"the README's row for {command} links to no docs page"
        for page in pages:
            text = (ROOT / page).read_text()
            headings = [line for line in text.splitlines() if line.startswith("#")]
            named = any(command in h for h in headings) or f"`{command}" in text
            assert named, f"{page} (linked from the README's {command} row) never names it"


def code_block_after(text: str, marker: str) -> str:
    start = text.index("```", text.index(marker))
    return text[start:text.index("```", start + 3)]


def table_after(text: str, marker: str) -> list[str]:
    lines = text[text.index(marker):].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("| folder |"))
    table = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        table.append(line)
    return table


def test_the_readme_map_is_the_architecture_page() -> None:
    page = (DOCS / "architecture.md").read_text()
    marker = "Packages depend downward only"
    assert code_block_after(readme(), marker) == code_block_after(page, marker)
    assert table_after(readme(), "| folder |") == table_after(page, "| folder |")

"""docs/bench.md and docs/tuning.md against the commands they document, as a user meets them:
each option `fairgate bench`, `fairgate tune` and `fairgate tune calibrate` print in --help is
named on its page and each option the page names for a command is one it takes, with the default
the help states; the page's workloads are the registry's; the fake server's options exist; the
page's library snippet runs against a fake server and reads the report it gets.
(README command -> page: tests/test_docs.py; the tune table's flags: tests/tuner/
test_tune_options.py; the report's JSON: tests/tuner/test_bench_cli.py and test_loadgen.py.)
"""

from __future__ import annotations

import ast
import json
import re
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from fairgate.cli import main
from tests.test_design_contract import printed_help
from tuner import fake_server
from tuner.engines import ENGINES
from tuner.workload import WORKLOADS, Synthetic, get_workload

ROOT = Path(__file__).resolve().parent.parent
BENCH_PAGE = ROOT / "docs" / "bench.md"
TUNING_PAGE = ROOT / "docs" / "tuning.md"
CALIBRATE = "## Calibrating the simulator"  # where tuning.md turns to `fairgate tune calibrate`
FAKE_SERVER = "`python -m tuner.fake_server"  # where bench.md turns to the fake server

Words = tuple[str, ...]
# command -> (its page, where the page's prose about it starts, where it ends: None = the end)
SECTIONS: dict[Words, tuple[Path, str, str | None]] = {
    ("bench",): (BENCH_PAGE, "# ", FAKE_SERVER),
    ("tune",): (TUNING_PAGE, "# ", CALIBRATE),
    ("tune", "calibrate"): (TUNING_PAGE, CALIBRATE, None),
}
# Options a section names that belong to another program, from that program's own code:
# `fairgate tune --engine vllm|sglang` appends the engines' flags, tuning.md's calibrate
# section tells of bench/sim_fidelity.py's options.
OTHERS: dict[Words, Callable[[], set[str]]] = {
    ("bench",): set,
    ("tune",): lambda: {flag for engine in ENGINES.values()
                        for flag in (*engine.knob_flags.values(), engine.host_flag,
                                     engine.port_flag)},
    ("tune", "calibrate"): lambda: parser_options(ROOT / "bench" / "sim_fidelity.py"),
}

OPTION = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*")
VLLM_SPAN = re.compile(r"`vllm [^`]*`")  # vLLM's own command (`vllm bench serve --goodput`)
# "`--opt X` (default N", "`--opt` (N)", "`--opt` (300 s)", "`--opt N`, default N"
PAGE_DEFAULT = re.compile(r"`(--[a-z][\w-]*)[^`]*`(?: \(|, )(?:default )?(\d[\d.,]*)")
HELP_DEFAULT = re.compile(r"\b[Dd]efault:? (\d[\d.,]*)")


# ---- what the command prints ----------------------------------------------------------------


def help_entries(help_text: str) -> dict[frozenset[str], str]:
    """Each option of an argparse help text (its spellings: `-c`, `--config`) -> its help."""
    entries: dict[frozenset[str], str] = {}
    spellings: frozenset[str] | None = None
    for line in help_text.splitlines():
        if line.startswith("  -"):  # "  -c FILE, --config FILE   help..."
            invocation, _, description = line[2:].partition("  ")
            spellings = frozenset(OPTION.findall(invocation))
            entries[spellings] = description.strip()
        elif spellings is not None and line.startswith(" " * 3):  # its help, continued
            entries[spellings] = f"{entries[spellings]} {line.strip()}".strip()
        else:  # a group's heading or description
            spellings = None
    entries.pop(frozenset({"-h", "--help"}), None)
    return entries


def command_help(capsys: pytest.CaptureFixture[str], words: Words) -> dict[frozenset[str], str]:
    return help_entries(printed_help(capsys, main, *words))


def parser_options(path: Path) -> set[str]:
    """The `--options` a script's `add_argument` calls declare, read without running it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {str(arg.value) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
            for arg in node.args
            if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")}


# ---- what the page names --------------------------------------------------------------------


def command_lines(page: str) -> list[tuple[Words, str]]:
    """The `fairgate ...` lines of a page's code blocks (continuations joined, comments cut),
    each with the command it runs (the longest of SECTIONS' that its words start with)."""
    lines: list[tuple[Words, str]] = []
    pending = ""
    for line in page.splitlines():
        if pending or (line.startswith("    ") and line.strip().startswith("fairgate ")):
            pending += " " + line.split(" #")[0].strip().removesuffix("\\")
            if not line.rstrip().endswith("\\"):
                words = tuple(pending.split()[1:])
                command = max((c for c in SECTIONS if words[:len(c)] == c), key=len,
                              default=None)
                if command is not None:  # `fairgate engine ...` is no command of these pages
                    lines.append((command, pending.strip()))
                pending = ""
    return lines


def prose_without_commands(page: str, start: str, end: str | None) -> str:
    """The page from `start` to `end`: its prose, the code blocks' command lines cut out (the
    options there are their command's, whatever the section), vLLM's commands too."""
    text = page[page.index(start):page.index(end) if end else None]
    kept: list[str] = []
    in_command = False
    for line in text.splitlines():
        starts = line.startswith("    ") and line.strip().startswith("fairgate ")
        if starts or in_command:
            in_command = line.rstrip().endswith("\\")
            continue
        kept.append(line)
    return VLLM_SPAN.sub("", "\n".join(kept))


def named_options(pages: dict[Path, str], command: Words) -> set[str]:
    """Every option spelling the pages name for `command`: in its section's prose and in any
    command line that runs it."""
    path, start, end = SECTIONS[command]
    named = set(OPTION.findall(prose_without_commands(pages[path], start, end)))
    for page in pages.values():
        named |= {o for c, line in command_lines(page) if c == command
                  for o in OPTION.findall(line)}
    return named


def page_defaults(page: str) -> list[tuple[str, str]]:
    """(option, the default the page gives it) for each "`--opt` (default N)"-like phrase."""
    return [(o, d.rstrip(".,")) for o, d in PAGE_DEFAULT.findall(" ".join(page.split()))]


def unnamed(entries: dict[frozenset[str], str], named: set[str]) -> list[str]:
    """The options of a help that the page names by none of their spellings."""
    return sorted(max(s, key=len) for s in entries if not s & named)


def unknown(entries: dict[frozenset[str], str], named: set[str], others: set[str]) -> list[str]:
    """The long options the page names that the help does not print (nor another program has)."""
    known = set().union(*entries)
    return sorted(o for o in named if o.startswith("--") and o not in known | others)


@pytest.fixture(scope="module")
def pages() -> dict[Path, str]:
    return {p: p.read_text(encoding="utf-8") for p in (BENCH_PAGE, TUNING_PAGE)}


# ---- the options ----------------------------------------------------------------------------

COMMANDS = list(SECTIONS)
IDS = [" ".join(c) for c in COMMANDS]


@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
def test_the_page_names_every_option_the_help_prints(
        capsys: pytest.CaptureFixture[str], pages: dict[Path, str], command: Words) -> None:
    entries = command_help(capsys, command)
    assert len(entries) >= 5  # the help was read
    assert unnamed(entries, named_options(pages, command)) == []


@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
def test_every_option_the_page_names_is_in_the_help(
        capsys: pytest.CaptureFixture[str], pages: dict[Path, str], command: Words) -> None:
    others = OTHERS[command]()
    entries = command_help(capsys, command)
    assert unknown(entries, named_options(pages, command), others) == []


def test_the_programs_the_pages_borrow_options_from_have_them() -> None:
    """OTHERS reads real parsers: a renamed engine flag or fidelity option is not excused."""
    assert {"--max-num-seqs", "--chunked-prefill-size", "--host"} <= OTHERS[("tune",)]()
    assert {"--no-interleave", "--sim-seeds", "--noise-floor"} <= OTHERS[("tune", "calibrate")]()


@pytest.mark.parametrize("command", COMMANDS, ids=IDS)
def test_the_defaults_the_page_gives_are_the_helps(
        capsys: pytest.CaptureFixture[str], pages: dict[Path, str], command: Words) -> None:
    path, start, end = SECTIONS[command]
    said = page_defaults(prose_without_commands(pages[path], start, end))
    by_option = {o: text for spellings, text in command_help(capsys, command).items()
                 for o in spellings}
    checked = [(o, d, HELP_DEFAULT.search(by_option[o])) for o, d in said if o in by_option]
    assert checked, "the page gives some default"
    assert [(o, d, m.group(1).rstrip(".,")) for o, d, m in checked
            if m is not None and m.group(1).rstrip(".,") != d] == []


def test_the_fake_server_takes_the_options_the_page_gives_it(
        capsys: pytest.CaptureFixture[str], pages: dict[Path, str]) -> None:
    page = pages[BENCH_PAGE]
    named = {o for o in OPTION.findall(page[page.index(FAKE_SERVER):]) if o.startswith("--")}
    known = set().union(*help_entries(printed_help(capsys, fake_server.main)))
    assert {"--port", "--ttft", "--status"} <= named
    assert sorted(named - known) == []


# ---- the workloads and the library ----------------------------------------------------------


def workload_table(page: str) -> list[str]:
    """The names in the first column of the page's "## Workloads" table."""
    table = page[page.index("## Workloads"):].split("\n\n")[1]
    rows = [line.split("|")[1] for line in table.splitlines()[2:]]
    return [name for cell in rows for name in re.findall(r"`([\w-]+)`", cell)]


def test_the_workload_table_is_the_registry(pages: dict[Path, str]) -> None:
    assert sorted(workload_table(pages[BENCH_PAGE])) == sorted(WORKLOADS)


def test_the_inline_kinds_are_the_synthetic_workloads(pages: dict[Path, str]) -> None:
    kinds = re.search(r"`\{kind: ([\w|-]+),", pages[BENCH_PAGE])
    assert kinds is not None
    synthetic = [n for n in WORKLOADS if isinstance(get_workload(n), Synthetic)]
    assert kinds.group(1).split("|") == synthetic


ServerFactory = Callable[[web.Application], Awaitable[TestServer]]
# The page's snippet replays the Mooncake trace for 120 s; here the same call on a named
# synthetic workload, three requests, against the fake server.
SNIPPET_EDITS = {'"mooncake"': '"fixed"', "duration=120": "duration=None, num_requests=3",
                 '"http://127.0.0.1:8080"': "url", '"run.json"': "out"}


async def test_the_library_snippet_runs(
        aiohttp_server: ServerFactory, pages: dict[Path, str], tmp_path: Path) -> None:
    snippet = pages[BENCH_PAGE].split("```python\n", 1)[1].split("```", 1)[0]
    for old, new in SNIPPET_EDITS.items():
        assert snippet.count(old) == 1, old
        snippet = snippet.replace(old, new)
    *body, last = snippet.strip().splitlines()  # the last line reads the report: return it
    code = "async def snippet(url, key, out):\n" + textwrap.indent(
        "\n".join([*body, f"return ({last})"]), "    ")
    namespace: dict[str, Any] = {}
    exec(compile(code, str(BENCH_PAGE), "exec"), namespace)
    server = await aiohttp_server(fake_server.make_fake_app(api_keys=["k"]))
    out = tmp_path / "run.json"
    goodput, p99_ttft_ms, tenants, _ = await namespace["snippet"](
        str(server.make_url("")).rstrip("/"), "k", str(out))
    assert goodput > 0 and p99_ttft_ms >= 0 and tenants == {}  # one tenant: no table
    assert json.loads(out.read_text())["completed"] == 3

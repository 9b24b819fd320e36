"""docs/benchmarks.md (and bench/README.md, where there is one) against the benchmark scripts
under bench/ and bench/RESULTS.md: every script the pages name exists and every benchmark is
named on docs/benchmarks.md; the command lines the pages and the scripts' docstrings show parse
with the script's own parser, every option they name is one the script takes, and a docstring's
`[--opt VALUE]` is the option's default; each goal the pages and the docstrings state is the one
the script prints its verdict against; each figure the pages' result table quotes is one
bench/RESULTS.md records for that script. No benchmark is run: each script's `main` is called
only as far as its parser (its `parse_args` is stopped)."""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import importlib
import inspect
import io
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
BENCHMARKS_PAGE = ROOT / "docs" / "benchmarks.md"
PAGES = [page for page in (BENCHMARKS_PAGE, BENCH / "README.md") if page.is_file()]
RESULTS = BENCH / "RESULTS.md"

MAIN = 'if __name__ == "__main__":'
BENCHMARKS = sorted(path.stem for path in BENCH.glob("*.py") if MAIN in path.read_text())

SCRIPT = r"(?<![\w/.])(?:bench/)?(\w+)\.py\b"  # bench/X.py or X.py, not engine/heap.py
OPTION = r"(?<![\w-])--[a-z][\w-]*"
MENTION = re.compile(f"{SCRIPT}|{OPTION}")
COMMAND = re.compile(r"^ *(?:\.venv/bin/)?python bench/(\w+)\.py(.*)$")
PLACEHOLDER = re.compile(r"[A-Z][A-Z_]*(?:=[A-Z_]+)?")  # DIR, N, KNOB=VALUE: any value will do
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b1[0-2]-[0-3]\d(?:/[0-3]\d)?\b")  # 2026-12-05, 12-04/05

# A docstring's `[--opt VALUE]` shows the default, except where the default is the machine's.
EXAMPLES = {("tuner_vs_grid", "--workers"): "os.cpu_count(); 2 on the project's VM"}


# ---- the scripts ------------------------------------------------------------------------------


class Built(Exception):
    """Raised in place of `parse_args`: the script's parser, built and not yet used."""


@dataclass(frozen=True)
class Script:
    module: ModuleType
    parser: argparse.ArgumentParser
    actions: tuple[argparse.Action, ...]

    @property
    def options(self) -> set[str]:
        """The option strings its --help shows."""
        return {option for action in self.actions if action.help != argparse.SUPPRESS
                for option in action.option_strings}

    @property
    def positionals(self) -> list[str]:
        """A value for each positional argument: what an option shown alone needs beside it."""
        return ["1" for action in self.actions if not action.option_strings]

    def action(self, option: str) -> argparse.Action:
        return next(action for action in self.actions if option in action.option_strings)

    def parse_error(self, argv: list[str]) -> str | None:
        """What the parser says of `argv` when it refuses it (it exits 2)."""
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                self.parser.parse_args(argv)
        except SystemExit:
            return (stderr.getvalue().strip() or "exited").splitlines()[-1]
        return None


@functools.cache
def script(name: str) -> Script:
    """bench/NAME.py imported, its `main` (or `parse_args`) run up to the parser's first use."""
    module = importlib.import_module(f"bench.{name}")
    actions: list[argparse.Action] = []
    add_argument = argparse.ArgumentParser.add_argument

    def recorded(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> argparse.Action:
        actions.append(add_argument(self, *args, **kwargs))
        return actions[-1]

    def stopped(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        raise Built(self)

    with (mock.patch.object(argparse.ArgumentParser, "add_argument", recorded),
          mock.patch.object(argparse.ArgumentParser, "parse_args", stopped),
          pytest.raises(Built) as built):
        started = getattr(module, "parse_args", module.main)()
        if inspect.iscoroutine(started):  # an async main parses before its first await
            started.send(None)
    return Script(module, built.value.args[0], tuple(actions))


def docstring(name: str) -> str:
    return script(name).module.__doc__ or ""


# ---- command lines and options as text shows them -----------------------------------------------


def alternatives(text: str) -> list[list[str]]:
    """The words of a usage group, once per alternative (`--a X | --b`, `aiohttp|lean`)."""
    if " | " in text:
        return [choice.split() for choice in text.split(" | ")]
    words = [word for word in text.split() if word != "..."]
    choices = next((word for word in words if "|" in word), None)
    if choices is None:
        return [words]
    return [[choice if word == choices else word for word in words]
            for choice in choices.split("|")]


def argvs(arguments: str) -> list[list[str]]:
    """The argument lists a usage line stands for: every `[...]` group given, the n-th list with
    each group's n-th alternative (or its last), placeholders as `1`."""
    groups = [alternatives(bracket or word)
              for bracket, word in re.findall(r"\[([^\]]*)\]|(\S+)", arguments)]
    runs = max((len(group) for group in groups), default=1)
    return [["1" if PLACEHOLDER.fullmatch(word) else word
             for group in groups for word in group[min(run, len(group) - 1)]]
            for run in range(runs)]


def usage_lines(text: str) -> list[tuple[str, str]]:
    """(script, arguments) for each `python bench/X.py ...` line of a text, a continuation line
    that opens with `[` joined to it; a trailing `# comment` or `(note)` cut off."""
    usages: list[tuple[str, str]] = []
    for line in text.splitlines():
        shown = re.split(r"\s{2,}[(#]", line)[0]
        if command := COMMAND.match(shown):
            usages.append((command[1], command[2]))
        elif usages and shown.lstrip().startswith("["):
            usages[-1] = (usages[-1][0], f"{usages[-1][1]} {shown.strip()}")
    return usages


def code_lines(page: str) -> list[str]:
    """The lines of a page's ``` blocks, each command with its comment's continuation lines."""
    lines: list[str] = []
    fenced = False
    for line in page.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced and line[:1].isspace() and lines:
            lines[-1] += " " + line.strip()
        elif fenced:
            lines.append(line)
    return lines


def prose_units(page: str) -> list[tuple[str | None, str]]:
    """(the script a unit is about, its text): each table row, about its first cell's script,
    and each paragraph outside code blocks, about none until it names one."""
    prose = re.sub(r"^```.*?^```", "", page, flags=re.S | re.M)
    units: list[tuple[str | None, str]] = []
    for block in prose.split("\n\n"):
        if block.lstrip().startswith("|"):
            units += [(row_script(row), row) for row in block.strip().splitlines()]
        else:
            units.append((None, block))
    return units


def row_script(row: str) -> str | None:
    named = re.match(rf"\| `{SCRIPT}`", row)
    return named[1] if named else None


def named_options(text: str, subject: str | None, follow: bool) -> list[tuple[str | None, str]]:
    """(script, option) for each option a text names: those in a `X.py --opt` span are X's, those
    in another program's span (`git worktree add --detach`) no script's, any other the subject's;
    with `follow`, a script named on its own becomes the subject."""
    found: list[tuple[str | None, str]] = []
    for index, part in enumerate(text.split("`")):
        span = index % 2 == 1
        carrier = re.match(rf"(?:\S*python )?{SCRIPT}", part) if span else None
        if carrier and re.search(OPTION, part):
            found += [(carrier[1], option) for option in re.findall(OPTION, part)]
            continue
        if span and not carrier and not part.startswith("--"):
            continue
        for mention in MENTION.finditer(part):
            if mention[1] is None:
                found.append((subject, mention[0]))
            elif follow:
                subject = mention[1]
    return found


def unknown_options(named: Iterable[tuple[str | None, str]]) -> list[str]:
    return [f"{option} ({name or 'no script'})" for name, option in named
            if name not in BENCHMARKS or option not in script(name).options]


# ---- the recorded figures ---------------------------------------------------------------------


def normalised(text: str) -> str:
    """Whitespace as single spaces, thousands without commas (`1,024` -> `1024`)."""
    return re.sub(r"(?<=\d),(?=\d{3}\b)", "", " ".join(text.split()))


def result_rows(page: str) -> list[dict[str, str]]:
    """The rows of the page's `| benchmark | result | goal |` table, header -> cell."""
    rows: list[dict[str, str]] = []
    header: list[str] = []
    for line in page.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| benchmark |"):
            header = cells
        elif header and line.startswith("| `"):
            rows.append(dict(zip(header, cells, strict=True)))
        elif not line.startswith("|"):
            header = []
    return rows


@functools.cache
def record_of(name: str) -> str:
    """The sections of bench/RESULTS.md that name bench/NAME.py, normalised."""
    sections = RESULTS.read_text().split("\n## ")
    return normalised(" ".join(s for s in sections if name in re.findall(SCRIPT, s)))


def unrecorded(cell: str, record: str) -> list[str]:
    """The dates and figures of a cell that the record lacks. A figure is recorded where the
    record has a number that rounds to it at the figure's precision (9.59 -> 9.6, 103.6 -> 104)."""
    cell = normalised(cell)
    recorded = sorted(float(n) for n in NUMBER.findall(DATE.sub(" ", record)))
    missing = [date for date in DATE.findall(cell) if date not in record]
    for quoted in NUMBER.findall(DATE.sub(" ", cell)):
        half = 0.5 * 10 ** -len(quoted.partition(".")[2]) + 1e-9
        nearest = bisect.bisect_left(recorded, float(quoted) - half)
        if nearest == len(recorded) or recorded[nearest] > float(quoted) + half:
            missing.append(quoted)
    return missing


# ---- the goals --------------------------------------------------------------------------------


FIGURE = r"(\d[\d,]*(?:\.\d+)?)"


def phrase(text: str) -> str:
    """A pattern for `text` as written, `{}` standing for the goal's figure (group 1)."""
    return re.escape(text).replace(re.escape("{}"), FIGURE)


def figure(text: str) -> float:
    return float(text.replace(",", ""))


def printed(module: ModuleType, text: str) -> float:
    """A goal a script writes into the verdict it prints, where it names no constant for it."""
    found = re.search(phrase(text), inspect.getsource(module))
    assert found, f"{module.__name__} prints no {text!r}"
    return figure(found[1])


def one(values: Iterable[float]) -> float:
    (value,) = set(values)
    return value


def percent(fraction: float) -> float:
    return fraction * 100


class Goal(NamedTuple):
    script: str
    page: str | None  # a phrase of the script's goal cell on the page, `{}` its figure
    docstring: str | None  # a phrase of the script's docstring, likewise
    verdict: Callable[[Any], float]  # the script module -> what its verdict is printed against


GOALS = [
    Goal("scheduler", "<= {} ms at 256", "median <= {} ms at 256",
         lambda m: m.GOAL_MEDIAN_S * 1e3),
    Goal("scheduler", "ratio <= {}", "ratio 1,024/256 <= {}", lambda m: m.GOAL_RATIO),
    Goal("gateway_cpu", "<= {}x and", "at most {}x the mock's CPU per request",
         lambda m: m.GOALS[False]),
    Goal("gateway_cpu", "and <= {}x:", "non-streaming, {}x streaming", lambda m: m.GOALS[True]),
    Goal("engine_vs_hf", ">= {}x", "at least {}x", lambda m: m.GOAL_RATIO),
    Goal("loadgen", ">= {} requests/s", "({} req/s", lambda m: m.TARGET_REQ_S),
    Goal("loadgen", "{} streamed tokens/s", "{} tok/s)", lambda m: m.TARGET_TOK_S),
    Goal("gateway_overhead", "p50 <= {} ms", "p50 <= {} ms",
         lambda m: printed(m, "added p50 <= {} ms")),
    Goal("gateway_overhead", "p99 <= {} ms", "p99 <= {} ms",
         lambda m: printed(m, "ms, p99 <= {} ms")),
    Goal("gateway_overhead", ">= {} req/s", ">= {} non-streaming",
         lambda m: printed(m, "goal >= {} requests/s")),
    Goal("fairness", "ratios <= {}", "goal: <= {}x alone",
         lambda m: printed(m, "verdict(ratios[0] <= {})")),
    Goal("fairness", "service within {}%", "within {}% of the weights",
         lambda m: percent(printed(m, "weight_b - 1) <= {}"))),
    Goal("bad_key_flood", "<= {}x", "under the flood <= {}x",
         lambda m: printed(m, "no flood <= {}x at p50 and p99")),
    Goal("sim_fidelity", "p50s within {}%", "within {}% for throughput and the p50s",
         lambda m: percent(one(m.GOALS[k] for k in m.GOALS if "p99" not in k))),
    Goal("sim_fidelity", "p99s within {}%", "{}% for the p99s",
         lambda m: percent(one(m.GOALS[k] for k in m.GOALS if "p99" in k))),
    Goal("tuner_vs_grid", "{}x over the grid", "as the study does) >= {}x", lambda m: m.GAIN),
    Goal("shadow_overhead", "p50 <= {} ms", "<= {} ms at p50", lambda m: m.GOAL_P50_MS),
    Goal("shadow_overhead", "p99 <= {} ms", "<= {} ms at p99", lambda m: m.GOAL_P99_MS),
    Goal("shadow_overhead", ">= {} met", None, lambda m: m.GOAL_RATIO),
    Goal("shadow_overhead", None, "within {}% of mirroring off",
         lambda m: percent(1 - m.GOAL_RATIO)),
    Goal("slo_dashboard", "<= {} ms", "tenants view in <= {} ms", lambda m: m.GOAL_MS),
    Goal("routing", "TTFT p99 -{}%", ">= {}% lower TTFT p99",
         lambda m: percent(1 - m.GOAL_P99_RATIO)),
    Goal("routing", "throughput within {}%", "tokens/s within {}%",
         lambda m: percent(1 - m.GOAL_THROUGHPUT)),
    Goal("routing", "hit rate {}x", ">= {}x the hit rate", lambda m: m.GOAL_HIT_RATIO),
]

DEFECTS: dict[tuple[str, str], str] = {}  # (kind, script) -> a known defect: a strict xfail


def marked(kind: str, name: str, value: object, test_id: str) -> Any:
    """`value` as a test parameter, expected to fail where DEFECTS names its script's defect."""
    reason = DEFECTS.get((kind, name))
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(value, marks=marks, id=test_id)


def goal_id(goal: Goal, pattern: str | None) -> str:
    return f"{goal.script}:{pattern}"


def row_name(row: dict[str, str]) -> str:
    name = row_script(f"| {row['benchmark']}")
    assert name, f"{row['benchmark']} names no bench script"
    return name


def goal_cells(name: str) -> str:
    """The goal cells of NAME's rows on the pages, one per line."""
    return "\n".join(row["goal"] for page in PAGES for row in result_rows(page.read_text())
                     if row_name(row) == name)


# ---- the tests --------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_script_the_page_names_exists(page: Path) -> None:
    named = set(re.findall(SCRIPT, page.read_text()))
    assert named
    assert sorted(n for n in named if not (BENCH / f"{n}.py").is_file()) == []


def test_every_benchmark_is_named_on_the_benchmarks_page() -> None:
    named = set(re.findall(SCRIPT, BENCHMARKS_PAGE.read_text()))
    assert "common" not in BENCHMARKS  # a helper module, not a benchmark
    assert sorted(set(BENCHMARKS) - named) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_the_command_lines_the_page_shows_parse(page: Path) -> None:
    commands = [(command[1], command[2], line.partition("#")[2])
                for line in code_lines(page.read_text())
                if (command := COMMAND.match(line.split("#")[0]))]
    assert commands
    refused = [f"{name}: {argv}: {error}" for name, arguments, _ in commands
               for argv in argvs(arguments) if (error := script(name).parse_error(argv))]
    assert refused == []
    named = [found for name, arguments, comment in commands
             for found in named_options(f"{arguments} {comment}", name, follow=False)]
    assert unknown_options(named) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_option_the_page_names_is_its_scripts(page: Path) -> None:
    named = [found for subject, text in prose_units(page.read_text())
             for found in named_options(text, subject, follow=True)]
    assert named
    assert unknown_options(named) == []


@pytest.mark.parametrize("name", BENCHMARKS)
def test_the_docstring_usage_parses(name: str) -> None:
    usages = usage_lines(docstring(name))
    assert usages, f"bench/{name}.py's docstring shows no `python bench/{name}.py` line"
    refused = [f"{shown}: {argv}: {error}" for shown, arguments in usages
               for argv in argvs(arguments) if (error := script(shown).parse_error(argv))]
    assert refused == []


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_option_the_docstring_names_is_the_scripts(name: str) -> None:
    assert unknown_options(named_options(docstring(name), name, follow=False)) == []


@pytest.mark.parametrize("name", [marked("default", name, name, name) for name in BENCHMARKS])
def test_a_value_the_docstring_usage_shows_is_the_default(name: str) -> None:
    bench = script(name)
    shown = [(option, value) for _, arguments in usage_lines(docstring(name))
             for option, value in re.findall(r"\[(--[\w-]+) ([^\s\]|]+)\]", arguments)
             if not PLACEHOLDER.fullmatch(value) and (name, option) not in EXAMPLES
             and bench.action(option).default is not None]
    differ = [f"{option} {value}: default {bench.action(option).default!r}"
              for option, value in shown
              if getattr(bench.parser.parse_args([*bench.positionals, option, value]),
                         bench.action(option).dest) != bench.action(option).default]
    assert differ == []


@pytest.mark.parametrize("goal", [
    marked("page", goal.script, goal, goal_id(goal, goal.page))
    for goal in GOALS if goal.page])
def test_a_goal_the_page_states_is_the_scripts(goal: Goal) -> None:
    assert goal.page is not None
    stated = [figure(found) for found in re.findall(phrase(goal.page), goal_cells(goal.script))]
    assert stated, f"{goal.script}'s goal cell states no {goal.page!r}"
    verdict = goal.verdict(script(goal.script).module)
    assert [value for value in stated if not math.isclose(value, verdict)] == []


@pytest.mark.parametrize("goal", [goal for goal in GOALS if goal.docstring],
                         ids=lambda goal: goal_id(goal, goal.docstring))
def test_a_goal_the_docstring_states_is_the_verdicts(goal: Goal) -> None:
    assert goal.docstring is not None
    stated = re.search(phrase(goal.docstring), " ".join(docstring(goal.script).split()))
    assert stated, f"bench/{goal.script}.py's docstring states no {goal.docstring!r}"
    assert math.isclose(figure(stated[1]), goal.verdict(script(goal.script).module))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_bound_in_the_goal_column_is_checked(page: Path) -> None:
    unchecked = []
    for row in result_rows(page.read_text()):
        name = row_name(row)
        spans = [found.span(1) for goal in GOALS if goal.script == name and goal.page
                 for found in re.finditer(phrase(goal.page), row["goal"])]
        unchecked += [f"{name}: {bound[0]}" for bound in re.finditer(r"[<>]= ?(\d[\d,.]*)",
                                                                      row["goal"])
                      if not any(start <= bound.start(1) < end for start, end in spans)]
    assert unchecked == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_figure_the_results_table_quotes_is_recorded(page: Path) -> None:
    rows = result_rows(page.read_text())
    assert rows
    missing = [f"{row['benchmark']}: {quoted}" for row in rows for column in ("result", "goal")
               for quoted in unrecorded(row[column], record_of(row_name(row)))]
    assert missing == []

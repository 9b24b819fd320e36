"""docs/troubleshooting.md against the code, as a user meets it: every span the page quotes (in
backticks or double quotes) is one the code can produce or accept.

- Messages (a double-quoted span, or a backticked one of four words or more that is not a
  command): a string literal or f-string of the packages matches it, its `{...}` fields (and
  `%s`) standing for any text; a fragment (or a quote cut with `…`) is found in one's literal
  text. The page's main ones are also met for real, in-process: a port in use, an engine on a
  non-loopback host without a key, a refused vLLM flag, the simulated `l4` out of memory, a
  shadowing package.
- Commands (`fairgate keys create TENANT`) take `--help` and their metavars; options are
  taken by the command their entry is about (any command where it names none); routes are
  registered with their method; metrics are declared; each (status, code) of the Requests
  table and `404 model_not_found` is one an `ApiError` is raised with
  (tests/test_api_reference.py's `raised`).
- Any other span (a knob, a file, an environment variable) is made of words the packages'
  code (or prometheus_client's) has, and the stated numbers (eight import names, the metrics
  listener's address, the calibration thresholds) are the code's.
(The error codes on docs/api.md: tests/test_api_reference.py; the port-in-use line in a real
process: tests/fairgate/test_serve_shutdown.py.)
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import json
import re
import socket
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import prometheus_client
import pytest

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sim import HARDWARE_PRESETS
from fairgate import cli, engine_cli, guard, serve_cli
from gateway.config import GatewayConfig
from protocol.errors import ApiError
from protocol.openai import parse_request
from tests.test_api_reference import raised
from tuner.calibrate import MAX_MEDIAN_ERROR, MIN_R2

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "troubleshooting.md"
PACKAGES = ("fairgate", "gateway", "engine", "control", "tenants", "tuner", "protocol", "kernels")

QUOTE = re.compile(r"`([^`]+)`|\"([^\"]+)\"")
COMMAND = re.compile(r"fairgate(?: [a-z]+)*(?: [A-Z]+)?")
OPTION = re.compile(r"--?[A-Za-z][\w-]*")
METRIC = re.compile(r"fairgate_\w+")
ROUTE = re.compile(r"(GET|POST|PUT|PATCH|DELETE) (/\S*)")
STATUS_CODE = re.compile(r"([1-5]\d\d) ([a-z]+(?:_[a-z]+)+)")
KNOB = re.compile(r"[a-z]+(?:_[a-z0-9]+)+(?:: \S+)?")  # `max_model_len`, `kv_cache_dtype: int8`
ADDRESS = re.compile(r"\d+\.\d+\.\d+\.\d+:\d+")
PLACEHOLDER = re.compile(r"\{[^{}]*\}|%[-\d.]*[sdfrg]")
NUMBERS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
           "nine": 9, "ten": 10}


# ---- the page -------------------------------------------------------------------------------


def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def entries(text: str) -> list[str]:
    """The page's entries: its paragraphs, and each row of its table on its own."""
    found: list[str] = []
    for block in re.split(r"\n\s*\n", text):
        rows = [line for line in block.splitlines() if line.startswith("| ")]
        found.extend(rows[2:] if rows else [block])  # past a table's heading and rule
    return found


def quotes(entry: str) -> list[tuple[str, bool]]:
    """(text, double-quoted) for each quoted span of an entry, in order."""
    return [(m.group(1) or m.group(2), m.group(2) is not None) for m in QUOTE.finditer(entry)]


def lead(entry: str) -> str:
    """An entry's bold lead (`**... .**`), the symptom it is about; '' for none."""
    found = re.match(r"\*\*(.+?)\*\*", entry, re.DOTALL)
    return found.group(1) if found else ""


def is_message(text: str, double_quoted: bool) -> bool:
    return double_quoted or (len(text.split()) >= 4 and COMMAND.fullmatch(text) is None)


def messages(text: str) -> list[str]:
    return [q for entry in entries(text) for q, dq in quotes(entry) if is_message(q, dq)]


def entry_about(text: str, words: str) -> str:
    """The one entry whose lead quotes a span containing `words`."""
    [found] = [e for e in entries(text) if any(words in q for q, _ in quotes(lead(e)))]
    return found


def lead_quote(text: str, words: str) -> str:
    return next(q for q, _ in quotes(lead(entry_about(text, words))) if words in q)


# ---- the code -------------------------------------------------------------------------------


def source_files(*, libraries: bool = False) -> Iterator[Path]:
    """The packages' modules; with `libraries`, also those of the libraries whose names the
    page quotes (prometheus_client's `_created` series and the variable that turns them off)."""
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))
    if libraries:
        yield from sorted(Path(prometheus_client.__file__).parent.rglob("*.py"))


def template(node: ast.expr) -> list[str | None] | None:
    """A string constant or f-string as literal parts and None for each replacement field."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        return [v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else None
                for v in node.values]
    return None


@cache
def templates() -> tuple[tuple[str | None, ...], ...]:
    """Every string literal and f-string of the packages (a plain string's `{}` and `%s` are
    replacement fields too: str.format and the log's arguments fill them)."""
    found: set[tuple[str | None, ...]] = set()
    for file in source_files():
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.FormattedValue):
                continue
            parts = template(node) if isinstance(node, ast.expr) else None
            if parts is None:
                continue
            split: list[str | None] = []
            for part in parts:
                if part is None:
                    split.append(None)
                    continue
                for i, piece in enumerate(PLACEHOLDER.split(part)):
                    split.extend(([None] if i else []) + [piece])
            if len(re.findall(r"[A-Za-z]{2,}", "".join(p for p in split if p))) >= 2:
                found.add(tuple(split))  # not `f"{a} {b}"`, which would match anything
    return tuple(found)


def template_regex(parts: tuple[str | None, ...]) -> re.Pattern[str]:
    return re.compile("".join(".+?" if p is None else re.escape(p) for p in parts), re.DOTALL)


def produced(quote: str) -> bool:
    """Whether a source template can print `quote`: the whole of it with its fields filled,
    or (a fragment, or each piece of a quote cut with `…`) in order within its literal text."""
    pieces = [p.strip() for p in quote.split("…") if p.strip()]
    for parts in templates():
        if "…" not in quote and template_regex(parts).fullmatch(quote):
            return True
        literal = "\0".join(p or "" for p in parts)  # no piece spans a field
        at = 0
        for piece in pieces:
            found = words_in(piece, literal, at)
            if found is None:
                break
            at = found.end()
        else:
            return True
    return False


def words_in(fragment: str, text: str, start: int = 0) -> re.Match[str] | None:
    """Where `fragment` is in `text` as whole words ("out of mem" is not in "out of memory")."""
    edge = r"(?<!\w)" if fragment[:1].isalnum() else ""
    end = r"(?!\w)" if fragment[-1:].isalnum() else ""
    return re.compile(edge + re.escape(fragment) + end).search(text, start)


@cache
def vocabulary() -> frozenset[str]:
    """The words of the packages' (and libraries') code: names, attributes, arguments, string
    and number literals (not comments)."""
    words: set[str] = set()
    for file in source_files(libraries=True):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Name):
                words.add(node.id)
            elif isinstance(node, ast.Attribute):
                words.add(node.attr)
            elif isinstance(node, ast.arg):
                words.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str | int | float):
                words.update(re.findall(r"\w+", str(node.value)))
    return frozenset(words)


@cache
def source_text() -> str:
    return "\n".join(f.read_text(encoding="utf-8") for f in source_files())


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """`fairgate NAME` -> its parser, for each command and nested command."""
    parsers: dict[str, argparse.ArgumentParser] = {}
    modules = {name: module for name, (module, _) in cli.SUBCOMMANDS.items()}
    modules.update({" ".join(words): module for words, (module, _) in cli.NESTED.items()})
    for name, module in modules.items():
        parser = argparse.ArgumentParser(prog=f"fairgate {name}")
        __import__(module, fromlist=["register"]).register(parser)
        parsers[name] = parser
    return parsers


def options_of(parser: argparse.ArgumentParser) -> set[str]:
    """The options a parser and its subcommands' parsers take."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= options_of(sub)
    return found


# ---- every quote is the code's --------------------------------------------------------------


def test_the_page_quotes_messages_commands_codes_and_metrics() -> None:
    spans = [q for e in entries(page()) for q, _ in quotes(e)]
    assert len(messages(page())) >= 4, messages(page())
    assert any(COMMAND.fullmatch(s) for s in spans)
    assert any(METRIC.fullmatch(s) for s in spans)
    assert any(STATUS_CODE.fullmatch(s) for s in spans)


def test_every_quoted_message_is_one_the_code_prints() -> None:
    stale = [q for q in messages(page()) if not produced(q)]
    assert not stale, f"docs/troubleshooting.md quotes messages no code produces: {stale}"


def test_every_quoted_command_runs_with_its_arguments(
        capsys: pytest.CaptureFixture[str]) -> None:
    commands = {q for e in entries(page()) for q, dq in quotes(e)
                if not dq and COMMAND.fullmatch(q) and q != "fairgate"}
    assert commands
    for command in sorted(commands):
        words = command.split()[1:]
        subcommand = [w for w in words if w.islower()]
        with pytest.raises(SystemExit) as exited:
            cli.main([*subcommand, "--help"])
        usage = capsys.readouterr().out
        assert exited.value.code == 0, command
        for metavar in (w for w in words if w.isupper()):
            assert re.search(rf"\b{metavar.lower()}\b", usage, re.IGNORECASE), (command, usage)


def test_every_quoted_option_is_taken_by_its_command() -> None:
    parsers = command_parsers()
    everyone = set().union(*(options_of(p) for p in parsers.values()))
    wrong = []
    for entry in entries(page()):
        named = [n for n in parsers if re.search(rf"\bfairgate {n}\b(?! [a-z])", entry)]
        about = max(named, key=len, default=None)  # `fairgate tune calibrate`, not `tune`
        for quote, _ in quotes(entry):
            if OPTION.fullmatch(quote):
                taken = everyone if about is None else options_of(parsers[about])
                if quote not in taken:
                    wrong.append(f"{quote} (fairgate {about or '...'})")
    assert not wrong, f"options no command the page names takes: {wrong}"


@cache
def raised_codes() -> frozenset[tuple[int | None, str]]:
    """(status, code) of each `ApiError` the packages raise with a constant code."""
    return frozenset((r.status, r.code) for r in raised(PACKAGES))


def test_every_quoted_route_metric_and_code_is_the_codes() -> None:
    codes = raised_codes()
    spans = [q for e in entries(page()) for q, _ in quotes(e)]
    missing = []
    for span in spans:
        route, metric, status_code = (ROUTE.fullmatch(span), METRIC.fullmatch(span),
                                      STATUS_CODE.fullmatch(span))
        if route and not re.search(rf"add_{route[1].lower()}\(\s*\"{re.escape(route[2])}\"",
                                   source_text()):
            missing.append(span)
        if metric and f'"{span}"' not in source_text():
            missing.append(span)
        if status_code and (int(status_code[1]), status_code[2]) not in codes:
            missing.append(span)
    assert not missing, f"routes, metrics or (status, code)s the code does not have: {missing}"


def table_codes(text: str) -> set[tuple[int, str]]:
    """(status, code) for each code in the first column of the Requests table."""
    listed: set[tuple[int, str]] = set()
    for row in entries(text):
        if row.startswith("| "):
            answer = row.split("|")[1]
            status = re.match(r" (\d{3})\b", answer)
            assert status, row
            listed |= {(int(status[1]), code) for code in re.findall(r"`(\w+)`", answer)}
    return listed


def test_every_code_of_the_requests_table_is_raised_with_its_status() -> None:
    listed = table_codes(page())
    assert len(listed) >= 8, listed
    never = sorted(listed - raised_codes())
    assert not never, f"the Requests table lists (status, code)s nothing raises: {never}"


def test_every_other_quoted_name_is_made_of_the_codes_words() -> None:
    shapes = (COMMAND, OPTION, METRIC, ROUTE, STATUS_CODE)
    unknown = []
    for entry in entries(page()):
        for quote, dq in quotes(entry):
            if is_message(quote, dq) or any(s.fullmatch(quote) for s in shapes):
                continue
            words = [w for w in re.findall(r"\w+", quote) if w != "_"]
            assert words, quote
            if not all(w in vocabulary() for w in words):
                unknown.append(quote)
    assert not unknown, f"names with words the code does not have: {unknown}"


# ---- the page's messages, met for real ------------------------------------------------------


def test_a_port_in_use_is_the_quoted_line_and_no_banner(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    quote = lead_quote(page(), "cannot listen")
    banner = next(m for m in messages(page()) if "…" in m and m.startswith("fairgate gateway"))
    monkeypatch.setattr(serve_cli, "setup_logging", lambda level: None)
    monkeypatch.setattr(serve_cli, "install_fast_event_loop", lambda: None)
    monkeypatch.chdir(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        # a remote backend: no engine to build, only the bind can fail
        (tmp_path / "fairgate.yaml").write_text(json.dumps({
            "database": f"sqlite:///{tmp_path / 'fg.db'}",
            "gateway": {"port": port, "metrics_port": None, "demo_tenant": False,
                        "backends": [{"url": "http://127.0.0.1:9"}]}}))
        try:
            assert cli.main(["serve", "-c", "fairgate.yaml"]) == 2
        finally:
            asyncio.set_event_loop(None)  # serve's loop, closed, is no later test's
    out, err = capsys.readouterr()
    assert err.startswith(ADDRESS.sub(f"127.0.0.1:{port}", quote)), err
    assert banner.split("…")[0] not in out, out


def test_a_non_loopback_engine_without_a_key_is_refused_naming_the_ways_out(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    entry = entry_about(page(), "fairgate engine")
    ways_out = [q for q, _ in quotes(entry)[1:] if q != "--host"]
    assert len(ways_out) >= 3, ways_out
    monkeypatch.delenv("FAIRGATE_ENGINE_KEY", raising=False)
    monkeypatch.setattr(engine_cli, "setup_logging", lambda level: None)
    assert cli.main(["engine", "--host", "0.0.0.0"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("fairgate engine: error: --host 0.0.0.0"), line
    assert [q for q in ways_out if q not in line] == [], line
    parser = cli.build_parser(["engine"])
    for extra, environ in ((["--api-key", "k" * 32], {}),
                           (["--allow-unauthenticated"], {}),
                           ([], {"FAIRGATE_ENGINE_KEY": "k" * 32})):
        args, _ = parser.parse_known_args(["engine", "--host", "0.0.0.0", *extra])
        engine_cli.build_access(args, environ)  # no refusal


def test_a_vllm_flag_fairgate_lacks_is_refused_by_name_with_the_reason(
        capsys: pytest.CaptureFixture[str]) -> None:
    quote = lead_quote(page(), "is a vLLM flag")
    with pytest.raises(SystemExit) as exited:
        cli.main(["engine", quote.split()[0], "2"])
    assert exited.value.code == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith(f"fairgate engine: error: {quote} ("), line


def test_out_of_memory_names_the_knobs_and_max_model_len_makes_l4_start(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    entry = entry_about(page(), "memory")
    said = [q for q, dq in quotes(lead(entry)) if dq]
    assert said and all(produced(q) for q in said), said
    # the knobs the entry names are named by the messages it quotes
    memory = " ".join("".join(p or " " for p in t) for t in templates()
                      if any(q in "".join(p or "" for p in t) for q in said))
    knobs = []  # `max_model_len`; `kv_cache_dtype: int8`, a knob with a value it takes
    for quote in (q for q, _ in quotes(entry) if KNOB.fullmatch(q)):
        knob, _, value = quote.partition(": ")
        if value:
            EngineConfig.from_dict({knob: value})  # ValueError: not a knob, or not its value
        knobs.append(knob)
    assert len(knobs) >= 4, knobs
    assert sorted(k for k in knobs if k not in EngineConfig.__dataclass_fields__) == []
    assert sorted(k for k in knobs if k not in memory) == []
    [hardware] = {q for q, _ in quotes(entry)} & set(HARDWARE_PRESETS)
    assert EngineConfig().sim_model == "llama-3-8b" and "Llama-3-8B" in entry
    monkeypatch.setattr(engine_cli, "setup_logging", lambda level: None)
    argv = ["engine", "--set", "executor=sim", "--set", f"sim_hardware={hardware}"]
    assert cli.main(argv) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("fairgate engine: error: "), line
    assert any(words_in(q, line) for q in said), line
    assert "max_model_len (131072)" in line and "128k" in entry  # the model's whole context
    engine = LLMEngine(EngineConfig(executor="sim", sim_hardware=hardware, max_model_len=8192))
    assert engine.config.max_model_len == 8192


def test_the_fields_the_page_says_are_refused_are() -> None:
    [row] = [r for r in entries(page()) if r.startswith("| 400 naming a field")]
    named = [q for q, _ in quotes(row.split("|")[2])]
    assert named == ["n", "tools", "logprobs"], named
    values = {"n": 2, "tools": [{"type": "function", "function": {"name": "f"}}], "logprobs": 1}
    bodies: dict[str, dict[str, Any]] = {"completions": {"model": "m", "prompt": "hi"},
              "chat": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    for endpoint, body in bodies.items():
        for field in named:
            with pytest.raises(ApiError) as refused:
                parse_request({**body, field: values[field]}, endpoint)
            assert (refused.value.status, refused.value.param) == (400, field)


def test_a_shadowing_package_is_one_line_naming_it_and_its_path(tmp_path: Path) -> None:
    entry = next(e for e in entries(page()) if lead(e).startswith("A line naming a package"))
    count = re.search(r"fairgate's (\w+) import names", entry)
    assert count and NUMBERS[count[1]] == len(guard.PACKAGES), entry
    assert {q for q, _ in quotes(entry)} <= set(guard.PACKAGES)
    assert guard.check() is None  # this checkout's own
    line = guard.check(root=tmp_path)  # every package is then someone else's
    assert line is not None and "\n" not in line
    assert "'fairgate'" in line and str(ROOT / "fairgate" / "__init__.py") in line, line


def test_the_stated_numbers_are_the_codes() -> None:
    text = " ".join(page().split())  # the lines joined
    config = GatewayConfig()
    assert f"`{config.metrics_host}:{config.metrics_port}` by default" in text
    assert re.search(rf"R² < {MIN_R2:g} or median error > {MAX_MEDIAN_ERROR:.0%}", text)

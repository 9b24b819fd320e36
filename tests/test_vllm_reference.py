"""docs/vllm.md against `fairgate engine`'s parser, as a vLLM user meets the page: every flag its
table says the engine takes is taken and reaches the knob (or server option) the table names,
with the defaults and vLLM value spellings it states; the table lists every flag of the code's
table; the example command runs as shown; every flag the prose says is refused is refused in
one line that names it, with a reason citing what the page cites, or by name alone where it
says so, and a flag on neither list is one line too; the tuner's flags and the yaml key
aliases are the ones the page names. The page is parsed here, not the code's table.
(tests/fairgate/test_vllm_flags.py checks the table against vLLM's own flag list and that the
page holds `markdown_table()`; this file reads the page's words.)"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.vllm_flags import KEY_ALIASES, VLLM_FLAGS
from fairgate.cli import build_parser, main
from fairgate.engine_cli import build_config, flag_knobs

PAGE = Path(__file__).resolve().parents[1] / "docs" / "vllm.md"
PROG = "fairgate engine"
# vLLM's flags of the families the page names without spelling a flag (from `vllm serve --help`)
FAMILIES = {"LoRA": ["--enable-lora", "--lora-modules", "--max-loras", "--max-lora-rank"],
            "multimodal": ["--limit-mm-per-prompt", "--mm-processor-kwargs"]}


# ---- the page -------------------------------------------------------------------------------
def section(title: str, text: str | None = None) -> str:
    """The body of the page's `## title` section."""
    text = PAGE.read_text() if text is None else text
    _, found, body = text.partition(f"\n## {title}\n")
    assert found, f"docs/vllm.md has no section '## {title}'"
    return body.split("\n## ", 1)[0]


def paragraphs(body: str) -> list[str]:
    """The prose paragraphs of `body`, each on one line (a code span may wrap)."""
    return [" ".join(p.split()) for p in body.split("\n\n") if p.strip()]


def ticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


@dataclass(frozen=True)
class Row:
    """One row of the flags table."""

    flags: tuple[str, ...]  # `--[no-]x` is ("--x", "--no-x")
    target: str  # `engine.KNOB`, or `fairgate engine --OPTION`
    meaning: str
    differs: str

    @property
    def knob(self) -> str | None:
        return self.target.removeprefix("engine.") if self.target.startswith("engine.") else None


def table(text: str | None = None) -> list[Row]:
    rows = []
    for line in section("vLLM's flags", text).splitlines():
        if not line.startswith("| `"):
            continue
        flag_cell, target, meaning, differs = (c.strip() for c in line.strip("|").split(" | "))
        [flag] = ticked(flag_cell)
        [target] = ticked(target)
        if flag.startswith("--[no-]"):
            name = flag.removeprefix("--[no-]")
            flags: tuple[str, ...] = (f"--{name}", f"--no-{name}")
        else:
            flags = (flag,)
        rows.append(Row(flags, target, meaning, differs))
    assert rows, "docs/vllm.md's flags table has no rows"
    return rows


@dataclass(frozen=True)
class Refused:
    """One item of the page's list of refused flags: the flags it names and the reason given."""

    item: str
    flags: tuple[str, ...]
    reason: str


def split_top_level(text: str, separator: str = ", ") -> list[str]:
    """`text` split at `separator` outside parentheses."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and text.startswith(separator, i):
            items.append(text[start:i])
            start = i + len(separator)
    return [*items, text[start:]]


def refused_items(text: str | None = None) -> list[Refused]:
    """The sentence 'Among the vLLM flags fairgate refuses are A (why), B (why), ...'."""
    [sentence] = [p for p in paragraphs(section("vLLM's flags", text))
                  if "fairgate refuses are " in p]
    sentence = sentence.split("fairgate refuses are ", 1)[1].split(". ", 1)[0]
    items = []
    for item in split_top_level(sentence):
        head, _, paren = item.partition(" (")
        examples, dots, reason = paren.removesuffix(")").partition("...: ")
        if not dots:
            examples, reason = "", paren.removesuffix(")")
        flags = [t for t in ticked(head) + ticked(examples) if t.startswith("-")]
        items.append(Refused(item, tuple(flags), reason))
    return items


# ---- the engine's parser, in-process --------------------------------------------------------
def parse(*argv: str) -> argparse.Namespace:
    args = ["engine", *argv]
    return build_parser(args).parse_args(args)


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """What `fairgate engine ARGV` prints on stderr when it refuses ARGV (exit 2, one line)."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        parse(*argv)
    assert exited.value.code == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"{PROG}: error: "), err
    return err.removesuffix("\n")


# ---- the table ------------------------------------------------------------------------------
KNOBS = {f.name for f in fields(EngineConfig)}


@pytest.mark.parametrize("row", table(), ids=lambda r: r.flags[0])
def test_each_flag_the_table_lists_is_taken_and_sets_what_the_table_says(row: Row) -> None:
    if row.knob is None:  # the server's own option, `fairgate engine --host`
        assert row.target == f"{PROG} {row.flags[0]}", row.target
        args = parse(row.flags[0], "9001")
        option = row.flags[0].removeprefix("--").replace("-", "_")
        assert getattr(args, option) in ("9001", 9001)
        assert flag_knobs(args) == {}
        return
    assert row.knob in KNOBS, f"{row.target} is not an engine knob"
    if len(row.flags) == 2:  # --x and --no-x
        assert flag_knobs(parse(row.flags[0])) == {row.knob: (row.flags[0], True)}
        assert flag_knobs(parse(row.flags[1])) == {row.knob: (row.flags[0], False)}
        return
    [(knob, (flag, _))] = flag_knobs(parse(row.flags[0], "1")).items()
    assert (knob, flag) == (row.knob, row.flags[0])


@pytest.mark.parametrize("row", [r for r in table() if "default " in r.differs],
                         ids=lambda r: r.flags[0])
def test_the_defaults_the_table_states_are_the_engines(row: Row) -> None:
    stated = re.search(r"\bdefault (\S+)", row.differs)
    assert stated is not None, row.differs
    if row.knob is None:
        default = getattr(parse(), row.flags[0].removeprefix("--").replace("-", "_"))
    else:
        default = getattr(build_config(None, []), row.knob)  # no file, no flag
    assert str(default) == stated[1] or float(default) == float(stated[1]), (row, default)


def spellings(row: Row) -> list[tuple[str, str]]:
    """The (what a user types, what the knob gets) pairs the row's meaning states: `8k is 8000`,
    and, in a list of choices after a colon, `float16 (half)`."""
    pairs = re.findall(r"\b(\d+[kKmMgG]?) is (\d+)\b", row.meaning)
    choices = row.meaning.partition(": ")[2]
    return pairs + [(typed, value) for value, typed in re.findall(r"(\w+) \((\w+)\)", choices)]


@pytest.mark.parametrize("row", [r for r in table() if spellings(r)], ids=lambda r: r.flags[0])
def test_the_value_spellings_the_table_states(row: Row) -> None:
    for typed, value in spellings(row):
        [(_, got)] = flag_knobs(parse(row.flags[0], typed)).values()
        assert str(got) == value, (row.flags[0], typed, got)


def test_the_table_lists_every_flag_of_the_code() -> None:
    on_page = {row.flags[0] for row in table()}
    assert sorted({f.flag for f in VLLM_FLAGS} - on_page) == []
    assert sorted(on_page - {f.flag for f in VLLM_FLAGS}) == []


def test_the_example_command_runs_as_shown() -> None:
    [example] = [p for p in section("vLLM's flags").split("\n\n") if "    fairgate engine " in p]
    argv = example.replace("\\\n", " ").split()[2:]  # after `fairgate engine`
    config = build_config(None, [], flag_knobs(parse(*argv)))
    assert config.model == argv[0]
    for row in table():
        if row.flags[0] in argv and row.knob is not None:
            given = argv[argv.index(row.flags[0]) + 1]
            assert str(getattr(config, row.knob)) in (given, str([given]), str((given,)))


def test_the_yaml_key_aliases_pair_as_the_page_pairs_them() -> None:
    [prose] = [p for p in paragraphs(section("vLLM's flags")) if "the fairgate names" in p]
    aliases, _, knobs = prose.partition("the fairgate names")
    aliases = aliases.rpartition("(")[2]
    pairs = dict(zip(ticked(aliases), ticked(knobs.split(";")[0]), strict=True))
    assert pairs == dict(KEY_ALIASES)


def test_the_tuner_appends_the_flags_the_page_names() -> None:
    from tuner.engines import VLLM

    [prose] = [p for p in paragraphs(section("`fairgate tune --engine vllm`"))
               if "appends vLLM's flags" in p]
    named = prose.split("for the tuned knobs (", 1)[1].split(", from the same table", 1)[0]
    assert sorted(ticked(named)) == sorted(VLLM.knob_flags.values())


# ---- the refusals ---------------------------------------------------------------------------
def test_the_quoted_refusal_is_what_the_engine_prints(capsys: pytest.CaptureFixture[str]) -> None:
    [quoted] = [t for p in paragraphs(section("vLLM's flags")) for t in ticked(p)
                if t.startswith(f"{PROG}: error: ")]
    flag = quoted.removeprefix(f"{PROG}: error: ").split()[0]
    assert refusal(capsys, flag, "2") == quoted


def refused_flags() -> list[str]:
    """Every flag the page says is refused: those it spells, and the families' (FAMILIES)."""
    flags = [flag for item in refused_items() for flag in item.flags]
    heads = " ".join(item.item.split(" (")[0] for item in refused_items())
    return flags + [flag for word, family in FAMILIES.items() if word in heads for flag in family]


def refusal_sentence(words: str) -> str:
    [prose] = [p for p in paragraphs(section("vLLM's flags")) if words in p]
    return next(s for s in prose.split(". ") if words in s)


def rarer_flags() -> list[str]:
    """The flags the page says are refused by name alone."""
    return [t for t in ticked(refusal_sentence("by name alone")) if t.startswith("--")]


@pytest.mark.parametrize("flag", refused_flags() + rarer_flags())
def test_each_flag_the_page_says_is_refused_is_refused_naming_it(
        capsys: pytest.CaptureFixture[str], flag: str) -> None:
    err = refusal(capsys, flag)
    assert err.startswith(f"{PROG}: error: {flag} is a vLLM flag fairgate does not have"), err


@pytest.mark.parametrize("item", [i for i in refused_items() if i.reason],
                         ids=lambda i: i.item.split(" (")[0])
def test_each_refusal_gives_the_reason_the_page_gives(
        capsys: pytest.CaptureFixture[str], item: Refused) -> None:
    """One reason for the flags the page gives it, citing what the page cites (`engine.policy`,
    `tokenizer_config.json`, ...)."""
    whys = {refusal(capsys, flag).partition(" (")[2].removesuffix(")") for flag in item.flags}
    [why] = whys
    assert why, f"the page gives {item.flags} a reason, the engine none"
    assert [term for term in ticked(item.reason) if term not in why] == [], why


@pytest.mark.parametrize("flag", refused_flags())
def test_each_refusal_the_page_names_says_why(capsys: pytest.CaptureFixture[str],
                                              flag: str) -> None:
    assert refusal(capsys, flag).endswith(")"), "the page: each of these refusals says why"


def test_the_rarer_refusals_name_the_flag_alone(capsys: pytest.CaptureFixture[str]) -> None:
    assert rarer_flags()
    for flag in rarer_flags():  # which flag it names: test_..._is_refused_naming_it
        assert refusal(capsys, flag).endswith(" is a vLLM flag fairgate does not have"), flag


def test_a_flag_on_neither_list_is_one_line_naming_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert "`fairgate engine`" in refusal_sentence("on neither list")
    capsys.readouterr()
    assert main(["engine", "--preemption-mode", "swap"]) == 2  # vLLM V0's, on neither list
    err = capsys.readouterr().err
    assert err.startswith(f"{PROG}: error: --preemption-mode: not a flag of {PROG}"), err
    assert err.count("\n") == 1


def test_the_families_the_test_knows_are_on_the_page() -> None:
    items = " ".join(i.item for i in refused_items())
    assert [word for word in FAMILIES if word not in items] == []

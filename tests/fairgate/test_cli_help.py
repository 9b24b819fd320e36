"""Every option and positional argument of every `fairgate` command, nested ones included
(`fairgate tenants create`, `fairgate tune calibrate`), has a line of help: the whole argparse
tree fairgate.cli builds is walked, and each argument without help is named."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterator

from fairgate.cli import NESTED, SUBCOMMANDS, build_parser


def commands() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """(`fairgate ...` words, parser) for each command with its own arguments registered."""
    for name in SUBCOMMANDS:
        yield from walk(f"fairgate {name}", subparser(build_parser([name]), name))
    for words, (module, _) in NESTED.items():
        parser = argparse.ArgumentParser(prog="fairgate " + " ".join(words))
        importlib.import_module(module).register(parser)
        yield from walk(parser.prog, parser)


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    [choices] = [a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert isinstance(choices, dict)
    return choices[name]


def walk(words: str, parser: argparse.ArgumentParser
         ) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from walk(f"{words} {name}", child)


def unhelped(parser: argparse.ArgumentParser) -> list[str]:
    return [
        "/".join(action.option_strings) or action.dest
        for action in parser._actions
        if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction)
        and not (action.help or "").strip() and action.help != argparse.SUPPRESS
    ]


def test_every_argument_of_every_command_has_help() -> None:
    found = dict(commands())
    assert {"fairgate tenants create", "fairgate keys revoke", "fairgate jobs create",
            "fairgate tune calibrate", "fairgate bench", "fairgate serve",
            "fairgate engine"} <= set(found)
    missing = {words: names for words, parser in found.items() if (names := unhelped(parser))}
    assert missing == {}, "arguments without a line of help"

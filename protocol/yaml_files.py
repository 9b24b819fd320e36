"""Reading YAML: the one loader for every file fairgate reads (fairgate.yaml, tenants.yaml,
tune specs, spaces, workloads, sim profiles, an uploaded profile's body).

`load_yaml` is `yaml.safe_load` that also refuses a mapping naming one key twice, at any depth
(PyYAML keeps the last value silently), and says every mistake in one line naming the source
and its line: `fairgate.yaml:3: duplicate key 'engine'`,
`fairgate.yaml:4: invalid YAML: expected <block end>, but found '<block mapping start>'`.
Callers with an error type of their own (TenantError, an HTTP 400) carry that same line.
"""

from __future__ import annotations

import os
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"


class YamlError(ValueError):
    """A YAML source that does not load: `<source>:<line>: <problem>` (no line when PyYAML
    knows none)."""

    def __init__(self, source: str, line: int | None, problem: str) -> None:
        super().__init__(f"{source}:{line}: {problem}" if line is not None
                         else f"{source}: {problem}")
        self.source = source
        self.line = line
        self.problem = problem


class LineDict(dict[Any, Any]):
    """A mapping that knows the line it starts on (`load_yaml(..., lines=True)`), for callers
    whose own checks name lines, as tenants.yaml's do."""

    line: int = 0


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate mapping keys; its mappings are plain dicts."""

    mapping_type: type[dict[Any, Any]] = dict


class LineLoader(UniqueKeyLoader):
    """UniqueKeyLoader whose mappings are LineDicts."""

    mapping_type = LineDict


class _DuplicateKey(yaml.MarkedYAMLError):
    pass


def _construct_mapping(loader: UniqueKeyLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    # Only the keys written in this mapping count: a `<<: *base` merge brings keys that the
    # mapping may override, as YAML means it to.
    seen: set[Any] = set()
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG:
            continue
        key = loader.construct_object(key_node, deep=True)
        if isinstance(key, Hashable):  # an unhashable key: construct_mapping says so below
            if key in seen:
                raise _DuplicateKey(problem=f"duplicate key {key!r}",
                                    problem_mark=key_node.start_mark)
            seen.add(key)
    mapping = loader.mapping_type(loader.construct_mapping(node, deep=True))
    if isinstance(mapping, LineDict):
        mapping.line = node.start_mark.line + 1
    return mapping


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(source: str | os.PathLike[str], text: str | bytes | None = None, *,
              lines: bool = False) -> Any:
    """The one YAML document of the file `source`, or of `text` named `source` in messages
    (`load_yaml("<body>", text=body)`); None for an empty one. `lines`: mappings are LineDicts.
    YamlError for bad YAML or a duplicate key; OSError when the file cannot be read."""
    name = str(source)
    if text is None:
        text = Path(source).read_bytes()  # PyYAML decodes it, and names a bad byte's line
    loader = LineLoader if lines else UniqueKeyLoader
    try:
        return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass
    except _DuplicateKey as exc:
        raise YamlError(name, _line(exc), str(exc.problem)) from None
    except yaml.reader.ReaderError as exc:  # a byte that is not UTF-8, a control character
        before = text[:exc.position]
        line = (before.count(b"\n") if isinstance(before, bytes) else before.count("\n")) + 1
        raise YamlError(name, line, f"invalid YAML: {str(exc).splitlines()[0]}") from None
    except yaml.MarkedYAMLError as exc:
        raise YamlError(name, _line(exc), f"invalid YAML: {_describe(exc)}") from None
    except yaml.YAMLError as exc:
        raise YamlError(name, None, f"invalid YAML: {str(exc).splitlines()[0]}") from None


def _line(exc: yaml.MarkedYAMLError) -> int | None:
    mark = exc.problem_mark or exc.context_mark
    return None if mark is None else mark.line + 1


def _describe(exc: yaml.MarkedYAMLError) -> str:
    text = str(exc.problem or exc.context)
    mark, context = exc.problem_mark, exc.context_mark
    # PyYAML often notices an unclosed bracket only at the end of the file: name where it began
    if exc.problem and exc.context and context is not None and (
            mark is None or context.line != mark.line):
        text += f" ({exc.context} on line {context.line + 1})"
    return text

"""Reading `fairgate.yaml`: one file, sections `engine`, `gateway`, `database`, `tenants`, `slo`,
`shadow`, `tuner`. Each package validates its own section; this module only reads the file and
turns YAML mistakes into one-line errors with the line number."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

SECTIONS = ("engine", "gateway", "database", "tenants", "slo", "shadow", "tuner")


def load_config_file(path: str | Path | None) -> dict[str, Any]:
    """The whole file as a mapping ({} when path is None). ValueError for anything malformed."""
    if path is None:
        return {}
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"config file {path} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read config file {path}: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ValueError(f"{path}{where}: invalid YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of sections ({', '.join(SECTIONS)})")
    unknown = sorted(set(map(str, data)) - set(SECTIONS))
    if unknown:
        raise ValueError(f"{path}: unknown section(s) {', '.join(unknown)}; "
                         f"sections are: {', '.join(SECTIONS)}")
    return data


def section(data: dict[str, Any], name: str) -> dict[str, Any]:
    value = data.get(name) or {}
    if not isinstance(value, dict):
        raise ValueError(f"config section {name!r} must be a mapping")
    return value

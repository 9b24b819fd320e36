"""Config validators: the one place a setting's type, range or spelling is checked.

Every check raises `ValueError` naming the key as the caller spells it ("gateway.port",
"max_num_seqs") and saying what is wanted and what was given, so a YAML mistake fails at start
with one line. Every check returns the value it accepted. bool is never a number here:
`max_num_seqs: true` in YAML is a mistake, not 1. NaN and infinity are never numbers either: NaN
passes every range check and infinity overflows counts and sort keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    Config = TypeVar("Config", bound=DataclassInstance)


def check_choice(name: str, value: object, choices: Collection[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {' | '.join(choices)}, got {value!r}"
                         f"{_did_you_mean(value, choices)}")
    return value


def check_int(name: str, value: object, low: int | None = None, high: int | None = None) -> int:
    """An int in [low, high] (either bound may be left out)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer{_bounds(low, high, prefix=' ')}, "
                         f"got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ValueError(f"{name} must be {_bounds(low, high)}, got {value!r}")
    return value


def check_positive_int(name: str, value: object) -> int:
    """An int >= 1: a count, a size, a budget."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def check_number(name: str, value: object, low: float | None = None, high: float | None = None,
                 open_low: bool = False, open_high: bool = False) -> float:
    """A finite int or float in the interval from low to high, each end closed unless open_*."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not _finite(value):
        finite = "a finite number" if high is None else "a number"
        raise ValueError(f"{name} must be {finite}{_bounds(low, high, open_low, open_high, ' ')}, "
                         f"got {value!r}")
    if ((low is not None and (value < low or (open_low and value == low)))
            or (high is not None and (value > high or (open_high and value == high)))):
        raise ValueError(f"{name} must be {_bounds(low, high, open_low, open_high)}, got {value!r}")
    return value


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return value


def check_known_keys(section: str, values: Iterable[Any], known: Iterable[str]) -> None:
    """Every key of `values` (a mapping's keys) is one of `known`, listed in this order.

    "unknown engine setting(s): max_num_seq; did you mean max_num_seqs?"; the known keys are
    listed when some unknown key is like none of them."""
    known = list(known)
    unknown = sorted({str(key) for key in values} - set(known))
    if not unknown:
        return
    matches = {key: difflib.get_close_matches(key, known, n=1) for key in unknown}
    guesses = [match[0] if len(unknown) == 1 else f"{match[0]} for {key}"
               for key, match in matches.items() if match]
    message = f"unknown {section} setting(s): {', '.join(unknown)}"
    if guesses:
        message += f"; did you mean {', '.join(guesses)}?"
    if len(guesses) < len(unknown):
        message += f"; known settings are: {', '.join(known)}"
    raise ValueError(message)


def from_mapping(cls: type[Config], values: Mapping[str, Any] | None, section: str) -> Config:
    """The frozen dataclass `cls` built from a YAML/JSON mapping (None: all defaults); unknown
    and missing keys are errors naming the key; the values are checked by `cls` itself."""
    if values is None:
        values = {}
    if not isinstance(values, Mapping):
        raise ValueError(f"the {section} settings must be a mapping of key: value, "
                         f"got {values!r}")
    fields = dataclasses.fields(cls)
    check_known_keys(section, values, [f.name for f in fields if f.init])
    missing = [f.name for f in fields if f.init and f.name not in values
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"missing {section} setting(s): {', '.join(missing)}")
    return cls(**values)


def _bounds(low: float | None, high: float | None, open_low: bool = False,
            open_high: bool = False, prefix: str = "") -> str:
    """For messages: 'in [0, 1)', '>= 0', '< 10', or '' when there are no bounds."""
    if low is not None and high is not None:
        text = f"in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    elif low is not None:
        text = f"{'>' if open_low else '>='} {low}"
    elif high is not None:
        text = f"{'<' if open_high else '<='} {high}"
    else:
        return ""
    return prefix + text


def _did_you_mean(value: object, choices: Collection[str]) -> str:
    match = difflib.get_close_matches(value, list(choices), n=1) if isinstance(value, str) else []
    return f"; did you mean {match[0]}?" if match else ""


def check_http_url(name: str, url: object) -> str:
    """An http:// or https:// URL with a host, and a port that is a number when one is given;
    ValueError naming `name` otherwise."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{name} must start with http:// or https://, got {url!r}")
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # reading the port parses it
    except ValueError:  # a bracket left open, a port that is no number
        host = None
    if not host:
        raise ValueError(f"{name} needs a host and a numeric port (if any), got {url!r}")
    return url


def check_out_file(flag: str, path: str | Path) -> Path:
    """A file to write once long work is done, checked before it starts (so the work is not
    lost to a bad path): its folder exists and it is not itself a folder."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {path.parent} does not exist")
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a directory; name the file")
    return path


"""JSON on the request path, by orjson where it gives what the standard library gives.

Every request body, engine body and engine answer the gateway handles is JSON; the standard
library's codec took 15-20 µs of a non-streamed request's CPU, orjson's about a fifth of that
(bench/RESULTS.md, issue 28). The two do not agree on everything, so each function here takes
orjson's answer only where it is the standard library's, and asks the standard library
otherwise:

- `loads` gives `json.loads`'s value, or its error, for every input. orjson refuses what JSON
  does not allow (NaN, Infinity, a number past a double, a lone surrogate, a byte-order mark,
  nesting past 1,024), and those go to `json.loads`, which accepts some of them. orjson reads an
  integer of 19 digits or more as a float where Python keeps it exact, so a body with such a
  run of digits goes to `json.loads` as well.
- `dumps_plain` is for the objects fairgate builds itself of strings, integers, booleans, None,
  lists and string-keyed dicts, no floats (a stream's token events, error bodies): for those
  orjson writes `json.dumps(value, ensure_ascii=False, separators=(",", ":"))`'s very bytes, in
  a tenth of the time. A float would go in orjson's form (the same value).
- `dumps` gives compact JSON whose value is `json.dumps`'s. orjson writes UTF-8 where the
  standard library escapes to ASCII, and its own shortest float form (`0.00001`, not `1e-05`):
  the same JSON value either way. It refuses integers past 64 bits and keys that are not
  strings, and writes NaN and the infinities as `null`; an object it refuses, or whose JSON has
  a `null` (where a NaN may have been), is written by `json.dumps`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import orjson

# An integer orjson would read as a float has 19 digits or more in a row: with every digit
# mapped to "0" and every other byte to " ", a run of 19 zeros. Two passes in C, a third of
# what a regular expression's scan took.
_DIGITS_AS_ZEROS = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"0" * 19


def loads(raw: bytes, reader: Callable[[bytes], Any] = json.loads) -> Any:
    """`reader(raw)`: the same value, or the same error, for every input. `reader` is
    `json.loads`, or a reader built on it (one that takes UTF-8 alone, say): orjson's value
    stands for it only where orjson reads the input, which is then valid UTF-8 without a
    byte-order mark."""
    if _LONG_RUN not in raw.translate(_DIGITS_AS_ZEROS):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the reader decides: it accepts some of what orjson refuses, or says why not
    return reader(raw)


def dumps(value: Any) -> bytes:
    """`value` as compact JSON (UTF-8) whose value is `json.dumps(value)`'s."""
    try:
        out = orjson.dumps(value)
    except orjson.JSONEncodeError:  # an int past 64 bits, a key not a string, a lone surrogate
        pass
    else:
        if b"null" not in out:  # else a NaN may have become null: json.dumps writes it
            return out
    return json.dumps(value, separators=(",", ":")).encode()


def dumps_plain(value: Any) -> bytes:
    """`json.dumps(value, ensure_ascii=False, separators=(",", ":"))` as UTF-8, for a value of
    no floats (see the module doc); what orjson refuses (an int past 64 bits, a key not a
    string, a lone surrogate) goes that way, and raises what it raises."""
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

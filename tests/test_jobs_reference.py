"""docs/jobs.md's job spec against the code that reads it (control.jobs.parse_spec, through
tuner.options' table) and the TuneJobSpec schema of the gateway's OpenAPI document: every field
the page's spec block names (an older name as `"holdout" (also "robustness")`) is one a POST
/admin/tune-jobs body may hold, and takes the value the page shows for it; every field the parser
takes is on the page; each default the page states as a literal (`` `heartbeat_s`, default 10 s``)
is the one a spec without that field gets; and the schema's properties are the parser's fields.

How the page writes the spec: one indented block under `## Jobs`, a JSON object with liberties
that the helper below reads: `"a": 1 | "b": 2` (one field or the other), `"x" | "y" | ...` (a
field's choices, `...`: more than those), a field named without a value, `, or` between two
fields, and parenthesised notes after a value (`(also "NAME")`: an older name of the field)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from control.jobs import JobSpec, parse_spec
from control.openapi import document
from protocol.errors import ApiError
from tests.test_docs import DOCS, section
from tuner.options import ALIASES, BY_NAME, JOB, JOB_MODES, OPTIONS, Choice, TuneOptions

PAGE = DOCS / "jobs.md"
SHADOWS = {"candidate": "http://127.0.0.1:8200"}  # the gateway's shadow targets: the page's
SLO = {"slo_ttft_p99_s": 0.5}  # a job needs one SLO, and no tenant gives one here
BASES: dict[str, dict[str, Any]] = {  # the fields a job of each mode cannot do without
    "sim": {"mode": "sim", "workload": "uniform", **SLO},
    "replay": {"mode": "replay", "target": "http://engine:8100", "workload": "uniform", **SLO},
    "shadow": {"mode": "shadow", "shadow": "candidate", **SLO},
}
INSTEAD = {"captured_minutes": "workload"}  # the page: "workload": ..., or "captured_minutes"

# A valid value for each field the page names without one.
VALID: dict[str, Any] = {"holdout": 2, "holdout_top": 5, "baseline": "vllm-grid", "seed": 7,
                         "heartbeat_s": 20, "shadow_requests": 50, "shadow_window_s": 60,
                         "recheck": 2}

# Defaults the page gives in words: not compared with the code's.
SKIPPED = {
    "slo_ttft_p99_s": "each SLO not given is the strictest an enabled tenant sets",
    "slo_tpot_p99_s": "each SLO not given is the strictest an enabled tenant sets",
    "slo_itl_p99_s": "each SLO not given is the strictest an enabled tenant sets",
}

NOT_LITERAL = object()
DEFAULT = re.compile(r"`(\w+)`,? \(?default:? ([^,;)]+)")
DECODER = json.JSONDecoder()


@dataclass
class DocField:
    """A field as the spec block shows it."""

    name: str
    values: list[Any] = field(default_factory=list)  # its example value, or its choices
    more: bool = False  # `| ...`: choices beyond those shown
    aliases: list[str] = field(default_factory=list)


def jobs_section() -> str:
    return section(PAGE.read_text(), "Jobs")


def spec_block() -> str:
    """The `## Jobs` section's indented block (the spec), on one line."""
    lines = jobs_section().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("    {"))
    block = []
    for line in lines[start:]:
        if not line.startswith("    "):
            break
        block.append(line.strip())
    return " ".join(block)


def _skip(text: str, pos: int, separators: str = " ") -> int:
    while pos < len(text):
        if text[pos] in separators:
            pos += 1
        elif " " in separators and text.startswith("or ", pos):
            pos += 3
        else:
            break
    return pos


def documented(text: str | None = None) -> dict[str, DocField]:
    """The fields of the spec block (`text`: the block, by default the page's), by name."""
    text = spec_block() if text is None else text
    assert text.startswith("{") and text.endswith("}"), f"the spec block is one object: {text}"
    fields: dict[str, DocField] = {}
    last: DocField | None = None
    pos = _skip(text, 1, " ,")
    while pos < len(text) - 1:
        if text[pos] == "(":  # a note on the last field: `(also "NAME")` names an older name
            end = text.index(")", pos)
            if text.startswith("(also ", pos):
                assert last is not None, f"a note before any field: {text[pos:end + 1]}"
                last.aliases += re.findall(r'"(\w+)"', text[pos:end])
            pos = _skip(text, end + 1, " ,")
            continue
        assert text[pos] == '"', f"cannot read the spec block at {text[pos:pos + 40]!r}"
        name, pos = DECODER.raw_decode(text, pos)
        last = fields.setdefault(name, DocField(name))
        pos = _skip(text, pos)
        if text[pos] == ":":
            pos = _read_values(text, _skip(text, pos + 1), last)
        pos = _skip(text, pos, " ,")
    return fields


def _read_values(text: str, pos: int, doc: DocField) -> int:
    """`doc`'s value at `pos` and any `| choice` after it; where the next field starts."""
    value, pos = DECODER.raw_decode(text, pos)
    doc.values.append(value)
    while text[_skip(text, pos)] == "|":
        start = _skip(text, _skip(text, pos) + 1)
        if text.startswith("...", start):
            doc.more = True
            return start + 3
        value, end = DECODER.raw_decode(text, start)
        if text[_skip(text, end)] == ":":  # `"trials": 30 | "timeout_s": 600`: a field
            return start
        doc.values.append(value)
        pos = end
    return pos


def names(fields: dict[str, DocField]) -> set[str]:
    return set(fields) | {alias for doc in fields.values() for alias in doc.aliases}


def canonical(name: str) -> str:
    return ALIASES.get(name, name)


def mode_of(name: str) -> str:
    """The first job mode a field means something in (captured_minutes: the job's own)."""
    option = BY_NAME.get(canonical(name))
    return next((m for m in option.modes if m in JOB_MODES), "sim") if option else "sim"


def spec_with(name: str, value: Any) -> dict[str, Any]:
    """A job spec with `name` set to `value`, and what its mode needs besides."""
    base = dict(BASES[value if name == "mode" and value in BASES else mode_of(name)])
    base.pop(INSTEAD.get(name, ""), None)
    return {**base, name: value}


def parse(spec: dict[str, Any]) -> JobSpec:
    return parse_spec(spec, SHADOWS, {})


def refused_as_unknown(name: str) -> bool:
    try:
        parse(spec_with(name, VALID.get(canonical(name), 1)))
    except ApiError as exc:
        return exc.param == name and exc.message.startswith("unknown field")
    return False


def job_schema_fields() -> set[str]:
    return set(document()["components"]["schemas"]["TuneJobSpec"]["properties"])


def accepted() -> set[str]:
    """The names a job body may hold: of every name the tune table, its older names, the
    OpenAPI schema and the page know, those parse_spec does not refuse as unknown."""
    candidates = ({o.name for o in OPTIONS} | set(ALIASES) | job_schema_fields()
                  | names(documented()))
    return {name for name in candidates if not refused_as_unknown(name)}


def literal(text: str) -> Any:
    """The value a default states ('10 s', '`true`', 'sim'), or NOT_LITERAL when it is words."""
    text = re.sub(r" (s|seconds)$", "", text.replace("`", "").strip())
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text if re.fullmatch(r"[A-Za-z][\w-]*", text) else NOT_LITERAL


def stated_defaults() -> dict[str, str]:
    """Each spec field's default as the `## Jobs` section writes it."""
    fields = names(documented())
    return {name: default for name, default in DEFAULT.findall(jobs_section()) if name in fields}


def parser_default(name: str) -> Any:
    """What a spec without `name` gets. From the table's defaults, before the gateway settles
    the SLOs (which turns tenant_slos off); the job's own fields from its JobSpec."""
    spec = {k: v for k, v in BASES[mode_of(name)].items() if k != name}
    options = TuneOptions.from_mapping(spec, JOB)
    if hasattr(options, canonical(name)):
        return getattr(options, canonical(name))
    return getattr(parse(spec), name)


def test_the_page_reads_as_a_spec() -> None:
    fields = documented()
    assert {"mode", "workload", "captured_minutes", "trials", "timeout_s"} <= set(fields)
    assert fields["holdout"].aliases == ["robustness"]
    assert fields["trials"].values == [30] and fields["timeout_s"].values == [600]
    assert fields["workload"].more and fields["set"].values == [{"max_model_len": 4096}]


def test_every_field_on_the_page_is_taken_with_the_value_it_shows() -> None:
    fields = documented()
    assert set(VALID) <= set(fields), f"VALID names fields the page lacks: {VALID.keys() - fields}"
    for doc in fields.values():
        values = doc.values or [VALID.get(doc.name)]
        assert values != [None], f"{doc.name}: the page shows no value; give one in VALID"
        for name in (doc.name, *doc.aliases):
            for value in values:
                try:
                    parse(spec_with(name, value))
                except ApiError as exc:
                    pytest.fail(f"{name}: {value!r} as the page shows it is refused: {exc}")


def test_a_field_the_page_lists_all_choices_of_has_those_choices() -> None:
    for doc in documented().values():
        kind = BY_NAME[doc.name].job_kind() if doc.name in BY_NAME else None
        if len(doc.values) > 1 and not doc.more and isinstance(kind, Choice):
            assert sorted(doc.values) == sorted(kind.choices), doc.name


def test_the_page_and_the_parser_have_the_same_fields() -> None:
    docs, code = names(documented()), accepted()
    assert sorted(code - docs) == [], "taken by POST /admin/tune-jobs, missing from the page"
    assert sorted(docs - code) == [], "on the page, refused by POST /admin/tune-jobs as unknown"


def test_a_field_the_parser_does_not_know_is_refused_by_name() -> None:
    assert refused_as_unknown("trial") and refused_as_unknown("workers")
    assert not refused_as_unknown("trials")


def test_each_literal_default_on_the_page_is_the_parsers() -> None:
    stated = stated_defaults()
    assert stated, "the page states some defaults (`heartbeat_s`, default 10 s)"
    fields = accepted()
    assert sorted(set(SKIPPED) - fields) == [], "SKIPPED names fields the parser does not have"
    for name, text in stated.items():
        if name in SKIPPED:
            continue
        value = literal(text)
        assert value is not NOT_LITERAL, f"{name}: default {text!r} is words: add it to SKIPPED"
        code = parser_default(name)
        assert value == code and isinstance(value, bool) == isinstance(code, bool), (
            f"{name}: the page says default {text!r}, a spec without it gets {code!r}")


def test_the_openapi_job_schema_has_the_parsers_fields() -> None:
    schema, code = job_schema_fields(), accepted()
    assert sorted(code - schema) == [], "taken by the parser, missing from TuneJobSpec"
    assert sorted(schema - code) == [], "in TuneJobSpec, refused by the parser as unknown"

"""docs/configuration.md against the code that reads fairgate.yaml: the keys its tables list for
`engine:` and `gateway:` are the keys `EngineConfig.from_dict` and `GatewayConfig.from_dict`
accept (and those of the nested mappings a row spells out as `{key: default, ...}`), and each
default the tables state as a literal is the code's default."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from engine.config import EngineAccess, EngineConfig
from engine.vllm_flags import KEY_ALIASES
from gateway.config import (
    BackendConfig,
    CaptureConfig,
    GatewayConfig,
    JobsConfig,
    OutlierDetectionConfig,
    RetryBudgetConfig,
    ShadowConfig,
)

DOCS = Path(__file__).resolve().parents[1] / "docs"
HEADINGS = {"engine": "Engine settings", "gateway": "Gateway keys"}

# The gateway's nested mappings, each documented inline in its row as `{key: default, ...}`:
# the config class that reads one, and the keys it cannot do without.
NESTED: dict[str, tuple[type, dict[str, Any]]] = {
    "backends": (BackendConfig, {"url": "http://127.0.0.1:8100"}),
    "shadow": (ShadowConfig, {"name": "candidate", "url": "http://127.0.0.1:8200"}),
    "capture": (CaptureConfig, {"path": "capture.jsonl"}),
    "jobs": (JobsConfig, {}),
    "outlier_detection": (OutlierDetectionConfig, {}),
    "retry_budget": (RetryBudgetConfig, {}),
}
LISTS = ("backends", "shadow")  # lists of such mappings, not one

# Defaults the docs give in words or as a list of choices: not compared with the code's.
SKIPPED = {
    "engine.served_model_name": "the model",
    "engine.max_model_len": "the model's context length",
    "engine.admin_key": "the api_key",
    "gateway.backends[].kind": "fairgate|openai: the choices, fairgate first",
    "gateway.shadow[].kind": "fairgate|openai: the choices, fairgate first",
    "gateway.shadow[].tenants": "all | [names]: the choices, all first",
}

NOT_LITERAL = object()
NO_DEFAULT = object()  # a nested key the docs name without a default, or a required field
NUMBER = re.compile(r"(-?\d+(?:\.\d+)?) ?(M|MiB)?")
SCALE = {None: 1, "M": 1_000_000, "MiB": 1 << 20}


def table_rows(heading: str) -> list[list[str]]:
    """The cells of each body row of the first table under `## heading`."""
    text = (DOCS / "configuration.md").read_text()
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    lines = [line.strip() for line in text[start:end].splitlines()]
    table = [line for line in lines if line.startswith("|")]
    assert len(table) > 2, f"no table under ## {heading}"
    # a cell's `\|` is a pipe inside it, not the end of the cell
    return [[cell.strip() for cell in re.split(r"(?<!\\)\|", line[1:-1])] for line in table[2:]]


def documented() -> dict[str, Any]:
    """Each key the tables document, dotted ('gateway.capture.path'), with its default as
    written (NO_DEFAULT for a nested key named without one)."""
    keys: dict[str, Any] = {}
    for section, heading in HEADINGS.items():
        for key_cell, default_cell, meaning in table_rows(heading):
            names = re.findall(r"`(\w+)`", key_cell)
            defaults = default_cell.split(", ") if len(names) > 1 else [default_cell]
            assert len(defaults) == len(names), f"one default per key: {key_cell}"
            keys.update((f"{section}.{name}", default)
                        for name, default in zip(names, defaults, strict=True))
            if section == "gateway" and names[0] in NESTED:
                keys.update(nested_keys(names[0], f"{default_cell} {meaning}"))
    return keys


def nested_keys(name: str, row: str) -> dict[str, Any]:
    """The keys of the row's first `{key, key: default, ...}`."""
    found = re.search(r"\{([^{}]*)\}", row)
    assert found, f"gateway.{name}'s row spells out its keys as {{key: default, ...}}"
    prefix = f"gateway.{name}[]." if name in LISTS else f"gateway.{name}."
    keys: dict[str, Any] = {}
    for item in found.group(1).split(","):
        key, colon, default = item.partition(":")
        keys[prefix + key.strip()] = default.strip() if colon else NO_DEFAULT
    return keys


def literal(text: str) -> Any:
    """The value a default cell states ('none (keep)', '`[]` = embedded', '4M', '1 MiB',
    '{dir: fairgate-jobs, storage: null}'), or NOT_LITERAL when it is words."""
    text = re.sub(r" *(\(.*\)|=.*)$", "", text.replace("`", "")).strip()  # less any gloss
    number = NUMBER.fullmatch(text)
    if number:
        value = float(number.group(1)) * SCALE[number.group(2)]
        return int(value) if value.is_integer() and "." not in number.group(1) else value
    words: dict[str, Any] = {"none": None, "null": None, "true": True, "false": False,
                             "[]": [], "{}": {}}
    if text.lower() in words:
        return words[text.lower()]
    if text.startswith("{") and text.endswith("}"):
        items = [item.partition(":") for item in text[1:-1].split(",")]
        values = {key.strip(): literal(value) for key, colon, value in items if colon}
        complete = len(values) == len(items) and NOT_LITERAL not in values.values()
        return values if complete else NOT_LITERAL
    if re.fullmatch(r"\"[^\"]*\"|'[^']*'", text):
        return text[1:-1]
    return text if re.fullmatch(r"[\w.:/+-]+", text) else NOT_LITERAL


def plain(value: Any) -> Any:
    """A code default as YAML writes it: tuples as lists, config classes as mappings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: plain(getattr(value, field.name))
                for field in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [plain(item) for item in value]
    return value


def defaults_of(cls: type, prefix: str) -> dict[str, Any]:
    return {prefix + field.name: NO_DEFAULT if field.default is dataclasses.MISSING
            else plain(field.default) for field in dataclasses.fields(cls) if field.init}


def accepted() -> dict[str, Any]:
    """Each key the code reads from `engine:` and `gateway:`, dotted, with its default."""
    keys = {**defaults_of(EngineConfig, "engine."), **defaults_of(EngineAccess, "engine."),
            **defaults_of(GatewayConfig, "gateway.")}
    for name, (cls, _) in NESTED.items():
        keys.update(defaults_of(cls, f"gateway.{name}[]." if name in LISTS else f"gateway.{name}."))
    return keys


def load(key: str, value: Any) -> object:
    """The config the code builds from a section holding only `key: value` (and, for a nested
    key, the other keys its mapping must have)."""
    section, _, name = key.partition(".")
    if section == "engine":
        return EngineConfig.from_dict({name: value})
    outer, dot, inner = name.partition(".")
    if not dot:
        return GatewayConfig.from_dict({name: value})
    outer = outer.removesuffix("[]")
    entry = {**NESTED[outer][1], inner: value}
    return GatewayConfig.from_dict({outer: [entry] if outer in LISTS else entry})


def same(doc: Any, code: Any) -> bool:
    """Equal as YAML values: 64 is 64.0, but true is not 1."""
    if isinstance(doc, dict) and isinstance(code, dict):
        return doc.keys() == code.keys() and all(same(doc[k], code[k]) for k in doc)
    if isinstance(doc, list) and isinstance(code, list):
        return len(doc) == len(code) and all(map(same, doc, code))
    return doc == code and isinstance(doc, bool) == isinstance(code, bool)


def test_the_tables_document_the_keys_the_code_accepts() -> None:
    docs, code = set(documented()), set(accepted())
    missing, unknown = sorted(code - docs), sorted(docs - code)
    assert missing == [], f"accepted by the code, missing from the docs' tables: {missing}"
    assert unknown == [], f"in the docs' tables, unknown to the code: {unknown}"
    # vLLM's names for some knobs are accepted too; vllm.md lists them beside its flags
    assert [alias for alias in KEY_ALIASES
            if f"`{alias}`" not in (DOCS / "vllm.md").read_text()] == []


def test_each_documented_key_loads_from_its_section() -> None:
    """What a user copying a key from the tables meets: from_dict takes it with its default
    (the required keys of a nested entry: a sample)."""
    code = accepted()
    for key in documented():
        value = code.get(key)  # a key the code lacks: None, and the error names the key
        if value is NO_DEFAULT:  # a nested mapping's required key: NESTED's sample
            outer, _, inner = key.removeprefix("gateway.").partition(".")
            value = NESTED[outer.removesuffix("[]")][1][inner]
        load(key, value)


@pytest.mark.parametrize("key", ["engine.max_num_seq", "gateway.max_queue_requests",
                                 "gateway.backends[].discovery", "gateway.capture.rotate",
                                 "gateway.retry_budget.percent"])
def test_a_key_the_code_does_not_know_is_refused_by_name(key: str) -> None:
    section = key.rpartition(".")[0].replace("[]", "")
    with pytest.raises(ValueError, match=rf"^unknown {re.escape(section)} setting\(s\): "
                                         rf"{key.rpartition('.')[2]}\b"):
        load(key, 1)


def test_each_literal_default_in_the_tables_is_the_codes() -> None:
    code = accepted()
    wrong = {}
    for key, text in documented().items():
        if text is NO_DEFAULT or key not in code:
            continue
        value = literal(text)
        if value is not NOT_LITERAL and not same(value, code[key]):
            wrong[key] = f"docs {text!r}, code {code[key]!r}"
    assert wrong == {}, f"defaults the docs state wrong: {wrong}"


def test_the_defaults_left_uncompared_are_the_ones_written_in_words() -> None:
    assert sorted(set(SKIPPED) - set(accepted())) == [], "SKIPPED names keys the code lacks"
    in_words = [key for key, text in documented().items()
                if text is not NO_DEFAULT and literal(text) is NOT_LITERAL]
    assert sorted(in_words) == sorted(SKIPPED), "SKIPPED lists the defaults written in words"


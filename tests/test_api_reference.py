"""docs/api.md against the code an API user meets: `protocol.openai`'s field table and
`parse_request`, and the error codes the package raises.

- Fields: every field the page names is one `parse_request` reads on the endpoints the page
  gives it (a wrong value is a 400 naming it, a right one passes), every field of the table is
  named on the page, the refused ones are refused whatever else is sent, and the engine
  extensions are the ones a gateway never passes on from a client.
- Literals: each default or bound the page states as a number (`temperature` 1.0, `max_tokens`
  16 on completions, `stop` up to 16, `top_k` -1 = off, the `tenant_weight` range) is the
  table's, and `parse_request` / `resolve_max_tokens` apply it; a number in those bullets that
  no check reads fails, so a new literal gets a check.
- Errors: each (status, code) the page lists is one an `ApiError` / `bad_request` call in
  protocol/, gateway/, engine/ or control/ raises (a constant `code`, or a `RateLimited` /
  `QueueFull` reason, which the gateway answers 429 with); the page claims its list is all of a
  completion request's codes, so every code raised on the request path is on it. The request
  path is what a POST /v1/completions or /v1/chat/completions passes through: the body and
  error handling (protocol/openai.py, protocol/http.py), the gateway's key check, admission,
  queues and proxy (gateway/auth.py, admission.py, fairqueue.py, service.py, proxy.py), its
  backends (gateway/backends/), and a fairgate engine's server (engine/server.py,
  engine/openai_api.py). The codes those modules raise only for /admin/* or a form body are
  left out by name, and codes computed at run time (aiohttp's status names, an engine's code
  passed on) are not counted. Each code the page says comes with Retry-After is raised with
  one.

tests/gateway/test_openapi.py holds the OpenAPI document to the same table; this file holds the
page to it.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from protocol.errors import ApiError, retry_after_header
from protocol.openai import (
    ENDPOINTS,
    FIELDS,
    Field,
    parse_request,
    request_fields,
    resolve_max_tokens,
)

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "api.md"
PACKAGES = ("protocol", "gateway", "engine", "control")
REQUEST_PATH = ("protocol/errors.py", "protocol/openai.py", "protocol/http.py",
                "gateway/auth.py", "gateway/admission.py", "gateway/fairqueue.py",
                "gateway/service.py", "gateway/proxy.py", "gateway/backends",
                "engine/server.py", "engine/openai_api.py")
# raised in those modules, never for a completion request
NOT_ON_THE_REQUEST_PATH = {
    "admin_disabled": "the gateway's /admin/* without an admin key configured",
    "invalid_admin_key": "/admin/* on the gateway and the engine",
    "invalid_form": "protocol.http.read_form: the dashboard's form posts, not the JSON API",
}
# the fields the page ties to one endpoint; any other field it names is on both
ONLY_ON = {"prompt": "completions", "messages": "chat", "max_completion_tokens": "chat"}
MINIMAL: dict[str, dict[str, Any]] = {"completions": {"prompt": "hi"},
           "chat": {"messages": [{"role": "user", "content": "hi"}]}}
NUMBER = r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[+-]?\d+)?(?![\w.])"


# ---- the page ------------------------------------------------------------------------------
def page() -> str:
    return PAGE.read_text()


def bullet(text: str, title: str) -> str:
    """The text of the top-level `- **title**` bullet, joined into one line."""
    match = re.search(rf"^- \*\*{re.escape(title)}\*\*(.*?)(?=^- |^\S|\Z)", text, re.M | re.S)
    assert match, f"docs/api.md has no '- **{title}**' bullet"
    return " ".join(match.group(1).split())


def code_names(text: str) -> list[str]:
    """The identifiers in backticks (`stream_options.include_usage` as both names)."""
    names = []
    for name in re.findall(r"`([a-z_][a-z0-9_.]*)`", text):
        names.extend([name, name.split(".")[0]] if "." in name else [name])
    return names


FIELD_BULLETS = ("Defaults", "Fields", "Engine extensions", "Refused, never silently ignored")
# the names in backticks in those bullets that are not request fields
NOT_FIELDS = {"null", "interactive", "batch", "fair", "include_usage"}


def page_fields(text: str) -> set[str]:
    """The fields the page names (`stream_options.include_usage` as `stream_options`)."""
    names = {n for title in FIELD_BULLETS for n in code_names(bullet(text, title))}
    return {n for n in names if "." not in n} - NOT_FIELDS


# ---- fields --------------------------------------------------------------------------------
def sample(spec: Field) -> Any:
    """A value the table accepts for the field."""
    if spec.allowed is not None:
        return next(a for a in spec.allowed if a is not None)
    shapes: dict[str, Any] = {
        "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "stop": ["x"], "token_ids": [1], "stream_options": {"include_usage": True},
        "string": "x", "boolean": True}
    if spec.kind in shapes:
        return shapes[spec.kind]
    assert spec.kind in ("integer", "number"), spec
    value = spec.default if spec.default is not None else spec.minimum
    assert value is not None, spec
    return int(value) if spec.kind == "integer" else value


def wrong(spec: Field) -> Any:
    """A value of the wrong type for the field (an object: an object for stream_options)."""
    return "yes" if spec.kind == "stream_options" else {"x": 1}


def refusal(body: dict[str, Any], endpoint: str) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(body, endpoint)
    assert info.value.status == 400, info.value.message
    return info.value


def endpoints_of(name: str) -> tuple[str, ...]:
    return (ONLY_ON[name],) if name in ONLY_ON else ENDPOINTS


def test_every_field_the_page_names_is_read_on_its_endpoints() -> None:
    named = page_fields(page())
    assert named >= {"temperature", "prompt", "priority"}, named
    unknown = sorted(named - set(FIELDS))
    assert not unknown, f"docs/api.md names fields the API does not read: {unknown}"
    for name in sorted(named):
        spec = FIELDS[name]
        assert set(spec.endpoints) == set(endpoints_of(name)), (
            f"docs/api.md gives '{name}' the endpoints {endpoints_of(name)}; the table "
            f"{spec.endpoints}")
        for endpoint in endpoints_of(name):
            body = {**MINIMAL[endpoint], name: sample(spec)}
            parse_request(body, endpoint)
            error = refusal({**body, name: wrong(spec)}, endpoint)
            assert error.param == name, (name, endpoint, error.message)


def test_every_field_the_table_reads_is_on_the_page() -> None:
    named = page_fields(page())
    for endpoint in ENDPOINTS:
        missing = [f.name for f in request_fields(endpoint) if f.name not in named]
        assert not missing, f"/v1/{endpoint} reads fields docs/api.md does not name: {missing}"


def test_the_refused_fields_are_refused_on_both_endpoints() -> None:
    refused = set(code_names(bullet(page(), "Refused, never silently ignored")))
    assert {"n", "echo", "tools", "guided_json"} <= refused, refused
    for name in sorted(refused):
        assert FIELDS[name].refusal, f"'{name}' is refused on the page, accepted by the table"
        for endpoint in ENDPOINTS:
            for value in (2, True, "auto", {"type": "json_object"}, ["x"]):
                error = refusal({**MINIMAL[endpoint], name: value}, endpoint)
                assert error.param == name, (name, value, error.message)
    for name, kept in (("n", 1), ("best_of", 1), ("response_format", {"type": "text"})):
        assert name in refused
        for endpoint in ENDPOINTS:
            parse_request({**MINIMAL[endpoint], name: kept}, endpoint)  # "other than" it


def test_the_engine_extensions_are_the_gateways_to_send() -> None:
    from engine.request import SamplingParams
    from gateway.backends.base import ENGINE_EXTENSIONS, Job, engine_body

    extensions = set(code_names(bullet(page(), "Engine extensions"))) & set(FIELDS)
    assert extensions == {"tenant", "tenant_weight", "prompt_token_ids"}, extensions
    assert extensions <= set(ENGINE_EXTENSIONS)
    client = {"prompt": "hi", "tenant": "mallory", "tenant_weight": 1e6,
              "prompt_token_ids": [7, 7]}
    req = parse_request(client, "completions")
    job = Job("r1", req, "acme", "interactive", 1, SamplingParams(max_tokens=4),
              tenant_weight=2.0)
    assert not extensions & set(engine_body(job, "m", False, fairgate=False))
    own = engine_body(job, "m", False, fairgate=True, prompt_ids=[1, 2])
    assert (own["tenant"], own["tenant_weight"], own["prompt_token_ids"]) == ("acme", 2.0, [1, 2])


# ---- literals ------------------------------------------------------------------------------
class Literal(NamedTuple):
    bullet: str
    field: str
    what: str  # default | at_most | off | range
    values: tuple[float, ...]


LITERALS = (  # the phrasings the page states a number in, per bullet
    ("Defaults", "default", rf"`(\w+)` ({NUMBER})"),
    ("Fields", "at_most", rf"`(\w+)` \(up to ({NUMBER})"),
    ("Fields", "off", rf"`(\w+)` \(({NUMBER}) = off\)"),
    ("Engine extensions", "range", rf"`(\w+)` \([^()]*?({NUMBER}) to ({NUMBER})\)"),
)


def page_literals(text: str) -> Iterator[Literal]:
    for title, what, pattern in LITERALS:
        for match in re.finditer(pattern, bullet(text, title)):
            values = tuple(float(v) for v in match.groups()[1:])
            yield Literal(title, match.group(1), what, values)


def test_every_number_in_the_field_bullets_is_read() -> None:
    text = page()
    literals = list(page_literals(text))
    for title in {title for title, _, _ in LITERALS}:
        stated = sorted(float(n) for n in re.findall(NUMBER, bullet(text, title)))
        read = sorted(v for lit in literals if lit.bullet == title for v in lit.values)
        assert stated == read, (f"the '{title}' bullet states the numbers {stated}; the "
                                f"phrasings this test reads give {read}: add one")


def test_the_defaults_and_bounds_are_the_tables() -> None:
    literals = list(page_literals(page()))
    assert {lit.what for lit in literals} == {"default", "at_most", "off", "range"}, literals
    for lit in literals:
        check_literal(lit)


def check_literal(lit: Literal) -> None:
    spec = FIELDS[lit.field]
    value = lit.values[0]
    for endpoint in spec.endpoints:
        body = MINIMAL[endpoint]
        if lit.what == "default" and lit.field == "max_tokens":
            req = parse_request(body, endpoint)
            if endpoint == "completions":
                assert resolve_max_tokens(req, 3, 1000) == value
            else:  # "the rest of the context on /v1/chat/completions"
                assert resolve_max_tokens(req, 3, 1000) == 997
        elif lit.what == "default":
            assert spec.default == value, (lit, spec.default)
            assert parse_request(body, endpoint).sampling[lit.field] == value
        elif lit.what == "at_most":
            count = int(value)
            assert parse_request({**body, lit.field: ["x"] * count}, endpoint)
            assert refusal({**body, lit.field: ["x"] * (count + 1)}, endpoint).param == lit.field
        elif lit.what == "off":
            assert spec.minimum == value and spec.default == value, (lit, spec)
            assert parse_request({**body, lit.field: int(value)}, endpoint).sampling[
                lit.field] == 0  # the engine's spelling of off
            assert refusal({**body, lit.field: int(value) - 1}, endpoint).param == lit.field
        else:
            low, high = lit.values
            assert (spec.minimum, spec.maximum) == (low, high), (lit, spec)
            for inside in (low, high):
                parse_request({**body, lit.field: inside}, endpoint)
            for outside in (low / 2, high * 2):
                assert refusal({**body, lit.field: outside}, endpoint).param == lit.field


# ---- errors --------------------------------------------------------------------------------
class Raised(NamedTuple):
    code: str
    status: int | None
    retry_after: bool  # a Retry-After value given (not a constant None)
    where: str


def _call_name(call: ast.Call) -> str:
    func = call.func
    if isinstance(func, ast.Attribute) and func.attr == "__init__":
        func = func.value  # ApiError.__init__(self, ...) in a subclass
    return func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")


def _strings(node: ast.expr | None) -> list[str]:
    """The constant strings an expression can be: a constant or either arm of `a if c else b`."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _strings(node.body) + _strings(node.orelse)
    return []


def _given(node: ast.expr | None) -> bool:
    return node is not None and not (isinstance(node, ast.Constant) and node.value is None)


def _raised_by(call: ast.Call, where: str) -> Iterator[Raised]:
    name = _call_name(call)
    keywords = {k.arg: k.value for k in call.keywords}
    init = isinstance(call.func, ast.Attribute) and call.func.attr == "__init__"
    args = call.args[1:] if init else call.args  # past `self`
    if name == "ApiError":
        first = args[0] if args else None
        status = first.value if isinstance(first, ast.Constant) and isinstance(
            first.value, int) else None
        for code in _strings(keywords.get("code")):
            yield Raised(code, status, _given(keywords.get("retry_after")), where)
    elif name == "bad_request":
        default: ast.expr = ast.Constant("invalid_value")  # bad_request's own default
        for value in _strings(keywords.get("code", args[2] if len(args) > 2 else default)):
            yield Raised(value, 400, False, where)
    elif name in ("RateLimited", "QueueFull") and args:  # answered 429 with their reason
        wait = args[1] if len(args) > 1 else keywords.get("retry_after")
        for code in _strings(args[0]):
            yield Raised(code, 429, _given(wait), where)


def raised(paths: tuple[str, ...]) -> list[Raised]:
    found: list[Raised] = []
    for path in paths:
        target = ROOT / path
        for file in sorted(target.rglob("*.py")) if target.is_dir() else [target]:
            where = str(file.relative_to(ROOT))
            for node in ast.walk(ast.parse(file.read_text(), where)):
                if isinstance(node, ast.Call):
                    found.extend(_raised_by(node, where))
    return found


def page_errors(text: str) -> set[tuple[int, str]]:
    """(status, code) for each code listed after its status: `429 `a`, `b` (why); 503 ...`."""
    errors = bullet(text, "Errors")
    listed = set()
    for status, codes in re.findall(r"\b([1-5]\d\d) ((?:`\w+`(?: \([^()]*\))?,? ?)+)", errors):
        listed |= {(int(status), code) for code in code_names(re.sub(r"\([^()]*\)", "", codes))}
    return listed


def page_retry_after(text: str) -> tuple[set[str], set[str]]:
    """The codes the page says come with Retry-After, and the 429s it says do not."""
    sentence = re.search(r"Retry-After [^.]*\.", bullet(text, "Errors"))
    assert sentence, "the Errors bullet has no sentence on Retry-After"
    but = re.search(r"every 429 but ((?:`\w+`(?:, | and |, and )?)+)", sentence.group(0))
    without = set(code_names(but.group(1))) if but else set()
    codes = {c for s, c in page_errors(text) if s == 429} - without
    with_503 = re.search(r"the 503s (.*)", sentence.group(0))
    return codes | set(code_names(with_503.group(1) if with_503 else "")), without


def test_every_code_the_page_lists_is_raised_with_its_status() -> None:
    listed = page_errors(page())
    assert len(listed) >= 20, listed
    produced = {(r.status, r.code) for r in raised(PACKAGES)}
    never = sorted(listed - produced)
    assert not never, f"docs/api.md lists (status, code) pairs nothing raises: {never}"


def test_every_code_of_the_request_path_is_on_the_page() -> None:
    text = page()
    assert "all the codes a completion request can get" in bullet(text, "Errors")
    on_path = raised(REQUEST_PATH)
    stale = sorted(set(NOT_ON_THE_REQUEST_PATH) - {r.code for r in on_path})
    assert not stale, f"NOT_ON_THE_REQUEST_PATH names codes those modules no longer raise: {stale}"
    listed = page_errors(text)
    missing = sorted({f"{r.status} {r.code} ({r.where})" for r in on_path
                      if r.code not in NOT_ON_THE_REQUEST_PATH
                      and (r.status, r.code) not in listed})
    assert not missing, f"raised on the request path, not in docs/api.md's list: {missing}"


def test_the_codes_said_to_come_with_retry_after_do() -> None:
    text = page()
    with_wait, without = page_retry_after(text)
    assert {"requests_per_min", "queue_timeout", "engine_overloaded"} <= with_wait, with_wait
    assert without == {"request_too_large"}, without
    given = {r.code for r in raised(PACKAGES) if r.retry_after}
    bare = sorted(with_wait - given)
    assert not bare, f"docs/api.md says these come with Retry-After; none is raised with: {bare}"
    assert "whole seconds, at least 1" in bullet(text, "Errors")
    assert [retry_after_header(s) for s in (0.0, 0.2, 1.0, 1.5)] == [1, 1, 1, 2]
    assert ApiError(429, "wait", retry_after=0.2).headers() == {"Retry-After": "1"}

"""protocol.openai's field table as the parser reads it: the messages a client sees for the
token-id prompts and integer bounds, and the defaults it hands the engine."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from protocol.errors import ApiError
from protocol.openai import (
    FIELDS,
    MAX_COUNT,
    MAX_TOKEN_ID,
    REQUEST_FIELDS,
    SAMPLING_FIELDS,
    parse_request,
    read_field,
    request_fields,
)


def _error(body: dict[str, Any], endpoint: str = "completions") -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(body, endpoint)
    assert info.value.status == 400
    return info.value


@pytest.mark.parametrize(("prompt", "where"), [
    ([1, -3], "prompt[1] is -3"),
    ([True, False], "prompt[0] is true"),
    ([4, 2.5], "prompt[1] is 2.5"),
    ([1, 2**31], f"prompt[1] is {2**31}"),
    ([[7, "a"]], 'prompt[0][1] is "a"'),
    ([1, [2]], "prompt[1] is [2]"),
    ([1, {"x": "y" * 80}], 'prompt[1] is {"x": "' + "y" * 33 + "..."),
])
def test_a_bad_token_id_is_named(prompt: list[Any], where: str) -> None:
    error = _error({"prompt": prompt})
    assert error.message == (f"'prompt' token ids must be integers in [0, {MAX_TOKEN_ID}]; "
                             f"{where}")
    assert error.param == "prompt" and error.code == "invalid_value"


def test_a_batch_is_still_a_batch() -> None:
    assert "batched prompts are not supported" in _error({"prompt": ["a", "b"]}).message
    assert "batched prompts are not supported" in _error({"prompt": [[1], [2]]}).message


def test_stop_token_ids_name_the_bad_one() -> None:
    error = _error({"prompt": "x", "stop_token_ids": [5, -1]})
    assert error.param == "stop_token_ids"
    assert error.message.endswith("stop_token_ids[1] is -1")


@pytest.mark.parametrize(("name", "value", "message"), [
    ("top_k", 10**18, f"'top_k' must be in [-1, {MAX_COUNT}], got {10**18}"),
    ("top_k", -2, f"'top_k' must be in [-1, {MAX_COUNT}], got -2"),
    ("min_tokens", 2**31, f"'min_tokens' must be in [0, {MAX_COUNT}], got {2**31}"),
    ("seed", 2**63, f"'seed' must be in [{-(2**63)}, {2**63 - 1}], got {2**63}"),
    ("top_k", 2.5, f"'top_k' must be an integer in [-1, {MAX_COUNT}], got 2.5"),
    ("temperature", 900, "'temperature' must be in [0.0, 100.0], got 900"),
    ("top_p", 0, "'top_p' must be in (0.0, 1.0], got 0"),
])
def test_integers_and_numbers_are_bounded(name: str, value: Any, message: str) -> None:
    error = _error({"prompt": "x", name: value})
    assert (error.message, error.param, error.code) == (message, name, "invalid_value")


def test_max_tokens_past_any_context_is_a_context_error() -> None:
    for body, endpoint, name in (({"prompt": "x", "max_tokens": 10**30}, "completions",
                                  "max_tokens"),
                                 ({"messages": [{"role": "user", "content": "x"}],
                                   "max_completion_tokens": 2**31}, "chat",
                                  "max_completion_tokens")):
        error = _error(body, endpoint)
        assert (error.param, error.code) == (name, "context_length_exceeded")


def test_the_bounds_themselves_are_accepted() -> None:
    req = parse_request({"prompt": [0, MAX_TOKEN_ID], "top_k": MAX_COUNT, "seed": -(2**63),
                         "max_tokens": MAX_COUNT, "min_tokens": MAX_COUNT}, "completions")
    assert req.prompt == [0, MAX_TOKEN_ID] and req.max_tokens == MAX_COUNT
    assert req.sampling["top_k"] == MAX_COUNT and req.sampling["seed"] == -(2**63)


def test_omitted_fields_are_the_engines_defaults() -> None:
    """Every SamplingParams keyword the table fills, filled with the engine's own default
    (temperature aside: OpenAI's 1.0, where the engine's own is greedy)."""
    sampling = parse_request({"prompt": "x"}, "completions").sampling
    assert set(sampling) == set(SAMPLING_FIELDS)
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert {k: v for k, v in sampling.items() if defaults[k] != v} == {"temperature": 1.0}


def test_the_table_is_one_entry_per_name() -> None:
    assert len(FIELDS) == len(REQUEST_FIELDS)
    assert all(f.endpoints for f in REQUEST_FIELDS)


# ---- the parser reads only what a body sends: the same answer as reading every field ---------
_VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 70000), st.floats(-3, 3, allow_nan=False),
    st.sampled_from(["", "hi", "auto", "batch", "interactive", "length"]),
    st.lists(st.integers(-1, 300), max_size=3),
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "bot"]),
                                    "content": st.sampled_from(["x", "", 3])}), max_size=2),
    st.fixed_dictionaries({"include_usage": st.booleans()}),
)
_NAMES = st.sampled_from([f.name for f in REQUEST_FIELDS] + ["unknown_field", "user"])


def _every_field(body: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """The table walk parse_request did before it skipped omitted fields: each field in order,
    read when sent or required, else its default; the first bad one raises."""
    values = {}
    for spec in request_fields(endpoint):
        value = body.get(spec.name)
        values[spec.name] = (spec.default if value is None and not spec.required
                             else read_field(spec, value))
    return values


def _outcome(call: Any) -> Any:
    try:
        return call()
    except ApiError as exc:
        return ("error", exc.status, exc.message, exc.param, exc.code)


@settings(max_examples=400, deadline=None)
@given(body=st.dictionaries(_NAMES, _VALUES, max_size=8),
       endpoint=st.sampled_from(["chat", "completions"]))
def test_reading_only_the_sent_fields_answers_as_reading_every_field(
        body: dict[str, Any], endpoint: str) -> None:
    """Whatever the body, parse_request fails on the same field with the same message as the
    whole table walk (the first bad field in the table's order, not the body's), or reads the
    same values: each field the walk read, with the same value."""
    walked = _outcome(lambda: _every_field(body, endpoint))
    parsed = _outcome(lambda: parse_request(body, endpoint))
    if isinstance(walked, tuple):
        assert parsed == walked
        return
    assert not isinstance(parsed, tuple), parsed
    expected_tokens = walked.get("max_completion_tokens")
    assert parsed.max_tokens == (walked["max_tokens"] if expected_tokens is None
                                 else expected_tokens)
    assert (parsed.model, parsed.stream, parsed.priority, parsed.tenant) == (
        walked["model"] or None, walked["stream"], walked["priority"], walked["tenant"])
    assert parsed.messages == walked.get("messages") and parsed.prompt == walked.get("prompt")
    for name in SAMPLING_FIELDS:
        want = walked[name]
        assert parsed.sampling[name] == (0 if name == "top_k" and want == -1 else want), name

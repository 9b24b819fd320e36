"""`sampling_params` builds one SamplingParams per distinct set of values and shares it: what it
answers is what building one for the request answers, a 400 included, whatever came before."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.openai_api import sampling_params
from engine.request import SamplingParams
from protocol.errors import ApiError
from protocol.openai import OpenAIRequest, parse_request


def chat(**fields: Any) -> OpenAIRequest:
    return parse_request({"messages": [{"role": "user", "content": "hi"}], **fields}, "chat")


def built(req: OpenAIRequest, max_tokens: int) -> SamplingParams | str:
    """What the request's own SamplingParams is, or the refusal's message."""
    try:
        return SamplingParams(max_tokens=max_tokens, **req.sampling)
    except ValueError as exc:
        return str(exc)


def answered(req: OpenAIRequest, max_tokens: int) -> SamplingParams | str:
    try:
        return sampling_params(req, max_tokens)
    except ApiError as exc:
        assert exc.status == 400
        return exc.message


def test_a_repeated_setting_shares_one_params() -> None:
    first = sampling_params(chat(temperature=0.7, stop=["\n"]), 16)
    assert sampling_params(chat(temperature=0.7, stop="\n"), 16) is first
    assert sampling_params(chat(temperature=0.7, stop=["\n"]), 17) is not first
    assert sampling_params(chat(temperature=0.8, stop=["\n"]), 16).temperature == 0.8


def test_a_value_equal_to_a_passed_one_but_refused_is_refused() -> None:
    # True == 1 and hashes alike: a key without the types would hand back min_tokens=1's params
    sampling_params(chat(min_tokens=1), 16)
    req = chat(min_tokens=1)
    refused = dataclasses.replace(req, sampling={**req.sampling, "min_tokens": True})
    with pytest.raises(ApiError, match="min_tokens must be an integer"):
        sampling_params(refused, 16)


def test_a_value_that_cannot_be_a_key_is_built_for_its_request() -> None:
    req = chat()
    listed = dataclasses.replace(req, sampling={**req.sampling, "stop": ["a", "b"]})
    assert sampling_params(listed, 16).stop == ("a", "b")


VALUES = {
    "temperature": [0, 0.0, 1, 1.0, 0.7, True, -1.0, 101],
    "top_k": [0, 1, 1.0, True, -3],
    "min_tokens": [0, 1, 4, True, 1.0, 99],
    "seed": [None, 0, 1, True, 2**63],
    "stop": [(), ("a",), ("",)],
}


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.fixed_dictionaries({k: st.sampled_from(v) for k, v in VALUES.items()}),
                          st.sampled_from([1, 4, 16, True])), min_size=1, max_size=12))
def test_the_shared_answer_is_the_requests_own(requests: list[tuple[dict[str, Any], int]]) -> None:
    base = chat()
    for values, max_tokens in requests:
        req = dataclasses.replace(base, sampling={**base.sampling, **values})
        want, got = built(req, max_tokens), answered(req, max_tokens)
        assert got == want
        if isinstance(want, SamplingParams):  # the same values down to their types
            assert isinstance(got, SamplingParams)
            assert [type(getattr(got, f.name)) for f in dataclasses.fields(got)] == [
                type(getattr(want, f.name)) for f in dataclasses.fields(want)]

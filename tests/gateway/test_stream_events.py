"""A remote engine's stream event the gateway cannot read (choices or usage of the wrong shape)
is a 502 in OpenAI's error shape, which the relay sends as the stream's error event, not an
exception that ends the stream as a 500."""

from __future__ import annotations

import json

import pytest

from engine.request import SamplingParams
from gateway.backends import Job, Outcome
from gateway.backends.stream import pass_event
from protocol.errors import ApiError
from protocol.openai import parse_request


def _job() -> Job:
    req = parse_request({"model": "m", "prompt": "hi", "stream": True}, "completions")
    return Job("r1", req, "acme", "interactive", 2, SamplingParams(max_tokens=16))


@pytest.mark.parametrize("event", [
    {"choices": "oops"},
    {"choices": [7]},
    {"choices": [{"text": "a"}], "usage": {"prompt_tokens": "many", "completion_tokens": 1}},
    {"choices": [], "usage": {"completion_tokens": [1]}},
])
def test_a_malformed_event_is_a_bad_gateway(event: dict[str, object]) -> None:
    with pytest.raises(ApiError) as raised:
        pass_event(json.dumps(event).encode(), _job(), Outcome(prompt_tokens=2))
    assert raised.value.status == 502 and raised.value.code == "bad_gateway"


def test_a_well_formed_event_passes_and_counts_its_token() -> None:
    outcome = Outcome(prompt_tokens=2)
    out = pass_event(json.dumps({"choices": [{"text": "a", "finish_reason": None}]}).encode(),
                     _job(), outcome)
    assert out.startswith(b"data: ") and outcome.completion_tokens == 1

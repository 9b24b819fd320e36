"""The engine's side of the OpenAI protocol (`protocol.openai`): a validated request becomes
prompt token ids and `SamplingParams`. The gateway's embedded backend and the engine server
both call these, so a body means the same on every surface."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.request import SamplingParams
from engine.tokenizer import Tokenizer
from protocol.errors import ApiError
from protocol.openai import (
    OpenAIRequest,
    invalid_value,
    prompt_token_ids,
    resolve_max_tokens,
)


@dataclass
class GenerationRequest:
    """What the engine runs for one API request."""

    prompt_token_ids: list[int]
    params: SamplingParams


def sampling_params(req: OpenAIRequest, max_tokens: int) -> SamplingParams:
    """The request's SamplingParams; the engine's range rules answered as 400s. One is built
    (and its rules checked: 5.5 µs) per distinct set of values and then shared, being frozen:
    a client's requests mostly repeat its settings. Values that are equal but of another type
    (1, 1.0, True) are told apart, so a value the rules refuse is never taken for one they
    passed; a refused set is not kept, and is checked again when it comes again."""
    try:
        try:
            return _shared_params(max_tokens, **req.sampling)
        except TypeError:  # a value that cannot be a key (a list): built for this request only
            return SamplingParams(max_tokens=max_tokens, **req.sampling)
    except ValueError as exc:
        raise invalid_value(exc) from None


@functools.lru_cache(maxsize=1024, typed=True)
def _shared_params(max_tokens: int, **sampling: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **sampling)


def generation_request(req: OpenAIRequest, tokenizer: Tokenizer, max_model_len: int,
                       model_names: Sequence[str]) -> GenerationRequest:
    """Check the model, render the prompt, resolve max_tokens, build the sampling params.
    `model_names`: the names the engine answers to, its id first (EngineConfig's
    accepted_model_names)."""
    check_model(req, model_names)
    ids = prompt_token_ids(req, tokenizer)
    max_tokens = resolve_max_tokens(req, len(ids), max_model_len)
    return GenerationRequest(ids, sampling_params(req, max_tokens))


def check_model(req: OpenAIRequest, model_names: Sequence[str]) -> None:
    """404 for a request naming a model that is none of `model_names` (no model: the engine's)."""
    if req.model is not None and req.model not in model_names:
        raise ApiError(404, f"The model {req.model!r} does not exist; this engine serves "
                       f"{model_names[0]!r}", param="model", code="model_not_found")

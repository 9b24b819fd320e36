"""Request.token_slice, which block hashing reads, against the plain slice of prompt + outputs."""

from __future__ import annotations

from engine.request import Request, SamplingParams


def test_token_slice_matches_the_whole_sequence_sliced() -> None:
    request = Request("r", [10, 11, 12, 13, 14], SamplingParams(max_tokens=8))
    for i, token in enumerate([20, 21, 22, 23]):
        request.append_output(token, float(i))
    sequence = request.prompt_token_ids + request.output_token_ids
    for start in range(len(sequence) + 2):
        for stop in range(start, len(sequence) + 3):
            assert request.token_slice(start, stop) == sequence[start:stop], (start, stop)

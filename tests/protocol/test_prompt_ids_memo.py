"""protocol.openai.prompt_token_ids: memoised per tokenizer, and given ids are tokenizer-free."""

from __future__ import annotations

from engine.tokenizer import ByteTokenizer
from protocol.openai import PROMPT_IDS, parse_request, prompt_token_ids


class Offset(ByteTokenizer):
    """Another model's tokenizer: every byte's id shifted by one."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [t + 1 for t in super().encode(text, add_special_tokens)]


def test_each_tokenizer_renders_its_own_ids_and_reuses_them() -> None:
    req = parse_request({"prompt": "ab"}, "completions")
    first, other = ByteTokenizer(), Offset()
    ids = prompt_token_ids(req, first)
    assert prompt_token_ids(req, first) is ids  # memoised for that tokenizer
    shifted = prompt_token_ids(req, other)  # a backend of another model: its own ids
    assert shifted == [t + 1 for t in ids]
    assert prompt_token_ids(req, other) is shifted


def test_ids_the_request_gave_are_every_tokenizers() -> None:
    listed = parse_request({"prompt": [5, 6]}, "completions")
    given = parse_request({"messages": [{"role": "user", "content": "x"}], PROMPT_IDS: [7, 8]},
                          "chat")
    empty = parse_request({"prompt": "x", PROMPT_IDS: []}, "completions")
    for tokenizer in (ByteTokenizer(), Offset()):
        assert prompt_token_ids(listed, tokenizer) == [5, 6]
        assert prompt_token_ids(given, tokenizer) == [7, 8]
    assert prompt_token_ids(empty, Offset()) == Offset().encode("x")  # empty: not given

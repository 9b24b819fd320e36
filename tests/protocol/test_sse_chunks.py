"""Which event of an OpenAI stream is a token (protocol.sse.read_chunk, is_token_chunk): each kind
of chunk, in both JSON spellings, and the byte-search fast path agreeing with the parse."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.sse import PLAIN_TOKEN, is_token_chunk, read_chunk


def _completion(text: str | None, finish: str | None = None, **top: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish}
    if text is not None:
        choice["text"] = text
    return {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
            "choices": [choice], **top}


def _chat(delta: dict[str, Any], finish: str | None = None, **top: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish}], **top}


USAGE = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
TOOL_CALL = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": ""}}]}

# (name, chunk, is a token)
CHUNKS: list[tuple[str, dict[str, Any], bool]] = [
    ("completion text", _completion("a"), True),
    ("completion empty text (a held-back UTF-8 byte)", _completion(""), True),
    ("completion last token", _completion("z", "stop"), True),
    ("completion finish only", _completion("", "length"), False),
    ("completion token, usage null", _completion("a", usage=None), True),
    ("completion token with running usage", _completion("a", usage=USAGE), True),
    ("text that looks like markers", _completion('"usage":{"error": "role"'), True),
    ("chat content", _chat({"content": "hi"}), True),
    ("chat empty content", _chat({"content": ""}), True),
    ("chat role-only first chunk", _chat({"role": "assistant", "content": ""}), False),
    ("chat role without content", _chat({"role": "assistant"}), False),
    ("chat role with the first token", _chat({"role": "assistant", "content": "Hi"}), True),
    ("chat tool-call delta", _chat(TOOL_CALL), True),
    ("chat tool-call arguments", _chat({"tool_calls": [
        {"index": 0, "function": {"arguments": '{"city": "Par'}}]}), True),
    ("chat reasoning delta", _chat({"reasoning_content": "let me think"}), True),
    ("chat null content", _chat({"content": None}), False),
    ("chat finish only", _chat({}, "stop"), False),
    ("chat finish with empty content", _chat({"content": ""}, "stop"), False),
    ("chat last token", _chat({"content": "."}, "stop"), True),
    ("usage only", {"id": "c", "choices": [], "usage": USAGE}, False),
    ("error event", {"error": {"message": 'the "text":"x" failed', "code": "engine_error"}},
     False),
    ("no choices at all", {"id": "c"}, False),
]
SPELLINGS = {"compact": (",", ":"), "spaced": (", ", ": ")}


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize(("name", "chunk", "token"), CHUNKS, ids=[c[0] for c in CHUNKS])
def test_each_kind_of_chunk_is_or_is_not_a_token(name: str, chunk: dict[str, Any], token: bool,
                                                 spelling: str) -> None:
    data = json.dumps(chunk, separators=SPELLINGS[spelling]).encode()
    read = read_chunk(data)
    assert read.token is token and is_token_chunk(chunk) is token
    assert not read.done
    assert read.error is ("error" in chunk)
    if read is PLAIN_TOKEN:  # told apart without a parse: nothing else in it to read
        assert not isinstance(chunk.get("usage"), dict) and "error" not in chunk
        assert chunk["choices"][0]["finish_reason"] is None
    else:
        assert read.body == chunk
        assert read.usage == (chunk.get("usage") or None)


def test_a_plain_token_needs_no_parse() -> None:
    assert read_chunk(b'{"choices":[{"index":0,"text":"a","finish_reason":null}]}') is PLAIN_TOKEN
    assert read_chunk(b'{"choices": [{"delta": {"content": "hi"}, "finish_reason": null}],'
                      b' "usage": null}') is PLAIN_TOKEN


@pytest.mark.parametrize("data", [b"[DONE]", b" [DONE] "])
def test_done_is_the_end_and_no_token(data: bytes) -> None:
    read = read_chunk(data)
    assert read.done and not read.token and read.body is None and not read.error


def test_garbage_raises_and_json_that_is_not_an_object_is_nothing() -> None:
    with pytest.raises(ValueError):
        read_chunk(b"{not json")
    for data in (b"[1, 2]", b'"text"', b"null"):
        read = read_chunk(data)
        assert not read.token and not read.done and read.body is None


_TEXTS = st.one_of(st.none(), st.just(""), st.text(max_size=6),
                   st.sampled_from(['"', '\\"', '"text":"x', '"usage":{', '"error"', '""']))
_DELTAS = st.fixed_dictionaries({}, optional={
    "role": st.just("assistant"), "content": _TEXTS, "reasoning_content": _TEXTS,
    "tool_calls": st.sampled_from([[], TOOL_CALL["tool_calls"]])})
_CHOICES = st.one_of(
    st.builds(lambda text, finish: {"index": 0, "text": text, "finish_reason": finish},
              _TEXTS, st.sampled_from([None, "stop", "length"])),
    st.builds(lambda delta, finish: {"index": 0, "delta": delta, "finish_reason": finish},
              _DELTAS, st.sampled_from([None, "stop", "tool_calls"])))
_CHUNKS = st.builds(
    lambda choices, usage, error: {"choices": choices,
                                   **({} if usage == "absent" else {"usage": usage}),
                                   **({"error": {"message": "x"}} if error else {})},
    st.lists(_CHOICES, max_size=1), st.sampled_from(["absent", None, USAGE]), st.booleans())


@given(_CHUNKS, st.sampled_from(list(SPELLINGS.values())), st.booleans())
def test_the_fast_path_agrees_with_the_parse(chunk: dict[str, Any], separators: tuple[str, str],
                                             ascii_only: bool) -> None:
    data = json.dumps(chunk, separators=separators, ensure_ascii=ascii_only).encode()
    read = read_chunk(data)
    assert read.token is is_token_chunk(chunk)
    if read is PLAIN_TOKEN:
        assert not isinstance(chunk.get("usage"), dict) and "error" not in chunk
        assert all(c["finish_reason"] is None for c in chunk["choices"])

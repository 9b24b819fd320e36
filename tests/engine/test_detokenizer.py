"""Incremental detokenisation never splits a UTF-8 character; stop strings never leak."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()


def stream(token_ids: list[int], chunks: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(TOKENIZER)
    deltas, start = [], 0
    for size in chunks:
        deltas.append(detok.add(token_ids[start:start + size]))
        start += size
    deltas.append(detok.add(token_ids[start:]))
    deltas.append(detok.flush())
    return deltas


def test_multibyte_character_is_held_until_complete() -> None:
    detok = IncrementalDetokenizer(TOKENIZER)
    euro = list("€".encode())  # three bytes
    assert detok.add([ord("a")]) == "a"
    assert detok.add(euro[:1]) == ""
    assert detok.add(euro[1:2]) == ""
    assert detok.add(euro[2:]) == "€"
    assert detok.add([ord("b")]) == "b"
    assert detok.flush() == ""


def test_special_tokens_are_skipped_and_invalid_bytes_flushed_as_replacement() -> None:
    detok = IncrementalDetokenizer(TOKENIZER)
    assert detok.add([256, ord("x"), 257]) == "x"
    assert detok.add([0xE2, 0x82]) == ""  # an unfinished character at the end...
    assert detok.flush() == "\ufffd"  # ...is replaced only when the stream ends


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=40), chunks=st.lists(st.integers(0, 5), max_size=60))
def test_deltas_join_to_the_text_and_never_split_a_character(text: str, chunks: list[int]) -> None:
    token_ids = TOKENIZER.encode(text, add_special_tokens=False)
    deltas = stream(token_ids, chunks)
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas if "\ufffd" not in text)


def test_stop_string_across_deltas_is_not_emitted() -> None:
    matcher = StopStringMatcher(("STOP",))
    emitted = [matcher.feed(d) for d in ("abc ST", "O", "P and more")]
    assert "".join(emitted) == "abc "
    assert matcher.stopped
    assert matcher.feed("later") == ""


def test_held_text_is_released_when_it_cannot_match_or_at_the_end() -> None:
    matcher = StopStringMatcher(("xyz",))
    # the last len("xyz") - 1 characters could begin a match: held
    assert matcher.feed("abx") == "a"
    assert matcher.feed("q") == "b"
    assert matcher.feed("xy", final=True) == "xqxy"
    assert not matcher.stopped


def streamed_stop(text: str, stops: list[str], bounds: list[int]) -> tuple[str, bool]:
    """The oracle: after each piece, is any stop string complete in the text received so far?
    The first time one is, the output is the received text up to the earliest start among the
    stops complete then (a stop completing later cannot undo what already matched)."""
    for end in bounds[1:]:
        found = [i for i in (text[:end].find(s) for s in stops) if i >= 0]
        if found:
            return text[:min(found)], True
    return text, False


def test_the_stop_complete_first_wins_over_one_starting_earlier() -> None:
    # "ab" arrives: "b" is complete at 1; "aba", starting at 0, completes only a piece later
    matcher = StopStringMatcher(("b", "aba"))
    assert matcher.feed("ab") + matcher.feed("a", final=True) == "a"
    assert streamed_stop("aba", ["b", "aba"], [0, 2, 3]) == ("a", True)


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet="abc", max_size=30),
       stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=3), min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 30), max_size=10))
def test_output_is_the_text_before_the_first_stop(text: str, stops: list[str],
                                                  cuts: list[int]) -> None:
    matcher = StopStringMatcher(tuple(stops))
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    out = "".join(matcher.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces))
    assert (out, matcher.stopped) == streamed_stop(text, stops, bounds)

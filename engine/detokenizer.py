"""Incremental detokenisation and stop strings for streamed outputs.

A token can end in the middle of a UTF-8 character (byte-level vocabularies) or change how the
previous token reads (SentencePiece's leading spaces), so each step decodes a short window of
recent tokens and emits only the text that the window adds over its settled prefix.
"""

from __future__ import annotations

from engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text deltas, never splitting a character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window: context for the next tokens
        self.read_offset = 0  # tokens before this have been emitted as text

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_token_ids: list[int]) -> str:
        """The text the new tokens complete ("" while a character is still incomplete)."""
        self.token_ids.extend(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        # A trailing replacement character is an incomplete UTF-8 sequence: wait for its bytes.
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text):]

    def flush(self) -> str:
        """At the end: whatever is still held back, incomplete characters replaced."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""


class StopStringMatcher:
    """Finds stop strings in streamed text. Text that could be the start of a stop string is
    held back until it can no longer match, so a client never sees part of a stop string."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""  # received, not yet emitted
        self.stopped = False

    def feed(self, delta: str, final: bool = False) -> str:
        """The text to emit now; sets `stopped` (and drops the rest) when a stop string matched."""
        if self.stopped:
            return ""
        self.pending += delta
        cut = self._first_match()
        if cut is not None:
            self.stopped = True
            emit, self.pending = self.pending[:cut], ""
            return emit
        keep = 0 if final or not self.stop else min(self.hold, len(self.pending))
        emit = self.pending[:len(self.pending) - keep]
        self.pending = self.pending[len(emit):]
        return emit

    def _first_match(self) -> int | None:
        found = [i for i in (self.pending.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None

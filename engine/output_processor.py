"""OutputProcessor: a request's new tokens become the RequestOutputs on its stream.

Engine thread only. Each request in the LLMEngine is tracked with its own incremental
detokeniser, stop-string matcher and destination stream; a finished request leaves a
RequestRecord for the stats. Outputs collect in an outbox that the engine loop hands to the
event loop once per step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.llm_engine import LLMEngine
from engine.request import FinishReason, Request
from engine.stats import RequestRecord


@dataclass
class RequestOutput:
    """One increment of a request's stream; `text` never ends inside a UTF-8 character."""

    request_id: str
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    arrival_time: float
    first_token_time: float | None = None
    queue_time: float | None = None  # seconds from arrival to first scheduled
    ttft: float | None = None
    num_cached_tokens: int = 0


Event = RequestOutput | BaseException  # an exception ends the stream by raising
Stream = asyncio.Queue[Event]


@dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    stop: StopStringMatcher
    stream: Stream

    def text(self, token_ids: list[int], final: bool) -> str:
        """The text to send for new tokens, stop strings held back or cut off."""
        text = self.detokenizer.add(token_ids)
        if final:
            text += self.detokenizer.flush()
        return self.stop.feed(text, final=final)


class OutputProcessor:
    def __init__(self, engine: LLMEngine, on_finished: Callable[[RequestRecord], None]) -> None:
        self._engine = engine
        self._on_finished = on_finished
        self._tracked: dict[str, _Tracked] = {}
        self._outbox: list[tuple[Stream, Event]] = []

    def track(self, request: Request, stream: Stream) -> None:
        """Start following a request the LLMEngine accepted."""
        self._tracked[request.request_id] = _Tracked(
            request, IncrementalDetokenizer(self._engine.tokenizer),
            StopStringMatcher(request.params.stop), stream)

    def emit(self, request_id: str, token_ids: list[int], reason: FinishReason | None) -> None:
        """Queue a tracked request's next output; a stop string ends it (in the engine too)."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return
        text = tracked.text(token_ids, final=reason is not None)
        if tracked.stop.stopped and reason in (None, FinishReason.LENGTH):
            if reason is None:
                self._engine.finish(request_id, FinishReason.STOP)
            reason = FinishReason.STOP
        self._outbox.append((tracked.stream, _output(tracked.request, token_ids, text, reason)))
        if reason is not None:
            del self._tracked[request_id]
            self._on_finished(self._record(tracked.request, reason))

    def finish(self, request_id: str, reason: FinishReason) -> None:
        """End a tracked request from outside the step (abort, error). Unknown ids: no-op."""
        if request_id in self._tracked:
            self._engine.finish(request_id, reason)
            self.emit(request_id, [], reason)

    def finish_all(self, reason: FinishReason) -> None:
        for request_id in list(self._tracked):
            self.finish(request_id, reason)

    def forget_all(self) -> None:
        """Drop every tracked request without an output (when ending them cleanly failed)."""
        self._tracked.clear()

    def fail(self, stream: Stream, error: BaseException) -> None:
        """A request the LLMEngine refused: its stream raises `error`."""
        self._outbox.append((stream, error))

    def abort_unstarted(self, stream: Stream, request_id: str, num_prompt_tokens: int,
                        arrival_time: float) -> None:
        """The final output of a request aborted before it reached the LLMEngine."""
        self._outbox.append((stream, RequestOutput(
            request_id, [], "", True, FinishReason.ABORT.value, num_prompt_tokens, 0,
            arrival_time)))

    def take_outbox(self) -> list[tuple[Stream, Event]]:
        batch, self._outbox = self._outbox, []
        return batch

    def _record(self, request: Request, reason: FinishReason) -> RequestRecord:
        finished = request.finished_time
        return RequestRecord(
            request_id=request.request_id, tenant=request.tenant, priority=request.priority,
            finish_reason=reason.value, arrival_time=request.arrival_time,
            finished_time=self._engine.clock.now() if finished is None else finished,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time, token_times=tuple(request.token_times),
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            num_preemptions=request.num_preemptions)


def _output(request: Request, token_ids: list[int], text: str,
            reason: FinishReason | None) -> RequestOutput:
    first_token, scheduled = request.first_token_time, request.first_scheduled_time
    return RequestOutput(
        request_id=request.request_id, new_token_ids=list(token_ids), text=text,
        finished=reason is not None, finish_reason=None if reason is None else reason.value,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=request.num_output_tokens, arrival_time=request.arrival_time,
        first_token_time=first_token,
        queue_time=None if scheduled is None else scheduled - request.arrival_time,
        ttft=None if first_token is None else first_token - request.arrival_time,
        num_cached_tokens=request.num_cached_tokens)

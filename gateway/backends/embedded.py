"""The embedded backend: an AsyncEngine in the gateway's own process, its outputs written as
OpenAI bytes here (the engine server's format, protocol.openai)."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from engine.tokenizer import Tokenizer
from gateway.backends.base import (
    RECENT_HORIZON_S,
    BackendUnavailable,
    Job,
    Outcome,
    RecentWork,
    room_from_load,
)
from protocol import fastjson
from protocol.errors import ApiError
from protocol.openai import OpenAIRequest, prompt_token_ids
from protocol.sse import DONE


class EmbeddedBackend:
    """An AsyncEngine in this process."""

    def __init__(self, engine: Any, slack: int = 4, name: str = "embedded") -> None:
        self.engine = engine
        self.name = name
        self.slack = slack
        self.model_name = str(getattr(engine, "model_name", engine.config.model))
        self.model_aliases = tuple(engine.config.accepted_model_names)  # the model path too
        self.max_model_len = int(engine.config.max_model_len)
        self.tokenizer: Tokenizer = engine.tokenizer
        self.inflight = 0
        self.healthy = True
        self.recent = RecentWork()
        self.sent = 0

    def capacity(self) -> int:
        return self.seats() + self.slack

    def seats(self) -> int:
        return int(self.engine.config.max_num_seqs)

    def has_room(self) -> bool:
        return room_from_load(self.engine.load(), self.inflight, self.slack)

    def outstanding_tokens(self) -> int:
        recent = self.recent.drop_before(time.monotonic() - RECENT_HORIZON_S)
        return int(self.engine.load().get("outstanding_tokens", 0)) + recent

    def dispatched(self, tokens: int) -> None:
        self.recent.add(tokens)
        self.sent += 1

    def count_prompt(self, req: OpenAIRequest) -> int:
        return len(prompt_token_ids(req, self.tokenizer))

    async def start(self) -> None:
        await self.engine.start()

    async def close(self) -> None:
        await self.engine.shutdown()

    async def _outputs(self, job: Job) -> AsyncGenerator[Any, None]:
        from engine.async_engine import EngineOverloaded

        try:
            gen = self.engine.generate(job.request_id, prompt_token_ids(job.req, self.tokenizer),
                                       job.params, tenant=job.tenant,
                                       priority=job.priority,
                                       tenant_weight=job.tenant_weight)
            first = await anext(gen)
        except EngineOverloaded as exc:
            raise BackendUnavailable(str(exc), float(exc.retry_after)) from None
        except ValueError as exc:
            raise ApiError(400, str(exc), code="invalid_value") from None
        except StopAsyncIteration:
            return
        except RuntimeError as exc:  # EngineStopped: shutting down or crashed
            raise BackendUnavailable(f"engine unavailable: {exc}", 5.0) from None
        try:
            yield first
            async for out in gen:
                yield out
        except (ValueError, RuntimeError) as exc:  # the engine failed this request mid-way
            raise ApiError(502, f"engine error: {exc}", code="engine_error") from None
        finally:
            await gen.aclose()  # early close aborts the engine request

    async def stream(self, job: Job, outcome: Outcome) -> AsyncGenerator[bytes, None]:
        writer = job.writer()
        opening = writer.role_chunk()  # sent with the first output: errors before it keep
        end = b""  # the last output's event, the usage and [DONE]: one write, one send
        async for out in self._outputs(job):  # their status code
            _note(outcome, out)
            if out.finished:
                end = opening + writer.chunk(out.text, outcome.finish_reason)
            elif out.text:
                yield opening + writer.chunk(out.text, None)
                opening = b""
        if job.req.include_usage:
            end += writer.usage_chunk(outcome.prompt_tokens, outcome.completion_tokens)
        yield end + DONE

    async def complete(self, job: Job, outcome: Outcome) -> bytes:
        writer = job.writer()
        parts = []
        async for out in self._outputs(job):
            _note(outcome, out)
            parts.append(out.text)
        body = writer.whole("".join(parts), outcome.finish_reason, outcome.prompt_tokens,
                            outcome.completion_tokens)
        return fastjson.dumps_plain(body)  # strings, integers and nulls (ResponseWriter's)


def _note(outcome: Outcome, out: Any) -> None:
    outcome.completion_tokens = int(out.num_output_tokens)
    outcome.prompt_tokens = int(out.num_prompt_tokens)
    outcome.usage_reported = True
    if out.new_token_ids:
        outcome.chunk_times.append(time.perf_counter())
    if out.finished:
        reason = out.finish_reason
        outcome.finish_reason = str(getattr(reason, "value", reason) or "stop")

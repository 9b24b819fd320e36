"""AsyncEngine: LLMEngine's step loop on its own thread, per-request async token streams.

The engine thread is the only one that touches the LLMEngine. Coroutines hand it requests,
aborts and reconfigurations through a locked inbox; it blocks on a condition when idle, drains
the inbox, steps, detokenises, and pushes each step's outputs to the event loop in one
`call_soon_threadsafe`, where they land in per-request asyncio queues. Turning tokens into
outputs is engine/output_processor.py's; the phases of a live reconfiguration are
engine/reconfigure.py's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, StepOutput
from engine.output_processor import Event, OutputProcessor, RequestOutput, Stream
from engine.reconfigure import Reconfigurer, ReconfigureRequest
from engine.request import FinishReason, RequestStatus, SamplingParams
from engine.stats import RequestRecord, StatsRecorder
from engine.tokenizer import Tokenizer

__all__ = ["AsyncEngine", "EngineObserver", "EngineOverloaded", "EngineStopped", "RequestOutput"]

logger = logging.getLogger("fairgate.engine")


class EngineOverloaded(Exception):
    """The waiting queue is full; try again after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineStopped(RuntimeError):
    """The engine is not running (not started yet, or shut down)."""


class EngineObserver(Protocol):
    """Called on the engine thread (the Prometheus metrics are one)."""

    def on_step(self, output: StepOutput) -> None: ...

    def on_finished(self, record: RequestRecord) -> None: ...


# ---- inbox commands --------------------------------------------------------------------------
@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tenant: str
    priority: str
    arrival_time: float
    stream: Stream  # where its outputs go: never looked up by a reusable id
    tenant_weight: float | None = None


@dataclass
class _Abort:
    request_id: str


_Command = _Add | _Abort | ReconfigureRequest


class AsyncEngine:
    def __init__(self, config: EngineConfig, *, llm_engine: LLMEngine | None = None) -> None:
        self._engine = llm_engine or LLMEngine(config)
        self.stats = StatsRecorder(self._engine.clock.now())
        self._cond = threading.Condition()
        # guarded by _cond
        self._inbox: list[_Command] = []
        self._stopping = False
        self._pending_requests = 0  # submitted, not yet in the LLMEngine (inbox or parked)
        self._pending_tokens = 0
        self._pending_work = 0  # their prompt and max_tokens: outstanding work, for routing
        # engine thread only
        self._unpended = [0, 0, 0]  # requests, tokens, work that left pending since the snapshot
        self._outputs = OutputProcessor(self._engine, self._record)
        self._reconfigurer: Reconfigurer[_Add] = Reconfigurer(self._engine, self._abort_all)
        # event loop only
        self._streams: dict[str, Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._reconfigure_lock = asyncio.Lock()
        self._observers: list[EngineObserver] = []
        self._snapshot: dict[str, Any] = {}
        self._publish_snapshot()

    @classmethod
    def from_engine(cls, llm_engine: LLMEngine) -> AsyncEngine:
        return cls(llm_engine.config, llm_engine=llm_engine)

    # ---- facts -------------------------------------------------------------------------------
    @property
    def config(self) -> EngineConfig:
        return self._engine.config

    @property
    def tokenizer(self) -> Tokenizer:
        return self._engine.tokenizer

    @property
    def model_name(self) -> str:
        """The model's id in the API (its first served name)."""
        return self._engine.config.served_model_names[0]

    @property
    def llm_engine(self) -> LLMEngine:
        """The synchronous core; touch it only while the engine thread is not running."""
        return self._engine

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def now(self) -> float:
        """The engine clock (virtual under the simulated executor's virtual clock)."""
        return self._engine.clock.now()

    def add_observer(self, observer: EngineObserver) -> None:
        self._observers = [*self._observers, observer]  # copied: the engine thread iterates

    def remove_observer(self, observer: EngineObserver) -> None:
        self._observers = [o for o in self._observers if o is not observer]

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="fairgate-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Abort every request (each open stream ends with reason abort), stop the thread."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._stopping = True
            return
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.to_thread(thread.join)
        await asyncio.sleep(0)  # let the final outputs reach their streams

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, tenant: str = "",
                       priority: str = "interactive", tenant_weight: float | None = None,
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs. Raises ValueError (bad input) or EngineOverloaded before
        the first output; leaving the loop early aborts the request. `tenant_weight` (if given)
        sets the tenant's weight for the `fair` policy, see `LLMEngine.add_request`."""
        queue = self._open_stream(request_id, prompt_token_ids, params, tenant, priority,
                                  tenant_weight)
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(_Abort(request_id))

    def _open_stream(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     tenant: str, priority: str,
                     tenant_weight: float | None = None) -> Stream:
        if not self.is_running:
            raise EngineStopped("the engine is not running")
        if not isinstance(prompt_token_ids, list):
            raise ValueError("prompt_token_ids must be a list of token ids")
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}: a request with this id is "
                             "still running")
        self._admit(len(prompt_token_ids))
        queue: Stream = asyncio.Queue()
        self._streams[request_id] = queue
        self._submit(_Add(request_id, prompt_token_ids, params, tenant, priority, self.now(),
                          queue, tenant_weight))
        return queue

    def _admit(self, num_tokens: int) -> None:
        config, load = self.config, self.load()
        waiting, tokens = load["waiting"], load["waiting_tokens"]
        if waiting >= config.max_waiting_requests:
            reason = f"{waiting} requests waiting (max_waiting_requests {config.max_waiting_requests})"
        elif tokens + num_tokens > config.max_waiting_tokens:
            reason = f"{tokens} tokens waiting (max_waiting_tokens {config.max_waiting_tokens})"
        else:
            return
        self.stats.reject(self.now(), "overloaded")
        raise EngineOverloaded(f"engine overloaded: {reason}", self._retry_after(waiting))

    def _retry_after(self, waiting: int) -> float:
        """Seconds until the queue has likely drained, from the last 10 s of completions."""
        records, _ = self.stats.recent(self.now(), 10.0)
        rate = len(records) / 10.0
        return 5.0 if rate == 0 else max(1.0, min(60.0, waiting / rate))

    async def abort(self, request_id: str) -> None:
        """End a request with reason abort; its stream gets a final output. Unknown ids: no-op."""
        self._submit(_Abort(request_id))

    async def reconfigure(self, changes: dict[str, Any], abort_running: bool = False,
                          drain_timeout: float | None = None) -> EngineConfig:
        """Drain (or abort) running work, then rebuild the scheduler and KV pool under the
        changed knobs, keeping the weights. Requests arriving meanwhile wait, then run under
        the new knobs. `drain_timeout`: seconds after which what still runs is aborted."""
        async with self._reconfigure_lock:
            try:
                config = self.config.replace(**changes)
            except TypeError as exc:  # a wrongly typed value compared inside validation
                raise ValueError(f"invalid engine setting: {exc}") from None
            self._engine.check_reconfigurable(config)
            deadline = None if drain_timeout is None else time.monotonic() + drain_timeout
            command = ReconfigureRequest(config, abort_running, deadline)
            self._submit(command)
            return await asyncio.wrap_future(command.future)

    def _submit(self, command: _Command) -> None:
        with self._cond:
            if isinstance(command, _Add):
                self._pending_requests += 1
                self._pending_tokens += len(command.prompt_token_ids)
                self._pending_work += _work(command)
            self._inbox.append(command)
            self._cond.notify()

    # ---- observation -------------------------------------------------------------------------
    def load(self) -> dict[str, Any]:
        """What a gateway routes on: a cheap, thread-safe snapshot. The snapshot and the
        pending counts are read together: a request leaves pending when the snapshot that
        counts it is published, so it is counted once, never twice nor not at all."""
        with self._cond:
            snapshot = dict(self._snapshot)
            snapshot["waiting"] += self._pending_requests
            snapshot["waiting_tokens"] += self._pending_tokens
            snapshot["outstanding_tokens"] += self._pending_work
        return snapshot

    def stats_window(self, window_s: float, slo_ttft: float | None = None,
                     slo_tpot: float | None = None,
                     slo_itl: float | None = None) -> dict[str, Any]:
        """`GET /stats`: engine.stats' window; `slo_ttft` and `slo_tpot` bound each request
        (goodput), `slo_itl` every gap (itl_attainment)."""
        stats = self.stats.window(self.now(), window_s, slo_ttft, slo_tpot, slo_itl)
        stats["preemptions_total"] = self._snapshot["num_preemptions"]
        stats["load"] = self.load()
        return stats

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            commands, stopping = self._wait_for_work()
            try:
                for command in commands:
                    self._apply(command)
                if stopping:
                    self._stop_all()
                else:
                    self._advance_reconfigure()
                    if self._engine.has_unfinished():
                        self._step()
            except Exception:  # a bug here must not strand every stream: fail them, go on
                logger.exception("engine loop error; failing unfinished requests")
                self._fail_all()
            self._publish_snapshot()
            self._flush()
            if stopping:
                return

    def _wait_for_work(self) -> tuple[list[_Command], bool]:
        with self._cond:
            while not (self._inbox or self._stopping or self._reconfigurer.reconfiguring
                       or self._engine.has_unfinished()):
                self._cond.wait()
            commands, self._inbox = self._inbox, []
            return commands, self._stopping

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Add):
            if not self._reconfigurer.park(command):
                self._add(command)
        elif isinstance(command, _Abort):
            self._abort(command.request_id)
        else:
            self._reconfigurer.begin(command)

    def _add(self, command: _Add) -> None:
        self._unpend(command)
        try:
            request = self._engine.add_request(
                command.request_id, command.prompt_token_ids, command.params,
                tenant=command.tenant, priority=command.priority,
                arrival_time=command.arrival_time, tenant_weight=command.tenant_weight)
        except ValueError as exc:
            self.stats.reject(self.now(), "invalid")
            self._outputs.fail(command.stream, exc)
            return
        self._outputs.track(request, command.stream)

    def _unpend(self, command: _Add) -> None:
        """Out of pending at the next snapshot, which counts it as the engine's (or not at all,
        when it ended)."""
        unpended = self._unpended
        unpended[0] += 1
        unpended[1] += len(command.prompt_token_ids)
        unpended[2] += _work(command)

    def _abort(self, request_id: str) -> None:
        parked = self._reconfigurer.unpark(request_id)
        if parked is not None:
            self._end_parked(parked)
        else:
            self._outputs.finish(request_id, FinishReason.ABORT)

    def _end_parked(self, command: _Add) -> None:
        self._unpend(command)
        self._outputs.abort_unstarted(command.stream, command.request_id,
                                      len(command.prompt_token_ids), command.arrival_time)

    def _abort_all(self) -> None:
        self._outputs.finish_all(FinishReason.ABORT)

    def _fail_all(self) -> None:
        try:
            self._outputs.finish_all(FinishReason.ERROR)
        except Exception:
            logger.exception("could not fail requests cleanly")
            self._outputs.forget_all()

    def _stop_all(self) -> None:
        for command in self._reconfigurer.cancel(EngineStopped("the engine shut down")):
            self._end_parked(command)
        self._abort_all()

    def _step(self) -> None:
        try:
            output = self._engine.step()
        except Exception:
            logger.exception("engine step failed; failing its requests")
            self._fail_all()
            return
        for request_id, token in output.sampled.items():
            self._outputs.emit(request_id, [token], output.finished.get(request_id))
        for request_id, reason in output.finished.items():
            if request_id not in output.sampled:
                self._outputs.emit(request_id, [], reason)
        for observer in self._observers:
            _notify(observer.on_step, output)

    def _record(self, record: RequestRecord) -> None:
        self.stats.add(record)
        for observer in self._observers:
            _notify(observer.on_finished, record)

    def _advance_reconfigure(self) -> None:
        for command in self._reconfigurer.advance(time.monotonic()):
            self._add(command)

    def _publish_snapshot(self) -> None:
        stats = self._engine.stats()
        # one pass over the unfinished requests, every step: the waiting ones' prefill left,
        # and everyone's prefill and outputs left at most (what "least loaded" routes on)
        waiting = outstanding = 0
        for r in self._engine.scheduler.requests.values():
            if r.status is RequestStatus.WAITING:
                waiting += r.num_remaining_tokens
            outstanding += r.estimated_remaining_work()
        stats["waiting_tokens"], stats["outstanding_tokens"] = waiting, outstanding
        stats["max_model_len"] = self._engine.config.max_model_len
        stats["reconfiguring"] = self._reconfigurer.reconfiguring
        stats["num_steps"] = self._engine.num_steps
        requests, tokens, work = self._unpended
        self._unpended = [0, 0, 0]
        with self._cond:  # readers see a whole snapshot and the pending counts that go with it
            self._snapshot = stats
            self._pending_requests -= requests
            self._pending_tokens -= tokens
            self._pending_work -= work

    def _flush(self) -> None:
        if self._loop is None:
            return
        batch = self._outputs.take_outbox()
        if not batch:
            return
        try:
            self._loop.call_soon_threadsafe(self._dispatch, batch)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            logger.debug("event loop closed; dropped %d outputs", len(batch))

    # ---- event loop --------------------------------------------------------------------------
    def _dispatch(self, batch: list[tuple[Stream, Event]]) -> None:
        # Each event goes to the stream that submitted its request, even when that client
        # left and a new stream reuses the request id (a left stream's queue is just dropped).
        for queue, event in batch:
            queue.put_nowait(event)


def _work(command: _Add) -> int:
    return len(command.prompt_token_ids) + command.params.max_tokens


def _notify(callback: Any, value: Any) -> None:
    try:
        callback(value)
    except Exception:  # an observer's bug must not stop serving
        logger.exception("engine observer failed")

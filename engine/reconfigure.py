"""Live reconfiguration as a state machine, driven by the engine thread.

    Idle --begin--> Draining --(running work ends)--> rebuild --> Idle, parked requests resumed
                       |  deadline passed: abort what still runs  |
                       |                                          +-- rebuild failed: the old
                       +-- shutdown (cancel): parked handed back      config is rebuilt, the
                                                                      caller gets the error

Requests that arrive while Draining are parked in that state, so only a Draining phase can
hold any, and leaving it always hands them back to run under whatever config the rebuild left.
The rebuild is a transition, not a phase: it runs within one engine-thread call, so nothing can
arrive or observe the engine half-rebuilt.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


class Parkable(Protocol):
    @property
    def request_id(self) -> str: ...


P = TypeVar("P", bound=Parkable)


@dataclass
class ReconfigureRequest:
    """What the caller asked for; `future` gets the config in force afterwards, or the error."""

    config: EngineConfig
    abort_running: bool
    deadline: float | None  # time.monotonic() after which running work is aborted
    future: concurrent.futures.Future[EngineConfig] = field(
        default_factory=concurrent.futures.Future)


@dataclass(frozen=True)
class Idle:
    """Serving: new requests go straight to the engine."""


@dataclass
class Draining(Generic[P]):
    """Waiting for running work to end before the rebuild; new requests wait in `parked`."""

    request: ReconfigureRequest
    parked: list[P] = field(default_factory=list)

    def expired(self, now: float) -> bool:
        deadline = self.request.deadline
        return deadline is not None and now >= deadline


Phase = Idle | Draining[P]


class Reconfigurer(Generic[P]):
    """The engine thread's reconfiguration phase. `abort_running` ends every request in the
    engine, with a final output to each stream (the drain deadline and `abort_running=True`)."""

    def __init__(self, engine: LLMEngine, abort_running: Callable[[], None]) -> None:
        self._engine = engine
        self._abort_running = abort_running
        self.phase: Phase[P] = Idle()

    @property
    def reconfiguring(self) -> bool:
        return isinstance(self.phase, Draining)

    def begin(self, request: ReconfigureRequest) -> None:
        """Idle -> Draining. A second reconfiguration while one runs is refused (the async side
        serialises them; this is belt and braces)."""
        if isinstance(self.phase, Draining):
            _resolve(request.future, error=RuntimeError("a reconfiguration is running"))
            return
        self.phase = Draining(request)
        if request.abort_running:
            self._abort_running()

    def park(self, item: P) -> bool:
        """Hold a new request while Draining (True); while Idle it is the caller's (False)."""
        if isinstance(self.phase, Draining):
            self.phase.parked.append(item)
            return True
        return False

    def unpark(self, request_id: str) -> P | None:
        """Take a parked request back out (it is being aborted), if it is parked."""
        parked = self.phase.parked if isinstance(self.phase, Draining) else []
        item = next((p for p in parked if p.request_id == request_id), None)
        if item is not None:
            parked.remove(item)
        return item

    def advance(self, now: float) -> list[P]:
        """Draining -> Idle once the engine has no unfinished work (aborting it past the
        deadline), rebuilding on the way. Returns the parked requests to add, in order."""
        phase = self.phase
        if not isinstance(phase, Draining):
            return []
        if phase.expired(now):
            self._abort_running()
        if self._engine.has_unfinished():
            return []  # still draining
        self.phase = Idle()
        try:
            _resolve(phase.request.future, result=self._rebuild(phase.request.config))
        except Exception as exc:
            _resolve(phase.request.future, error=exc)
        return phase.parked

    def cancel(self, error: BaseException) -> list[P]:
        """Draining -> Idle without a rebuild (shutdown); returns the parked requests."""
        phase = self.phase
        if not isinstance(phase, Draining):
            return []
        self.phase = Idle()
        _resolve(phase.request.future, error=error)
        return phase.parked

    def _rebuild(self, config: EngineConfig) -> EngineConfig:
        """Reconfigure; on failure, rebuild the old configuration so the engine keeps serving."""
        old = self._engine.config
        try:
            self._engine.reconfigure(config)
        except Exception:
            self._engine.reconfigure(old)
            raise
        return self._engine.config


def _resolve(future: concurrent.futures.Future[EngineConfig], result: EngineConfig | None = None,
             error: BaseException | None = None) -> None:
    if future.done():  # the awaiting coroutine was cancelled
        return
    if error is not None:
        future.set_exception(error)
    elif result is not None:
        future.set_result(result)

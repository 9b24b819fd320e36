"""Trial runners: one per mode, each replaying a workload under one config.

`RUNNERS` holds what is built: `sim` here, `replay` and `launch` in `tuner.remote` (real
time, over HTTP; their early stop cuts the load generator's run short), `shadow` in
`tuner.shadow_mode`; each implements the `TrialRunner` protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.config import EngineConfig
from protocol.measures import RequestTiming
from protocol.validators import check_choice
from tuner.measures import StopRule, TrialRun
from tuner.traces import TraceRequest

MODES = ("sim", "replay", "launch", "shadow")


class TrialRunner(Protocol):
    def prepare(self, config: EngineConfig) -> EngineConfig:
        """The config this runner actually runs for the user's `config`."""
        ...

    def run(self, config: EngineConfig, requests: Sequence[TraceRequest],
            stop: StopRule) -> TrialRun:
        """Replay `requests` under `config`; ValueError when it cannot start."""
        ...

    def finish(self, winner: EngineConfig | None) -> None:
        """The study ended (`winner` None: without a recommendation, or by an error): put
        what it changed back (replay: the engine's own config, unless told to apply it)."""
        ...


@dataclass(frozen=True)
class RunnerOptions:
    """What the HTTP runners need beyond the config: the engine's --url (replay), the server
    --command template (launch), its keys, and the space's knobs (what replay reconfigures)."""

    url: str | None = None
    command: str | None = None
    api_key: str | None = None  # the engine's (replay, launch, shadow's engine): /v1/*, /load
    engine_admin_key: str | None = None  # replay, shadow: the engine's /admin/*; None: api_key
    launch_timeout_s: float = 120.0
    knobs: tuple[str, ...] = ()
    gateway: str | None = None  # shadow: the gateway, its admin key and the target's name
    admin_key: str | None = None
    shadow: str | None = None
    shadow_requests: int = 100  # mirrored requests per trial
    shadow_window_s: float = 300.0  # the longest a trial waits for them
    engine: str = "fairgate"  # launch: whose flags the tuned knobs become (tuner.engines)
    apply: bool = False  # replay: leave the engine on the winner, not on its own config


class SimRunner:
    """In process, on the simulated executor's virtual clock (`tuner.simulate`). The user's
    executor is kept in best.yaml; trials simulate `sim_model` on `sim_hardware`. No trial
    runs more than SIM_TRIAL_CPU_S of CPU time (one that does is infeasible, with why)."""

    def __init__(self, options: RunnerOptions | None = None) -> None:
        del options  # everything sim needs is in the config

    def prepare(self, config: EngineConfig) -> EngineConfig:
        return config.replace(executor="sim", sim_clock="virtual")

    def run(self, config: EngineConfig, requests: Sequence[TraceRequest],
            stop: StopRule) -> TrialRun:
        from tuner.simulate import simulate

        return simulate(config, requests, stop=stop, max_cpu_s=SIM_TRIAL_CPU_S)

    def finish(self, winner: EngineConfig | None) -> None:
        del winner  # nothing outside this process changed
SIM_TRIAL_CPU_S = 300.0  # a 2,000-request trial takes about a second


def _replay_runner(options: RunnerOptions) -> TrialRunner:
    from tuner.remote import ReplayRunner

    if options.url is None:
        raise ValueError("--mode replay needs --url URL of a running fairgate engine")
    return ReplayRunner(options.url, options.api_key, options.knobs, apply=options.apply,
                        admin_key=options.engine_admin_key)


def _launch_runner(options: RunnerOptions) -> TrialRunner:
    from tuner.remote import LaunchRunner

    if options.command is None:
        raise ValueError("--mode launch needs --command '... --port {port} ...'")
    return LaunchRunner(options.command, options.api_key, options.launch_timeout_s,
                        engine=options.engine, knobs=options.knobs)


def _shadow_runner(options: RunnerOptions) -> TrialRunner:
    from tuner.shadow_mode import ShadowRunner

    if options.gateway is None or options.shadow is None:
        raise ValueError("--mode shadow needs --gateway URL and --shadow NAME")
    return ShadowRunner(options.gateway, options.admin_key, options.shadow, options.knobs,
                        options.shadow_requests, options.shadow_window_s,
                        engine_api_key=options.api_key,
                        engine_admin_key=options.engine_admin_key)


RUNNERS: dict[str, Callable[[RunnerOptions], TrialRunner]] = {
    "sim": SimRunner, "replay": _replay_runner, "launch": _launch_runner,
    "shadow": _shadow_runner}


def check_mode(mode: str) -> str:
    check_choice("--mode", mode, MODES)
    if mode not in RUNNERS:
        raise ValueError(f"--mode {mode} is not built yet; built: {', '.join(RUNNERS)}")
    return mode


@dataclass(frozen=True)
class Timings:
    """Timings as a TrialRun (the live side of a shadow trial)."""

    timings: list[RequestTiming]
    elapsed_s: float
    stopped: str | None = None
    wall_s: float = 0.0


"""What a study is: `TuneSpec`, its objectives and its storage URL."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import EngineConfig
from protocol.measures import SLO
from protocol.validators import check_choice, check_int, check_number, check_positive_int
from tuner.capacity import mean_rate
from tuner.runners import RunnerOptions, check_mode
from tuner.space import Space
from tuner.traces import TraceRequest

OBJECTIVES = ("goodput", "capacity", "pareto")
BUILT_OBJECTIVES = OBJECTIVES
OBJECTIVE_TEXT = {"goodput": "requests/s meeting both SLOs at the workload's own rate",
                  "capacity": "the highest arrival rate, requests/s, at which both p99s hold",
                  "pareto": "output tokens/s against p99 TTFT, both SLOs as constraints"}
OBJECTIVE_UNIT = {"goodput": "req/s", "capacity": "req/s", "pareto": "tok/s"}
BASELINES = ("vllm-grid",)
MAX_RECHECK = 20  # re-checked configs: each is a real-time replay
DEFAULT_TRIALS = 30  # the study's size when neither trials nor timeout_s is given
DEFAULT_RECHECK = 3  # shadow: configs re-checked on the captured traffic after the study
DEFAULT_HOLDOUT_TOP = 3  # the study's top configs run on the held-out windows
HEARTBEAT_S = 10  # a killed worker's trial is retried once it missed two heartbeats
ASYNC_DRIVERS = {"aiosqlite": "sqlite", "asyncpg": "postgresql"}


def check_objective(objective: str) -> str:
    check_choice("--objective", objective, OBJECTIVES)
    if objective not in BUILT_OBJECTIVES:
        raise ValueError(f"--objective {objective} is not built yet; built: "
                         f"{', '.join(BUILT_OBJECTIVES)}")
    return objective


def optuna_storage_url(url: str) -> str:
    """The project's database URL for Optuna's synchronous SQLAlchemy engine:
    sqlite+aiosqlite:///x.db -> sqlite:///x.db, postgresql+asyncpg://... -> postgresql://..."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ValueError(f"--storage must be a database URL (sqlite:///tune.db, "
                         f"postgresql://user@host/db), got {url!r}")
    dialect, _, driver = scheme.partition("+")
    sync = f"{ASYNC_DRIVERS[driver]}://{rest}" if driver in ASYNC_DRIVERS else url
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        make_url(sync).get_dialect()  # a scheme SQLAlchemy has no dialect for fails here
    except (ArgumentError, NoSuchModuleError):
        raise ValueError(f"--storage {url!r} is not a database URL SQLAlchemy knows "
                         "(sqlite:///tune.db, postgresql://user@host/db)") from None
    return sync


@dataclass(frozen=True)
class Window:
    """A stretch of the workload: a trace's window, or a synthetic workload's seed."""

    label: str  # "trace 600-900 s", "seed 1"
    requests: tuple[TraceRequest, ...]

    @property
    def rate(self) -> float:
        """Requests per second over the window's arrivals."""
        span = max((r.arrival for r in self.requests), default=0.0)
        return len(self.requests) / span if span > 0 else 0.0


@dataclass(frozen=True)
class TuneSpec:
    mode: str
    base: EngineConfig  # the user's config (-c, --set); best.yaml is this plus the winner's knobs
    space: Space
    requests: tuple[TraceRequest, ...]
    slo: SLO  # at least one target set
    storage: str
    study_name: str
    out_dir: Path
    objective: str = "goodput"
    trials: int | None = DEFAULT_TRIALS  # the study's size: finished, over every run and worker
    timeout_s: float | None = None
    seed: int = 0
    workload: str = ""  # how the requests were made, for the report
    runner: RunnerOptions = RunnerOptions()
    baseline: str | None = None  # "vllm-grid": vLLM auto_tune's 8 configs join the study
    workers: int = 1  # sim: processes; replay: one per --url
    urls: tuple[str, ...] = ()  # replay with several engines: worker i drives urls[i]
    holdout: tuple[Window, ...] = ()  # held-out windows the recommendation is chosen on
    holdout_top: int = DEFAULT_HOLDOUT_TOP  # top configs run on them beside the baselines
    heartbeat_s: int = HEARTBEAT_S
    recheck: int = DEFAULT_RECHECK  # shadow: the best configs re-checked on captured traffic

    def __post_init__(self) -> None:
        check_mode(self.mode)
        check_objective(self.objective)
        if self.objective == "capacity" and self.requests:
            mean_rate(self.requests)  # raises for a workload with no arrival span
        if self.slo.unset:
            raise ValueError("give at least one SLO: --slo-ttft-p99 S, --slo-tpot-p99 S, "
                             "--slo-itl-p99 S")
        if not self.requests:
            raise ValueError("the workload produced no requests; raise --duration or --rate")
        if self.trials is None and self.timeout_s is None:
            raise ValueError("give --trials N or --timeout S")
        if self.timeout_s is not None:
            check_number("--timeout", self.timeout_s, low=0, open_low=True)
        check_positive_int("--workers", self.workers)
        check_positive_int("--heartbeat", self.heartbeat_s)
        check_int("--recheck", self.recheck, low=0, high=MAX_RECHECK)
        check_positive_int("--holdout-top", self.holdout_top)
        if self.baseline is not None:
            check_choice("--baseline", self.baseline, BASELINES)
            missing = [k for k in VLLM_GRID_KNOBS if k not in self.space]
            if missing:
                raise ValueError(f"--baseline vllm-grid varies {', '.join(VLLM_GRID_KNOBS)}; "
                                 f"add {', '.join(missing)} to the space")
            if self.trials is not None and self.trials < 1 + len(VLLM_GRID):
                raise ValueError(f"--baseline vllm-grid adds {len(VLLM_GRID)} trials to the "
                                 f"default one: --trials must be at least {1 + len(VLLM_GRID)}")

    @property
    def multi_objective(self) -> bool:
        return self.objective == "pareto"

    def fingerprint(self, prepared_base: EngineConfig) -> dict[str, Any]:
        """What a resumed study must agree on (JSON-shaped, as Optuna stores it)."""
        digest = hashlib.sha256(json.dumps(
            [[r.arrival, r.prompt_tokens, r.output_tokens, r.tenant, r.priority]
             for r in self.requests]).encode()).hexdigest()[:16]
        value = {"mode": self.mode, "objective": self.objective,
                 "slo": [self.slo.ttft_s, self.slo.tpot_s, self.slo.itl_s, self.slo.target],
                 "space": self.space.describe(), "requests": len(self.requests),
                 "requests_sha256": digest, "workload": self.workload,
                 "baseline": self.baseline, "base": prepared_base.to_dict()}
        loaded: dict[str, Any] = json.loads(json.dumps(value))
        return loaded
FINGERPRINT_TEXT = {"requests": "number of requests",
                    "requests_sha256": "workload (the same number of requests, other arrivals "
                                       "or lengths)",
                    "base": "base engine config"}


# vLLM's benchmarks/auto_tune: every max_num_seqs x max_num_batched_tokens pair, each at the
# highest gpu_memory_utilization from 0.98 down in steps of 0.01 at which the server starts
VLLM_GRID_KNOBS = ("max_num_seqs", "max_num_batched_tokens")
VLLM_GRID = tuple((seqs, tokens) for seqs in (128, 256) for tokens in (512, 1024, 2048, 4096))
VLLM_MEMORY_PROBE = tuple(round(0.98 - 0.01 * i, 2) for i in range(49))  # 0.98 .. 0.50


"""fairgate-package: tuner

Workloads, traces, the load generator and (later) the Optuna tuner.

`import tuner` stays cheap: the names below load their modules on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tuner import workload as workloads
    from tuner.loadgen import RunOptions, Target, run_workload, run_workload_sync
    from tuner.report import Report
    from tuner.simulate import SimResult, sample_workload
    from tuner.traces import TraceRequest, load_trace

# `simulate` itself is not here: `tuner.simulate` is its module, which an import of it binds on
# the package; use `from tuner.simulate import simulate`
_LAZY = {
    "run_workload": "tuner.loadgen",
    "run_workload_sync": "tuner.loadgen",
    "RunOptions": "tuner.loadgen",
    "Target": "tuner.loadgen",
    "Report": "tuner.report",
    "SimResult": "tuner.simulate",
    "sample_workload": "tuner.simulate",
    "TraceRequest": "tuner.traces",
    "load_trace": "tuner.traces",
}

__all__ = [
    "Report",
    "RunOptions",
    "SimResult",
    "Target",
    "TraceRequest",
    "load_trace",
    "run_workload",
    "run_workload_sync",
    "sample_workload",
    "workloads",
]


def __getattr__(name: str) -> Any:
    if name == "workloads":
        return importlib.import_module("tuner.workload")
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tuner' has no attribute {name!r}")

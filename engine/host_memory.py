"""glibc's malloc, set for a CPU engine: memory freed after a step is kept for the next one.

By default glibc serves an allocation above its mmap threshold (128 KiB, rising to at most
32 MiB as such blocks are freed) with a fresh mapping, and hands the top of its heap back to the
kernel once more than twice that is free. A CPU forward pass allocates and frees its
activations every step, so each step faults them in again, page by page: a 480-token prefill of
`random:tiny` took about 5,000 minor page faults and 26.5 ms, against 176 faults and 20.2 ms
with the settings below (bench/RESULTS.md, issue 24). The cost grew faster than the prompt, which
the simulator's calibration could not model. The settings keep the engine's peak step memory
mapped, as a GPU engine's caching allocator does.

Applied once, process-wide, when a TorchExecutor runs on the CPU; left alone when the
environment sets any of glibc's own MALLOC_* tunables (the operator's choice wins), and where
the C library has no `mallopt` (not glibc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys

logger = logging.getLogger("fairgate.engine")

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters
SETTINGS = ((M_MMAP_THRESHOLD, 32 << 20),  # glibc's largest: smaller blocks come from the heap
            (M_TRIM_THRESHOLD, 1 << 30),  # the heap's free top is handed back past 1 GiB
            (M_TOP_PAD, 64 << 20))  # and grows 64 MiB at a time
# the operator's own malloc settings: any of them set leaves malloc to them
OPERATOR_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_",
                "GLIBC_TUNABLES")
_state: str | None = None


def keep_step_memory() -> None:
    """Set glibc's malloc as above, once per process (`state()` says what was done)."""
    global _state
    if _state is None:
        _state = _apply()
        logger.info("host memory: %s", _state)


def state() -> str | None:
    """What `keep_step_memory` did in this process, in words; None before it ran."""
    return _state


def _apply() -> str:
    if not sys.platform.startswith("linux"):
        return "malloc left as it is (not Linux)"
    chosen = [name for name in OPERATOR_ENV if os.environ.get(name)]
    if chosen:
        return f"malloc left to ${chosen[0]}"
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return "malloc left as it is (the C library has no mallopt: not glibc)"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    refused = [param for param, value in SETTINGS if mallopt(param, value) != 1]
    if refused:
        return f"malloc settings refused by the C library: {refused}"
    return ("freed step memory kept for the next step (mmap threshold 32 MiB, trim threshold "
            "1 GiB, top pad 64 MiB)")

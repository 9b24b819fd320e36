"""Python's garbage collector, set as a long-running engine process needs it.

Two settings, both process-wide, for servers and for the harnesses that measure the engine as
it serves (`fairgate tune calibrate`, bench/sim_fidelity.py):

- `size_young_generation(max_num_seqs)`: the young generation's threshold (CPython's default
  is 700 allocations) raised to `YOUNG_PER_SEQ` x `max_num_seqs`, so the objects a step
  allocates and frees are not collected inside the step. With 700, a step at 1,024 running
  collected the young generation about twice, and every tenth time the older ones too, each
  walk reaching every running request: the step's p99 was 13 ms against a 1.3 ms median
  (bench/scheduler.py, bench/RESULTS.md, issue 28).
- `gc.freeze()` once the engine has started: full collections skip what startup allocated
  (the model, the imports, the pools). Unfrozen, a full collection in a CPU engine's process
  took 120-200 ms, a stall of every running request (engine/server.py's
  `freeze_startup_heap` does it for the servers; `serving_heap` for a measurement).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# Tracked objects a step allocates and frees per running request (its ScheduledRequest, and
# what the async engine builds for its output): at 1,024 running, about 1,000 to 2,000 a step.
YOUNG_PER_SEQ = 20


def size_young_generation(max_num_seqs: int) -> int:
    """Raise the young generation's threshold to `YOUNG_PER_SEQ` x `max_num_seqs`, never
    lowering it, and return what it is now. A collector switched off (threshold 0) stays off."""
    gen0, gen1, gen2 = gc.get_threshold()
    if gen0 == 0:
        return 0
    wanted = max(gen0, YOUNG_PER_SEQ * max_num_seqs)
    gc.set_threshold(wanted, gen1, gen2)
    return wanted


_depth = 0  # serving_heap blocks open
_frozen_before = False  # the heap was frozen when the outermost block began (a server's)


@contextmanager
def serving_heap(max_num_seqs: int) -> Iterator[None]:
    """The collector as a server has it, for the length of a measurement: everything alive now
    (enter it after the engine started) frozen and the young generation sized. Both are undone
    when the outermost such block ends, so what the blocks allocated is collected as usual
    afterwards; a heap that was frozen before (a server's) stays frozen. A block inside another
    (a replay between calibration rounds) freezes what started since."""
    global _depth, _frozen_before
    if not _depth:
        _frozen_before = gc.get_freeze_count() > 0
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    size_young_generation(max_num_seqs)
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        gc.set_threshold(*threshold)
        if not _depth and not _frozen_before:
            gc.unfreeze()

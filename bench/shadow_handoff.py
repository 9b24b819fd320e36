"""What does handing a shadow copy to the sender process cost the gateway's event loop? The
same copies handed over down a pipe (a pickled frame per loop turn: control/shadow_worker.py's
FrameSender) and through the shared-memory ring (its RingSender, control/shm_ring.py), each to a
real reader process, against a run that hands nothing over; alternating, in one process.

Each loop turn does some stand-in request work (JSON-encoding a list of chat bodies, about
a gateway request's CPU) and puts `--per-turn` copies of a chat request; the writer's CPU per
copy above the no-copy run is what the hand-off costs the live loop. The reader's CPU is
printed too: it runs on another core where one is free.

    .venv/bin/python bench/shadow_handoff.py [--turns 20000] [--per-turn 1] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository

from bench.common import machine  # noqa: E402
from control import shm_ring  # noqa: E402
from control.shadow_worker import FrameSender, RingSender  # noqa: E402

READER = """
import asyncio, os, sys
from control import shm_ring
from control.shadow_worker import FrameReader, RingReceiver

async def main(fd):
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()
    count = [0]
    def take(batch): count[0] += len(batch)
    stdin = os.fdopen(0, "rb", buffering=0)
    if fd >= 0:
        ring = shm_ring.RingReader(fd)
        await loop.connect_read_pipe(lambda: RingReceiver(ring, take, ended.set), stdin)
    else:
        await loop.connect_read_pipe(lambda: FrameReader(take, ended.set), stdin)
    await ended.wait()
    t = os.times()
    print(count[0], t.user + t.system)

asyncio.run(main(int(sys.argv[1])))
"""
BODY = {"model": "m", "messages": [{"role": "user", "content": "hello " * 150}],
        "max_tokens": 64, "stream": True}


class _Nothing:
    """The baseline: copies go nowhere."""

    def put(self, item: Any) -> None:
        pass

    def close(self) -> None:
        pass


async def run(kind: str, turns: int, per_turn: int) -> tuple[float, float]:
    """(the writer's CPU per copy, the reader's), microseconds."""
    ring = shm_ring.create() if kind == "ring" else -1
    reader = subprocess.Popen([sys.executable, "-c", READER, str(ring)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parent.parent,
                              pass_fds=(ring,) if ring >= 0 else ())
    sender: Any
    if kind == "ring":
        sender = await RingSender.open_ring(shm_ring.RingWriter(ring), reader.stdin)
        os.close(ring)
    elif kind == "pipe":
        sender = await FrameSender.open(reader.stdin)
    else:
        sender = _Nothing()
    work = [BODY] * 40
    copies = turns * per_turn
    start = os.times()
    for turn in range(turns):
        for i in range(per_turn):
            sender.put(("copy", "candidate", f"req-{turn}-{i}", BODY, "chat", "acme",
                        "interactive", time.perf_counter()))
        json.dumps(work)  # the turn's own work
        await asyncio.sleep(0)
    while isinstance(sender, RingSender) and sender.waiting:  # the reader fell behind: it
        await asyncio.sleep(0.001)  # drains, as a gateway's ring does (close would drop it)
    end = os.times()
    sender.close()
    if kind == "none":
        assert reader.stdin is not None
        reader.stdin.close()
    assert reader.stdout is not None
    out = await asyncio.to_thread(reader.stdout.read)
    await asyncio.to_thread(reader.wait)
    got, reader_cpu = out.split()
    if kind != "none" and int(got) != copies:
        raise RuntimeError(f"{kind}: the reader got {got} of {copies} copies")
    writer_cpu = end.user + end.system - start.user - start.system
    return 1e6 * writer_cpu / copies, 1e6 * float(reader_cpu) / copies


async def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--turns", type=int, default=20000)
    parser.add_argument("--per-turn", type=int, default=1, help="copies per loop turn")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not shm_ring.SUPPORTED:
        print("the shared-memory ring needs Linux (memfd) on x86-64: nothing to compare here")
        return 1
    print(f"{args.turns} loop turns x {args.per_turn} copies, {args.rounds} rounds "
          f"alternating; {machine()}")
    kinds = ("none", "pipe", "ring")
    writer: dict[str, list[float]] = {k: [] for k in kinds}
    reader: dict[str, list[float]] = {k: [] for k in kinds}
    for round_ in range(args.rounds):
        for kind in kinds[round_ % 3:] + kinds[:round_ % 3]:
            w, r = await run(kind, args.turns, args.per_turn)
            writer[kind].append(w)
            reader[kind].append(r)
    base = statistics.median(writer["none"])
    added = {k: statistics.median(writer[k]) - base for k in ("pipe", "ring")}
    print(f"the loop's CPU per copy with no hand-off: {base:.1f} us (its turn's own work)")
    for kind in ("pipe", "ring"):
        print(f"{kind}: the hand-off adds {added[kind]:.1f} us per copy to the writer (rounds: "
              + ", ".join(f"{w - base:+.1f}" for w in writer[kind])
              + f"); the reader process {statistics.median(reader[kind]):.1f} us per copy")
    print(f"ring / pipe, the writer's added CPU per copy: {added['ring'] / added['pipe']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

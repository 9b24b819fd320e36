"""One OS process of the concurrency test: migrate, import, record usage, all at once with a twin.

Usage: python usage_worker.py DATABASE_URL TENANTS_YAML WORKER_ID EVENTS PARTIES
Prints one JSON line: {"worker": ..., "flushed": ..., "new_keys": ...}.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from tenants import LedgerFullError, TenantStore, UsageEvent, UsageLedger, import_yaml


async def barrier(ready_dir: Path, worker: str, parties: int) -> None:
    """Return once all `parties` processes are ready, so their work really overlaps."""
    (ready_dir / f"{worker}.ready").touch()
    deadline = time.monotonic() + 60
    while len(list(ready_dir.glob("*.ready"))) < parties and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


async def main(url: str, yaml_path: str, worker: str, events: int, parties: int) -> None:
    await barrier(Path(yaml_path).parent, worker, parties)
    store = TenantStore(url)
    await store.init()  # both migrate a fresh database at the same moment
    new_keys = len((await import_yaml(store, yaml_path)).new_keys)
    ledger = UsageLedger(store, flush_interval=0.02, max_pending=200)
    await ledger.start()
    for i in range(events):
        event = UsageEvent(tenant=f"t{i % 3}", key_id=worker, model="m", priority="interactive",
                           prompt_tokens=1, completion_tokens=i, status=200, ttft=0.01)
        try:
            ledger.record(event)
        except LedgerFullError:  # backpressure: wait for the database, then record
            await ledger.flush()
            ledger.record(event)
        if i % 100 == 99:
            await asyncio.sleep(0.005)  # let the flusher interleave with the twin's writes
            if i % 1000 == 999:  # and re-import mid-stream: more write transactions racing
                new_keys += len((await import_yaml(store, yaml_path)).new_keys)
    await ledger.close()
    await store.close()
    print(json.dumps({"worker": worker, "flushed": ledger.flushed, "new_keys": new_keys}))


if __name__ == "__main__":
    url, path, worker, events, parties = sys.argv[1:6]
    asyncio.run(main(url, path, worker, int(events), int(parties)))

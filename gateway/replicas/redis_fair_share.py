"""Queue bounds and fair share shared by every gateway replica through Redis (`gateway.redis`).

Each replica runs one Lua script a moment (MIN_GAP_S) after its queue dispatches or finishes a
request, and every SYNC_INTERVAL_S anyway: it writes what its fair queue holds
(each lately active tenant's queued requests and tokens, running requests, weight and the
weighted tokens this replica has charged it: `FairQueue.shared_view`) under its own field of
one hash, stamps its heartbeat, drops replicas whose heartbeat is older than REPLICA_TTL_S (a
replica that died), and returns every replica's entry. From the others' entries the replica sets
`FairQueue.remote` (their tenants summed) and advances its own tenants' virtual counters by
their service there (`add_remote_service`): one set of counters, one queue bound and one share
of the seats per tenant across replicas.

These figures are a few milliseconds old under load (one sync and a round trip), so a queue
bound may be passed by what the other replicas queue meanwhile, and a share may be off by the
requests they dispatch meanwhile; the requests/min and tokens/min windows are exact (gateway/replicas/redis_limits.py).
Redis away: `remote` is emptied and each replica queues and shares alone, as the rate windows
do; syncing resumes when the limiter's probe finds Redis again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from gateway.fairqueue import CLASSES, FairQueue, RemoteTenant
from gateway.metrics import GatewayMetrics
from gateway.replicas.redis_limits import SharedRateLimiter
from protocol.serving import wait_event

log = logging.getLogger("fairgate.gateway")

SYNC_INTERVAL_S = 0.05
STOP_WAIT_S = 2.0  # how long a shutdown waits for the sync task to end
MIN_GAP_S = 0.005  # at most one sync this often: changes in a burst go together
REPLICA_TTL_S = 3.0  # a replica not heard from for this long is gone (its entry dropped)

# KEYS: entries (hash replica -> JSON), heartbeats (zset replica -> ms)
# ARGV: replica, its JSON, ttl ms -> {replica, JSON, replica, JSON, ...} of the live replicas
SYNC_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)
for _, id in ipairs(gone) do
  redis.call('HDEL', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
end
for i = 1, 2 do redis.call('PEXPIRE', KEYS[i], 10 * ttl) end
return redis.call('HGETALL', KEYS[1])
"""


LEAVE_LUA = """
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""
_FIELDS = 5 + len(CLASSES)  # queued, tokens, running, weight, served, ready per class


def _rows(raw: str) -> Iterator[tuple[str, tuple[int, int, int, float, float, list[int]]]]:
    """Another replica's well-formed rows; anything else (another version's format, a
    deployment sharing the prefix) is skipped."""
    try:
        tenants = json.loads(raw)
    except ValueError:
        return
    if not isinstance(tenants, dict):
        return
    for name, row in tenants.items():
        if not (isinstance(row, list) and len(row) == _FIELDS
                and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                        and math.isfinite(v) and v >= 0 for v in row)):
            continue
        queued, tokens, running, weight, served, *ready = row
        if weight <= 0:
            continue
        yield str(name), (int(queued), int(tokens), int(running), float(weight),
                          float(served), [int(v) for v in ready])


class SharedFairState:
    def __init__(self, limiter: SharedRateLimiter, queue: FairQueue,
                 metrics: GatewayMetrics | None = None, interval_s: float = SYNC_INTERVAL_S,
                 on_change: Callable[[], None] | None = None) -> None:
        """`on_change`: called after each sync (a tenant held for another replica's may go)."""
        self.limiter = limiter
        self.queue = queue
        self.on_change = on_change
        self.interval = interval_s
        self.replica = os.urandom(6).hex()
        base = f"{limiter.prefix}:{{fair}}"  # one hash tag: both keys in one Cluster slot
        self.keys = [f"{base}:entries", f"{base}:heartbeats"]
        self.replicas = 0  # other live replicas, as of the last sync
        self.syncs = 0
        self.ok = False  # the last sync went through
        self._served: dict[str, dict[str, float]] = {}  # replica -> tenant -> served, last seen
        self._task: asyncio.Task[None] | None = None
        self._poked = asyncio.Event()
        self._stopping = False
        queue.on_change = self._poked.set
        limiter.add_script("fair_sync", SYNC_LUA)
        limiter.add_script("fair_leave", LEAVE_LUA)
        if metrics is not None:
            metrics.read_at_scrape("fairgate_gateway_peer_replicas", "Other gateway replicas "
                                   "whose queues and shares this one counts (via Redis)",
                                   lambda: self.replicas, kind="gauge")

    async def lifespan(self, app: object) -> AsyncIterator[None]:
        self._task = asyncio.create_task(self._run(), name="fair share sync")
        try:
            yield
        finally:
            # a flag as well as the cancel: a client library that turns a cancellation into
            # an error of its own must not keep the loop (and the shutdown) going
            self._stopping = True
            self._task.cancel()
            await asyncio.wait([self._task], timeout=STOP_WAIT_S)
            if self.limiter.up:  # the others stop counting this replica's queue at once
                with contextlib.suppress(Exception):
                    await self.limiter.run_script("fair_leave", self.keys, [self.replica])

    async def _run(self) -> None:
        while not self._stopping:
            await wait_event(self._poked, self.interval)
            self._poked.clear()
            try:
                await self.sync()
            except Exception:  # a bug here must not end the syncing: alone until the next one
                if self._stopping:
                    return
                log.exception("fair share sync failed")
                self._alone()
            await asyncio.sleep(MIN_GAP_S)

    async def sync(self) -> None:
        """One exchange with the other replicas; Redis away: alone until it is back."""
        if not self.limiter.up:
            self._alone()
            return
        mine = json.dumps(self.queue.shared_view(), separators=(",", ":"))
        try:
            reply = await self.limiter.run_script(
                "fair_sync", self.keys, [self.replica, mine, round(REPLICA_TTL_S * 1000)])
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - the limiter logged it and marked Redis down
            self._alone()
            return
        self._apply(reply)
        self.syncs += 1
        self.ok = True
        if self.on_change is not None:
            self.on_change()

    def _alone(self) -> None:
        """Redis away: this replica's figures alone. Service elsewhere meanwhile is not caught
        up on afterwards (the counters restart from what the others report when it is back)."""
        self.queue.remote = {}
        self.replicas = 0
        self._served.clear()
        self.ok = False

    def _apply(self, reply: list[Any]) -> None:
        entries = {_text(reply[i]): _text(reply[i + 1]) for i in range(0, len(reply) - 1, 2)}
        entries.pop(self.replica, None)
        remote: dict[str, list[Any]] = {}
        service: dict[str, float] = {}
        for replica, raw in entries.items():
            known = replica in self._served  # a tenant new there then started from nothing
            seen = self._served.setdefault(replica, {})
            for name, row in _rows(raw):
                queued, tokens, running, weight, served, ready = row
                total = remote.setdefault(name, [0, 0, 0, weight, [0] * len(ready)])
                total[0] += queued
                total[1] += tokens
                total[2] += running
                total[3] = max(total[3], weight)
                total[4] = [a + b for a, b in zip(total[4], ready, strict=False)]
                before = seen.get(name, 0.0 if known else None)
                if before is not None and served != before:  # settles can take some back
                    service[name] = service.get(name, 0.0) + served - before
                seen[name] = served
        for gone in set(self._served) - set(entries):
            del self._served[gone]
        self.queue.remote = {name: RemoteTenant(q, t, r, w, tuple(ready))
                             for name, (q, t, r, w, ready) in remote.items()}
        self.queue.add_remote_service(service)
        self.replicas = len(entries)

    def status(self) -> str:
        return (f"queue bounds and fair share counted over {self.replicas + 1} gateway "
                f"replicas" if self.limiter.up and self.ok else "queue bounds and fair share "
                "are this replica's alone")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)

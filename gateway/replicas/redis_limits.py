"""Rate windows shared by every gateway replica through Redis (`gateway.redis`).

Each tenant's one-minute window is three Redis keys: a sorted set of charge ids scored by the
Redis server's clock (so replicas' clocks never disagree about the window), a hash of each
charge's tokens, and the running token sum. Three Lua scripts, run by EVALSHA, keep
estimate-and-settle exact: `charge` expires old charges, checks both limits and adds the new
charge in one atomic step (one round trip on the live path); `settle` sets a charge's tokens to
the actual count and `refund` removes it. Both of those name the charge by id and set absolute
values, so a retried one (its reply was lost) applies nothing twice; they run as tasks the
request does not wait on, retried until Redis answers or the charge has left the window, and
awaited (bounded) at shutdown.

Redis away: every replica enforces each tenant's full limit by itself (`RateLimiter`), so a
tenant may get up to N times its limit while it lasts but no request fails because of Redis;
the log, `fairgate_gateway_redis_up` and /readyz's check say so. A probe finds Redis again and
shared windows resume (charges made locally meanwhile stay local).

The same Redis carries key revocations (`KeyRevocations`, pub/sub): a key revoked on one
replica is refused on every replica at once, not when their key caches expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from gateway.admission import (
    PERIOD_S,
    Charge,
    RateLimiter,
    check_fits,
    requests_limited,
    tokens_limited,
)
from gateway.metrics import GatewayMetrics
from protocol.retry import Backoff, retry_async
from protocol.serving import wait_event
from tenants import TenantLimits

log = logging.getLogger("fairgate.gateway")

URL_SCHEMES = ("redis", "rediss", "unix")
DEFAULT_KEY_PREFIX = "fairgate"
_KEY_PREFIX = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
# the live path waits at most this long for Redis before it enforces the limits locally
REDIS_TIMEOUT_S = 0.25
CALL_TIMEOUT_S = 0.5  # one charge's whole call (connect, handshake, a script reload)
UPDATE_CONCURRENCY = 16  # settles and refunds in flight at once
PROBE_INTERVAL_S = 0.5  # how often an unreachable Redis is asked again
# a settle or refund that failed pauses, then waits for Redis to answer: those one outage caught
# do not all come back in one burst
UPDATE_BACKOFF = Backoff(first_s=0.05, max_s=PROBE_INTERVAL_S)
SHUTDOWN_DRAIN_S = 5.0  # how long a shutdown waits for settles still on their way

# KEYS: log (zset id -> ms), tokens (hash id -> tokens), total (tokens in the window)
_EXPIRE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function expire(horizon)
  local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', horizon)
  local freed = 0
  for i = 1, #old, 1000 do
    local chunk = {unpack(old, i, math.min(i + 999, #old))}
    for _, v in ipairs(redis.call('HMGET', KEYS[2], unpack(chunk))) do
      if v then freed = freed + tonumber(v) end
    end
    redis.call('HDEL', KEYS[2], unpack(chunk))
    redis.call('ZREM', KEYS[1], unpack(chunk))
  end
  if freed ~= 0 then redis.call('DECRBY', KEYS[3], freed) end
end
-- ms until the oldest charges worth `excess` tokens have left the window
local function tokens_wait(excess, now, period)
  local freed, start = 0, 0
  while true do
    local batch = redis.call('ZRANGE', KEYS[1], start, start + 255, 'WITHSCORES')
    if #batch == 0 then return period end
    local ids = {}
    for i = 1, #batch, 2 do ids[#ids + 1] = batch[i] end
    local values = redis.call('HMGET', KEYS[2], unpack(ids))
    for i, v in ipairs(values) do
      freed = freed + tonumber(v or '0')
      if freed >= excess then return tonumber(batch[2 * i]) + period - now end
    end
    start = start + 256
  end
end
"""
# ARGV: id, tokens, requests_per_min (-1: none), tokens_per_min (-1: none), period ms, ttl ms
# -> {0, 0} charged | {1, wait ms} over requests_per_min | {2, wait ms} over tokens_per_min
CHARGE_LUA = _EXPIRE + """
local id, cost = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, period = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local now = now_ms()
expire(now - period)
local requests = redis.call('ZCARD', KEYS[1])
if rpm >= 0 and requests + 1 > rpm then
  local oldest = redis.call('ZRANGE', KEYS[1], requests - rpm, requests - rpm, 'WITHSCORES')
  if #oldest == 0 then return {1, period} end
  return {1, tonumber(oldest[2]) + period - now}
end
local tokens = tonumber(redis.call('GET', KEYS[3]) or '0')
if tpm >= 0 and tokens + cost > tpm then
  return {2, tokens_wait(tokens + cost - tpm, now, period)}
end
redis.call('ZADD', KEYS[1], now, id)
redis.call('HSET', KEYS[2], id, cost)
redis.call('INCRBY', KEYS[3], cost)
for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[6]) end
return {0, 0}
"""
# ARGV: id, actual tokens; a charge that has left the window (or was refunded) is not touched
SETTLE_LUA = """
local old = redis.call('HGET', KEYS[2], ARGV[1])
if not old then return 0 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('INCRBY', KEYS[3], tonumber(ARGV[2]) - tonumber(old))
return 1
"""
# ARGV: id
REFUND_LUA = """
local old = redis.call('HGET', KEYS[2], ARGV[1])
if not old then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('DECRBY', KEYS[3], tonumber(old))
return 1
"""


def split_redis_url(url: Any) -> tuple[str, str]:
    """`gateway.redis` -> (the URL redis-py connects to, the key prefix). The optional
    `key_prefix` query parameter keeps deployments that share one Redis apart."""
    if not isinstance(url, str) or urlsplit(url).scheme not in URL_SCHEMES:
        raise ValueError("gateway.redis must be a Redis URL (redis://host:port/db, rediss://... "
                         f"or unix:///path.sock), got {url!r}")
    parts = urlsplit(url)
    query = parse_qsl(parts.query)
    prefix = dict(query).get("key_prefix", DEFAULT_KEY_PREFIX)
    if not _KEY_PREFIX.fullmatch(prefix):
        raise ValueError("gateway.redis key_prefix must be 1-64 letters, digits or '_.:-', "
                         f"got {prefix!r}")
    if parts.scheme != "unix":
        try:
            parts.port  # noqa: B018 - reading it parses it
        except ValueError:
            raise ValueError(f"gateway.redis needs a numeric port, got {url!r}") from None
        if not parts.hostname:
            raise ValueError(f"gateway.redis needs a host, got {url!r}")
    rest = urlencode([(k, v) for k, v in query if k != "key_prefix"])
    return urlunsplit(parts._replace(query=rest)), prefix


@dataclass(eq=False)
class SharedCharge(Charge):
    """A charge held in Redis: its id in the tenant's keys."""

    id: str = ""
    keys: tuple[str, str, str] = field(default=("", "", ""), repr=False)


class SharedRateLimiter:
    """A `Limiter` whose windows live in Redis; `local` keeps them while Redis is away."""

    def __init__(self, url: str, metrics: GatewayMetrics | None = None,
                 period_s: float = PERIOD_S, local: RateLimiter | None = None) -> None:
        self.url, self.prefix = split_redis_url(url)
        self.period = period_s
        self.local = local or RateLimiter(period_s)
        self.up = False
        self.errors = 0  # operations Redis did not answer
        self.dropped = 0  # settles and refunds given up (their charge left the window first)
        self.last_error: str | None = "not connected yet"
        self._pending: set[asyncio.Task[None]] = set()
        self._back = asyncio.Event()  # set while Redis answers
        self._updates = asyncio.Semaphore(UPDATE_CONCURRENCY)
        self.call_timeout = CALL_TIMEOUT_S
        self._ids = itertools.count()
        self._replica = os.urandom(6).hex()
        self._client: Any = None
        self._lua = {"charge": CHARGE_LUA, "settle": SETTLE_LUA, "refund": REFUND_LUA}
        self._scripts: dict[str, Any] = {}
        self._probe: asyncio.Task[None] | None = None
        self._closing = False
        if metrics is not None:
            self._export(metrics)

    def _export(self, metrics: GatewayMetrics) -> None:
        metrics.read_at_scrape("fairgate_gateway_redis_up", "1 while the shared rate windows' "
                               "Redis answers; 0: each replica enforces the limits alone",
                               lambda: float(self.up), kind="gauge")
        metrics.read_at_scrape("fairgate_gateway_redis_errors", "Redis operations that failed "
                               "(charges fell back to local limits; settles were retried)",
                               lambda: self.errors)
        metrics.read_at_scrape("fairgate_gateway_redis_pending_updates", "Settles and refunds "
                               "on their way to Redis", lambda: len(self._pending), kind="gauge")
        metrics.read_at_scrape("fairgate_gateway_redis_dropped_updates", "Settles and refunds "
                               "given up because their charge left the window first",
                               lambda: self.dropped)

    # ---- lifetime: a cleanup context of the gateway app --------------------------------------
    async def lifespan(self, app: object) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.close()

    async def start(self) -> None:
        try:
            from redis.asyncio import Redis
            from redis.asyncio.retry import Retry
            from redis.backoff import NoBackoff
        except ImportError:
            raise RuntimeError("gateway.redis needs the redis package: pip install "
                               "'redis>=5'") from None
        # no retries inside the client: a failure falls back at once and the probe retries
        self._client = Redis.from_url(self.url, socket_timeout=REDIS_TIMEOUT_S,
                                      socket_connect_timeout=REDIS_TIMEOUT_S,
                                      retry=Retry(NoBackoff(), 0))
        # a socket_timeout given in the URL (a loaded test machine) stretches the call's bound
        own = self._client.connection_pool.connection_kwargs.get("socket_timeout")
        if isinstance(own, (int, float)) and own > REDIS_TIMEOUT_S:
            self.call_timeout = max(CALL_TIMEOUT_S, 2 * float(own))
        self._scripts = {name: self._client.register_script(lua)
                         for name, lua in self._lua.items()}
        if not await self._ping():
            log.warning("redis at %s does not answer (%s): rate limits are enforced by each "
                        "replica alone, at each tenant's full limit, until it does",
                        self._where(), self.last_error)
        self._probe = asyncio.create_task(self._probe_loop())

    async def close(self, timeout: float = SHUTDOWN_DRAIN_S) -> None:
        await self.flush(timeout)  # the probe still runs: Redis may come back meanwhile
        left = list(self._pending)
        for task in left:
            task.cancel()
        if left:
            log.warning("%d rate-limit settles did not reach redis before shutdown", len(left))
            await asyncio.gather(*left, return_exceptions=True)
        if self._probe is not None:
            self._closing = True  # as well as the cancel (redis-py may turn one into an error)
            self._probe.cancel()
            await asyncio.wait([self._probe], timeout=2.0)
        if self._client is not None:
            await self._client.aclose()

    async def flush(self, timeout: float | None = None) -> None:
        """Wait (at most `timeout` s) for the settles and refunds on their way."""
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=timeout)

    def add_script(self, name: str, lua: str) -> None:
        """A script of another shared part (gateway/replicas/redis_fair_share.py), loaded with these; before
        `start`."""
        self._lua[name] = lua

    async def run_script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run a script (bounded by the call timeout) and raise what fails; only a lost
        connection or a timeout marks Redis down (a script's own error does not take the
        rate windows with it)."""
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeoutError

        try:
            async with asyncio.timeout(self.call_timeout):
                return await self._scripts[name](keys=keys, args=args)
        except (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError) as exc:
            self._failed(exc)
            raise

    # ---- the Limiter -------------------------------------------------------------------------
    async def charge(self, tenant: str, limits: TenantLimits, tokens: int) -> Charge:
        check_fits(limits, tokens)
        if not self.up:
            return self.local.admit(tenant, limits, tokens)
        charge = SharedCharge(at=time.monotonic(), tokens=tokens, keys=self.keys(tenant),
                              id=f"{self._replica}-{next(self._ids)}")
        rpm, tpm = limits.requests_per_min, limits.tokens_per_min
        try:
            # one bound on the whole call: a new connection's handshake, a NOSCRIPT reload
            async with asyncio.timeout(self.call_timeout):
                verdict, wait_ms = await self._scripts["charge"](keys=charge.keys, args=[
                    charge.id, tokens, -1 if rpm is None else rpm, -1 if tpm is None else tpm,
                    round(self.period * 1000), round(self.period * 1000) + 60_000])
        except asyncio.CancelledError:  # the client left mid-call: the script may have run
            self._send(charge, "refund", [charge.id])
            raise
        except Exception as exc:  # whatever Redis did, this request is not failed for it
            self._failed(exc)
            # the script may have run before the reply was lost: take back what it may have added
            self._send(charge, "refund", [charge.id])
            return self.local.admit(tenant, limits, tokens)
        wait = max(0.0, int(wait_ms) / 1000)
        if verdict == 1:
            raise requests_limited(rpm or 0, wait)
        if verdict == 2:
            raise tokens_limited(tpm or 0, tokens, wait)
        return charge

    def settle(self, charge: Charge, actual_tokens: int) -> None:
        if not isinstance(charge, SharedCharge):
            self.local.settle(charge, actual_tokens)
            return
        charge.tokens = actual_tokens
        self._send(charge, "settle", [charge.id, actual_tokens])

    def refund(self, charge: Charge) -> None:
        if not isinstance(charge, SharedCharge):
            self.local.refund(charge)
            return
        charge.tokens = charge.requests = 0
        self._send(charge, "refund", [charge.id])

    def shared_state_status(self) -> dict[str, Any]:
        if self.up:
            return {"ok": True, "detail": f"rate limits shared through redis at {self._where()}"}
        return {"ok": False, "detail": f"redis at {self._where()} does not answer "
                f"({self.last_error}): each replica enforces every tenant's full rate limits "
                "alone"}

    async def window(self, tenant: str) -> tuple[int, int]:
        """(requests, tokens) in the tenant's shared window, as Redis holds it now."""
        log_key, _, total = self.keys(tenant)
        requests = await self._client.zcard(log_key)
        return int(requests), int(await self._client.get(total) or 0)

    def keys(self, tenant: str) -> tuple[str, str, str]:
        # one hash tag per tenant: the three keys of a script share a Redis Cluster slot
        base = f"{self.prefix}:{{{tenant}}}"
        return f"{base}:log", f"{base}:tokens", f"{base}:total"

    # ---- settles and refunds: sent without waiting, never lost -------------------------------
    def _send(self, charge: SharedCharge, script: str, args: list[Any]) -> None:
        task = asyncio.create_task(self._apply(charge, script, args))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _apply(self, charge: SharedCharge, script: str, args: list[Any]) -> None:
        """Retried until it lands or its charge has left the window (nothing left to fix), each
        try once Redis answers; at most UPDATE_CONCURRENCY at once, so a backlog sent when
        Redis returns does not swamp the pool the live path charges through."""
        deadline = charge.at + self.period

        async def land() -> None:
            if not await wait_event(self._back, deadline - time.monotonic()):
                raise TimeoutError("redis did not answer")
            try:
                async with self._updates:
                    await self._scripts[script](keys=charge.keys, args=args)
            except Exception as exc:
                self._failed(exc)
                raise

        try:
            await retry_async(land, UPDATE_BACKOFF, deadline=deadline)
        except Exception:  # noqa: BLE001 - each failure counted and logged by _failed
            self.dropped += 1
            log.warning("a rate-limit %s was given up: redis did not answer before its "
                        "charge left the window", script)

    # ---- up and down ---------------------------------------------------------------------------
    def _failed(self, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = type(exc).__name__
        if self.up:
            self.up = False
            self._back.clear()
            log.warning("redis at %s failed (%s: %s): rate limits are enforced by each replica "
                        "alone, at each tenant's full limit, until it answers again",
                        self._where(), type(exc).__name__, exc)

    async def _ping(self) -> bool:
        try:
            await self._client.ping()
            for script in self._scripts.values():  # loaded, so the live path's EVALSHA hits
                await self._client.script_load(script.script)
        except Exception as exc:
            self.last_error = type(exc).__name__
            return False
        self.up, self.last_error = True, None
        self._back.set()
        return True

    async def _probe_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(PROBE_INTERVAL_S)
            if self.up:
                continue
            try:
                # connections from before the outage are dead: the live path must not find one
                await self._client.connection_pool.disconnect()
            except Exception as exc:  # noqa: BLE001 - closing a dead socket may fail too
                self.last_error = type(exc).__name__
            if await self._ping():
                log.info("redis at %s answers again: rate limits are shared again",
                         self._where())

    def _where(self) -> str:
        parts = urlsplit(self.url)  # never the password
        return parts.path if parts.scheme == "unix" else f"{parts.hostname}:{parts.port or 6379}"


class KeyRevocations:
    """Revoked keys told to every replica at once: a replica that revokes a key publishes its
    id (never the key) on `<key_prefix>:revoked-keys`, and every replica that hears it calls
    `on_revoked(key_id)`, which drops the key from its cache, its last known answer too, so a
    replica that cannot reach the database does not serve it from its outage grace. Published
    while Redis is away, the message is lost and logged: the other replicas then refuse the key
    once their cache entry expires and the database answers."""

    def __init__(self, limiter: SharedRateLimiter, on_revoked: Callable[[str], None]) -> None:
        self.limiter = limiter
        self.channel = f"{limiter.prefix}:revoked-keys"
        self.on_revoked = on_revoked
        self._sending: set[asyncio.Task[None]] = set()
        self._listener: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()  # set while subscribed

    async def lifespan(self, app: object) -> AsyncIterator[None]:
        """After the limiter's (its Redis client), before it closes; a replica that serves
        has subscribed, when Redis answers."""
        self._listener = asyncio.create_task(self._listen(), name="key-revocations")
        if self.limiter.up:
            await wait_event(self._subscribed, self.limiter.call_timeout)
        try:
            yield
        finally:
            self._listener.cancel()
            if self._sending:
                await asyncio.wait(list(self._sending), timeout=self.limiter.call_timeout)
            await asyncio.gather(self._listener, return_exceptions=True)

    def publish(self, key_id: str) -> None:
        """Tell the other replicas, without waiting (a revoke is not failed for Redis)."""
        task = asyncio.create_task(self._publish(key_id))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _publish(self, key_id: str) -> None:
        try:
            async with asyncio.timeout(self.limiter.call_timeout):
                await self.limiter._client.publish(self.channel, key_id)
        except Exception as exc:  # noqa: BLE001 - logged; the cache TTL still bounds it
            log.warning("revoked key %s was not told to the other replicas (redis: %s); they "
                        "refuse it when their cache of it expires", key_id, type(exc).__name__)

    async def _listen(self) -> None:
        """Subscribed while Redis answers; subscribed again after it fails."""
        while True:
            await self.limiter._back.wait()
            pubsub = self.limiter._client.pubsub()
            try:
                await pubsub.subscribe(self.channel)
                self._subscribed.set()
                while self.limiter.up:
                    message = await pubsub.get_message(ignore_subscribe_messages=True,
                                                       timeout=PROBE_INTERVAL_S)
                    if message is not None and message["type"] == "message":
                        self.on_revoked(_text(message["data"]))
            except Exception as exc:  # noqa: BLE001 - Redis failed: wait for it, then again
                log.warning("key revocations from other replicas are not heard (redis: %s) "
                            "until it answers", type(exc).__name__)
                await asyncio.sleep(PROBE_INTERVAL_S)
            finally:
                self._subscribed.clear()
                with contextlib.suppress(Exception):
                    await pubsub.aclose()


def _text(data: bytes | str) -> str:
    return data.decode() if isinstance(data, bytes) else data


def make_limiter(redis_url: str | None, metrics: GatewayMetrics) -> tuple[
        RateLimiter | SharedRateLimiter, Callable[[Any], AsyncIterator[None]] | None]:
    """The gateway's limiter and, when it is shared, the cleanup context that runs it."""
    if redis_url is None:
        return RateLimiter(), None
    shared = SharedRateLimiter(redis_url, metrics)
    return shared, shared.lifespan


__all__ = ["KeyRevocations", "SharedCharge", "SharedRateLimiter", "make_limiter",
           "split_redis_url"]

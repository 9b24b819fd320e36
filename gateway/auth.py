"""`Authorization: Bearer <key>` -> tenant, and the admin key for /admin/*.

What a lookup costs is bounded, so a flood of bad keys cannot slow everyone down:
- a key that is not of the shape fairgate makes (prefix, length, alphabet) is 401 at once,
  without hashing it or asking the database;
- unknown keys are remembered briefly (by the store's hash, never the plaintext), so a client
  retrying a bad key does not turn every request into a query;
- every client address has a budget of failed attempts (`auth_failures_per_s`, with a burst):
  past it, keys the gateway has not seen valid lately are answered 429 without a lookup until
  the budget refills. Keys that authenticated lately are never held back by it. A wrong admin
  key, as a bearer token on /admin/* or in the dashboard's login form, spends the same budget
  (`admin_key_matches`), and while it is spent even the right one is 429 from that address.
The store caches positive answers. 401s use OpenAI's wording so clients show a familiar
message.

While the database is away (a lookup or a ping failed, none has succeeded since) a key that
authenticated within `outage_grace_s` keeps working with its last known tenant (limits,
weight), without waiting on the database; one lookup at a time keeps asking it in the
background, and the first that is answered ends the outage. A key not seen within the grace is
a retryable 503. Whether the database answers is `database_ready`, what /readyz reports: there
the outage is a degraded state, not a reason to take the gateway out of service.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web

from protocol.errors import ApiError
from protocol.http import bearer
from tenants import Principal, TenantStore
from tenants.keys import looks_like_key

log = logging.getLogger("fairgate.gateway")
_NEGATIVE_TTL_S = 5.0
_NEGATIVE_MAX = 10_000
_CLIENTS_MAX = 10_000  # failed-attempt budgets kept (least recently used dropped first)
LOOKUP_TIMEOUT_S = 5.0  # a database that does not answer is a 503, not a hung request
PING_TTL_S = 1.0  # /readyz asks the database at most this often
PING_TIMEOUT_S = 1.0  # and waits at most this long for the answer
DEFAULT_OUTAGE_GRACE_S = 600.0


@dataclass
class _Budget:
    """A token bucket of failed lookups for one client address."""

    tokens: float
    at: float


SESSION_COOKIE = "fairgate_session"
SESSION_TTL_S = 12 * 3600.0


class Authenticator:
    def __init__(self, store: TenantStore, admin_key: str | None, *,
                 failures_per_s: float = 10.0, failure_burst: int = 20,
                 outage_grace_s: float = DEFAULT_OUTAGE_GRACE_S) -> None:
        self.store = store
        self.admin_key = admin_key
        self.failures_per_s = failures_per_s  # 0: no per-address budget
        self.failure_burst = failure_burst
        self.outage_grace_s = outage_grace_s
        self._unknown: OrderedDict[str, float] = OrderedDict()
        self._budgets: OrderedDict[str, _Budget] = OrderedDict()
        self._sessions: dict[str, float] = {}  # dashboard session id -> expiry (epoch s)
        # One database lookup per key at a time: when the store's cache entry expires, the
        # requests arriving meanwhile share that lookup instead of each running their own.
        self._lookups: dict[str, asyncio.Future[Principal | None]] = {}
        self._ping: tuple[float, str | None] | None = None  # (when, why not ready)
        self._pinging: asyncio.Future[None] | None = None
        self._away_since: float | None = None  # the database failed and has not answered since
        self.lookup_failures = 0  # the database did not answer a lookup (metrics, readiness)
        self.held_back = 0  # keys answered 429 because their address spent its budget
        self.outage_answers = 0  # keys answered from their last known tenant, database away

    async def tenant(self, request: web.Request) -> Principal:
        key = bearer(request)
        if key is None:
            raise ApiError(401, "You didn't provide an API key. You need to provide your API "
                           "key in an Authorization header using Bearer auth (i.e. "
                           "Authorization: Bearer YOUR_KEY).", code="missing_api_key")
        if not looks_like_key(key):  # not a key fairgate made: no hash, no lookup
            raise _invalid()
        digest = self.store.hash_key(key)
        now = time.monotonic()
        if self._unknown.get(digest, 0.0) > now:
            raise _invalid()
        cached = self.store.cached_principal(digest, now)
        if cached is not None:  # the common case: no task, no suspension
            return cached
        client = request.remote or ""
        if not self.store.known_key(digest):
            self._check_budget(client, now)
        principal = await self._authenticate(digest, key)
        if principal is None:
            self._spend(client, time.monotonic())
            self._unknown[digest] = now + _NEGATIVE_TTL_S
            while len(self._unknown) > _NEGATIVE_MAX:
                self._unknown.popitem(last=False)
            raise _invalid()
        return principal

    @property
    def database_away(self) -> bool:
        return self._away_since is not None

    async def _authenticate(self, digest: str, key: str) -> Principal | None:
        """The database's answer; while it is away, the key's last known one (asked again in
        the background) or a 503."""
        last_known = self.store.last_known(digest, self.outage_grace_s)
        if self.database_away and self._lookups and digest not in self._lookups:
            return self._from_memory(last_known)  # the database is being asked already
        lookup = self._lookup(digest, key)
        if self.database_away and last_known is not None:
            return self._from_memory(last_known)
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                return await asyncio.shield(lookup)
        except TimeoutError:  # it goes on in the background; the outage starts now
            self._database_failed("the tenant database did not answer a key lookup")
            return self._from_memory(last_known)
        except Exception:  # the database is down (counted as the lookup ended)
            return self._from_memory(last_known)

    def _from_memory(self, last_known: Principal | None) -> Principal:
        """A key's last known tenant while the database is away; a retryable 503 (not a 401
        or a 500) for a key not seen within the grace."""
        if last_known is None:
            raise ApiError(503, "authentication is temporarily unavailable",
                           code="auth_unavailable", retry_after=5.0)
        self.outage_answers += 1
        return last_known

    def _lookup(self, digest: str, key: str) -> asyncio.Future[Principal | None]:
        pending = self._lookups.get(digest)
        if pending is None:
            pending = asyncio.ensure_future(self.store.authenticate_key(key))
            self._lookups[digest] = pending
            pending.add_done_callback(lambda done: self._looked_up(digest, done))
        return pending

    def _looked_up(self, digest: str, done: asyncio.Future[Principal | None]) -> None:
        self._lookups.pop(digest, None)
        if done.cancelled():
            return
        error = done.exception()  # retrieved here: nobody may be waiting for it
        if error is None:
            self._database_answered()
        else:
            self.lookup_failures += 1
            self._database_failed("the tenant database did not answer a key lookup")

    # ---- the database away and back -------------------------------------------------------------
    def _database_failed(self, reason: str) -> None:
        now = time.monotonic()
        self._ping = (now, reason)
        if self._away_since is None:
            self._away_since = now
            log.warning("%s: keys seen in the last %g s keep working with their last known "
                        "limits, unknown keys get 503, until it answers", reason,
                        self.outage_grace_s)

    def _database_answered(self) -> None:
        if self._away_since is not None:
            log.info("the tenant database answers again after %.1f s",
                     time.monotonic() - self._away_since)
            self._away_since = None

    async def database_ready(self) -> str | None:
        """None when the database answers (asked at most every PING_TTL_S), else why not;
        within about PING_TIMEOUT_S whatever the database does."""
        now = time.monotonic()
        if self._ping is not None and now - self._ping[0] < PING_TTL_S:
            return self._ping[1]
        if self._pinging is None or self._pinging.done():
            # Waited on, never cancelled: cancelling a statement on a connection the database
            # left silent makes SQLAlchemy close that connection politely, which asyncpg
            # gives 2 s more (the first /readyz took 3 s). One ping at a time runs on instead.
            self._pinging = asyncio.ensure_future(self.store.ping())
            self._pinging.add_done_callback(self._pinged)
        try:
            async with asyncio.timeout(PING_TIMEOUT_S):
                await asyncio.shield(self._pinging)
            reason = None
        except TimeoutError:
            reason = f"the tenant database did not answer within {PING_TIMEOUT_S:g} s"
        except Exception as exc:
            reason = f"the tenant database does not answer ({type(exc).__name__})"
        self._ping = (time.monotonic(), reason)
        return reason

    def _pinged(self, done: asyncio.Future[None]) -> None:
        if done.cancelled():
            return
        if done.exception() is None:
            self._database_answered()
        else:
            self._database_failed("the tenant database does not answer a ping")

    # ---- the failed-attempt budget per client address -----------------------------------------
    def _budget(self, client: str, now: float) -> _Budget:
        budget = self._budgets.get(client)
        if budget is None:
            budget = self._budgets[client] = _Budget(float(self.failure_burst), now)
            while len(self._budgets) > _CLIENTS_MAX:
                self._budgets.popitem(last=False)
        else:
            self._budgets.move_to_end(client)
            budget.tokens = min(float(self.failure_burst),
                                budget.tokens + (now - budget.at) * self.failures_per_s)
            budget.at = now
        return budget

    def _check_budget(self, client: str, now: float) -> None:
        if self.failures_per_s <= 0:
            return
        budget = self._budget(client, now)
        if budget.tokens < 1.0:
            self.held_back += 1
            wait = (1.0 - budget.tokens) / self.failures_per_s
            raise ApiError(429, "too many requests with invalid keys from this address; "
                           "check your key", code="too_many_invalid_keys", retry_after=wait)

    def _spend(self, client: str, now: float) -> None:
        if self.failures_per_s > 0:
            self._budget(client, now).tokens -= 1.0

    def admin_key_matches(self, client: str, key: object) -> bool:
        """Whether `key` is the admin key; a wrong one spends `client`'s failed-attempt budget,
        the one unknown API keys spend. /admin/*'s bearer token and the dashboard's login form
        both ask here. ApiError 429 while the budget is spent, whatever the key."""
        assert self.admin_key is not None
        now = time.monotonic()
        self._check_budget(client, now)
        if isinstance(key, str) and hmac.compare_digest(key.encode(), self.admin_key.encode()):
            return True
        self._spend(client, now)
        return False

    def check_admin(self, request: web.Request) -> None:
        """The admin key as a bearer token; or, for reading (GET), the dashboard's session
        cookie. A cookie never authorises a change: a page elsewhere cannot make a logged-in
        browser act (no CSRF), whatever it submits."""
        if self.admin_key is None:
            raise ApiError(404, "the admin API is disabled (set gateway.admin_key)",
                           code="admin_disabled")
        key = bearer(request)
        if key is None and request.method in ("GET", "HEAD") and self.session_valid(
                request.cookies.get(SESSION_COOKIE)):
            return
        if key is None or not self.admin_key_matches(request.remote or "", key):
            raise ApiError(401, "an admin key is required for /admin/*", code="invalid_admin_key")

    # ---- the dashboard's sessions ---------------------------------------------------------------
    def open_session(self, now: float | None = None) -> str:
        """A new session id (random; held here, so logging out or a restart ends it)."""
        now = time.time() if now is None else now
        self._sessions = {k: v for k, v in self._sessions.items() if v > now}
        token = secrets.token_urlsafe(32)
        self._sessions[token] = now + SESSION_TTL_S
        return token

    def session_valid(self, token: str | None, now: float | None = None) -> bool:
        if not token:
            return False
        expires = self._sessions.get(token)
        return expires is not None and expires > (time.time() if now is None else now)

    def close_session(self, token: str | None) -> None:
        if token:
            self._sessions.pop(token, None)


def _invalid() -> ApiError:
    return ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

"""`Authorization: Bearer <key>` -> tenant, and the admin key for /admin/*.

What a lookup costs is bounded, so a flood of bad keys cannot slow everyone down:
- a key that is not of the shape fairgate makes (prefix, length, alphabet) is 401 at once,
  without hashing it or asking the database;
- unknown keys are remembered briefly (by the store's hash, never the plaintext), so a client
  retrying a bad key does not turn every request into a query;
- every client address has a budget of failed lookups (`auth_failures_per_s`, with a burst):
  past it, keys the gateway has not seen valid lately are answered 429 without a lookup until
  the budget refills. Keys that authenticated lately are never held back by it.
The store caches positive answers. 401s use OpenAI's wording so clients show a familiar
message. Whether the database answers is `database_ready`, what /readyz reports.
"""

from __future__ import annotations

import asyncio
import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass

from aiohttp import web

from protocol.errors import ApiError
from tenants import Principal, TenantStore
from tenants.keys import looks_like_key

_NEGATIVE_TTL_S = 5.0
_NEGATIVE_MAX = 10_000
_CLIENTS_MAX = 10_000  # failed-lookup budgets kept (least recently used dropped first)
LOOKUP_TIMEOUT_S = 5.0  # a database that does not answer is a 503, not a hung request
PING_TTL_S = 1.0  # /readyz asks the database at most this often


def bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


@dataclass
class _Budget:
    """A token bucket of failed lookups for one client address."""

    tokens: float
    at: float


SESSION_COOKIE = "fairgate_session"
SESSION_TTL_S = 12 * 3600.0


class Authenticator:
    def __init__(self, store: TenantStore, admin_key: str | None, *,
                 failures_per_s: float = 10.0, failure_burst: int = 20) -> None:
        self.store = store
        self.admin_key = admin_key
        self.failures_per_s = failures_per_s  # 0: no per-address budget
        self.failure_burst = failure_burst
        self._unknown: OrderedDict[str, float] = OrderedDict()
        self._budgets: OrderedDict[str, _Budget] = OrderedDict()
        self._sessions: dict[str, float] = {}  # dashboard session id -> expiry (epoch s)
        # One database lookup per key at a time: when the store's cache entry expires, the
        # requests arriving meanwhile share that lookup instead of each running their own.
        self._lookups: dict[str, asyncio.Future[Principal | None]] = {}
        self._ping: tuple[float, str | None] | None = None  # (when, why not ready)
        self.lookup_failures = 0  # the database did not answer a lookup (metrics, readiness)
        self.held_back = 0  # keys answered 429 because their address spent its budget

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
        cached = self.store.cached_principal(digest)
        if cached is not None:  # the common case: no task, no suspension
            return cached
        client = request.remote or ""
        if not self.store.known_key(digest):
            self._check_budget(client, now)
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT_S):
                principal = await self._lookup(digest, key)
        except Exception:  # the database is down: a retryable 503, not a 401 or a 500
            self.lookup_failures += 1
            self._ping = (now, "the tenant database did not answer a key lookup")
            raise ApiError(503, "authentication is temporarily unavailable",
                           code="auth_unavailable", retry_after=5.0) from None
        if principal is None:
            self._spend(client, time.monotonic())
            self._unknown[digest] = now + _NEGATIVE_TTL_S
            while len(self._unknown) > _NEGATIVE_MAX:
                self._unknown.popitem(last=False)
            raise _invalid()
        return principal

    # ---- the failed-lookup budget per client address ------------------------------------------
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
            raise ApiError(429, "too many requests with invalid API keys from this address; "
                           "check your key", code="too_many_invalid_keys", retry_after=wait)

    def _spend(self, client: str, now: float) -> None:
        if self.failures_per_s > 0:
            self._budget(client, now).tokens -= 1.0

    # ---- readiness -----------------------------------------------------------------------------
    async def database_ready(self) -> str | None:
        """None when the database answers (asked at most every PING_TTL_S), else why not."""
        now = time.monotonic()
        if self._ping is not None and now - self._ping[0] < PING_TTL_S:
            return self._ping[1]
        try:
            async with asyncio.timeout(PING_TTL_S):
                await self.store.ping()
            reason = None
        except Exception as exc:
            reason = f"the tenant database does not answer ({type(exc).__name__})"
        self._ping = (time.monotonic(), reason)
        return reason

    async def _lookup(self, digest: str, key: str) -> Principal | None:
        pending = self._lookups.get(digest)
        if pending is not None:
            return await asyncio.shield(pending)
        task = asyncio.ensure_future(self.store.authenticate_key(key))
        self._lookups[digest] = task
        task.add_done_callback(lambda _: self._lookups.pop(digest, None))
        return await asyncio.shield(task)

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
        if not hmac.compare_digest((key or "").encode(), self.admin_key.encode()):
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

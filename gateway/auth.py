"""`Authorization: Bearer <key>` -> tenant, and the admin key for /admin/*.

The tenant store caches positive answers; unknown keys are cached here briefly too (by the
store's hash, never the plaintext), so a client retrying a bad key cannot turn every request into
a database query. 401s use OpenAI's wording so clients show a familiar message.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections import OrderedDict

from aiohttp import web

from protocol.errors import ApiError
from tenants import Principal, TenantStore

_NEGATIVE_TTL_S = 5.0
_NEGATIVE_MAX = 10_000


def bearer(request: web.Request) -> str | None:
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


class Authenticator:
    def __init__(self, store: TenantStore, admin_key: str | None) -> None:
        self.store = store
        self.admin_key = admin_key
        self._unknown: OrderedDict[str, float] = OrderedDict()
        # One database lookup per key at a time: when the store's cache entry expires, the
        # requests arriving meanwhile share that lookup instead of each running their own.
        self._lookups: dict[str, asyncio.Future[Principal | None]] = {}

    async def tenant(self, request: web.Request) -> Principal:
        key = bearer(request)
        if key is None:
            raise ApiError(401, "You didn't provide an API key. You need to provide your API "
                           "key in an Authorization header using Bearer auth (i.e. "
                           "Authorization: Bearer YOUR_KEY).", code="missing_api_key")
        digest = self.store.hash_key(key)
        now = time.monotonic()
        if self._unknown.get(digest, 0.0) > now:
            raise _invalid()
        cached = self.store.cached_principal(digest)
        if cached is not None:  # the common case: no task, no suspension
            return cached
        try:
            principal = await self._lookup(digest, key)
        except Exception:  # the database is down: a retryable 503, not a 401 or a 500
            raise ApiError(503, "authentication is temporarily unavailable",
                           code="auth_unavailable", retry_after=5.0) from None
        if principal is None:
            self._unknown[digest] = now + _NEGATIVE_TTL_S
            while len(self._unknown) > _NEGATIVE_MAX:
                self._unknown.popitem(last=False)
            raise _invalid()
        return principal

    async def _lookup(self, digest: str, key: str) -> Principal | None:
        pending = self._lookups.get(digest)
        if pending is not None:
            return await asyncio.shield(pending)
        task = asyncio.ensure_future(self.store.authenticate_key(key))
        self._lookups[digest] = task
        task.add_done_callback(lambda _: self._lookups.pop(digest, None))
        return await asyncio.shield(task)

    def check_admin(self, request: web.Request) -> None:
        if self.admin_key is None:
            raise ApiError(404, "the admin API is disabled (set gateway.admin_key)",
                           code="admin_disabled")
        key = bearer(request) or ""
        if not hmac.compare_digest(key.encode(), self.admin_key.encode()):
            raise ApiError(401, "an admin key is required for /admin/*", code="invalid_admin_key")


def _invalid() -> ApiError:
    return ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

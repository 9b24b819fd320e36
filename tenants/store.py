"""TenantStore: tenants and API keys in SQLite or PostgreSQL, with cached key authentication.

Only key hashes are stored. `authenticate` caches positive answers for `cache_ttl` seconds (the
hot path of every request); a revoke, update or delete made through this store clears the
affected entries at once, and a lookup that was under way meanwhile asks again rather than
cache what it read before the change. Changes made by another process show up within
`cache_ttl`, or at once for a revocation told through `forget_key`. An entry past its TTL is
kept (up to `_CACHE_MAX_ENTRIES`) as the key's last known answer, `last_known`, which the
gateway serves while the database is away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from tenants.db import Database
from tenants.keys import (
    display_prefix,
    generate_key,
    hash_key,
    hashes_equal,
    looks_like_key,
    new_key_id,
)
from tenants.migrate import migrate
from tenants.models import ApiKeyRow, TenantRow
from tenants.values import (
    PRIORITIES,
    DuplicateTenantError,
    KeyInfo,
    KeyNotFoundError,
    Principal,
    TenantError,
    TenantInfo,
    TenantLimits,
    TenantNotFoundError,
    check_tenant_name,
    stored,
)

log = logging.getLogger(__name__)

_CACHE_MAX_ENTRIES = 10_000
_LAST_USED_EVERY_S = 60.0  # write last_used_at at most this often per key (it costs a write)
_TOUCH_CLOSE_S = 5.0  # how long `close` waits for last_used_at writes under way
_TENANT_FIELDS = frozenset(f.name for f in dataclasses.fields(TenantInfo)) - {"id", "name"}
_LOOKUP_ATTEMPTS = 3  # a lookup overtaken by this many changes in a row is answered uncached


class _Checked(NamedTuple):
    """A key's answer from the database and when it was read (monotonic seconds)."""

    at: float
    principal: Principal


def row_to_info(row: TenantRow) -> TenantInfo:
    limit_values = {n: getattr(row, n) for n in TenantLimits.names()}
    values: dict[str, Any] = dict(
        id=row.id,
        name=row.name,
        weight=row.weight,
        default_priority=row.default_priority,
        allowed_priorities=tuple(row.allowed_priorities.split(",")),
        slo_ttft_p99_s=row.slo_ttft_p99_s,
        slo_tpot_p99_s=row.slo_tpot_p99_s,
        slo_itl_p99_s=row.slo_itl_p99_s,
        enabled=row.enabled,
    )
    try:
        return TenantInfo(limits=TenantLimits(**limit_values), **values)
    except TenantError as exc:  # written under older, looser rules: it loads as it is
        log.warning("tenant row %d does not pass today's checks (%s); loaded as stored",
                    row.id, exc)
        return stored(TenantInfo, limits=stored(TenantLimits, **limit_values), **values)


def info_to_row_values(info: TenantInfo) -> dict[str, Any]:
    values: dict[str, Any] = {n: getattr(info.limits, n) for n in TenantLimits.names()}
    values.update(
        weight=float(info.weight),
        default_priority=info.default_priority,
        allowed_priorities=",".join(info.allowed_priorities),
        slo_ttft_p99_s=info.slo_ttft_p99_s,
        slo_tpot_p99_s=info.slo_tpot_p99_s,
        slo_itl_p99_s=info.slo_itl_p99_s,
        enabled=info.enabled,
    )
    return values


def key_row_to_info(row: ApiKeyRow, tenant: str) -> KeyInfo:
    return KeyInfo(
        id=row.id,
        tenant=tenant,
        prefix=row.prefix,
        created_at=row.created_at,
        last_used_at=row.last_used_at,
        revoked_at=row.revoked_at,
    )


def apply_changes(current: TenantInfo, changes: dict[str, Any]) -> TenantInfo:
    """`current` with `changes`; a limit may be given alone (`max_tokens=...`) or as `limits=`."""
    limit_names = set(TenantLimits.names())
    unknown = set(changes) - _TENANT_FIELDS - limit_names
    if unknown:
        raise TenantError(f"unknown tenant field(s): {', '.join(sorted(unknown))}")
    limit_changes = {k: v for k, v in changes.items() if k in limit_names}
    other = {k: v for k, v in changes.items() if k not in limit_names}
    limits = other.pop("limits", current.limits)
    if isinstance(limits, dict):
        limits = TenantLimits.from_mapping(limits)
    if limit_changes:
        limits = dataclasses.replace(limits, **limit_changes)
    return dataclasses.replace(current, limits=limits, **other)


class TenantStore:
    def __init__(
        self, database_url: str, secret: str | bytes | None = None, *, cache_ttl: float = 5.0
    ) -> None:
        self.db = Database(database_url)
        self._secret = secret
        self.cache_ttl = cache_ttl
        # key hash -> its last answer, fresh or not; hashes, never plaintext, are held in memory
        self._cache: OrderedDict[str, _Checked] = OrderedDict()
        self._changes = 0  # cache entries forgotten so far: a lookup overtaken asks again
        self._revoke_listeners: list[Callable[[str], None]] = []
        # key id -> its last_used_at write under way: in the background, so a lookup never waits
        # for the database's write lock (behind a usage flush under load: seconds, and the
        # gateway's lookup timeout made that a 503; bench/RESULTS.md, issue 28)
        self._touching: dict[str, asyncio.Future[None]] = {}

    @property
    def url(self) -> str:
        return self.db.url

    async def init(self) -> None:
        """Migrate the schema to head; idempotent and safe from several processes at once."""
        await migrate(self.db)

    async def close(self) -> None:
        try:  # no last_used_at write lost, unless the database keeps it waiting
            async with asyncio.timeout(_TOUCH_CLOSE_S):
                await self.touched()
        except TimeoutError:
            log.warning("closing with %d last-used times not written", len(self._touching))
            for write in self._touching.values():
                write.cancel()
        self._cache.clear()
        await self.db.dispose()

    def hash_key(self, plaintext: str) -> str:
        return hash_key(plaintext, self._secret)

    @property
    def hash_scheme(self) -> str:
        return "sha256" if self._secret is None else "hmac-sha256"

    # -- tenants ------------------------------------------------------------------------------

    async def create_tenant(
        self,
        name: str,
        *,
        weight: float = 1.0,
        default_priority: str = "interactive",
        allowed_priorities: Sequence[str] = PRIORITIES,
        limits: TenantLimits | None = None,
        slo_ttft_p99_s: float | None = None,
        slo_tpot_p99_s: float | None = None,
        slo_itl_p99_s: float | None = None,
        enabled: bool = True,
    ) -> TenantInfo:
        info = TenantInfo(
            name=name,
            weight=weight,
            default_priority=default_priority,
            allowed_priorities=allowed_priorities,  # type: ignore[arg-type]  # TenantInfo refuses a bare string
            limits=limits or TenantLimits(),
            slo_ttft_p99_s=slo_ttft_p99_s,
            slo_tpot_p99_s=slo_tpot_p99_s,
            slo_itl_p99_s=slo_itl_p99_s,
            enabled=enabled,
        )
        async def op(s: AsyncSession) -> TenantInfo:
            return row_to_info(await insert_tenant(s, info))

        return await self.db.run(op)

    async def get_tenant(self, name: str) -> TenantInfo | None:
        async def op(s: AsyncSession) -> TenantInfo | None:
            row = await find_tenant_row(s, name)
            return row_to_info(row) if row else None

        return await self.db.run(op, write=False)

    async def list_tenants(self) -> list[TenantInfo]:
        async def op(s: AsyncSession) -> list[TenantInfo]:
            rows = (await s.scalars(select(TenantRow).order_by(TenantRow.name))).all()
            return [row_to_info(r) for r in rows]

        return await self.db.run(op, write=False)

    async def count_tenants(self) -> int:
        async def op(s: AsyncSession) -> int:
            return int(await s.scalar(select(func.count()).select_from(TenantRow)) or 0)

        return await self.db.run(op, write=False)

    async def update_tenant(self, name: str, **fields: Any) -> TenantInfo:
        """Change some fields; ValueError (TenantError) for unknown tenant, field or bad value."""

        async def op(s: AsyncSession) -> TenantInfo:
            row = await require_tenant_row(s, name)
            return await update_tenant_row(s, row, apply_changes(row_to_info(row), fields))

        info = await self.db.run(op)
        self._forget(lambda p: p.tenant.name == name)
        return info

    async def delete_tenant(self, name: str) -> None:
        """Delete a tenant and its keys; its usage records stay (they name the tenant)."""

        async def op(s: AsyncSession) -> None:
            row = await require_tenant_row(s, name)
            await s.execute(delete(ApiKeyRow).where(ApiKeyRow.tenant_id == row.id))
            await s.delete(row)

        await self.db.run(op)
        self._forget(lambda p: p.tenant.name == name)

    # -- keys ---------------------------------------------------------------------------------

    async def create_key(self, tenant: str) -> tuple[KeyInfo, str]:
        """A new key for `tenant`: (its public info, the plaintext, shown this once only)."""
        plaintext = generate_key()

        async def op(s: AsyncSession) -> KeyInfo:
            row = await require_tenant_row(s, tenant)
            return await add_key_row(s, row, self.hash_key(plaintext), display_prefix(plaintext))

        return await self.db.run(op), plaintext

    async def list_keys(self, tenant: str | None = None) -> list[KeyInfo]:
        await self.touched()

        async def op(s: AsyncSession) -> list[KeyInfo]:
            query = select(ApiKeyRow, TenantRow.name).join(TenantRow)
            if tenant is not None:
                await require_tenant_row(s, tenant)
                query = query.where(TenantRow.name == tenant)
            rows = (await s.execute(query.order_by(ApiKeyRow.created_at, ApiKeyRow.id))).all()
            return [key_row_to_info(k, name) for k, name in rows]

        return await self.db.run(op, write=False)

    async def revoke_key(self, key_id: str) -> KeyInfo:
        """Revoke a key (idempotent); this process stops accepting it immediately."""

        async def op(s: AsyncSession) -> KeyInfo:
            found = (
                await s.execute(
                    select(ApiKeyRow, TenantRow.name).join(TenantRow).where(ApiKeyRow.id == key_id)
                )
            ).first()
            if found is None:
                raise KeyNotFoundError(f"unknown key id {key_id!r}")
            row, name = found
            if row.revoked_at is None:
                row.revoked_at = time.time()
            return key_row_to_info(row, name)

        info = await self.db.run(op)
        self.forget_key(key_id)
        for listener in self._revoke_listeners:
            listener(key_id)
        return info

    def on_revoke(self, listener: Callable[[str], None]) -> None:
        """Call `listener(key_id)` after each key this store revokes (the gateway tells its
        other replicas); not for revocations it only hears of through `forget_key`."""
        self._revoke_listeners.append(listener)

    def forget_key(self, key_id: str) -> None:
        """Drop the key from the cache, its last known answer too: revoked elsewhere, it is
        refused here at once, even while the database is away."""
        self._forget(lambda p: p.key_id == key_id)

    # -- authentication -----------------------------------------------------------------------

    async def authenticate(self, plaintext: str) -> TenantInfo | None:
        """The tenant owning this key; None for unknown, revoked or disabled."""
        principal = await self.authenticate_key(plaintext)
        return principal.tenant if principal else None

    async def authenticate_key(self, plaintext: str) -> Principal | None:
        """Like `authenticate`, plus the key id (which the usage ledger records)."""
        if not looks_like_key(plaintext):
            return None
        key_hash = self.hash_key(plaintext)
        cached = self.cached_principal(key_hash)
        if cached is not None:
            return cached
        for _ in range(_LOOKUP_ATTEMPTS):
            changes, at = self._changes, time.monotonic()
            principal = await self._lookup(key_hash)
            if changes == self._changes:  # nothing was revoked or changed while it ran
                self._remember(key_hash, at, principal)
                break
        return principal

    def _remember(self, key_hash: str, at: float, principal: Principal | None) -> None:
        self._cache.pop(key_hash, None)
        if principal is not None:
            self._cache[key_hash] = _Checked(at, principal)
            while len(self._cache) > _CACHE_MAX_ENTRIES:
                self._cache.popitem(last=False)

    def cached_principal(self, key_hash: str, now: float | None = None) -> Principal | None:
        """The principal for `key_hash` while its cache entry is fresh, without awaiting: the
        gateway's hot path checks here before it starts a lookup."""
        seen = self._seen(key_hash, now)
        return seen[0] if seen is not None and seen[1] < self.cache_ttl else None

    def last_known(self, key_hash: str, max_age: float,
                   now: float | None = None) -> Principal | None:
        """The principal the database gave for `key_hash` if that was at most `max_age` s ago,
        fresh or not: what the gateway serves while the database is away. None for a key never
        seen, or forgotten since (revoked, changed, deleted)."""
        seen = self._seen(key_hash, now)
        return seen[0] if seen is not None and seen[1] <= max_age else None

    def _seen(self, key_hash: str, now: float | None) -> tuple[Principal, float] | None:
        """The key's last answer and its age in seconds."""
        checked = self._cache.get(key_hash)
        if checked is None:
            return None
        return checked.principal, (time.monotonic() if now is None else now) - checked.at

    async def _lookup(self, key_hash: str) -> Principal | None:
        async def op(s: AsyncSession) -> tuple[Principal, float | None] | None:
            found = (
                await s.execute(
                    select(ApiKeyRow, TenantRow)
                    .join(TenantRow)
                    .where(ApiKeyRow.key_hash == key_hash, ApiKeyRow.revoked_at.is_(None))
                )
            ).first()
            # The index finds the row; compare_digest is the constant-time check of the match.
            if found is None or not hashes_equal(found[0].key_hash, key_hash):
                return None
            key, tenant = found
            if not tenant.enabled:
                return None
            return Principal(tenant=row_to_info(tenant), key_id=key.id), key.last_used_at

        result = await self.db.run(op, write=False)
        if result is None:
            return None
        principal, last_used = result
        if last_used is None or time.time() - last_used > _LAST_USED_EVERY_S:
            self._touch(principal.key_id)
        return principal

    def _touch(self, key_id: str) -> None:
        """Record that the key was used, in the background (one write in flight per key); a
        failed write is logged and the next lookup past _LAST_USED_EVERY_S tries again."""
        if key_id in self._touching:
            return
        used_at = time.time()

        async def op(s: AsyncSession) -> None:
            row = await s.get(ApiKeyRow, key_id)
            if row is not None:
                row.last_used_at = used_at

        def done(write: asyncio.Future[None]) -> None:
            del self._touching[key_id]
            if not write.cancelled() and (error := write.exception()) is not None:
                log.warning("could not record that key %s was used: %s", key_id, error)

        write = self._touching[key_id] = asyncio.ensure_future(self.db.run(op))
        write.add_done_callback(done)

    async def touched(self) -> None:
        """Wait for the last_used_at writes under way (what `list_keys` then reads has them)."""
        while self._touching:
            await asyncio.wait(list(self._touching.values()))

    def _forget(self, matches: Callable[[Principal], bool]) -> None:
        self._changes += 1
        for key_hash in [h for h, checked in self._cache.items() if matches(checked.principal)]:
            del self._cache[key_hash]

    def forget_all(self) -> None:
        """Drop the whole authentication cache (after a bulk import, say)."""
        self._changes += 1
        self._cache.clear()

    def known_key(self, key_hash: str) -> bool:
        """True when `key_hash` authenticated lately (its cache entry may have expired): the
        gateway does not count a re-check of such a key as a guess."""
        return key_hash in self._cache

    async def ping(self) -> None:
        """One round trip to the database; raises when it cannot be reached."""

        async def op(s: AsyncSession) -> None:
            await s.execute(select(1))

        await self.db.run(op, write=False)


# -- session-level helpers, shared with the YAML importer ------------------------------------


async def find_tenant_row(s: AsyncSession, name: str) -> TenantRow | None:
    """The tenant's row, None when there is none; an invalid name is an error, not a miss."""
    check_tenant_name(name)
    return await s.scalar(select(TenantRow).where(TenantRow.name == name))


async def require_tenant_row(s: AsyncSession, name: str) -> TenantRow:
    row = await find_tenant_row(s, name)
    if row is None:
        raise TenantNotFoundError(f"unknown tenant {name!r}")
    return row


async def insert_tenant(s: AsyncSession, info: TenantInfo) -> TenantRow:
    if await find_tenant_row(s, info.name) is not None:
        raise DuplicateTenantError(f"tenant {info.name!r} already exists")
    now = time.time()
    row = TenantRow(name=info.name, created_at=now, updated_at=now, **info_to_row_values(info))
    s.add(row)
    try:
        await s.flush()
    except IntegrityError:
        # Another process created the same name between our check and our insert.
        raise DuplicateTenantError(f"tenant {info.name!r} already exists") from None
    return row


async def update_tenant_row(s: AsyncSession, row: TenantRow, info: TenantInfo) -> TenantInfo:
    for column, value in info_to_row_values(info).items():
        setattr(row, column, value)
    row.updated_at = time.time()
    await s.flush()
    return row_to_info(row)


async def add_key_row(s: AsyncSession, tenant: TenantRow, key_hash: str, prefix: str) -> KeyInfo:
    row = ApiKeyRow(
        id=new_key_id(),
        tenant_id=tenant.id,
        prefix=prefix,
        key_hash=key_hash,
        created_at=time.time(),
    )
    s.add(row)
    await s.flush()
    return key_row_to_info(row, tenant.name)

"""Rows an older release could write keep loading under today's stricter input checks: one such
row must not stop every listing, or every key of its tenant."""

from __future__ import annotations

from sqlalchemy import update

from tenants import TenantStore
from tenants.models import TenantRow


async def test_rows_written_under_older_rules_still_load(sqlite_store: TenantStore) -> None:
    await sqlite_store.create_tenant("acme")
    await sqlite_store.create_tenant("other")
    _, key = await sqlite_store.create_key("other")

    async def loosen(s: object) -> None:  # what the old rules let through
        await s.execute(update(TenantRow).where(TenantRow.name == "acme")  # type: ignore[attr-defined]
                        .values(name="demo\n"))
        await s.execute(update(TenantRow).where(TenantRow.name == "other")  # type: ignore[attr-defined]
                        .values(max_tokens=2**40))

    await sqlite_store.db.run(loosen)
    sqlite_store.forget_all()
    names = [t.name for t in await sqlite_store.list_tenants()]
    assert names == ["demo\n", "other"]
    principal = await sqlite_store.authenticate_key(key)
    assert principal is not None and principal.tenant.limits.max_tokens == 2**40

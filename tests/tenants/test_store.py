from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect as sa_inspect
from sqlalchemy import select, text

import tenants.store
from tenants import (
    DuplicateTenantError,
    KeyNotFoundError,
    TenantError,
    TenantLimits,
    TenantNotFoundError,
    TenantStore,
    hash_key,
)
from tenants.db import Database
from tenants.migrate import migrate
from tenants.models import ApiKeyRow, Base


async def test_init_is_idempotent_and_schema_matches_models(store: TenantStore) -> None:
    await store.init()  # second run: already at head
    async with store.db.engine.connect() as conn:
        version = (await conn.execute(text("SELECT version_num FROM fg_alembic_version"))
                   ).scalar()

        def diff(sync_conn: object) -> list[object]:
            context = MigrationContext.configure(sync_conn, opts={  # type: ignore[arg-type]
                "version_table": "fg_alembic_version"})
            return compare_metadata(context, Base.metadata)

        assert await conn.run_sync(diff) == []  # migrations create exactly the models' tables
    assert version == "0005"  # the newest migration


async def test_a_database_versioned_in_alembic_version_is_adopted_and_optuna_shares_it(
        tmp_path: Path) -> None:
    """Until 0003 our revision lived in `alembic_version`, the table Optuna keeps its own schema
    version in: an old database moves ours out on init, and then an Optuna study opens in the
    same database (tune jobs keep their studies beside the jobs table)."""
    import optuna

    url = f"sqlite+aiosqlite:///{tmp_path / 'old.db'}"
    await migrate(url, "0002")
    db = Database(url)
    try:
        async with db.engine.begin() as conn:  # how 0002 left it, before version_table moved
            await conn.execute(text("DROP TABLE fg_alembic_version"))
            await conn.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) "
                                    "NOT NULL PRIMARY KEY)"))
            await conn.execute(text("INSERT INTO alembic_version VALUES ('0002')"))
    finally:
        await db.dispose()
    store = TenantStore(url)
    try:
        await store.init()
        await store.create_tenant("acme")
        async with store.db.engine.connect() as conn:
            version = (await conn.execute(text("SELECT version_num FROM fg_alembic_version"))
                       ).scalar()
            tables = await conn.run_sync(lambda c: set(sa_inspect(c).get_table_names()))
    finally:
        await store.close()
    assert version == "0005" and "alembic_version" not in tables and "fg_tune_jobs" in tables
    study = optuna.create_study(study_name="s", storage=f"sqlite:///{tmp_path / 'old.db'}")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    store = TenantStore(url)
    try:
        await store.init()  # Optuna's alembic_version is left alone
        assert [t.name for t in await store.list_tenants()] == ["acme"]
    finally:
        await store.close()
    assert len(optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'old.db'}")
               .trials) == 2


async def test_init_from_two_stores_at_once(database_url: str) -> None:
    a, b = TenantStore(database_url), TenantStore(database_url)
    try:
        await asyncio.gather(a.init(), b.init())
        await a.create_tenant("acme")
        assert await b.count_tenants() == 1
    finally:
        await a.close()
        await b.close()


async def test_tenant_crud(store: TenantStore) -> None:
    limits = TenantLimits(requests_per_min=60, max_tokens=512, queue_timeout_s=2.5)
    created = await store.create_tenant(
        "acme", weight=2.0, limits=limits, slo_ttft_p99_s=1.5, default_priority="batch",
        allowed_priorities=("batch",),
    )
    assert created.id is not None and created.limits == limits and created.weight == 2.0
    assert await store.get_tenant("acme") == created
    assert await store.get_tenant("nobody") is None
    await store.create_tenant("beta")
    assert [t.name for t in await store.list_tenants()] == ["acme", "beta"]
    assert await store.count_tenants() == 2

    updated = await store.update_tenant("acme", weight=3, max_tokens=None, tokens_per_min=1000)
    assert updated.weight == 3 and updated.limits.max_tokens is None
    assert updated.limits.tokens_per_min == 1000 and updated.limits.requests_per_min == 60
    assert await store.get_tenant("acme") == updated

    await store.delete_tenant("beta")
    assert await store.count_tenants() == 1
    with pytest.raises(TenantNotFoundError):
        await store.delete_tenant("beta")


async def test_bad_input_writes_nothing(store: TenantStore) -> None:
    await store.create_tenant("acme", weight=2.0)
    with pytest.raises(DuplicateTenantError, match="already exists"):
        await store.create_tenant("acme")
    for bad in ({"weight": 0}, {"weight": -1}, {"max_tokens": 0}, {"requests_per_min": -5}):
        with pytest.raises(TenantError):
            await store.update_tenant("acme", **bad)
    with pytest.raises(TenantError, match="unknown tenant field"):
        await store.update_tenant("acme", wieght=2)
    with pytest.raises(TenantNotFoundError, match="unknown tenant 'ghost'"):
        await store.update_tenant("ghost", weight=1)
    with pytest.raises(TenantError):
        await store.create_tenant("zero", weight=0)
    with pytest.raises(TenantNotFoundError):
        await store.create_key("ghost")
    with pytest.raises(KeyNotFoundError):
        await store.revoke_key("key_nope")
    assert [(t.name, t.weight) for t in await store.list_tenants()] == [("acme", 2.0)]
    assert await store.list_keys() == []


async def test_key_authenticates_until_revoked(store: TenantStore) -> None:
    await store.create_tenant("acme")
    info, plaintext = await store.create_key("acme")
    assert plaintext.startswith("fg-") and info.prefix == plaintext[:10] and not info.revoked
    tenant = await store.authenticate(plaintext)
    assert tenant is not None and tenant.name == "acme"
    principal = await store.authenticate_key(plaintext)
    assert principal is not None and principal.key_id == info.id
    assert await store.authenticate(plaintext + "x") is None
    assert await store.authenticate("fg-unknown") is None
    assert await store.authenticate("not-a-key") is None
    assert (await store.list_keys("acme"))[0].last_used_at is not None

    revoked = await store.revoke_key(info.id)  # cached a moment ago: must still be refused now
    assert revoked.revoked
    assert await store.authenticate(plaintext) is None
    assert (await store.revoke_key(info.id)).revoked_at == revoked.revoked_at  # idempotent


async def test_cached_principal_answers_from_the_cache_only(store: TenantStore) -> None:
    await store.create_tenant("acme")
    info, plaintext = await store.create_key("acme")
    digest = store.hash_key(plaintext)
    assert store.cached_principal(digest) is None  # not looked up yet
    await store.authenticate_key(plaintext)
    cached = store.cached_principal(digest)
    assert cached is not None and cached.key_id == info.id
    assert store.cached_principal(digest, now=time.monotonic() + store.cache_ttl + 1) is None
    await store.revoke_key(info.id)
    assert store.cached_principal(digest) is None


async def test_a_lookup_does_not_wait_for_the_write_lock(store: TenantStore) -> None:
    """A key's first lookup records that it was used, in the background: while another
    transaction holds what that write needs (SQLite's write lock; PostgreSQL's row lock on the
    key), the lookup still answers at once; the write lands once the lock is let go."""
    await store.create_tenant("acme")
    info, plaintext = await store.create_key("acme")
    holder = store.db.engine.execution_options(sqlite_begin="IMMEDIATE")  # SQLite: the lock
    async with holder.connect() as conn:
        await conn.execute(text("SELECT id FROM fg_api_keys WHERE id = :id"
                                + (" FOR UPDATE" if store.db.is_postgres else "")),
                           {"id": info.id})
        # the lock is held until this block ends; the lookup must not wait for it (the
        # write would wait SQLite's 30 s busy timeout, PostgreSQL's lock for ever)
        principal = await asyncio.wait_for(store.authenticate_key(plaintext), 10)
        assert principal is not None and principal.key_id == info.id
        assert (await store.db.run(lambda s: s.get(ApiKeyRow, info.id), write=False)
                ).last_used_at is None  # the write waits for the lock
    assert (await store.list_keys("acme"))[0].last_used_at is not None  # then lands


async def test_close_gives_up_on_a_last_used_write_the_lock_holds(
        store: TenantStore, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(tenants.store, "_TOUCH_CLOSE_S", 0.2)
    await store.create_tenant("acme")
    _, plaintext = await store.create_key("acme")
    holder = store.db.engine.execution_options(sqlite_begin="IMMEDIATE")
    async with holder.connect() as conn:
        await conn.execute(text("SELECT id FROM fg_api_keys"
                                + (" FOR UPDATE" if store.db.is_postgres else "")))
        assert await store.authenticate_key(plaintext) is not None  # its write waits
        await asyncio.wait_for(store.close(), 10)  # gives up after 0.2 s, not the lock's time
        assert "1 last-used times not written" in caplog.text
        writes = list(store._touching.values())
        assert len(writes) == 1 and writes[0].cancelling()  # told to stop
    await asyncio.wait_for(store.touched(), 10)  # and gone once the lock is let go


async def test_disabled_or_deleted_tenant_is_refused_at_once(store: TenantStore) -> None:
    await store.create_tenant("acme")
    _, plaintext = await store.create_key("acme")
    assert await store.authenticate(plaintext) is not None
    await store.update_tenant("acme", enabled=False)
    assert await store.authenticate(plaintext) is None
    await store.update_tenant("acme", enabled=True)
    assert await store.authenticate(plaintext) is not None
    await store.delete_tenant("acme")
    assert await store.authenticate(plaintext) is None
    assert await store.list_keys() == []


async def test_other_process_revoke_seen_after_ttl(database_url: str) -> None:
    ttl = 1.0
    gateway = TenantStore(database_url, cache_ttl=ttl)
    admin = TenantStore(database_url)
    try:
        await gateway.init()
        await admin.create_tenant("acme")
        info, plaintext = await admin.create_key("acme")
        cached_at = time.monotonic()
        assert await gateway.authenticate(plaintext) is not None
        await admin.revoke_key(info.id)
        if time.monotonic() - cached_at < ttl * 0.8:  # a loaded machine may take longer
            assert await gateway.authenticate(plaintext) is not None  # still cached, by design
        await asyncio.sleep(max(0.0, cached_at + ttl + 0.05 - time.monotonic()))
        assert await gateway.authenticate(plaintext) is None
    finally:
        await gateway.close()
        await admin.close()


async def test_secret_makes_hmac_hashes(database_url: str) -> None:
    store = TenantStore(database_url, secret="server-secret")
    try:
        await store.init()
        await store.create_tenant("acme")
        info, plaintext = await store.create_key("acme")
        assert await store.authenticate(plaintext) is not None

        async def stored_hash(s: object) -> str:
            return (await s.scalar(select(ApiKeyRow.key_hash)))  # type: ignore[attr-defined, no-any-return]

        assert await store.db.run(stored_hash, write=False) == hash_key(plaintext, "server-secret")
        plain_store = TenantStore(database_url)  # same database, no secret: the key is refused
        try:
            assert await plain_store.authenticate(plaintext) is None
        finally:
            await plain_store.close()
    finally:
        await store.close()


async def test_list_keys_filters_by_tenant(store: TenantStore) -> None:
    await store.create_tenant("a")
    await store.create_tenant("b")
    ka, _ = await store.create_key("a")
    kb, _ = await store.create_key("b")
    assert [k.id for k in await store.list_keys("a")] == [ka.id]
    assert {k.id for k in await store.list_keys()} == {ka.id, kb.id}
    with pytest.raises(TenantNotFoundError):
        await store.list_keys("ghost")


async def test_plaintext_key_never_stored(database_url: str, sqlite_path: Path) -> None:
    store = TenantStore(database_url)
    await store.init()
    await store.create_tenant("acme")
    keys = [(await store.create_key("acme"))[1] for _ in range(3)]
    assert all([await store.authenticate(k) for k in keys])

    async def dump(s: object) -> str:
        rows = []
        for table in ("fg_tenants", "fg_api_keys", "fg_usage"):
            rows += (await s.execute(text(f"SELECT * FROM {table}"))).all()  # type: ignore[attr-defined]
        return repr(rows)

    everything = await store.db.run(dump, write=False)
    await store.close()
    secrets_ = [k[len("fg-"):] for k in keys]
    assert not any(k in everything for k in keys + secrets_)
    if database_url.startswith("sqlite"):  # the raw file and its WAL, byte for byte
        blob = b"".join(p.read_bytes() for p in sqlite_path.parent.glob(sqlite_path.name + "*"))
        assert not any(k.encode() in blob for k in keys + secrets_)
        assert not any(s[10:30].encode() in blob for s in secrets_)

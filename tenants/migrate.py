"""Run the package's Alembic migrations programmatically (no alembic.ini needed).

Two processes may call `migrate()` at once: PostgreSQL serialises them with a transaction-scoped
advisory lock, SQLite with `BEGIN IMMEDIATE` (the write lock); the loser then finds the schema at
head and does nothing. Both databases run DDL transactionally, so a failed migration leaves
nothing half-applied.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text

from tenants.db import Database

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
_PG_MIGRATION_LOCK = 0x46470001  # arbitrary, constant: "FG" + 1


# Alembic narrates every migration step at INFO; a server's log should say what matters.
logging.getLogger("alembic").setLevel(logging.WARNING)


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


VERSION_TABLE = "fg_alembic_version"  # tenants/migrations/env.py's
LEGACY_VERSION_TABLE = "alembic_version"  # ours until 0003; Optuna's own too


def _upgrade(sync_connection: Any, cfg: Config, revision: str) -> None:
    _adopt_legacy_version(sync_connection, cfg)
    cfg.attributes["connection"] = sync_connection
    command.upgrade(cfg, revision)


def _adopt_legacy_version(conn: Any, cfg: Config) -> None:
    """A database migrated before 0003 kept our revision in `alembic_version`, where Optuna
    keeps its own: move ours to `fg_alembic_version` (Optuna's row, if any, stays)."""
    tables = set(inspect(conn).get_table_names())
    if VERSION_TABLE in tables or LEGACY_VERSION_TABLE not in tables:
        return
    ours = {rev.revision for rev in ScriptDirectory.from_config(cfg).walk_revisions()}
    rows = [r[0] for r in conn.execute(text(f"SELECT version_num FROM {LEGACY_VERSION_TABLE}"))]
    mine = [r for r in rows if r in ours]
    if not mine:
        return
    conn.execute(text(f"CREATE TABLE {VERSION_TABLE} (version_num VARCHAR(32) NOT NULL, "
                      f"CONSTRAINT {VERSION_TABLE}_pkc PRIMARY KEY (version_num))"))
    for version in mine:
        conn.execute(text(f"INSERT INTO {VERSION_TABLE} (version_num) VALUES (:v)"),
                     {"v": version})
        conn.execute(text(f"DELETE FROM {LEGACY_VERSION_TABLE} WHERE version_num = :v"),
                     {"v": version})
    if len(mine) == len(rows):
        conn.execute(text(f"DROP TABLE {LEGACY_VERSION_TABLE}"))


async def migrate(db: Database | str, revision: str = "head") -> None:
    """Bring the schema to `revision` (default: the newest)."""
    owned = isinstance(db, str)
    database = Database(db) if isinstance(db, str) else db
    cfg = alembic_config()
    try:
        engine = database.engine
        if database.is_sqlite:
            engine = engine.execution_options(sqlite_begin="IMMEDIATE")
        async with engine.begin() as conn:
            if database.is_postgres:
                await conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _PG_MIGRATION_LOCK})
            await conn.run_sync(_upgrade, cfg, revision)
    finally:
        if owned:
            await database.dispose()

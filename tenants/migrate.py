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
from sqlalchemy import text

from tenants.db import Database

MIGRATIONS_DIR = Path(__file__).resolve().parent / "migrations"
_PG_MIGRATION_LOCK = 0x46470001  # arbitrary, constant: "FG" + 1


# Alembic narrates every migration step at INFO; a server's log should say what matters.
logging.getLogger("alembic").setLevel(logging.WARNING)


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def _upgrade(sync_connection: Any, cfg: Config, revision: str) -> None:
    cfg.attributes["connection"] = sync_connection
    command.upgrade(cfg, revision)


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

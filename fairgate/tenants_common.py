"""What `fairgate tenants` and `fairgate keys` share: database options, errors, formatting."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy.exc import SQLAlchemyError

from fairgate.config import database_url, load_config_file
from tenants.db import DEFAULT_DATABASE_URL, unusable
from tenants.store import TenantStore
from tenants.values import check_tenant_name

T = TypeVar("T")
DEFAULT_CONFIG = "fairgate.yaml"
SECRET_ENV = "FAIRGATE_KEY_SECRET"


def add_database_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database",
        metavar="URL",
        help=f"database URL (default: the config's 'database', else {DEFAULT_DATABASE_URL})",
    )
    parser.add_argument(
        "-c", "--config", metavar="FILE", help=f"fairgate config file (default: ./{DEFAULT_CONFIG} if present)"
    )


def _database_url(args: argparse.Namespace) -> str:
    """--database, else the `database` of -c FILE or ./fairgate.yaml, else the default."""
    if getattr(args, "database", None):
        return str(args.database)
    path = getattr(args, "config", None)
    if path is None:
        if not Path(DEFAULT_CONFIG).is_file():
            return DEFAULT_DATABASE_URL
        path = DEFAULT_CONFIG
    return database_url(load_config_file(path))


def run_with_store(args: argparse.Namespace, fn: Callable[[TenantStore], Awaitable[T]]) -> T:
    """Open the store (migrating it), run `fn`, close; database failures become one line."""
    url = _database_url(args)

    async def main() -> T:
        store = TenantStore(url, secret=os.environ.get(SECRET_ENV) or None)
        try:
            await store.init()
            return await fn(store)
        finally:
            await store.close()

    try:
        return asyncio.run(main())
    except (SQLAlchemyError, OSError) as exc:
        if isinstance(exc, FileNotFoundError | PermissionError):
            raise
        raise unusable(url, exc) from None


def check_name_args(args: argparse.Namespace, *dests: str) -> None:
    """The tenant names given on the command line (absent or None ones skipped), checked before
    the database is opened, so a bad name changes nothing and opens nothing."""
    for dest in dests:
        if getattr(args, dest, None) is not None:
            check_tenant_name(getattr(args, dest))


def when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [headers, *[[("-" if c is None else str(c)) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells
    )

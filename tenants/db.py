"""One engine for SQLite (aiosqlite) and PostgreSQL (asyncpg), and a retrying transaction runner.

SQLite needs care for several processes sharing one file: WAL (readers never block the writer), a
busy timeout (a writer waits for the lock instead of failing), explicit `BEGIN` (pysqlite would
otherwise run DDL outside any transaction) and `BEGIN IMMEDIATE` for write transactions (a
deferred transaction that reads first and writes later fails at once with "database is locked"
when another process committed in between, without waiting for the busy timeout).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, OperationalError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from protocol.retry import Backoff, retry_async, retry_sync
from tenants.values import TenantError

T = TypeVar("T")

DEFAULT_DATABASE_URL = "sqlite+aiosqlite:///fairgate.db"
_ASYNC_DRIVERS = {"sqlite": "sqlite+aiosqlite", "postgresql": "postgresql+asyncpg",
                  "postgres": "postgresql+asyncpg"}
_BUSY_TIMEOUT_S = 30.0
# a transaction SQLite refused for a lock, tried again from scratch; jittered, so two processes
# that collided do not collide again in lock step
_LOCK_BACKOFF = Backoff(first_s=0.05, max_s=1.0, attempts=8)
_PG_CONNECT_TIMEOUT_S = 5.0
# `PRAGMA journal_mode = WAL` while another process switches the file: short pauses, under a
# second in all
_WAL_BACKOFF = Backoff(first_s=0.005, max_s=0.05, attempts=20)
_PG_COMMAND_TIMEOUT_S = 30.0  # longer than any query fairgate sends takes


def normalize_url(url: str) -> str:
    """Map `sqlite:///x.db` and `postgresql://...` onto the async drivers fairgate uses."""
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise TenantError(f"bad database URL {url!r}: {exc}") from None
    backend, _, driver = parsed.drivername.partition("+")
    if backend not in _ASYNC_DRIVERS:
        raise TenantError(f"unsupported database {backend!r}: use sqlite:/// or postgresql://")
    if driver not in ("", "aiosqlite", "asyncpg"):
        raise TenantError(f"database driver {driver!r} is not async; use {_ASYNC_DRIVERS[backend]}")
    return parsed.set(drivername=_ASYNC_DRIVERS[backend]).render_as_string(hide_password=False)


def unusable(url: str, exc: BaseException) -> TenantError:
    """A database error as one line: the URL (its password hidden) and the driver's first
    line of what went wrong."""
    try:
        shown = make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        shown = "<database>"
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return TenantError(f"database {shown}: {detail[0] if detail else type(exc).__name__}")


def _check_sqlite_folder(url: str) -> None:
    """TenantError for a SQLite file whose folder does not exist: SQLite would create the
    file, not the folder, and fail at the first connection, in the driver's thread."""
    path = make_url(url).database
    if path and path != ":memory:" and not path.startswith("file:"):
        folder = Path(path).parent
        if not folder.is_dir():
            raise TenantError(f"database {url}: the folder {folder} does not exist "
                              f"(SQLite creates the file, not its folder)")


def _switch_to_wal(cursor: Any) -> None:
    """`PRAGMA journal_mode = WAL`, which SQLite answers "database is locked" at once (busy
    timeout or not) while another process is switching the same new file or writing to it
    in rollback mode; a few short retries outlast that. A connect hook cannot await: the
    pauses block, only while a new connection opens during another process's switch (a pool
    opens few), a few milliseconds at a time."""
    # any error whose text says locked: the driver's OperationalError, as the adapter re-raises it
    retry_sync(lambda: cursor.execute("PRAGMA journal_mode = WAL"), _WAL_BACKOFF,
               when=lambda exc: "locked" in str(exc))


def _install_sqlite_hooks(engine: AsyncEngine) -> None:
    @event.listens_for(engine.sync_engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # we send BEGIN ourselves, see module doc
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {int(_BUSY_TIMEOUT_S * 1000)}")
        _switch_to_wal(cursor)
        cursor.execute("PRAGMA synchronous = NORMAL")  # WAL + NORMAL is durable against app crashes
        cursor.execute("PRAGMA foreign_keys = ON")
        cursor.close()

    @event.listens_for(engine.sync_engine, "begin")
    def _on_begin(conn: Any) -> None:
        mode = conn.get_execution_options().get("sqlite_begin", "")
        conn.exec_driver_sql(f"BEGIN {mode}".strip())


def is_locked_error(exc: BaseException) -> bool:
    text = str(getattr(exc, "orig", exc)).lower()
    return "database is locked" in text or "database table is locked" in text


class Database:
    """An async engine plus read and write session factories."""

    def __init__(self, url: str) -> None:
        self.url = normalize_url(url)
        self.is_sqlite = self.url.startswith("sqlite")
        if self.is_sqlite:
            _check_sqlite_folder(self.url)
        self.is_postgres = not self.is_sqlite
        kwargs: dict[str, Any] = {}
        if self.is_sqlite:
            kwargs["connect_args"] = {"timeout": _BUSY_TIMEOUT_S}
        else:
            kwargs["pool_pre_ping"] = True
            # asyncpg waits 60 s for a connection by default: a partitioned database would hold
            # every caller that long before anyone hears it is unreachable
            # and a statement on a connection whose peer vanished (packets dropped, no reset)
            # would wait for TCP to give up, a quarter of an hour
            kwargs["connect_args"] = {"timeout": _PG_CONNECT_TIMEOUT_S,
                                      "command_timeout": _PG_COMMAND_TIMEOUT_S}
        self.engine = create_async_engine(self.url, **kwargs)
        write_engine = self.engine
        if self.is_sqlite:
            _install_sqlite_hooks(self.engine)
            write_engine = self.engine.execution_options(sqlite_begin="IMMEDIATE")
        self._read = async_sessionmaker(self.engine, expire_on_commit=False)
        self._write = async_sessionmaker(write_engine, expire_on_commit=False)

    async def run(self, fn: Callable[[AsyncSession], Awaitable[T]], *, write: bool = True) -> T:
        """Run `fn` in one transaction, retried (from scratch) while SQLite reports a lock."""
        factory = self._write if write else self._read

        async def transaction() -> T:
            async with factory() as session, session.begin():
                return await fn(session)

        return await retry_async(transaction, _LOCK_BACKOFF, retry_on=OperationalError,
                                 when=is_locked_error)

    async def dispose(self) -> None:
        await self.engine.dispose()

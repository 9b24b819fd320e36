"""One study, several `fairgate tune` processes (on one machine or many): a lock on the study's
database for the few steps that must not interleave between them (creating Optuna's tables,
setting a study up and enqueueing its baselines, a sampler taking its slot), and the storage
URL as people read it.

Optuna's own `enqueue_trial(skip_if_exists=True)` is check-then-act: two processes opening a
study at the same moment both find no base-config trial and both enqueue one; two opening a new
database both create its tables, and one fails. Under `database_lock` each check and its act
are one step for every process that shares the database.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tuner.spec import optuna_storage_url


def storage_text(url: str) -> str:
    """The study's storage as optuna-dashboard and `optuna.load_study` open it: the synchronous
    driver's URL (never sqlite+aiosqlite:// or postgresql+asyncpg://), its password masked."""
    from sqlalchemy.engine import make_url

    return make_url(optuna_storage_url(url)).render_as_string(hide_password=True)


# SQLite: the DBAPI's own transaction handling off (`immediate_transactions` begins them), and
# a writer waits up to 30 s for the lock (Python's default, 5 s, is short for several workers
# on a loaded machine)
SQLITE_ENGINE_KWARGS: dict[str, Any] = {"connect_args": {"isolation_level": None,
                                                         "timeout": 30.0}}


def immediate_transactions(engine: Any) -> None:
    """Every transaction on `engine` (SQLite, made with SQLITE_ENGINE_KWARGS) begins with
    `BEGIN IMMEDIATE`, which takes the database's write lock at once: Optuna pops a waiting
    trial by reading it WAITING and then writing RUNNING, behind a SELECT ... FOR UPDATE that
    SQLite ignores (and Python's sqlite3 runs a SELECT outside any transaction), so two
    processes could both pop, run and tell the same trial. SQLAlchemy's recipe for pysqlite."""
    from sqlalchemy import event

    @event.listens_for(engine, "begin")
    def begin_immediate(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN IMMEDIATE")


@contextmanager
def database_lock(url: str, name: str) -> Iterator[None]:
    """Held by one process at a time among all that share `url`'s database, per `name`
    (SQLite: one lock for every name). Never nest two: on SQLite the inner one would wait on
    the outer.

    PostgreSQL: a transaction-scoped advisory lock (`pg_advisory_xact_lock`) on a connection
    of its own, so Optuna's storage keeps writing on its connections while it is held; the
    transaction ends (and the lock with it) when the block does, or the server ends it when
    the holder dies. SQLite: an exclusive `flock` on a file beside the database; SQLite's own
    write lock would not do (`BEGIN IMMEDIATE` here would block Optuna's writes in this very
    process); the kernel drops the flock when the holder exits or is killed. In-memory SQLite
    is one process's own. Other databases: no lock."""
    from sqlalchemy.engine import make_url

    parsed = make_url(optuna_storage_url(url))
    backend = parsed.get_backend_name()
    if backend == "postgresql":
        with _advisory_lock(parsed.render_as_string(hide_password=False), name):
            yield
    elif backend == "sqlite" and parsed.database not in (None, "", ":memory:"):
        with _file_lock(Path(f"{parsed.database}.lock")):
            yield
    else:
        yield


def open_rdb_storage(url: str, *, writer: bool = True, **storage_kwargs: Any) -> Any:
    """Optuna's RDB storage on `url`, opened under the database's lock: processes (or threads)
    that open a new database at once would each create Optuna's tables and stamp its schema
    version, and all but one fail (`UNIQUE constraint failed: alembic_version`). A `writer` on
    SQLite begins every transaction with `BEGIN IMMEDIATE` (`immediate_transactions`); a
    reader, such as the jobs API's view of a study, does not take the write lock to read.
    A database that cannot be opened is a ValueError naming the storage and the cause."""
    import warnings

    import optuna
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import SQLAlchemyError

    url = optuna_storage_url(url)
    sqlite = make_url(url).get_backend_name() == "sqlite"
    try:
        with warnings.catch_warnings(), database_lock(url, "optuna tables"):
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = optuna.storages.RDBStorage(
                url, engine_kwargs=dict(SQLITE_ENGINE_KWARGS) if sqlite else None,
                **storage_kwargs)
    except (SQLAlchemyError, ImportError, OSError) as exc:  # OSError: SQLite's lock file
        cause = str(getattr(exc, "orig", None) or exc).splitlines()[0]
        hint = "; does its directory exist?" if url.startswith("sqlite") else ""
        raise ValueError(f"--storage {storage_text(url)}: cannot open the database "
                         f"({cause}){hint}") from None
    if sqlite and writer:
        immediate_transactions(storage.engine)
    return storage


def _lock_key(name: str) -> int:
    """A signed 64-bit advisory-lock key for `name` (advisory locks have one namespace per
    database, shared with every other program on it: hence the prefix)."""
    digest = hashlib.sha256(f"fairgate tune: {name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@contextmanager
def _advisory_lock(url: str, name: str) -> Iterator[None]:
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool)
    try:
        with engine.connect() as connection, connection.begin():
            connection.execute(sqlalchemy.text("SELECT pg_advisory_xact_lock(:key)"),
                               {"key": _lock_key(name)})
            yield
    finally:
        engine.dispose()


@contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    import fcntl

    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes or the process ends
        yield

"""UsageLedger: write-behind usage records and the queries over them.

`record()` is synchronous and O(1): it normalises the event into a row fg_usage always accepts
and appends it to an in-memory buffer that a background task writes in one transaction per batch
every `flush_interval` seconds. At `max_pending` buffered rows the flusher is woken at once; if the
database cannot keep up (or is down) and the buffer reaches twice that, `record()` raises
`LedgerFullError` - loud backpressure the gateway turns into a 503, never a silent drop.

Normalising (`normalise_row`) is what keeps one request from poisoning the ledger for everyone:
text becomes valid Unicode without control characters or line separators (each one replaced by
U+FFFD) cut to its column's length, integers are clamped to their column's range (token counts to >= 0),
NaN and infinite latencies become None and a non-finite timestamp becomes "now". The bounds come
from the `UsageRow` columns. A field of the wrong type is refused at once with a TypeError.

Should the database still refuse a row, a failed write tells the two kinds of failure apart
(`is_refusal`). The database being unreachable or overloaded keeps the batch and retries it later.
The database refusing the data bisects the batch: the good rows are written and each refused row
is set aside, with the reason, in fg_usage_dead_letters (`dead_letters()` lists them;
`dead_lettered` counts them), or, if even that insert fails, in a JSONL file and the log. So a bad
row never blocks the rows behind it. `close()` flushes everything and raises only when the
database is unreachable, so a graceful shutdown loses nothing.

Queries see flushed records only (call `flush()` first when that matters). Percentiles are
protocol.stats' (the nearest rank), computed in SQL with ORDER BY/OFFSET so they work alike on
SQLite and PostgreSQL and never load a whole window into memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import numbers
import os
import re
import sqlite3
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast

from sqlalchemy import (
    BigInteger,
    Column,
    Float,
    Integer,
    SmallInteger,
    String,
    Table,
    delete,
    func,
    insert,
    select,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import Dialect
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.elements import ColumnElement

from protocol.retry import Backoff, retry_async
from protocol.serving import wait_event
from protocol.stats import nearest_rank
from tenants.models import UsageDeadLetterRow, UsageHourRow, UsageMinuteRow, UsageRow
from tenants.store import TenantStore
from tenants.values import UsageEvent

log = logging.getLogger(__name__)

Row = dict[str, Any]

_INSERT_CHUNK = 2_048  # rows a RowInsert.run takes at once: a whole number of SQLite's blocks
_MAX_MINUTE = 2**31 - 1
PRUNE_EVERY_S = 3600.0  # fg_usage_minutes.minute is a 32-bit integer
_SHUTDOWN_BACKOFF = Backoff(first_s=0.1, max_s=2.0)  # a flush at shutdown, until its timeout
LATENCY_COLUMNS = ("ttft", "e2e", "queue_time")
DEFAULT_DEAD_LETTER_PATH = Path(tempfile.gettempdir()) / "fairgate-usage-dead-letters.jsonl"


class LedgerFullError(RuntimeError):
    """The usage buffer is full because the database is not keeping up."""


# -- normalising: every field bounded before it reaches the buffer ------------------------------

# C0 and C1 controls (NUL among them: PostgreSQL refuses it in text), the line and paragraph
# separators (line breaks to a log reader) and lone surrogates (no database can encode them).
_UNSAFE_CHARS = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_COUNT_COLUMNS = frozenset({"prompt_tokens", "completion_tokens", "itl_gaps",
                            "itl_gaps_met"})  # never negative
Cleaner = Callable[[str, Any], Any]  # (field name, value) -> storable value, None if it has none


def clean_text(value: str, max_length: int) -> str:
    """`value` cut to `max_length` characters, every unsafe character replaced by U+FFFD."""
    value = value[:max_length]
    if _UNSAFE_CHARS.search(value) is not None:
        value = _UNSAFE_CHARS.sub("\ufffd", value)
    return value


def _wrong_type(name: str, expected: str, value: object) -> TypeError:
    return TypeError(f"usage field {name!r} must be {expected}, got {type(value).__name__}")


def _string_cleaner(max_length: int) -> Cleaner:
    def clean(name: str, value: object) -> str:
        if type(value) is str and len(value) <= max_length and value.isprintable():
            return value  # the usual case, kept cheap
        if not isinstance(value, str):
            raise _wrong_type(name, "a string", value)
        return clean_text(value, max_length)

    return clean


def _integer_cleaner(low: int, high: int) -> Cleaner:
    def clean(name: str, value: object) -> int:
        if type(value) is int and low <= value <= high:  # the usual case, kept cheap
            return value
        if not isinstance(value, numbers.Integral):
            raise _wrong_type(name, "an integer", value)
        return min(max(int(value), low), high)

    return clean


def _clean_real(name: str, value: object) -> float | None:
    """A finite float, or None for NaN and +-inf (nothing sums or orders those sensibly)."""
    if type(value) is float:
        return value if math.isfinite(value) else None
    if not isinstance(value, numbers.Real):
        raise _wrong_type(name, "a number", value)
    try:
        value = float(value)
    except OverflowError:  # an int beyond any float
        return None
    return value if math.isfinite(value) else None


def _integer_range(kind: Integer) -> tuple[int, int]:
    # Integer is 32-bit on PostgreSQL (SQLite would take 64); the narrower bound fits both.
    bits = 64 if isinstance(kind, BigInteger) else 16 if isinstance(kind, SmallInteger) else 32
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def _text_length(column: Column[Any]) -> int:
    assert isinstance(column.type, String) and column.type.length, f"{column} needs a length"
    return column.type.length


def _cleaner(column: Column[Any]) -> Cleaner:
    kind = column.type
    if isinstance(kind, String):
        return _string_cleaner(_text_length(column))
    if isinstance(kind, Integer):
        low, high = _integer_range(kind)
        return _integer_cleaner(0 if column.name in _COUNT_COLUMNS else low, high)
    if isinstance(kind, Float):
        return _clean_real
    raise TypeError(f"no normaliser for fg_usage.{column.name} of type {kind}")


class _ColumnRule(NamedTuple):
    name: str
    clean: Cleaner
    nullable: bool


_USAGE_RULES = tuple(_ColumnRule(c.name, _cleaner(c), bool(c.nullable))
                     for c in cast(Table, UsageRow.__table__).columns if not c.primary_key)
# What a required column gets when its value is missing or not finite; they run in column order,
# so finished_at falls back on the created_at already normalised.
_FALLBACKS: dict[str, Callable[[Row], Any]] = {
    "created_at": lambda row: time.time(),
    "finished_at": lambda row: row["created_at"],
}
assert [r.name for r in _USAGE_RULES if r.name in _FALLBACKS] == list(_FALLBACKS)


def normalise_row(row: Mapping[str, Any]) -> Row:
    """`row` as fg_usage always stores it (see the module doc); TypeError for a wrong type or a
    missing required value."""
    clean: Row = {}
    for name, cleaner, nullable in _USAGE_RULES:
        value = row.get(name)
        if value is not None:
            value = cleaner(name, value)
        if value is None and not nullable:
            fallback = _FALLBACKS.get(name)
            if fallback is None:
                raise TypeError(f"usage field {name!r} is required")
            value = fallback(clean)
        clean[name] = value
    return clean


def _finished_at(e: UsageEvent) -> Any:
    try:
        return e.finished()
    except (TypeError, ArithmeticError):  # a field of the wrong type or size: normalising says
        return None


def _event_row(e: UsageEvent) -> Row:
    return {
        "tenant": e.tenant,
        "key_id": e.key_id,
        "model": e.model,
        "priority": e.priority,
        "prompt_tokens": e.prompt_tokens,
        "completion_tokens": e.completion_tokens,
        "status": e.status,
        "queue_time": e.queue_time,
        "ttft": e.ttft,
        "e2e": e.e2e,
        "created_at": e.created_at,
        "finished_at": _finished_at(e),
        "tpot": e.tpot,
        "slo_ttft": None if e.slo_ttft is None else int(e.slo_ttft),
        "slo_tpot": None if e.slo_tpot is None else int(e.slo_tpot),
        "cached_tokens": e.cached_tokens,
        "backend": e.backend,
        "itl_gaps": e.itl_gaps,
        "itl_gaps_met": e.itl_gaps_met,
    }


MINUTE_COUNTS = ("requests", "ok", "rejected", "failed", "prompt_tokens", "completion_tokens",
                 "ttft_checked", "ttft_met", "tpot_checked", "tpot_met", "slo_checked", "slo_met",
                 "itl_gaps", "itl_gaps_met")


def minute_rollups(rows: Iterable[Row]) -> list[Row]:
    """Normalised usage rows summed per tenant and minute (what fg_usage_minutes adds)."""
    sums: dict[tuple[str, int], Row] = {}
    for r in rows:
        # a finish time absurd enough to overflow the column is kept in the row as it came,
        # and counted at the edge of the rollups' range
        key = (r["tenant"], min(max(int(r["finished_at"] // 60), 0), _MAX_MINUTE))
        m = sums.get(key)
        if m is None:
            m = sums[key] = {"tenant": key[0], "minute": key[1],
                             **dict.fromkeys(MINUTE_COUNTS, 0)}
        status = r["status"]
        m["requests"] += 1
        m["ok"] += status == 200
        m["rejected"] += status == 429
        m["failed"] += status >= 500
        m["prompt_tokens"] += r["prompt_tokens"]
        m["completion_tokens"] += r["completion_tokens"]
        ttft, tpot = r.get("slo_ttft"), r.get("slo_tpot")
        if ttft is not None:
            m["ttft_checked"] += 1
            m["ttft_met"] += ttft
        if tpot is not None:
            m["tpot_checked"] += 1
            m["tpot_met"] += tpot
        if ttft is not None or tpot is not None:
            m["slo_checked"] += 1
            m["slo_met"] += (ttft is None or ttft == 1) and (tpot is None or tpot == 1)
        gaps, met = r.get("itl_gaps"), r.get("itl_gaps_met")
        if gaps is not None and met is not None:
            m["itl_gaps"] += gaps
            m["itl_gaps_met"] += min(met, gaps)  # normalise_row bounds each alone
    return list(sums.values())


def hour_rollups(minutes: Iterable[Row]) -> list[Row]:
    """Minute rollups summed per tenant and hour (what fg_usage_hours adds): a flush's few
    minutes rather than its rows once more. A minute's hour is `minute // 60`, the hour of its
    rows' finish times; a row beyond the minutes' range counts in the hour of the last minute,
    as it counts in that minute."""
    sums: dict[tuple[str, int], Row] = {}
    for m in minutes:
        key = (m["tenant"], m["minute"] // 60)
        h = sums.get(key)
        if h is None:
            h = sums[key] = {"tenant": key[0], "hour": key[1], **dict.fromkeys(MINUTE_COUNTS, 0)}
        for name in MINUTE_COUNTS:
            h[name] += m[name]
    return list(sums.values())


@functools.cache
def _upsert_rollups(dialect: str, model: Any, column: str) -> Any:
    """INSERT ... ON CONFLICT (tenant, minute|hour) DO UPDATE SET n = n + excluded.n, one
    statement per database and table, run as an executemany of the rollup rows: built and
    compiled once (a statement carrying its rows' values was compiled anew at every flush: about
    3 ms a flush for the two on this project's 2-core VM; bench/RESULTS.md, issue 28)."""
    from sqlalchemy.dialects import postgresql, sqlite

    table = cast(Table, model.__table__)
    stmt: Any = postgresql.insert(table) if dialect == "postgresql" else sqlite.insert(table)
    return stmt.on_conflict_do_update(
        index_elements=[table.c.tenant, table.c[column]],
        set_={name: table.c[name] + stmt.excluded[name] for name in MINUTE_COUNTS})


# SQLite takes at least 999 parameters a statement (32,766 since 3.32): 32 rows of fg_usage's
# 19 columns fit the older limit, 256 rows the newer one.
_BLOCK_ROWS = 256 if sqlite3.sqlite_version_info >= (3, 32, 0) else 32


def block_sizes(rows: int) -> list[int]:
    """How `rows` rows split into SQLite insert blocks: as many of `_BLOCK_ROWS` as fit, then
    the rest as the powers of two that add up to it, largest first (257 rows: 256 and 1)."""
    full, rest = divmod(rows, _BLOCK_ROWS)
    return [_BLOCK_ROWS] * full + [1 << bit for bit in reversed(range(rest.bit_length()))
                                   if rest >> bit & 1]


def _sqlite_qmark(dialect: Dialect) -> bool:
    return dialect.name == "sqlite" and dialect.paramstyle == "qmark"


class InsertBlocks:
    """A one-row INSERT compiled for SQLite (`... VALUES (?, ...)`, an `ON CONFLICT` clause
    after it or not) run as multi-row statements of `block_sizes` rows: one statement step,
    so one wait for the GIL, a block instead of a row (`RowInsert` says why)."""

    def __init__(self, sql: str) -> None:
        head, _, rest = sql.partition(" VALUES (")
        group, _, tail = rest.partition(")")
        self._head, self._group, self._tail = f"{head} VALUES ", f"({group})", tail
        self.width = group.count("?")

    @classmethod
    def of(cls, compiled: SQLCompiler, dialect: Dialect) -> InsertBlocks | None:
        """Blocks for `compiled`, an INSERT; None unless it is SQLite's, positional, and its
        values need no bind processor (they go to the driver as they are)."""
        if not _sqlite_qmark(dialect) or not compiled.positional:
            return None
        table = cast(Table, cast(Any, compiled.statement).table)
        if any(table.c[name].type.bind_processor(dialect) for name in compiled.positiontup or ()):
            return None
        return cls(compiled.string)

    def sql(self, rows: int) -> str:
        return self._head + ", ".join([self._group] * rows) + self._tail

    async def run(self, connection: AsyncConnection, rows: Sequence[tuple[Any, ...]]) -> None:
        flat = [value for row in rows for value in row]
        at = 0
        for size in block_sizes(len(rows)):
            end = at + size * self.width
            await connection.exec_driver_sql(self.sql(size), tuple(flat[at:end]))
            at = end


class RowInsert:
    """The INSERT of usage rows, compiled once for a database: each value through its type's
    bind processor as SQLAlchemy would (no statement compiled and no parameter dict built per
    row, as an ORM bulk insert does).

    On SQLite the rows go as multi-row `INSERT ... VALUES (...), (...), ...` statements of up
    to `_BLOCK_ROWS` rows (`block_sizes`), not as an executemany of a one-row statement.
    Python's sqlite3 lets go of the GIL around every statement step, and SQLite's thread must
    then take it back from the event loop's, which under load holds it but for moments: an
    executemany waits for it once per row. A saturated gateway's flush of a few thousand rows
    took seconds that way, and a usage query, which waits for a flush, answered in 1.7 s at
    the median, up to 3.3 s, once past its 5 s timeout (a 503); in blocks, in 0.3 s
    (bench/usage_under_load.py; bench/RESULTS.md, issue 28). The blocks are powers of two, so
    a connection's statement cache holds them all. PostgreSQL (asyncpg) gets one executemany
    of tuples; a driver that takes named parameters, SQLAlchemy's Core executemany."""

    def __init__(self, dialect: Dialect) -> None:
        table = self.table = cast(Table, UsageRow.__table__)
        self.names = tuple(rule.name for rule in _USAGE_RULES)
        compiled = insert(table).compile(dialect=dialect, column_keys=list(self.names))
        positional = compiled.positional and tuple(compiled.positiontup or ()) == self.names
        self.sql: str | None = compiled.string if positional else None
        processors = [table.c[name].type.bind_processor(dialect) for name in self.names]
        self.converted = [(i, p) for i, p in enumerate(processors) if p is not None]
        # the values go through `values` (the processors above): blocks take them as they are
        self.blocks = (InsertBlocks(compiled.string) if positional and _sqlite_qmark(dialect)
                       else None)

    def values(self, row: Row) -> tuple[Any, ...]:
        values = [row[name] for name in self.names]
        for i, process in self.converted:
            if values[i] is not None:
                values[i] = process(values[i])
        return tuple(values)

    async def run(self, connection: AsyncConnection, rows: list[Row]) -> None:
        if self.sql is None:
            await connection.execute(insert(self.table), rows)
        elif self.blocks is None:
            await connection.exec_driver_sql(self.sql, [self.values(row) for row in rows])
        else:
            await self.blocks.run(connection, [self.values(row) for row in rows])


# -- telling a refused row from an unreachable database -----------------------------------------

_OUTAGES = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError,
            sa_exc.TimeoutError, OSError)  # OSError: ConnectionError and TimeoutError among them
_REFUSALS = (sa_exc.DataError, sa_exc.IntegrityError, ValueError, TypeError, OverflowError)
_REFUSED_SQLSTATE_CLASSES = ("22", "23")  # data exception, integrity constraint violation


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc`, the driver error it wraps, what that was raised from, ..."""
    chain: list[BaseException] = []
    cause: BaseException | None = exc
    while cause is not None and cause not in chain and len(chain) < 8:
        chain.append(cause)
        cause = getattr(cause, "orig", None) or cause.__cause__
    return chain


def is_refusal(exc: BaseException) -> bool:
    """True when the database refuses the data itself (retrying cannot help: set the row aside);
    False when it is unreachable or overloaded, or the error is unknown (keep it and retry).

    PostgreSQL's SQLSTATE decides where there is one; otherwise the error's type does.
    """
    chain = _causes(exc)
    for cause in chain:
        state = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
        if isinstance(state, str) and state:
            return state[:2] in _REFUSED_SQLSTATE_CLASSES
    for cause in chain:
        if isinstance(cause, _OUTAGES):
            return False
        if isinstance(cause, _REFUSALS):
            return True
    return False


# -- dead letters -------------------------------------------------------------------------------

_REASON_LENGTH = _text_length(cast(Table, UsageDeadLetterRow.__table__).c.reason)
_DEAD_STRING_CHARS = 4_096  # of each string kept in a dead letter: the rest cannot matter
_LOG_CHARS = 1_000  # of a dead letter in one log line


@dataclass(frozen=True)
class DeadLetter:
    """A usage row the database refused: the row as it was (strings escaped) and why."""

    id: int
    row: dict[str, Any]
    reason: str
    created_at: float


def _dead_letter_value(value: object) -> object:
    """A refused row's value as JSON holds it, bounded, the bad data still readable: a string
    cut short, a huge int or a non-finite float as text, anything else as its ASCII repr."""
    if isinstance(value, str):
        return value[:_DEAD_STRING_CHARS]
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**63 else f"<int of {value.bit_length()} bits>"
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    try:
        return ascii(value)[:_DEAD_STRING_CHARS]
    except Exception:  # a repr that raises: the type must do
        return f"<{type(value).__name__}>"


def dead_letter_json(row: Mapping[Any, Any]) -> str:
    """`row` as ASCII-only JSON: every string escaped (NUL, lone surrogates), so it always
    encodes, and bounded."""
    return json.dumps({ascii(k) if not isinstance(k, str) else k: _dead_letter_value(v)
                       for k, v in row.items()}, ensure_ascii=True)


def error_summary(exc: BaseException) -> str:
    """"DBAPIError(CharacterNotInRepertoireError): invalid byte sequence ...": the error and its
    root cause, bounded, without the SQL and parameters (which may hold the bad data itself)."""
    root = _causes(exc)[-1]
    name = type(exc).__name__ if root is exc else f"{type(exc).__name__}({type(root).__name__})"
    return clean_text(f"{name}: {root}", _REASON_LENGTH)


def _append_line(path: Path, line: str) -> None:
    with path.open("a", encoding="ascii") as f:
        f.write(line + "\n")


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


# -- the ledger ---------------------------------------------------------------------------------


class UsageLedger:
    def __init__(
        self, store: TenantStore, flush_interval: float = 1.0, max_pending: int = 100_000,
        dead_letter_path: str | os.PathLike[str] | None = DEFAULT_DEAD_LETTER_PATH,
        spill_path: str | os.PathLike[str] | None = None,
        retention_s: float | None = None,
    ) -> None:
        """`dead_letter_path`: the JSONL file for dead letters the database will not take
        either; None: the log only. `spill_path`: where `close` keeps the records a database
        that stays away could not take (JSONL; one file per database); None: close raises."""
        if flush_interval <= 0 or max_pending <= 0:
            raise ValueError("flush_interval and max_pending must be > 0")
        self.store = store
        self.flush_interval = flush_interval
        self.max_pending = max_pending
        self.dead_letter_path = Path(dead_letter_path) if dead_letter_path is not None else None
        self.spill_path = Path(spill_path) if spill_path is not None else None
        self._pending: list[Row] = []
        self._wake = asyncio.Event()
        self._flush_lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._shared: asyncio.Future[int] | None = None
        self._closed = False
        self.retention_s = retention_s  # raw rows older than this are pruned; None: kept
        self._next_prune = 0.0
        self._insert: RowInsert | None = None  # compiled for the database at the first write
        self._rollup_inserts: dict[Any, tuple[InsertBlocks | None, tuple[str, ...]]] = {}
        self.flushed = 0  # records written so far, for metrics and tests
        self.dead_lettered = 0  # records the database refused, set aside

    @property
    def pending(self) -> int:
        return len(self._pending)

    async def start(self) -> None:
        await self._replay_spill()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="usage-ledger-flush")

    def record(self, event: UsageEvent) -> None:
        """Buffer one event; never blocks. Raises LedgerFullError rather than drop it, and
        TypeError for a field of the wrong type."""
        if self._closed:
            raise RuntimeError("usage ledger is closed")
        if len(self._pending) >= 2 * self.max_pending:
            raise LedgerFullError(f"{len(self._pending)} usage records waiting for the database")
        self._pending.append(normalise_row(_event_row(event)))
        if len(self._pending) >= self.max_pending:
            self._wake.set()

    def record_many(self, events: Iterable[UsageEvent]) -> None:
        for e in events:
            self.record(e)

    async def flush(self) -> int:
        """Write everything buffered so far, in one batch; returns how many records were
        written (refused ones are set aside, not counted). Raises, keeping the rest, if the
        database is down. Records that come while it writes wait for the next flush: one that
        took them too would, under steady traffic, write a few rows at a time back to back and
        never return, a transaction's whole cost spread over a handful of requests
        (bench/RESULTS.md, issue 28). A flush that waited for another's lock takes what is
        buffered once it has it: everything recorded before it was called, written or kept."""
        async with self._flush_lock:
            batch, self._pending = self._pending, []
            return await self._write_or_set_aside(batch) if batch else 0

    def shared_flush(self) -> asyncio.Future[int]:
        """A flush for callers that only need what was recorded before they asked (a usage
        query): the one already running when there is one, so callers that give up on a
        database gone silent leave one flush behind, not one each. Its failure is the
        caller's to hear or not; it is never left unretrieved."""
        if self._shared is None or self._shared.done():
            self._shared = asyncio.ensure_future(self.flush())
            self._shared.add_done_callback(_retrieved)
        return self._shared

    async def _write_or_set_aside(self, batch: list[Row]) -> int:
        """Write `batch`, bisecting it to find and set aside the rows the database refuses.

        On any other failure the rows not yet written go back to the front of the buffer, in
        order, for the next flush.
        """
        parts = [batch]  # still to write, a stack: parts[-1] holds the oldest rows
        written = 0
        try:
            while parts:
                rows = parts[-1]
                refusal = await self._try_write(rows)
                if refusal is not None and len(rows) > 1:
                    mid = len(rows) // 2
                    parts[-1:] = [rows[mid:], rows[:mid]]
                    continue
                if refusal is not None:
                    await self._set_aside(rows[0], refusal)
                else:
                    written += len(rows)
                    self.flushed += len(rows)
                parts.pop()
        except BaseException:
            self._pending[:0] = [row for rows in reversed(parts) for row in rows]
            raise
        return written

    async def _try_write(self, rows: list[Row]) -> Exception | None:
        """None once `rows` are written; the error when the database refuses them."""
        try:
            await self._write(rows)
        except Exception as exc:
            if is_refusal(exc):
                return exc
            raise
        return None

    async def _write(self, rows: list[Row]) -> None:
        """The rows and their minute rollups, in one transaction: the dashboard's long views
        (rollups) and its short ones (rows) never disagree."""
        minutes = minute_rollups(rows)
        rollups = ((UsageMinuteRow, "minute", minutes),
                   (UsageHourRow, "hour", hour_rollups(minutes)))
        dialect = "postgresql" if self.store.db.is_postgres else "sqlite"

        statement = self._insert_statement()

        async def op(s: AsyncSession) -> None:
            connection = await s.connection()
            for i in range(0, len(rows), _INSERT_CHUNK):
                await statement.run(connection, rows[i : i + _INSERT_CHUNK])
            for model, column, sums in rollups:
                sums.sort(key=lambda m: (m["tenant"], m[column]))  # one lock order for all
                if not sums:
                    continue
                upsert = _upsert_rollups(dialect, model, column)
                blocks, names = self._rollup_blocks(upsert)
                if blocks is None:  # PostgreSQL: one executemany
                    await s.execute(upsert, sums)
                else:  # SQLite: a block of tenants and periods a statement, as the rows
                    await blocks.run(connection, [tuple(m[n] for n in names) for m in sums])

        await self.store.db.run(op)

    def _insert_statement(self) -> RowInsert:
        if self._insert is None:
            self._insert = RowInsert(self.store.db.engine.dialect)
        return self._insert

    def _rollup_blocks(self, upsert: Any) -> tuple[InsertBlocks | None, tuple[str, ...]]:
        """A rollup upsert's SQLite blocks (None elsewhere) and its columns in their order:
        compiled once for this database."""
        found = self._rollup_inserts.get(upsert)
        if found is None:
            dialect = self.store.db.engine.dialect
            compiled = cast(SQLCompiler, upsert.compile(dialect=dialect))
            found = (InsertBlocks.of(compiled, dialect), tuple(compiled.positiontup or ()))
            self._rollup_inserts[upsert] = found
        return found

    async def prune(self, before: float) -> int:
        """Delete raw usage rows that finished before `before` (epoch seconds); their minute
        rollups stay. The number deleted."""
        async def op(s: AsyncSession) -> int:
            result = await s.execute(delete(UsageRow).where(UsageRow.finished_at < before))
            return int(result.rowcount or 0)  # type: ignore[attr-defined]

        return await self.store.db.run(op)

    async def _set_aside(self, row: Row, refusal: Exception) -> None:
        row_json, reason = dead_letter_json(row), error_summary(refusal)
        log.warning("usage row refused and set aside (%s): %s", reason, row_json[:_LOG_CHARS])
        letter: Row = {"row_json": row_json, "reason": reason, "created_at": time.time()}

        async def op(s: AsyncSession) -> None:
            await s.execute(insert(UsageDeadLetterRow), [letter])

        try:
            await self.store.db.run(op)
        except Exception as exc:
            await self._keep_dead_letter_elsewhere(letter, exc)
        self.dead_lettered += 1

    async def _keep_dead_letter_elsewhere(self, letter: Row, exc: Exception) -> None:
        """The dead-letter insert failed too: the JSONL file, else the log, keeps the row."""
        line, why = json.dumps(letter, ensure_ascii=True), error_summary(exc)
        if self.dead_letter_path is not None:
            try:
                await asyncio.to_thread(_append_line, self.dead_letter_path, line)
            except OSError as file_exc:
                log.error("usage dead letter kept in the log only (database: %s; file: %s): %s",
                          why, file_exc, line[:_LOG_CHARS])
                return
        where = self.dead_letter_path or "the log only"
        log.warning("usage dead letter kept in %s (database: %s): %s", where, why,
                    line[:_LOG_CHARS])

    async def _run(self) -> None:
        while not self._closed:
            await wait_event(self._wake, self.flush_interval)
            self._wake.clear()
            try:
                await self.flush()
                await self._prune_when_due()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the loop alive; the batch stays buffered
                log.warning("usage flush failed (%d pending): %s", self.pending,
                            error_summary(exc))

    async def _prune_when_due(self) -> None:
        """With a retention, raw rows older than it go once an hour (the rollups stay)."""
        if self.retention_s is None or time.monotonic() < self._next_prune:
            return
        self._next_prune = time.monotonic() + PRUNE_EVERY_S
        deleted = await self.prune(time.time() - self.retention_s)
        if deleted:
            log.info("usage: pruned %d raw rows older than %g days (minute rollups kept)",
                     deleted, self.retention_s / 86400)

    async def close(self, timeout: float = 30.0) -> None:
        """Stop the background task and write everything. While the database is away, keep
        trying for `timeout` seconds; then spill what is left to `spill_path` (the next `start`
        writes it); raises only when there is nowhere to keep it."""
        self._closed = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._task is not None:
            # Let the loop finish on its own: cancelling it mid-commit could leave a batch both
            # written and back in the buffer, i.e. recorded twice. Only a flush stuck past the
            # whole timeout (a database gone silent) is cut off: its rows go back to the buffer.
            self._wake.set()
            done, _ = await asyncio.wait({self._task}, timeout=timeout)
            if not done:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            self._task = None

        async def flush() -> None:
            async with asyncio.timeout(max(deadline - loop.time(), 1.0)):
                await self.flush()

        def retrying(exc: BaseException, pause: float) -> None:
            log.warning("usage flush at shutdown failed (%d pending), retrying: %s",
                        self.pending, error_summary(exc))

        try:  # TimeoutError retried too: a database gone silent
            await retry_async(flush, _SHUTDOWN_BACKOFF, deadline=deadline, on_retry=retrying,
                              clock=loop.time)
        except Exception as exc:
            if self.spill_path is None:
                raise
            self._spill(exc)

    def _spill(self, failure: Exception) -> None:
        assert self.spill_path is not None
        with self.spill_path.open("a", encoding="ascii") as f:
            for row in self._pending:
                f.write(json.dumps(row) + "\n")
        log.error("the database is unavailable at shutdown (%s): %d usage records kept in %s, "
                  "written at the next start", error_summary(failure), len(self._pending),
                  self.spill_path)
        self._pending = []

    async def _replay_spill(self) -> None:
        """Rows an earlier shutdown could not write: written now, then the file is removed. The
        file is first renamed to this process's own name, so two gateways sharing it never
        both write it; if the database fails midway, what is left goes back to the file and
        the start fails (a crash between the write and the removal would write them twice;
        nothing is ever lost)."""
        path = self.spill_path
        if path is None:
            return
        mine = path.with_name(f"{path.name}.{os.getpid()}.replaying")
        try:
            path.rename(mine)
        except FileNotFoundError:
            return
        rows = [normalise_row(json.loads(line)) for line in
                mine.read_text(encoding="ascii").splitlines() if line.strip()]
        async with self._flush_lock:
            try:
                written = await self._write_or_set_aside(rows)
            except BaseException:
                left, self._pending = self._pending, []  # only this file's rows were pending
                with path.open("a", encoding="ascii") as f:
                    f.writelines(json.dumps(row) + "\n" for row in left)
                mine.unlink()
                raise
        mine.unlink()
        log.info("wrote %d usage records kept from an earlier shutdown (%s)", written, path)

    # -- queries ------------------------------------------------------------------------------

    @staticmethod
    def _where(tenant: str, window_s: float | None) -> list[ColumnElement[bool]]:
        clauses = [UsageRow.tenant == tenant]
        if window_s is not None:
            clauses.append(UsageRow.finished_at >= time.time() - window_s)
        return clauses

    async def totals(self, tenant: str, window_s: float | None = None) -> dict[str, Any]:
        """Requests and tokens of `tenant` over the last `window_s` seconds (None: all time)."""
        where = self._where(tenant, window_s)

        async def op(s: AsyncSession) -> dict[str, Any]:
            by_status = (
                await s.execute(
                    select(
                        UsageRow.status,
                        func.count(),
                        func.coalesce(func.sum(UsageRow.prompt_tokens), 0),
                        func.coalesce(func.sum(UsageRow.completion_tokens), 0),
                    )
                    .where(*where)
                    .group_by(UsageRow.status)
                )
            ).all()
            return {
                "requests": sum(int(r[1]) for r in by_status),
                "prompt_tokens": sum(int(r[2]) for r in by_status),
                "completion_tokens": sum(int(r[3]) for r in by_status),
                "by_status": {int(r[0]): int(r[1]) for r in by_status},
            }

        return await self.store.db.run(op, write=False)

    async def latency_percentiles(
        self,
        tenant: str,
        window_s: float | None = None,
        percentiles: Sequence[float] = (50, 90, 99),
    ) -> dict[str, dict[float, float | None]]:
        """{"ttft"|"e2e"|"queue_time": {p: seconds or None when no data}}."""
        where = self._where(tenant, window_s)

        async def op(s: AsyncSession) -> dict[str, dict[float, float | None]]:
            return {
                name: await _percentiles(s, getattr(UsageRow, name), where, percentiles)
                for name in LATENCY_COLUMNS
            }

        return await self.store.db.run(op, write=False)

    async def output_tokens_percentile(
        self, tenant: str, window_s: float | None, percentile: float = 90
    ) -> float | None:
        """Completion tokens at `percentile` over successful (2xx) requests; None if none.

        Errors are left out: their near-zero outputs would make cost estimates too low.
        """
        where = [*self._where(tenant, window_s), UsageRow.status.between(200, 299)]

        async def op(s: AsyncSession) -> float | None:
            found = await _percentiles(s, UsageRow.completion_tokens, where, (percentile,))
            return found[percentile]

        return await self.store.db.run(op, write=False)

    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        """The `limit` most recent rows the database refused, newest first."""
        if limit <= 0:
            raise ValueError(f"limit must be > 0, got {limit}")

        async def op(s: AsyncSession) -> list[DeadLetter]:
            found = await s.scalars(
                select(UsageDeadLetterRow).order_by(UsageDeadLetterRow.id.desc()).limit(limit))
            return [DeadLetter(r.id, json.loads(r.row_json), r.reason, r.created_at)
                    for r in found]

        return await self.store.db.run(op, write=False)


async def _percentiles(
    s: AsyncSession, column: Any, where: list[ColumnElement[bool]], percentiles: Sequence[float]
) -> dict[float, float | None]:
    where = [*where, column.is_not(None)]
    count = int(await s.scalar(select(func.count()).select_from(UsageRow).where(*where)) or 0)
    result: dict[float, float | None] = {}
    for p in percentiles:
        if not 0 < p <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {p}")
        if count == 0:
            result[p] = None
            continue
        value = await s.scalar(
            select(column).where(*where).order_by(column)
            .offset(nearest_rank(count, p) - 1).limit(1)
        )
        result[p] = float(value) if value is not None else None
    return result

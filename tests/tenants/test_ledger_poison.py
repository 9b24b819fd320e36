"""One bad usage event must never poison the ledger for everyone (issue 13).

Normalising makes every event storable; a row the database refuses anyway is set aside as a dead
letter without blocking the rows behind it; a database that is down keeps the batch for later.
Every test runs on SQLite and on PostgreSQL.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import func, select, text
from sqlalchemy.exc import OperationalError

import tenants.ledger
from tenants import TenantStore, UsageEvent, UsageLedger
from tenants.db import Database
from tenants.models import UsageRow
from tests.support.processes import free_port

INT32_MAX = 2**31 - 1


def event(tenant: str = "acme", **over: Any) -> UsageEvent:
    fields: dict[str, Any] = dict(
        tenant=tenant, key_id="key_1", model="random:tiny", priority="interactive",
        prompt_tokens=10, completion_tokens=5, status=200, queue_time=0.01, ttft=0.1, e2e=0.5,
    )
    fields.update(over)
    return UsageEvent(**fields)


async def usage_sums(store: TenantStore) -> tuple[int, int]:
    """(rows, prompt tokens) over all of fg_usage."""
    async with store.db.engine.connect() as conn:
        found = await conn.execute(
            select(func.count(), func.coalesce(func.sum(UsageRow.prompt_tokens), 0)))
        rows, tokens = found.one()
    return int(rows), int(tokens)


# -- normalising: random values in every field ----------------------------------------------------

def long_texts() -> st.SearchStrategy[str]:
    return st.builds(lambda c, n: c * n, st.characters(), st.integers(250, 3000))


poison_texts = (
    st.text(max_size=20)
    | st.text(alphabet=st.characters(categories=["Cs", "Cc", "Zl", "Co"]), max_size=20)
    | long_texts()
    | st.sampled_from(["\x00", "a\x00b", "\ud800", "a\udfffb", "\x01\x1f\x7f\x9f", ""])
)
poison_ints = st.integers(-(2**70), 2**70) | st.sampled_from(
    [2**31, INT32_MAX, -(2**31) - 1, 2**63, -1, 0, 10**30])
poison_numbers = st.floats() | st.integers(-(2**1100), 2**1100)
poison_events = st.builds(
    UsageEvent,
    tenant=st.builds(lambda t: "p" + t, poison_texts),  # never the name of a valid tenant
    key_id=st.none() | poison_texts, model=poison_texts, priority=poison_texts,
    prompt_tokens=poison_ints, completion_tokens=poison_ints, status=poison_ints,
    queue_time=st.none() | poison_numbers, ttft=st.none() | poison_numbers,
    e2e=st.none() | poison_numbers, created_at=poison_numbers,
    finished_at=st.none() | poison_numbers,
)
latencies = st.none() | st.floats(0, 60)
valid_events = st.builds(
    event, tenant=st.sampled_from(["v0", "v1", "v2"]), model=st.sampled_from(["m", "random:tiny"]),
    prompt_tokens=st.integers(0, 10_000), completion_tokens=st.integers(0, 10_000),
    status=st.sampled_from([200, 400, 429, 500]), queue_time=latencies, ttft=latencies,
    e2e=latencies,
)
_examples = itertools.count()


@settings(max_examples=100, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(events=st.lists(valid_events | poison_events, min_size=1, max_size=25))
async def test_any_values_are_normalised_and_every_event_is_written(
        store: TenantStore, events: list[UsageEvent]) -> None:
    # One store for all examples: tenant names private to the example, sums compared as deltas.
    run = next(_examples)
    events = [dataclasses.replace(e, tenant=f"{e.tenant}-{run}") if e.tenant.startswith("v")
              else e for e in events]
    valid = [e for e in events if e.tenant.startswith("v")]
    rows_before, tokens_before = await usage_sums(store)

    ledger = UsageLedger(store, dead_letter_path=None)
    ledger.record_many(events)
    await ledger.close()  # raises if any flush fails

    assert ledger.pending == 0 and ledger.dead_lettered == 0 and ledger.flushed == len(events)
    for tenant in {e.tenant for e in valid}:
        mine = [e for e in valid if e.tenant == tenant]
        statuses = [e.status for e in mine]
        assert await ledger.totals(tenant) == {
            "requests": len(mine),
            "prompt_tokens": sum(e.prompt_tokens for e in mine),
            "completion_tokens": sum(e.completion_tokens for e in mine),
            "by_status": {s: statuses.count(s) for s in set(statuses)},
        }
    clamped = sum(min(max(e.prompt_tokens, 0), INT32_MAX) for e in events)  # valid: unchanged
    assert await usage_sums(store) == (rows_before + len(events), tokens_before + clamped)
    async with store.db.engine.connect() as conn:
        stored = (await conn.execute(select(UsageRow.tenant, UsageRow.key_id, UsageRow.model,
                                            UsageRow.priority).order_by(UsageRow.id.desc())
                                     .limit(len(events)))).all()
    assert not {unicodedata.category(c) for row in stored for t in row if t for c in t} & {
        "Cc", "Cs", "Zl", "Zp"}  # no controls, lone surrogates or line breaks survive


async def test_normalised_row_is_bounded_and_clean(store: TenantStore) -> None:
    ledger = UsageLedger(store, dead_letter_path=None)
    ledger.record(event("a\x00b", key_id="\ud800" * 40, model="m\x01" * 1000, priority="\x7f",
                        prompt_tokens=-5, completion_tokens=2**80, status=-(2**40),
                        queue_time=float("nan"), ttft=float("inf"), e2e=-float("inf"),
                        created_at=float("nan"), finished_at=float("inf")))
    await ledger.close()
    async with store.db.engine.connect() as conn:
        row = (await conn.execute(select(UsageRow))).one()
    assert row.tenant == "a\ufffdb" and row.key_id == "\ufffd" * 32 and row.priority == "\ufffd"
    assert row.model == "m\ufffd" * 128  # String(256)
    assert (row.prompt_tokens, row.completion_tokens, row.status) == (0, INT32_MAX, -(2**31))
    assert (row.queue_time, row.ttft, row.e2e) == (None, None, None)
    assert row.created_at == row.finished_at and row.created_at > 1e9  # "now"


@pytest.mark.parametrize(("field", "value"), [
    ("prompt_tokens", "5"), ("prompt_tokens", 1.5), ("status", None), ("tenant", None),
    ("model", b"bytes"), ("ttft", "fast"), ("created_at", [1.0]),
])
async def test_wrong_type_is_refused_at_record(store: TenantStore, field: str,
                                               value: Any) -> None:
    ledger = UsageLedger(store, dead_letter_path=None)
    with pytest.raises(TypeError, match=field):
        ledger.record(event(**{field: value}))
    ledger.record(event())
    assert ledger.pending == 1  # the refused event never reached the buffer
    await ledger.close()
    assert (await ledger.totals("acme"))["requests"] == 1


# -- the dead-letter path, normalising bypassed -------------------------------------------------

def refused_model(store: TenantStore) -> str:
    """A model name this database refuses (SQLite stores NUL; nobody encodes a surrogate)."""
    return "a\x00b" if store.db.is_postgres else "a\ud800b"


@pytest.fixture
def raw_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows reach the database exactly as the events held them."""
    monkeypatch.setattr(tenants.ledger, "normalise_row", dict)


@pytest.mark.usefixtures("raw_rows")
async def test_refused_rows_are_dead_lettered_and_never_block(store: TenantStore,
                                                            tmp_path: Path) -> None:
    bad_model = refused_model(store)
    ledger = UsageLedger(store, dead_letter_path=tmp_path / "dead.jsonl")
    ledger.record_many([
        event(model=bad_model, prompt_tokens=1),  # first of the batch
        event(prompt_tokens=2), event(prompt_tokens=3),
        event(prompt_tokens=2**70),  # in the middle: beyond every INTEGER
        event(prompt_tokens=4),
        event(model=bad_model, prompt_tokens=5),  # last of the batch
    ])
    assert await ledger.flush() == 3
    ledger.record(event(prompt_tokens=6))
    await ledger.close()

    assert (await ledger.totals("acme"))["prompt_tokens"] == 2 + 3 + 4 + 6
    assert ledger.pending == 0 and ledger.dead_lettered == 3 and ledger.flushed == 4
    letters = await ledger.dead_letters()
    assert [d.row["prompt_tokens"] for d in letters] == [5, "<int of 71 bits>", 1]  # newest first
    assert letters[0].row["model"] == bad_model and letters[0].row["tenant"] == "acme"
    assert all(0 < len(d.reason) <= 512 and "INSERT" not in d.reason for d in letters)
    assert letters[0].created_at >= letters[1].created_at >= letters[2].created_at
    assert [d.id for d in await ledger.dead_letters(limit=1)] == [letters[0].id]
    assert not (tmp_path / "dead.jsonl").exists()  # the table took them all


@pytest.mark.usefixtures("raw_rows")
async def test_dead_letter_the_database_refuses_too_goes_to_a_file(
        store: TenantStore, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with store.db.engine.begin() as conn:
        await conn.execute(text("DROP TABLE fg_usage_dead_letters"))
    path = tmp_path / "dead.jsonl"
    ledger = UsageLedger(store, dead_letter_path=path)
    bad_model = refused_model(store) * 100_000
    ledger.record_many([event(prompt_tokens=1), event(model=bad_model), event(prompt_tokens=2)])
    with caplog.at_level(logging.WARNING, logger="tenants.ledger"):
        await ledger.close()

    assert (await ledger.totals("acme"))["prompt_tokens"] == 3 and ledger.dead_lettered == 1
    [line] = path.read_text(encoding="ascii").splitlines()
    letter = json.loads(line)
    assert json.loads(letter["row_json"])["model"] == bad_model[:4096]
    assert letter["reason"] and letter["created_at"] > 0
    assert caplog.records and all(len(r.getMessage()) < 4_000 for r in caplog.records)

    # With no file configured the log is the only record, still one bounded line.
    ledger = UsageLedger(store, dead_letter_path=None)
    ledger.record(event(model=bad_model))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="tenants.ledger"):
        await ledger.close()
    assert ledger.dead_lettered == 1 and path.read_text().count("\n") == 1
    assert any("log only" in r.getMessage() for r in caplog.records)
    assert all(len(r.getMessage()) < 4_000 for r in caplog.records)


# -- a database that is down keeps everything ---------------------------------------------------

def unreachable(store: TenantStore, tmp_path: Path) -> Database:
    """A database that cannot be reached: PostgreSQL on a closed port; SQLite in a folder
    that went away after it was opened (a missing one is refused at once)."""
    if not store.db.is_sqlite:
        return Database(f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/fairgate")
    folder = tmp_path / "gone"
    folder.mkdir()
    down = Database(f"sqlite+aiosqlite:///{folder / 'x.db'}")
    folder.rmdir()
    return down


@pytest.mark.usefixtures("raw_rows")
async def test_database_down_keeps_the_batch_until_it_is_back(store: TenantStore,
                                                              tmp_path: Path) -> None:
    ledger = UsageLedger(store, dead_letter_path=tmp_path / "dead.jsonl")
    ledger.record_many(event(prompt_tokens=i) for i in range(5))
    ledger.record(event(model=refused_model(store), prompt_tokens=100))  # not while it is down
    up, down = store.db, unreachable(store, tmp_path)
    store.db = down
    try:
        with pytest.raises((OSError, OperationalError)) as failure:
            await ledger.flush()
        assert not tenants.ledger.is_refusal(failure.value)
        ledger.record(event(prompt_tokens=5))
        with pytest.raises((OSError, OperationalError)):
            await ledger.close(timeout=0.2)  # shutdown says it could not write, and keeps the rows
        assert ledger.pending == 7 and ledger.dead_lettered == 0 and ledger.flushed == 0
    finally:
        store.db = up
        await down.dispose()
    assert await ledger.flush() == 6  # back: the good rows written, the bad one set aside
    assert (await ledger.totals("acme"))["prompt_tokens"] == sum(range(6))
    [letter] = await ledger.dead_letters()
    assert letter.row["prompt_tokens"] == 100 and ledger.dead_lettered == 1
    assert not (tmp_path / "dead.jsonl").exists()


@pytest.mark.usefixtures("raw_rows")
async def test_outage_while_bisecting_puts_the_rest_back_in_order(
        store: TenantStore, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger = UsageLedger(store, dead_letter_path=None)
    ledger.record_many([event(prompt_tokens=1), event(prompt_tokens=2),
                        event(model=refused_model(store), prompt_tokens=3),
                        event(prompt_tokens=4)])
    real_write, calls = ledger._write, 0

    async def down_after_the_first_half(rows: list[dict[str, Any]]) -> None:
        nonlocal calls
        calls += 1
        if calls == 3:  # 1: the batch (refused), 2: its first half (written), 3: the second
            raise ConnectionError("database went away")
        await real_write(rows)

    monkeypatch.setattr(ledger, "_write", down_after_the_first_half)
    with pytest.raises(ConnectionError):
        await ledger.flush()
    assert ledger.flushed == 2 and ledger.dead_lettered == 0
    assert [r["prompt_tokens"] for r in ledger._pending] == [3, 4]
    await ledger.close()
    assert (await ledger.totals("acme"))["prompt_tokens"] == 1 + 2 + 4  # nothing twice
    assert ledger.dead_lettered == 1 and ledger.pending == 0

"""What clients saw, request by request, and the usage rows the gateway wrote for them.

`Seen` is one request from the client's side: its HTTP status, the tokens it was sent, an error
(the body, or an SSE error event after the stream started) and whether the stream ended with
[DONE]. `unmatched` pairs those with the fg_usage rows: one row per request, with the status
the client saw and, when it got any tokens, exactly that many completion tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
import asyncpg

from tests.faults.cluster import STREAM_TOKENS, Cluster
from tests.support.waiting import wait_until

# Turned away before the key was known: no tenant, so no usage row.
UNRECORDED_CODES = ("auth_unavailable", "invalid_api_key", "missing_api_key")


@dataclass(frozen=True)
class Seen:
    tenant: str
    status: int  # HTTP status
    tokens: int  # stream: token events received; whole: usage.completion_tokens
    error: dict[str, Any] | None = None  # the error body, or the SSE error event
    done: bool = False  # the stream ended with data: [DONE]
    usage_tokens: int | None = None  # completion_tokens the stream's usage event reported
    finish_reason: str | None = None
    elapsed: float = 0.0  # seconds from sending to the end of the response

    @property
    def code(self) -> str | None:
        return None if self.error is None else self.error.get("code")

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def stream_error(self) -> bool:
        """The stream started (200) and then failed: the row carries a 5xx status."""
        return self.status == 200 and self.error is not None

    @property
    def recorded(self) -> bool:
        return self.code not in UNRECORDED_CODES


def completion(max_tokens: int = STREAM_TOKENS, **extra: Any) -> dict[str, Any]:
    return {"prompt": "hello", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **extra}


async def send(session: aiohttp.ClientSession, url: str, tenant: str, key: str,
               body: dict[str, Any] | bytes, started: asyncio.Event | None = None) -> Seen:
    """POST /v1/completions and read the whole answer; `started` is set at the first token."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    begin = time.perf_counter()
    async with session.post(f"{url}/v1/completions", data=data, headers={
            "Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as resp:
        if resp.content_type != "text/event-stream":
            payload = await resp.json(content_type=None)
            usage = payload.get("usage") or {}
            return Seen(tenant, resp.status, int(usage.get("completion_tokens", 0)),
                        payload.get("error"), elapsed=time.perf_counter() - begin)
        seen = await _read_stream(resp, tenant, started)
    return _with_elapsed(seen, time.perf_counter() - begin)


async def streaming(session: aiohttp.ClientSession, url: str, tenant: str, key: str,
                    body: dict[str, Any], timeout: float = 10.0) -> asyncio.Task[Seen]:
    """A stream sent in the background, returned once its first token has arrived;
    AssertionError with what the client saw when it ends (or `timeout` passes) before."""
    started = asyncio.Event()
    task = asyncio.create_task(send(session, url, tenant, key, body, started))
    waiter = asyncio.create_task(started.wait())
    await asyncio.wait({task, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not started.is_set():
        task.cancel()
        seen = task.result() if task.done() and not task.cancelled() else "nothing"
        raise AssertionError(f"no first token within {timeout} s; the client saw {seen}")
    return task


async def _read_stream(resp: aiohttp.ClientResponse, tenant: str,
                       started: asyncio.Event | None) -> Seen:
    tokens, error, done, usage_tokens, reason = 0, None, False, None, None
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data: "):
            continue
        assert not done, f"an event after [DONE]: {line!r}"
        if line == b"data: [DONE]":
            done = True
            continue
        event = json.loads(line[6:])
        if "error" in event:
            error = event["error"]
        for choice in event.get("choices") or ():
            reason = choice.get("finish_reason") or reason
            if choice.get("text"):
                tokens += 1
                if started is not None:
                    started.set()
        if event.get("usage"):
            usage_tokens = int(event["usage"]["completion_tokens"])
    return Seen(tenant, resp.status, tokens, error, done, usage_tokens, reason)


def _with_elapsed(seen: Seen, elapsed: float) -> Seen:
    return Seen(seen.tenant, seen.status, seen.tokens, seen.error, seen.done, seen.usage_tokens,
                seen.finish_reason, elapsed)


def check_clean(seen: Seen) -> None:
    """A stream that ended the way the protocol says: [DONE] last, and either every token
    with its usage or an error event in OpenAI's shape."""
    if seen.status != 200:
        assert seen.error is not None and seen.error.get("message"), seen
        return
    assert seen.done, f"the stream ended without [DONE]: {seen}"
    if seen.error is None:
        assert seen.finish_reason is not None and seen.usage_tokens == seen.tokens, seen
    else:
        assert {"message", "type", "code"} <= set(seen.error), seen


# ---- fg_usage ----------------------------------------------------------------------------------
async def usage_rows(database_url: str, tenants: list[str]) -> list[tuple[str, int, int]]:
    """(tenant, status, completion_tokens) of every fg_usage row of `tenants`."""
    conn = await asyncpg.connect(database_url, timeout=5)
    try:
        rows = await conn.fetch("SELECT tenant, status, completion_tokens FROM fg_usage "
                                "WHERE tenant = ANY($1::text[]) ORDER BY id", tenants)
    finally:
        await conn.close()
    return [(r["tenant"], r["status"], r["completion_tokens"]) for r in rows]


async def flushed_rows(database_url: str, seen: list[Seen],
                       timeout: float = 15.0) -> list[tuple[str, int, int]]:
    """The rows of `seen`'s tenants once there are at least as many as recorded requests
    (the gateway writes usage behind, about once a second)."""
    tenants = sorted({s.tenant for s in seen})
    want = sum(s.recorded for s in seen)
    rows: list[tuple[str, int, int]] = []

    async def enough() -> bool:
        nonlocal rows
        rows = await usage_rows(database_url, tenants)
        return len(rows) >= want

    await wait_until(enough, timeout, f"{want} usage rows for {tenants} (have {len(rows)})")
    return rows


def unmatched(seen: list[Seen], rows: list[tuple[str, int, int]]) -> tuple[
        list[Seen], list[tuple[str, int, int]]]:
    """(requests without their row, rows without their request). A row matches a request of
    its tenant with the same status (a stream that failed after it started: any 5xx) and, when
    the client got tokens, the same completion tokens (0 when the HTTP status was an error)."""
    left = Counter(rows)
    missing = []
    # Exact statuses first, so a failed stream takes a 5xx row no exact request needed.
    for s in sorted((s for s in seen if s.recorded), key=lambda s: s.stream_error):
        tokens = s.tokens if s.status == 200 else 0
        statuses = sorted({st for (t, st, _) in left if t == s.tenant and st >= 500}) if (
            s.stream_error) else [s.status]
        key = next(((s.tenant, st, tokens) for st in statuses
                    if left[(s.tenant, st, tokens)] > 0), None)
        if key is None:
            missing.append(s)
        else:
            left[key] -= 1
    return missing, sorted(left.elements())


async def assert_usage_matches(database_url: str, seen: list[Seen],
                               timeout: float = 15.0) -> list[tuple[str, int, int]]:
    rows = await flushed_rows(database_url, seen, timeout)
    missing, extra = unmatched(seen, rows)
    assert not missing and not extra, (
        f"requests without a usage row: {missing}\nrows without a request: {extra}")
    return rows


async def first_engine_down_others_serve(c: Cluster, session: aiohttp.ClientSession, what: str,
                                         requests: int) -> list[Seen]:
    """Wait until the gateway has marked engine 0 down (and engine 1 up), then send `requests`
    short requests: each must succeed, on the other engine. What they saw, for the usage check."""

    async def marked_down() -> bool:
        return await c.backends(session) == {c.engine_urls[0]: False, c.engine_urls[1]: True}

    await wait_until(marked_down, 5, f"the gateway marks the {what} engine down")
    after = [await send(session, c.url, c.tenants["acme"], c.keys["acme"], completion(8))
             for _ in range(requests)]
    assert all(s.ok and s.tokens == 8 for s in after), after
    return after

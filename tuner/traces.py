"""Request traces: one `TraceRequest` per request, read from public traces or fairgate's own.

Formats (`load_trace(path, fmt="auto")` picks by suffix and first line):

- ``azure``: the Azure LLM inference 2023 CSVs, columns ``TIMESTAMP,ContextTokens,GeneratedTokens``
  (timestamps like ``2023-11-16 18:17:03.9799600``).
- ``mooncake``: Mooncake JSONL, ``{"timestamp": ms, "input_length": n, "output_length": m,
  "hash_ids": [...]}``; each hash id names a 512-token prompt block, equal ids are a shared prefix.
- ``fairgate``: what the gateway captures, JSONL, one object per request::

    {"arrival": 0.125,            # seconds since the trace started (required)
     "prompt_tokens": 812,        # prompt length in the engine's tokens (required)
     "output_tokens": 143,        # tokens actually generated (required; replay forces this length)
     "max_tokens": 256,           # what the client asked for (optional, default output_tokens)
     "tenant": "acme",            # optional, default "default"
     "priority": "interactive",   # optional priority class, default none
     "prefix_hashes": [17, 18],   # optional, one id per `block_tokens` prompt block; equal ids =
     "block_tokens": 512}         #   identical prompt text (shareable prefix); default 512

  Lines that are empty or start with ``#`` are skipped. `write_fairgate_trace` writes this format.

Every reading error names the file and line: ``traces.jsonl:17: output_tokens must be >= 0``.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 512
TRACE_FORMATS = ("auto", "azure", "mooncake", "fairgate")


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request to send: when, how long in and out, for whom."""

    arrival: float  # seconds from the start of the run
    prompt_tokens: int
    output_tokens: int  # forced with max_tokens + ignore_eos
    tenant: str = "default"
    priority: str | None = None
    max_tokens: int | None = None  # the client's own cap when traced; None = output_tokens
    prefix_hashes: tuple[int, ...] = ()
    block_tokens: int = BLOCK_TOKENS
    api_key: str | None = None  # per-tenant key; None = the run's default key
    prompt: str | None = None  # its text, where the trace kept it; None: made-up text

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "arrival": round(self.arrival, 6),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "tenant": self.tenant,
        }
        if self.priority is not None:
            out["priority"] = self.priority
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.prefix_hashes:
            out["prefix_hashes"] = list(self.prefix_hashes)
            out["block_tokens"] = self.block_tokens
        if self.prompt is not None:
            out["prompt"] = self.prompt
        return out


def load_trace(path: str | Path, fmt: str = "auto") -> list[TraceRequest]:
    """Read a whole trace, arrivals shifted to start at 0 and sorted."""
    path = Path(path)
    if fmt not in TRACE_FORMATS:
        raise TraceError(f"unknown trace format {fmt!r}; known: {', '.join(TRACE_FORMATS)}")
    try:
        stat = path.stat()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    # Cached by (path, mtime): the tuner replays the same trace in every trial.
    return list(_load_cached(str(path.resolve()), stat.st_mtime_ns, fmt))


@lru_cache(maxsize=8)
def _load_cached(path: str, _mtime_ns: int, fmt: str) -> tuple[TraceRequest, ...]:
    p = Path(path)
    if fmt == "auto":
        fmt = detect_format(p)
    readers = {"azure": _read_azure, "mooncake": _read_mooncake, "fairgate": _read_fairgate}
    try:
        with p.open(encoding="utf-8", newline="") as f:
            requests = list(readers[fmt](p, f))
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {p}: {exc}") from None
    if not requests:
        raise TraceError(f"{p}: the trace has no requests")
    return tuple(_rebase(requests))


def parse_fairgate_trace(text: str, source: str) -> list[TraceRequest]:
    """A fairgate trace handed over as text (a gateway's `GET /admin/capture`), rebased and
    sorted as `load_trace` does; empty when it holds no requests. Errors name `source`."""
    requests = list(_read_fairgate(Path(source), text.splitlines()))
    return _rebase(requests) if requests else []


def detect_format(path: Path) -> str:
    """Azure by CSV header, Mooncake by `input_length`, fairgate by `prompt_tokens`."""
    try:
        with path.open(encoding="utf-8") as f:
            first = next((line for line in f if line.strip() and not line.startswith("#")), "")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace {path}: {exc}") from None
    if first.startswith("TIMESTAMP") or path.suffix == ".csv":
        return "azure"
    if '"input_length"' in first:
        return "mooncake"
    if '"prompt_tokens"' in first:
        return "fairgate"
    raise TraceError(
        f"{path}:1: cannot tell the trace format; pass one of azure, mooncake, fairgate"
    )


def _rebase(requests: list[TraceRequest]) -> list[TraceRequest]:
    requests.sort(key=lambda r: r.arrival)
    t0 = requests[0].arrival
    return [replace(r, arrival=r.arrival - t0) for r in requests]


def _read_azure(path: Path, f: Iterable[str]) -> Iterator[TraceRequest]:
    reader = csv.reader(f)
    header = next(reader, None)
    if header is None or [h.strip() for h in header[:3]] != [
        "TIMESTAMP",
        "ContextTokens",
        "GeneratedTokens",
    ]:
        raise TraceError(f"{path}:1: expected header TIMESTAMP,ContextTokens,GeneratedTokens")
    for row in reader:
        if not row:
            continue
        try:
            stamp = datetime.fromisoformat(row[0].strip()).timestamp()
            req = _record(stamp, int(row[1]), int(row[2]))
        except (ValueError, IndexError) as exc:
            raise TraceError(
                f"{path}:{reader.line_num}: bad row {','.join(row)!r}: {exc}"
            ) from None
        yield req


def _read_mooncake(path: Path, f: Iterable[str]) -> Iterator[TraceRequest]:
    return _read_json(path, f, _mooncake, "mooncake")


def _read_fairgate(path: Path, f: Iterable[str]) -> Iterator[TraceRequest]:
    return _read_json(path, f, _fairgate, "fairgate trace")


def _mooncake(obj: dict[str, Any]) -> TraceRequest:
    req = _record(
        float(obj["timestamp"]) / 1000.0, int(obj["input_length"]), int(obj["output_length"])
    )
    return replace(req, prefix_hashes=tuple(int(h) for h in obj.get("hash_ids", ())))


def _fairgate(obj: dict[str, Any]) -> TraceRequest:
    req = _record(float(obj["arrival"]), int(obj["prompt_tokens"]), int(obj["output_tokens"]))
    max_tokens = obj.get("max_tokens")
    priority = obj.get("priority")
    prompt = obj.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise TypeError(f"prompt must be text, got {type(prompt).__name__}")
    return replace(
        req,
        prompt=prompt,
        tenant=str(obj.get("tenant", "default")),
        priority=None if priority is None else str(priority),
        max_tokens=None if max_tokens is None else int(max_tokens),
        prefix_hashes=tuple(int(h) for h in obj.get("prefix_hashes", ())),
        block_tokens=int(obj.get("block_tokens", BLOCK_TOKENS)),
    )


def _read_json(
    path: Path, f: Iterable[str], convert: Callable[[dict[str, Any]], TraceRequest], what: str
) -> Iterator[TraceRequest]:
    for line, obj in _json_lines(path, f):
        try:
            req = convert(obj)
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceError(f"{path}:{line}: bad {what} record: {_why(exc)}") from None
        yield req


def _json_lines(path: Path, f: Iterable[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    for line, text in enumerate(f, start=1):
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{line}: not valid JSON: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{path}:{line}: expected a JSON object, got {type(obj).__name__}")
        yield line, obj


def _record(arrival: float, prompt: int, output: int) -> TraceRequest:
    if prompt < 1:
        raise ValueError(f"prompt length must be >= 1, got {prompt}")
    if output < 0:
        raise ValueError(f"output length must be >= 0, got {output}")
    # Traces record some 0-token outputs (aborted requests); one token is the least we can ask.
    return TraceRequest(arrival=arrival, prompt_tokens=prompt, output_tokens=max(1, output))


def _why(exc: Exception) -> str:
    return f"missing field {exc}" if isinstance(exc, KeyError) else str(exc)


def write_fairgate_trace(path: str | Path, requests: Sequence[TraceRequest]) -> None:
    """Write requests in fairgate's JSONL trace format (round-trips through `load_trace`)."""
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")

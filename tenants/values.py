"""Plain values the rest of fairgate sees: tenants, limits, keys, usage events.

These are frozen dataclasses validated in `__post_init__`, never ORM rows, so callers can cache
and share them freely. Every validation error is a `TenantError` (a `ValueError`) whose message a
user can act on.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields

from protocol.priority import PRIORITIES
from protocol.validators import check_bool, check_number, check_positive_int

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class TenantError(ValueError):
    """A user-facing mistake: bad value, duplicate or unknown name, bad file."""


class DuplicateTenantError(TenantError):
    pass


class TenantNotFoundError(TenantError):
    pass


class KeyNotFoundError(TenantError):
    pass


@contextmanager
def _tenant_errors(hint: str = "") -> Iterator[None]:
    """protocol.validators' ValueErrors as TenantErrors, the one error type tenants raise."""
    try:
        yield
    except ValueError as error:
        raise TenantError(f"{error}{hint}") from None


@dataclass(frozen=True)
class TenantLimits:
    """Per-tenant admission limits; None means unlimited."""

    requests_per_min: int | None = None
    tokens_per_min: int | None = None
    max_concurrent: int | None = None
    max_queued_requests: int | None = None
    max_queued_tokens: int | None = None
    max_tokens: int | None = None
    queue_timeout_s: float | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            with _tenant_errors(hint="; leave it unset for no limit"):
                if f.name.endswith("_s"):
                    check_number(f.name, value, low=0, open_low=True)
                else:
                    check_positive_int(f.name, value)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


@dataclass(frozen=True)
class TenantInfo:
    name: str
    weight: float = 1.0
    default_priority: str = "interactive"
    allowed_priorities: tuple[str, ...] = PRIORITIES
    limits: TenantLimits = field(default_factory=TenantLimits)
    slo_ttft_p99_s: float | None = None
    slo_itl_p99_s: float | None = None
    enabled: bool = True
    id: int | None = None  # None until stored

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise TenantError(
                f"tenant name {self.name!r} must be 1-64 characters of letters, digits, '.', '_'"
                " or '-', starting with a letter or digit"
            )
        with _tenant_errors():
            check_number("weight", self.weight, low=0, open_low=True)
            # An SLO target of None means "no target", the same shape as an unlimited limit.
            for name in ("slo_ttft_p99_s", "slo_itl_p99_s"):
                if getattr(self, name) is not None:
                    check_number(name, getattr(self, name), low=0, open_low=True)
            check_bool("enabled", self.enabled)
        if not isinstance(self.limits, TenantLimits):
            raise TenantError("limits must be a TenantLimits")
        self._check_priorities()

    def _check_priorities(self) -> None:
        allowed = self.allowed_priorities
        if isinstance(allowed, str) or not allowed:
            raise TenantError(f"allowed_priorities must be a non-empty list of {PRIORITIES}")
        # Normalise lists from YAML/CLI into a tuple so the value stays hashable.
        object.__setattr__(self, "allowed_priorities", tuple(dict.fromkeys(allowed)))
        for p in (*self.allowed_priorities, self.default_priority):
            if p not in PRIORITIES:
                raise TenantError(f"unknown priority {p!r}; choose from {', '.join(PRIORITIES)}")
        if self.default_priority not in self.allowed_priorities:
            raise TenantError(
                f"default_priority {self.default_priority!r} is not in allowed_priorities "
                f"{list(self.allowed_priorities)}"
            )


@dataclass(frozen=True)
class KeyInfo:
    """An API key's public facts; the plaintext is returned once by `create_key` only."""

    id: str
    tenant: str
    prefix: str  # first characters of the key, for humans to tell keys apart
    created_at: float
    last_used_at: float | None = None
    revoked_at: float | None = None

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None


@dataclass(frozen=True)
class Principal:
    """Who a request is: the tenant and the key it authenticated with."""

    tenant: TenantInfo
    key_id: str


@dataclass(frozen=True)
class UsageEvent:
    """One finished (or rejected) request, as the gateway reports it. Times in seconds."""

    tenant: str
    key_id: str | None
    model: str
    priority: str
    prompt_tokens: int
    completion_tokens: int
    status: int
    queue_time: float | None = None
    ttft: float | None = None
    e2e: float | None = None
    created_at: float = field(default_factory=time.time)  # arrival, epoch seconds
    finished_at: float | None = None  # None: created_at + e2e

    def finished(self) -> float:
        if self.finished_at is not None:
            return self.finished_at
        return self.created_at + (self.e2e or 0.0)

"""Plain values the rest of fairgate sees: tenants, limits, keys, usage events.

These are frozen dataclasses validated in `__post_init__`, never ORM rows, so callers can cache
and share them freely. Every validation error is a `TenantError` (a `ValueError`) whose message a
user can act on.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field, fields

from protocol.priority import PRIORITIES

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class TenantError(ValueError):
    """A user-facing mistake: bad value, duplicate or unknown name, bad file."""


class DuplicateTenantError(TenantError):
    pass


class TenantNotFoundError(TenantError):
    pass


class KeyNotFoundError(TenantError):
    pass


def check_positive(name: str, value: object, kind: type = float, optional: bool = True) -> None:
    """Accept None (unlimited, when `optional`) or a finite number > 0; ints where `kind` is int."""
    unset = " (or unset for unlimited)" if optional else ""
    if value is None and optional:
        return
    # bool is an int subclass; `max_concurrent: true` in YAML is a mistake, not 1.
    numeric = (int,) if kind is int else (int, float)
    if isinstance(value, bool) or not isinstance(value, numeric):
        wanted = "an integer" if kind is int else "a number"
        raise TenantError(f"{name} must be {wanted} > 0{unset}, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise TenantError(f"{name} must be > 0{unset}, got {value!r}")


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
            kind = float if f.name.endswith("_s") else int
            check_positive(f.name, getattr(self, f.name), kind)

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
        check_positive("weight", self.weight, optional=False)
        # An SLO target of None means "no target", the same shape as an unlimited limit.
        check_positive("slo_ttft_p99_s", self.slo_ttft_p99_s)
        check_positive("slo_itl_p99_s", self.slo_itl_p99_s)
        if not isinstance(self.enabled, bool):
            raise TenantError(f"enabled must be true or false, got {self.enabled!r}")
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

"""Plain values the rest of fairgate sees: tenants, limits, keys, usage events.

These are frozen dataclasses validated in `__post_init__`, never ORM rows, so callers can cache
and share them freely (`UsageEvent`, a record of one request, excepted: see there). Every
validation error is a `TenantError` (a `ValueError`) whose message a user can act on.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from protocol.fairness import WEIGHT_RANGE
from protocol.measures import SLO, RequestTiming
from protocol.priority import PRIORITIES
from protocol.validators import check_bool, check_known_keys, check_number, check_positive_int

# Whole names only (fullmatch): `$` would also match before a trailing newline. ASCII only, so a
# name cannot be a look-alike of another ("dеmo" with a Cyrillic е) or carry control characters.
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_RULE = "1-64 characters of letters, digits, '.', '_' or '-', starting with a letter or digit"
# The limits' INTEGER columns: PostgreSQL's is 32-bit signed (SQLite's holds more; one bound for
# both keeps a tenants file portable between them).
INT_COLUMN_MAX = 2**31 - 1
# A tenant's p99 targets (protocol.measures.SLO): TTFT and TPOT per request, ITL per gap. A
# value stored as slo_itl_p99_s before migration 0005 bounded TPOT: it is slo_tpot_p99_s now.
SLO_FIELDS = ("slo_ttft_p99_s", "slo_tpot_p99_s", "slo_itl_p99_s")


def strictest_slos(tenants: Iterable[Any]) -> dict[str, tuple[float, str]]:
    """{SLO field: (the strictest p99 target an enabled tenant sets, that tenant's name)}: the
    targets a tune job or `fairgate tune` takes where it names none."""
    found: dict[str, tuple[float, str]] = {}
    for tenant in tenants:
        if not tenant.enabled:
            continue
        for name in SLO_FIELDS:
            target = getattr(tenant, name)
            if target is not None and (name not in found or target < found[name][0]):
                found[name] = (target, tenant.name)
    return found


def shown(value: object, limit: int = 80) -> str:
    """`value` for a message: quoted, with control and non-ASCII characters escaped (so a name
    that only looks like another shows how it differs), and cut to about `limit` characters."""
    text = ascii(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class TenantError(ValueError):
    """A user-facing mistake: bad value, duplicate or unknown name, bad file.

    `field` names the value at fault as a tenant's JSON spells it ("weight", "limits.max_tokens",
    "allowed_priorities"), or is None when no one field is; the admin API answers it as `param`.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidTenantNameError(TenantError):
    def __init__(self, message: str, field: str | None = "name") -> None:
        super().__init__(message, field)


class DuplicateTenantError(TenantError):
    def __init__(self, message: str, field: str | None = "name") -> None:
        super().__init__(message, field)


class TenantNotFoundError(TenantError):
    pass


class KeyNotFoundError(TenantError):
    pass


def check_tenant_name(name: object) -> str:
    """`name` when it is a valid tenant name; every surface that takes a name calls this."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidTenantNameError(f"invalid tenant name {shown(name)}: a name is {NAME_RULE}")
    return name


@contextmanager
def _tenant_errors(field: str | None, hint: str = "") -> Iterator[None]:
    """protocol.validators' ValueErrors as TenantErrors about `field`, the one error type
    tenants raise; a TenantError raised inside keeps its own field."""
    try:
        yield
    except TenantError:
        raise
    except ValueError as error:
        raise TenantError(f"{error}{hint}", field) from None


def checked_mapping(section: str, values: object, known: Sequence[str],
                    prefix: str = "") -> dict[str, Any]:
    """`values` as a dict when it is a mapping whose keys are all in `known`; else a TenantError
    about `prefix` + the first unknown key, with a did-you-mean."""
    if not isinstance(values, Mapping):
        raise TenantError(f"{section} must be a mapping of name: value, got {shown(values)}",
                          prefix.rstrip(".") or None)
    # Escaped, so a key with control characters cannot break the message's line.
    keys = [k if isinstance(k, str) and k.isascii() and k.isprintable() else ascii(k)
            for k in values]
    unknown = sorted(set(keys) - set(known))
    with _tenant_errors(prefix + unknown[0] if unknown else None):
        check_known_keys(section, keys, known)
    return dict(values)


def _check_limit(name: str, value: object) -> None:
    if name.endswith("_s"):
        check_number(name, value, low=0, open_low=True)
        return
    check_positive_int(name, value)
    assert isinstance(value, int)
    if value > INT_COLUMN_MAX:
        raise ValueError(f"{name} must be at most {INT_COLUMN_MAX} (the largest value the "
                         f"database's INTEGER column holds), got {value}")


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
            with _tenant_errors(f"limits.{f.name}", hint="; leave it unset for no limit"):
                _check_limit(f.name, value)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_mapping(cls, values: object) -> TenantLimits:
        """From a JSON/YAML `limits` mapping; None (or absent limits) means no limits."""
        return cls(**limits_mapping(values))


@dataclass(frozen=True)
class TenantInfo:
    name: str
    weight: float = 1.0
    default_priority: str = "interactive"
    allowed_priorities: tuple[str, ...] = PRIORITIES
    limits: TenantLimits = field(default_factory=TenantLimits)
    slo_ttft_p99_s: float | None = None  # each request's TTFT
    slo_tpot_p99_s: float | None = None  # each request's TPOT
    slo_itl_p99_s: float | None = None  # every gap between two tokens, pooled
    enabled: bool = True
    id: int | None = None  # None until stored

    def __post_init__(self) -> None:
        check_tenant_name(self.name)
        with _tenant_errors("weight"):
            check_number("weight", self.weight, low=0, open_low=True)
            check_number("weight", self.weight, low=WEIGHT_RANGE[0], high=WEIGHT_RANGE[1])
        # An SLO target of None means "no target", the same shape as an unlimited limit.
        for name in SLO_FIELDS:
            if getattr(self, name) is not None:
                with _tenant_errors(name):
                    check_number(name, getattr(self, name), low=0, open_low=True)
        with _tenant_errors("enabled"):
            check_bool("enabled", self.enabled)
        if not isinstance(self.limits, TenantLimits):
            raise TenantError("limits must be a TenantLimits", "limits")
        self._check_priorities()

    def _check_priorities(self) -> None:
        allowed = self.allowed_priorities
        if (not isinstance(allowed, list | tuple) or not allowed
                or not all(isinstance(p, str) for p in allowed)):
            raise TenantError(f"allowed_priorities must be a non-empty list of priorities "
                              f"({', '.join(PRIORITIES)}), got {shown(allowed)}",
                              "allowed_priorities")
        # Normalise lists from YAML/CLI into a tuple so the value stays hashable.
        object.__setattr__(self, "allowed_priorities", tuple(dict.fromkeys(allowed)))
        for p in self.allowed_priorities:
            if p not in PRIORITIES:
                raise TenantError(f"unknown priority {shown(p)} in allowed_priorities; choose "
                                  f"from {', '.join(PRIORITIES)}", "allowed_priorities")
        if self.default_priority not in PRIORITIES:
            raise TenantError(f"unknown priority {shown(self.default_priority)} for "
                              f"default_priority; choose from {', '.join(PRIORITIES)}",
                              "default_priority")
        if self.default_priority not in self.allowed_priorities:
            raise TenantError(
                f"default_priority {self.default_priority!r} is not in allowed_priorities "
                f"{list(self.allowed_priorities)}", "default_priority"
            )

    @functools.cached_property
    def slo(self) -> SLO:
        """The tenant's latency targets, as protocol.measures checks them: built once per
        TenantInfo (immutable; the gateway reads it several times a request)."""
        return SLO(self.slo_ttft_p99_s, self.slo_tpot_p99_s, self.slo_itl_p99_s)

    def settings(self) -> dict[str, Any]:
        """Every field but `id` and `name`: what `TenantStore.create_tenant` takes."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("id", "name")}


T = TypeVar("T")


def stored(cls: type[T], **values: Any) -> T:
    """A value as the database holds it, without the input checks: rows written under older,
    looser rules (a name like 'demo\n', a limit over 2**31-1 on SQLite) must keep loading, or
    one such row would stop every listing and every key of its tenant."""
    value = object.__new__(cls)
    for name, field_value in values.items():
        object.__setattr__(value, name, field_value)
    return value


# What a tenant's JSON/YAML mapping may set (`id` is the database's).
TENANT_KEYS = tuple(f.name for f in fields(TenantInfo) if f.name != "id")


def tenant_mapping(values: object, extra: Sequence[str] = ()) -> dict[str, Any]:
    """A tenant's JSON/YAML mapping as a dict, its keys (TENANT_KEYS and `extra`) and its name
    checked; the other values are checked when they become a TenantInfo."""
    settings = checked_mapping("tenant", values, (*TENANT_KEYS, *extra))
    if "name" not in settings:
        raise TenantError("missing 'name'", "name")
    check_tenant_name(settings["name"])
    return settings


def limits_mapping(values: object) -> dict[str, Any]:
    """A JSON/YAML `limits` mapping (None: no entries) as a dict, its keys checked; the values
    are checked when they become a TenantLimits."""
    if values is None:
        return {}
    return checked_mapping("limits", values, TenantLimits.names(), prefix="limits.")


def tenant_from_mapping(values: object) -> TenantInfo:
    """A new tenant from a JSON/YAML mapping (absent fields take defaults, `limits: null` is no
    limits); every mistake is a TenantError whose `field` names the value at fault."""
    settings = tenant_mapping(values)
    settings["limits"] = TenantLimits.from_mapping(settings.get("limits"))
    return TenantInfo(**settings)


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


@dataclass(slots=True)
class UsageEvent:
    """One finished (or rejected) request, as the gateway reports it. Times in seconds.

    Not frozen, unlike the values above: the gateway builds one per request, and a frozen
    dataclass's `__init__` (a call per field) took 4.5x as long (3.0 against 0.67 µs;
    bench/RESULTS.md, issue 28). `UsageLedger.record` copies it into its own row, so a change
    after that is not recorded."""

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
    tpot: float | None = None  # mean gap between its tokens after the first
    slo_ttft: bool | None = None  # met the tenant's TTFT target; None: no target or unmeasured
    slo_tpot: bool | None = None  # met its TPOT target
    # its part of the tenant's pooled ITL target (RequestTiming.gaps_within): gaps within the
    # target, of its gaps; None: no ITL target or unmeasured
    itl_gaps_met: int | None = None
    itl_gaps: int | None = None
    cached_tokens: int | None = None
    backend: str | None = None

    def finished(self) -> float:
        if self.finished_at is not None:
            return self.finished_at
        return self.created_at + (self.e2e or 0.0)


def slo_outcomes(slo: SLO, timing: RequestTiming) -> dict[str, Any]:
    """A request's UsageEvent fields against `slo`, for each target it sets: `slo_ttft`,
    `slo_tpot` (met or not) and `itl_gaps_met`, `itl_gaps` (RequestTiming.gaps_within)."""
    out: dict[str, Any] = {}
    if slo.ttft_s is not None:
        out["slo_ttft"] = timing.meets_ttft(slo)
    if slo.tpot_s is not None:
        out["slo_tpot"] = timing.meets_tpot(slo)
    if slo.itl_s is not None:
        out["itl_gaps_met"], out["itl_gaps"] = timing.gaps_within(slo)
    return out
